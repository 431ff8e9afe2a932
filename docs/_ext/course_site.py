"""The course website's own Sphinx extension: lesson pages from docs/lessons.toml, links to repository files.

The site's source directory is the repository root, so every relative link in README.md, docs/ and the
notebooks points at the file it names in the repository.  This extension

- reads the lesson catalog (docs/lessons.toml) and checks that each entry's script, notebook and launcher exist;
- writes one overview page per course day into docs/_generated/ (git-ignored), with the day's lessons in
  course order and a toctree of their notebooks;
- turns each lesson's notebook into its lesson page while Sphinx reads it (the committed .ipynb file is not
  touched): the catalog's title, idea, objectives and minutes under the notebook's heading, and the lesson's
  script and SLURM launcher included at the end;
- maps links to a lesson's script or launcher onto those sections of its lesson page; links to any other
  repository file become downloads (Sphinx copies the file into the site);
- gives solutions/README.md a toctree of the solutions (solutions/<notebook>.md) in course order, and each
  lesson card a link to its solutions;
- writes index.html at the site's root, which forwards to the home page docs/index.html.
"""
from __future__ import annotations

import json
import logging as pylogging
import tomllib
from pathlib import Path
from urllib.parse import unquote, urlsplit

from docutils import nodes
from sphinx import addnodes
from sphinx.errors import ConfigError
from sphinx.util import logging

LOGGER = logging.getLogger(__name__)

CATALOG = "docs/lessons.toml"
GENERATED = "docs/_generated"
FIELDS = ("id", "day", "title", "idea", "objectives", "minutes", "script", "notebook", "launcher")
OBJECTIVE_PREFIX = "After this lesson you can "
# Output MIME types the site leaves out: the notebooks' records of their runs (time, machine load), which the
# course's checks read from the committed notebooks (notebooks/nbhelpers.py RECORD_MIME), not for readers.
HIDDEN_MIME = ("application/vnd.course.run+json",)


def load_catalog(root: Path) -> list[dict]:
    """The catalog's lessons, in course order; a ConfigError naming the entry and field when one is wrong."""
    path = root / CATALOG
    try:
        lessons = tomllib.loads(path.read_text())["lesson"]
    except FileNotFoundError:
        raise ConfigError(f"{CATALOG} not found: the website makes its lesson pages from it") from None
    except (tomllib.TOMLDecodeError, KeyError) as err:
        raise ConfigError(f"{CATALOG}: not a list of [[lesson]] tables ({err})") from None
    seen = set()
    for number, lesson in enumerate(lessons, 1):
        name = f"{CATALOG}, lesson entry {number} (id {lesson.get('id', '?')!r})"
        missing = [field for field in FIELDS if field not in lesson]
        if missing:
            raise ConfigError(f"{name}: missing {', '.join(missing)}")
        if lesson["id"] in seen:
            raise ConfigError(f"{name}: the id appears twice")
        seen.add(lesson["id"])
        for field in ("script", "notebook", "launcher"):
            if not (root / lesson[field]).is_file():
                raise ConfigError(f"{name}: {field} {lesson[field]} does not exist")
        if not lesson["notebook"].startswith("notebooks/") or not lesson["notebook"].endswith(".ipynb"):
            raise ConfigError(f"{name}: notebook must be notebooks/<name>.ipynb, not {lesson['notebook']}")
    return lessons


def docname(lesson: dict) -> str:
    """The lesson page's Sphinx document name: its notebook's path without the suffix."""
    return lesson["notebook"].removesuffix(".ipynb")


def label(lesson: dict, part: str) -> str:
    return f"lesson-{lesson['id']}-{part}".lower().replace("_", "-")


def lesson_name(lesson: dict) -> str:
    return f"Lesson {lesson['id']}" if lesson["id"].isdigit() else lesson["script"].rsplit("/", 1)[-1]


def day_page(day: int, lessons: list[dict]) -> str:
    """An overview page of one day: a table of its lessons (title, idea, minutes) and their toctree."""
    total = sum(lesson["minutes"] for lesson in lessons)
    rows = "\n".join(
        f"| {lesson_name(lesson)} | [{lesson['title']}](/{lesson['notebook']}) | {lesson['idea']} "
        f"| {lesson['minutes']} |" for lesson in lessons)
    entries = "\n".join(f"/{docname(lesson)}" for lesson in lessons)
    return f"""# Day {day}

{len(lessons)} lessons, about {total // 60} h {total % 60:02d} min of teaching and hands-on time in a workshop
(breaks not included). Each lesson page has the notebook, the script and its SLURM launcher.

| | Lesson | What it adds | Minutes |
|---|---|---|---|
{rows}

```{{toctree}}
:hidden:
:maxdepth: 1

{entries}
```
"""


