# The course website: Sphinx + myst-nb + sphinx-book-theme.  Build it with scripts/build_site.sh
# (docs/contributors/website.md).  The source directory is the repository root (sphinx-build -c docs . OUT),
# so relative links in README.md, docs/ and the notebooks resolve to the files they name.  The committed
# notebooks are rendered as they are, outputs and plots included; nothing is executed.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))
ROOT = Path(__file__).resolve().parent.parent

project = "PyTorch distributed data-parallel training on HPC clusters"
author = "the course's authors"
copyright = "the course's authors"

extensions = ["myst_nb", "course_site"]
root_doc = "docs/index"

# Only these are pages; every other top-level directory (the venv, data, runs, lesson code, the output of
# a build) is not even walked.
KEEP = {"README.md", "docs", "notebooks", "solutions", "benchmarks"}
include_patterns = ["README.md", "docs/**.md", "notebooks/*.ipynb", "solutions/*.md", "benchmarks/README.md"]
exclude_patterns = sorted(entry.name for entry in ROOT.iterdir() if entry.name not in KEEP) + [
    "docs/_build", "**/.ipynb_checkpoints", "notebooks/src"]

# The notebooks are committed with their outputs: render them as they are.
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3
# A code block that Pygments cannot lex in its language (e.g. a listing of tagged lines with their numbers
# fenced as python) is shown unhighlighted-in-part; that is cosmetic, not a build failure.
suppress_warnings = ["misc.highlighting_failure"]
smartquotes_action = "qe"  # typographic quotes, but "--flag" stays two hyphens (no en dash)

html_theme = "sphinx_book_theme"
html_title = "DDP on HPC clusters"
html_static_path = ["_static"]
html_css_files = ["course.css"]
html_copy_source = False
html_show_sourcelink = False
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": False,
    "home_page_in_toc": True,
}
