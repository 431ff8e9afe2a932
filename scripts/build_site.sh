#!/usr/bin/env bash
# Build the course website into site/ (or the directory given): the lesson pages from docs/lessons.toml and
# the committed notebooks (not executed), the guides in docs/, README.md.  Warnings are errors; a failed
# build leaves the previous site as it was.  Uses the venv (scripts/setup_env.sh installs
# requirements-docs.txt).  Preview: python -m http.server -d site 8000 (docs/contributors/website.md).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${VENV:-$REPO/.venv}/bin/python"
OUT="$(realpath -m "${1:-$REPO/site}")"
if ! "$PY" -c "import sphinx, myst_nb, sphinx_book_theme" 2>/dev/null; then
  echo "error: Sphinx, myst-nb or sphinx-book-theme missing in ${VENV:-$REPO/.venv}: run scripts/setup_env.sh" \
       "(or: $PY -m pip install -r requirements-docs.txt)" >&2
  exit 1
fi
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT")" ] && [ ! -e "$OUT/.buildinfo" ]; then
  echo "error: $OUT is not empty and holds no earlier site (no .buildinfo): give an empty or new directory" >&2
  exit 1
fi
"$PY" "$REPO/docs/_ext/course_site.py"  # the lesson catalog, checked first: one line on what is wrong
# A fresh build in a directory beside the output (-E: every page read again), moved into place on success.
NEW="$(mktemp -d "${TMPDIR:-/tmp}/course-site.XXXXXX")"
trap 'rm -rf "$NEW"' EXIT
"$PY" -m sphinx -W --keep-going -E -q -b html -c "$REPO/docs" -d "$NEW/.doctrees" "$REPO" "$NEW/html"
rm -rf "$OUT"
mv "$NEW/html" "$OUT"
echo "site built: $OUT/index.html (preview: $PY -m http.server -d $OUT 8000)"
