#!/usr/bin/env python
"""Build the course's notebooks from their readable sources and run them, so they carry real outputs.

    python notebooks/build_notebooks.py                 # every notebook: build, execute, save (~5 min on 2 cores)
    python notebooks/build_notebooks.py 4 test-profile  # only these (a number or a name)
    python notebooks/build_notebooks.py --no-execute    # cells only, no outputs
    python notebooks/build_notebooks.py --check         # exit 1 if a committed notebook differs from its source
    python notebooks/build_notebooks.py --stale         # list notebooks whose code changed since their run

Each notebook notebooks/<lesson>.ipynb comes from notebooks/src/<lesson>.py, a plain Python file in the
"percent" format (as jupytext writes it): `# %%` starts a code cell, `# %% [markdown]` a Markdown cell whose
lines are comments.  Edit the source, never the .ipynb, then rebuild.  Execution uses nbclient with the
notebook's own directory as working directory, exactly as JupyterLab runs it; lesson outputs go to
runs/notebooks/<lesson>/ (not committed).

An executed notebook records what it ran on: `metadata.course.inputs_sha256`, a digest of every file that can
change its outputs (inputs() below).  tests/test_notebooks.py executes a notebook again only when that digest
no longer matches: otherwise its committed outputs are already a run of exactly the current code.
"""
import argparse
import ast
import hashlib
import re
import sys
import time
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
CELL_TIMEOUT = 900  # seconds; a full-size run on a GPU node can take minutes per cell
KERNEL = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
REPO = HERE.parent
# a repository file a notebook's code names: a lesson it runs, a script or launcher it shows or diffs
NAMED_FILE = re.compile(r"\b((?:day\d+|data_tools|slurm|scripts)/[\w./-]+\.(?:py|sh))\b")
OUR_PACKAGES = ("course", "data_tools")
MODULE_NAME = re.compile(r"^(?:course|data_tools)(?:\.\w+)+$")


def sources() -> dict:
    """{notebook name: source file}, in course order."""
    def order(p):
        m = re.match(r"(\d+)_", p.stem)
        return (0, int(m.group(1)), "") if m else (1, 0, p.stem)

    return {p.stem: p for p in sorted(SRC.glob("*.py"), key=order)}


def parse(text: str) -> list:
    """Percent-format text -> [(cell_type, source)]."""
    cells, kind, lines = [], None, []

    def flush():
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(re.sub(r"^# ?", "", l) if l.startswith("#") else l for l in body.splitlines())
        if body.strip():
            cells.append((kind, body))

    for line in text.splitlines():
        m = re.match(r"^# %%(.*)$", line)
        if m:
            flush()
            kind, lines = ("markdown" if "[markdown]" in m.group(1) else "code"), []
        elif kind is not None:
            lines.append(line)
    flush()
    return cells


def notebook(name: str, path: Path) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": KERNEL, "language_info": {"name": "python"}}
    for i, (kind, body) in enumerate(parse(path.read_text())):
        new = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        nb.cells.append(new(body, id=f"cell-{i}"))  # stable ids: rebuilding changes only what changed
    return nb


def execute(nb, timeout=CELL_TIMEOUT):
    from nbclient import NotebookClient

    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(HERE)}})
    client.execute()
    for cell in nb.cells:  # one stream output per stream, not one per line the lesson printed
        if cell.cell_type != "code":
            continue
        merged = []
        for out in cell.outputs:
            if (out.output_type == "stream" and merged and merged[-1].output_type == "stream"
                    and merged[-1].name == out.name):
                merged[-1].text += out.text
            else:
                merged.append(out)
        cell.outputs = merged
    nb.metadata = {"kernelspec": KERNEL, "language_info": {"name": "python"}}  # no per-machine versions
    return nb


def _module_files(module: str) -> list:
    """The files importing `module` runs from this repository: each enclosing package's __init__.py, the module."""
    parts, found = module.split("."), []
    for i in range(1, len(parts) + 1):
        base = REPO.joinpath(*parts[:i])
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if candidate.is_file():
                found.append(candidate)
    return found