def solutions(lesson: dict) -> str:
    """The path of the lesson's solutions to its exercises (solutions/<notebook name>.md)."""
    return "solutions/" + lesson["notebook"].removeprefix("notebooks/").removesuffix(".ipynb") + ".md"


def lesson_card(lesson: dict, root: Path) -> str:
    """The catalog's facts about a lesson, in MyST, shown under the notebook's heading."""
    objectives = lesson["objectives"]
    if all(item.startswith(OBJECTIVE_PREFIX) for item in objectives):
        intro, items = "After this lesson you can:", [item[len(OBJECTIVE_PREFIX):] for item in objectives]
    else:
        intro, items = "Objectives:", objectives
    bullets = "\n".join(f"- {item}" for item in items)
    return f"""
````{{admonition}} {lesson_name(lesson)}: {lesson['title']}
:class: lesson-card

Day {lesson['day']}, about {lesson['minutes']} minutes. {lesson['idea'][:1].upper()}{lesson['idea'][1:]}.

{intro}

{bullets}

Files: [the script](#{label(lesson, 'script')}) `{lesson['script']}`, [the SLURM launcher](#{label(lesson, 'launcher')})
`{lesson['launcher']}`, the notebook {{download}}`{lesson['notebook']} </{lesson['notebook']}>` (this page).{
    f" Solutions to the exercises: [{solutions(lesson)}](/{solutions(lesson)})." if (root / solutions(lesson)).is_file() else ""}
````
"""


def lesson_files(lesson: dict) -> str:
    """The script and the launcher, included in full at the end of the lesson page."""
    parts = []
    for part, language, heading in (("script", "python", "The script"), ("launcher", "bash", "The SLURM launcher")):
        path = lesson[part]
        parts.append(f"""({label(lesson, part)})=
## {heading}: `{path}`

{{download}}`Download {path} </{path}>`

```{{literalinclude}} /{path}
:language: {language}
:linenos:
```
""")
    return "\n".join(parts)


def markdown_cell(source: str, cell_id: str) -> dict:
    return {"cell_type": "markdown", "id": f"course-site-{cell_id}", "metadata": {}, "source": source}


def without_records(notebook: dict) -> dict:
    """The notebook without the outputs' HIDDEN_MIME data (an output left empty is dropped)."""
    for cell in notebook["cells"]:
        outputs = []
        for output in cell.get("outputs", []):
            data = output.get("data")
            if data and any(mime in data for mime in HIDDEN_MIME):
                for mime in HIDDEN_MIME:
                    data.pop(mime, None)
                if not any(data.values()):
                    continue
            outputs.append(output)
        if "outputs" in cell:
            cell["outputs"] = outputs
    return notebook


def lesson_notebook(text: str, lesson: dict, root: Path) -> str:
    """The notebook's JSON with the lesson card under its first heading and the files appended."""
    notebook = without_records(json.loads(text))
    cells = notebook["cells"]
    first = next((i for i, cell in enumerate(cells) if cell["cell_type"] == "markdown"), None)
    card = markdown_cell(lesson_card(lesson, root), "card")
    if first is None:
        cells.insert(0, card)
    else:
        lines = "".join(cells[first]["source"]).splitlines(keepends=True)
        heading = next((i for i, line in enumerate(lines) if line.startswith("# ")), None)
        if heading is None:
            cells.insert(first, card)
        else:
            head, rest = "".join(lines[:heading + 1]), "".join(lines[heading + 1:])
            cells[first:first + 1] = [markdown_cell(head, "heading"), card] + ([markdown_cell(rest, "intro")] if rest.strip() else [])
    cells.append(markdown_cell(lesson_files(lesson), "files"))
    return json.dumps(notebook)


class Course:
    def __init__(self, root: Path):
        self.root = root
        self.lessons = load_catalog(root)
        self.by_doc = {docname(lesson): lesson for lesson in self.lessons}
        # a lesson's script and launcher -> (lesson page, anchor); its notebook is the page itself
        self.targets = {}
        for lesson in self.lessons:
            self.targets[lesson["script"]] = (docname(lesson), label(lesson, "script"))
            self.targets[lesson["launcher"]] = (docname(lesson), label(lesson, "launcher"))

    def solutions_toctree(self) -> str:
        """A hidden toctree of solutions/*.md: the lessons' in course order, then any other."""
        ordered = [solutions(lesson) for lesson in self.lessons if (self.root / solutions(lesson)).is_file()]
        others = sorted(path.relative_to(self.root).as_posix() for path in (self.root / "solutions").glob("*.md")
                        if path.name != "README.md")
        entries = "\n".join("/" + path.removesuffix(".md") for path in ordered + [p for p in others if p not in ordered])
        return f"\n\n```{{toctree}}\n:hidden:\n\n{entries}\n```\n"

    def days(self) -> dict[int, list[dict]]:
        days: dict[int, list[dict]] = {}
        for lesson in self.lessons:
            days.setdefault(lesson["day"], []).append(lesson)
        return days

    def write_generated(self) -> list[str]:
        """Write the day pages into docs/_generated/, replacing what an earlier build left; their docnames."""
        out = self.root / GENERATED
        out.mkdir(parents=True, exist_ok=True)
        wanted = {f"day{day}.md": day_page(day, lessons) for day, lessons in self.days().items()}
        for stale in out.glob("*.md"):
            if stale.name not in wanted:
                stale.unlink()
        for name, text in wanted.items():
            path = out / name
            if not path.exists() or path.read_text() != text:  # unchanged pages keep their mtime
                path.write_text(text)
        return [f"{GENERATED}/{name.removesuffix('.md')}" for name in sorted(wanted)]


