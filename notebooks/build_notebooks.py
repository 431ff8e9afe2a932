#!/usr/bin/env python
"""Build the course's notebooks from their readable sources and run them, so they carry real outputs.

    python notebooks/build_notebooks.py                 # every notebook: build, execute, save (~5 min on 2 cores)
    python notebooks/build_notebooks.py 4 test-profile  # only these (a number or a name)
    python notebooks/build_notebooks.py --no-execute    # cells only, no outputs
    python notebooks/build_notebooks.py --check         # exit 1 if a committed notebook differs from its source

Each notebook notebooks/<lesson>.ipynb comes from notebooks/src/<lesson>.py, a plain Python file in the
"percent" format (as jupytext writes it): `# %%` starts a code cell, `# %% [markdown]` a Markdown cell whose
lines are comments.  Edit the source, never the .ipynb, then rebuild.  Execution uses nbclient with the
notebook's own directory as working directory, exactly as JupyterLab runs it; lesson outputs go to
runs/notebooks/<lesson>/ (not committed).
"""
import argparse
import re
import sys
import time
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
CELL_TIMEOUT = 900  # seconds; a full-size run on a GPU node can take minutes per cell
KERNEL = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


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
    args = p.parse_args(argv)
    available = sources()
    names = resolve(args.names, available) if args.names else list(available)
    if args.check:
        return check(names, available)
    for name in names:
        t0 = time.perf_counter()
        nb = notebook(name, available[name])
        if not args.no_execute:
            print(f"running {name} ...", flush=True)
            try:
                execute(nb)
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