def inputs(name: str) -> list:
    """Every repository file the outputs of notebook `name` can depend on: its source, nbhelpers.py, the files
    they name (lesson scripts, launchers, the scripts those name in turn), everything of course/ and
    data_tools/ these import or name as a module ("course.launching.gc_paused"), followed file by file, the
    requirement files, and constraints.txt (the exact torch and torchvision a venv of the course gets)."""
    todo, seen = [SRC / f"{name}.py", HERE / "nbhelpers.py"], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        text = path.read_text()
        todo += [REPO / m for m in NAMED_FILE.findall(text) if (REPO / m).is_file()]
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(text)):
            modules = []
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # a submodule too
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.match(node.value):
                modules = [node.value]
            for module in modules:
                if module.split(".")[0] in OUR_PACKAGES:
                    todo += _module_files(module)
    return sorted(seen | set(REPO.glob("requirements*.txt")) | {REPO / "constraints.txt"})


def inputs_sha256(name: str) -> str:
    digest = hashlib.sha256()
    for path in inputs(name):
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def recorded_sha256(nb: nbformat.NotebookNode):
    """The inputs digest an executed notebook was committed with (None: never executed by this script)."""
    return nb.metadata.get("course", {}).get("inputs_sha256")


def stale(names) -> list:
    """The notebooks whose committed outputs are not a run of the current code."""
    return [n for n in names
            if recorded_sha256(nbformat.read(HERE / f"{n}.ipynb", as_version=4)) != inputs_sha256(n)]


def resolve(names, available) -> list:
    chosen = []
    for n in names:
        n = Path(n).stem
        hits = [a for a in available if a == n or a.split("_")[0] == n]
        if not hits:
            sys.exit(f"build_notebooks.py: error: no notebook source for {n!r} in {SRC} "
                     f"(have: {', '.join(available)})")
        chosen += hits
    return chosen


def check(names, available) -> int:
    bad = 0
    for name in names:
        target = HERE / f"{name}.ipynb"
        want = [(k, s) for k, s in parse(available[name].read_text())]
        if not target.exists():
            print(f"{target.name}: missing (python notebooks/build_notebooks.py {name})")
            bad += 1
            continue
        have = [(c.cell_type, c.source) for c in nbformat.read(target, as_version=4).cells]
        if have != want:
            print(f"{target.name}: differs from src/{name}.py (python notebooks/build_notebooks.py {name})")
            bad += 1
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python notebooks/build_notebooks.py", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="notebooks to build (default: all), by name or lesson number")
    p.add_argument("--no-execute", action="store_true", help="write the cells without running them")
    p.add_argument("--check", action="store_true", help="only compare the committed notebooks with the sources")
    p.add_argument("--stale", action="store_true",
                   help="only list the notebooks whose code changed since their committed run (exit 1 if any)")
    args = p.parse_args(argv)
    available = sources()
    names = resolve(args.names, available) if args.names else list(available)
    if args.check:
        return check(names, available)
    if args.stale:
        old = stale(names)
        for name in old:
            print(f"{name}.ipynb: its code changed since its committed run (python notebooks/build_notebooks.py "
                  f"{name})")
        return 1 if old else 0
    for name in names:
        t0 = time.perf_counter()
        nb = notebook(name, available[name])
        if not args.no_execute:
            print(f"running {name} ...", flush=True)
            digest = inputs_sha256(name)  # before the run: a file edited meanwhile makes the notebook stale
            try:
                execute(nb)
                nb.metadata["course"] = {"inputs_sha256": digest}
            except Exception as e:  # keep the last good notebook; say which cell failed
                print(f"{name}: FAILED, {HERE / (name + '.ipynb')} left unchanged\n{e}", file=sys.stderr)
                return 1
        nbformat.write(nb, HERE / f"{name}.ipynb")
        size = (HERE / f"{name}.ipynb").stat().st_size
        print(f"{name}.ipynb: {len(nb.cells)} cells, {size / 1024:.0f} KB, {time.perf_counter() - t0:.0f} s",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