def on_source_read(app, name: str, source: list[str]) -> None:
    lesson = app.course.by_doc.get(name)
    if lesson is not None:
        source[0] = lesson_notebook(source[0], lesson, app.course.root)
    elif name == "solutions/README":
        source[0] += app.course.solutions_toctree()
    elif str(app.env.doc2path(name)).endswith(".ipynb"):
        source[0] = json.dumps(without_records(json.loads(source[0])))


def relative_links_in_outputs(app, doctree) -> None:
    """A notebook's Markdown outputs (IPython's Markdown()) reach the page with their relative links as plain
    URLs ('7_mnist_ddp_pt_timing.ipynb'): resolve them as the notebook's own Markdown cells are, to the page
    (or the lesson page's section) of the file they name."""
    env = app.env
    for node in list(doctree.findall(nodes.reference)):
        uri = node.get("refuri", "")
        parts = urlsplit(uri)
        if not uri or parts.scheme or parts.netloc or not parts.path or node.get("internal"):
            continue
        path, absolute = env.relfn2path(unquote(parts.path), env.docname)
        page, anchor = env.path2doc(absolute), parts.fragment or None
        if page is None:
            page, anchor = app.course.targets.get(Path(path).as_posix(), (None, None))
        if page is None:
            continue  # left as it is: the site's link check reports it
        xref = addnodes.pending_xref("", refdomain="doc", reftarget=page, reftargetid=anchor, reftype="myst",
                                     refexplicit=True, refdoc=env.docname)
        xref += nodes.inline("", "", *node.children)
        node.replace_self(xref)


def on_doctree_read(app, doctree) -> None:
    """Links to a lesson's script or launcher go to that section of its lesson page (before the download
    collector copies the files)."""
    env = app.env
    relative_links_in_outputs(app, doctree)
    for node in list(doctree.findall(addnodes.download_reference)):
        if node.get("reftype") != "myst":
            continue  # an explicit {download} role stays a download
        path, _ = env.relfn2path(node["reftarget"], env.docname)
        target = app.course.targets.get(Path(path).as_posix())
        if target is None:
            continue
        page, anchor = target
        xref = addnodes.pending_xref("", refdomain="doc", reftarget=page, reftargetid=anchor, reftype="myst",
                                     refexplicit=True, refdoc=env.docname)
        xref += node.children
        node.replace_self(xref)


def on_build_finished(app, exception) -> None:
    if exception is None and app.builder.format == "html":
        home = app.builder.get_target_uri(app.config.root_doc)
        (Path(app.outdir) / "index.html").write_text(
            f'<!DOCTYPE html>\n<meta charset="utf-8">\n<title>Redirect</title>\n'
            f'<meta http-equiv="refresh" content="0; url={home}">\n<a href="{home}">{home}</a>\n')


class EmptyGlobFilter:
    """A glob toctree of the home page that matches nothing yet (a reader's section not written yet) is
    reported as information, not as a warning: sections appear as their files do."""

    def filter(self, record) -> bool:
        if getattr(record, "subtype", None) == "empty_glob":
            LOGGER.info(f"(no pages yet) {record.getMessage()}")
            return False
        return True


def setup(app):
    for handler in pylogging.getLogger(logging.NAMESPACE).handlers:
        if isinstance(handler, logging.WarningStreamHandler):
            handler.filters.insert(0, EmptyGlobFilter())  # before Sphinx counts it as a warning
    app.course = Course(Path(app.srcdir))
    app.course.write_generated()
    app.connect("source-read", on_source_read)
    app.connect("doctree-read", on_doctree_read, priority=400)
    app.connect("build-finished", on_build_finished)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":  # scripts/build_site.sh: check the catalog first, one line on what is wrong
    import sys

    try:
        load_catalog(Path(__file__).resolve().parents[2])
    except ConfigError as err:
        sys.exit(f"error: {err}")
