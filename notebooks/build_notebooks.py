#!/usr/bin/env python
"""Build the course's notebooks from their readable sources and run them, so they carry real outputs.

    python notebooks/build_notebooks.py                 # every notebook: build, execute, save (~5 min on 2 cores)
    python notebooks/build_notebooks.py 4 test-profile  # only these (a number or a name)
    python notebooks/build_notebooks.py --no-execute    # cells only, no outputs
    python notebooks/build_notebooks.py --check         # exit 1 if a committed notebook differs from its source
    python notebooks/build_notebooks.py --stale         # list notebooks whose code changed since their run
    python notebooks/build_notebooks.py --restamp /tmp/previous.py  # new digest rule: re-record, run nothing

Each notebook notebooks/<lesson>.ipynb comes from notebooks/src/<lesson>.py, a plain Python file in the
"percent" format (as jupytext writes it): `# %%` starts a code cell, `# %% [markdown]` a Markdown cell whose
lines are comments.  Edit the source, never the .ipynb, then rebuild.  Execution uses nbclient with the
notebook's own directory as working directory, exactly as JupyterLab runs it; lesson outputs go to
runs/notebooks/<lesson>/ (not committed).

An executed notebook records what it ran on: `metadata.course.inputs_sha256`, a digest of the files, and of the
parts of nbhelpers.py its cells use, that can change its outputs (inputs() below).  tests/test_notebooks.py
executes a notebook again only when that digest no longer matches: otherwise its committed outputs are already
a run of exactly the current code.
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


def _our_modules(tree) -> set:
    """The modules of course/ and data_tools/ that code imports: its import statements (those inside functions
    too), a string that is exactly a module name ("course.launching.gc_paused", a fork server's preload list),
    and the import statements of Python code held in a string (code run with `python -c`)."""
    found = set()
    for node in ast.walk(tree):
        modules = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # a submodule too
        elif isinstance(node, (ast.Constant, ast.JoinedStr)):
            # an f-string's code: each {...} read as a name ("build_model({model!r}, 0)" -> "build_model(_, 0)")
            text = node.value if isinstance(node, ast.Constant) else "".join(
                v.value if isinstance(v, ast.Constant) else "_" for v in node.values)
            if isinstance(text, str) and MODULE_NAME.match(text):
                modules = [text]
            elif isinstance(text, str) and "import" in text:
                try:
                    found |= _our_modules(ast.parse(text))
                except (SyntaxError, ValueError):
                    pass  # prose, not code
        found |= {m for m in modules if m.split(".")[0] in OUR_PACKAGES}
    return found


def _files(start: list) -> set:
    """`start` and every file reached from it: a Python file reaches the course/ and data_tools/ modules it
    imports (_our_modules), a shell file the repository files it names (NAMED_FILE: a launcher runs them)."""
    todo, seen = list(start), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        text = path.read_text()
        if path.suffix == ".py":
            todo += [f for m in _our_modules(ast.parse(text)) for f in _module_files(m)]
        else:
            todo += [REPO / m for m in NAMED_FILE.findall(text) if (REPO / m).is_file()]
    return seen


def _helpers(tree) -> tuple:
    """What code (a notebook's source) uses of nbhelpers.py: ({"notebooks/nbhelpers.py:<part>": its text},
    {the course/ and data_tools/ modules those parts import}).  See inputs()."""
    helpers = HERE / "nbhelpers.py"
    wanted, star = set(), False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "nbhelpers" and node.level == 0:
            star |= any(a.name == "*" for a in node.names)
            wanted |= {a.name for a in node.names if a.name != "*"}
        elif isinstance(node, ast.Import) and any(a.name == "nbhelpers" for a in node.names):
            wanted |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                       and isinstance(n.value, ast.Name) and n.value.id == "nbhelpers"}
    if not (star or wanted):
        return {}, set()
    text = helpers.read_text()
    lines = text.splitlines(keepends=True)
    module = ast.parse(text)

    def source(stmt):
        first = min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])])
        return "".join(lines[first - 1:stmt.end_lineno])

    def names_in(node):
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

    defines, at_import, exported = {}, [], None  # name -> the statements binding it; the rest, in file order
    for i, stmt in enumerate(module.body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound = [stmt.name]
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            bound = [(a.asname or a.name).split(".")[0] for a in stmt.names]
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            bound = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # the module's docstring
        else:
            at_import.append(stmt)
            continue
        if bound == ["__all__"]:
            try:
                exported = set(ast.literal_eval(stmt.value))
                continue
            except (ValueError, TypeError, SyntaxError):
                at_import.append(stmt)  # not a plain list: all of it counts
                continue
        for name in bound:
            defines.setdefault(name, []).append(stmt)
    if star:
        used = names_in(tree)
        public = exported if exported is not None else {n for n in defines if not n.startswith("_")}
        wanted |= used & public
    parts = {}
    if exported is not None:  # of __all__, only whether the names the notebook takes are still in it
        parts["__all__"] = "".join(f"{n}\n" for n in sorted(wanted & exported))
    if at_import:
        parts["<import time>"] = "".join(source(s) for s in at_import)
    todo, done = sorted(wanted) + sorted(set().union(*map(names_in, at_import))), set()
    while todo:
        name = todo.pop()
        if name in done or name not in defines:
            continue
        done.add(name)
        for stmt in defines[name]:
            todo += sorted(names_in(stmt))
    chosen = [s for s in module.body if any(s in defines.get(n, []) for n in done)]
    modules = set()
    for stmt in at_import + chosen:
        modules |= _our_modules(stmt)
    for stmt in chosen:
        label = ", ".join(n for n in defines if stmt in defines[n])
        parts[label] = parts.get(label, "") + source(stmt)
    prefix = helpers.relative_to(REPO).as_posix()
    return {f"{prefix}:{label}": body for label, body in parts.items()}, modules


def _inputs(name: str) -> dict:
    """{entry: its bytes} for inputs(name)."""
    src = SRC / f"{name}.py"
    text = src.read_text()
    tree = ast.parse(text)
    helper_parts, helper_modules = _helpers(tree)
    start = [src] + [REPO / m for m in NAMED_FILE.findall(text) if (REPO / m).is_file()]
    start += [f for m in helper_modules for f in _module_files(m)]
    files = _files(start) | set(REPO.glob("requirements*.txt")) | {REPO / "constraints.txt"}
    entries = {p.relative_to(REPO).as_posix(): p.read_bytes() for p in files}
    entries.update((k, v.encode()) for k, v in helper_parts.items())
    return dict(sorted(entries.items()))


def inputs(name: str) -> list:
    """What the outputs of notebook `name` can depend on, as repository paths ("course/models.py") and parts of
    notebooks/nbhelpers.py ("notebooks/nbhelpers.py:run_lesson"); inputs_sha256() digests their bytes.

    - The notebook's source, notebooks/src/<name>.py, all of it.
    - The files its text names (NAMED_FILE): the lessons it runs, the scripts it shows or diffs, the launchers
      it shows.  A shell file among them brings the files it names in turn (a launcher runs what it names).
    - From each Python file so far, the course/ and data_tools/ modules it imports (imports inside functions
      too), names as a module ("course.launching.gc_paused": the fork server preloads it by name), or imports
      in code held in a string (`python -c`), followed module by module, with each package's __init__.py.
      Only imports are followed from Python files, not the files their text names: a lesson or a module of
      course/ names other lessons and launchers in its help and its messages, and runs none of them (the
      commands that do run lessons, course/day1_sequence.py and course/readiness.py, no lesson imports).
    - Of nbhelpers.py, only what the notebook's cells use, each part as its source text: the helpers the cells
      name (their names that nbhelpers exports), then, transitively, every top-level definition of nbhelpers
      a used part names (run_lesson -> _stream -> is_noise -> NOISE; `import matplotlib.pyplot as plt`), plus
      the statements that run at every `from nbhelpers import *` whatever the cells use (the plotting setup,
      sys.path), and, of `__all__`, only which of the used names it still exports.  The course/ and
      data_tools/ modules those parts import (plot_trace's course.measuring.profiling, the code ddp_buckets
      runs in a subprocess: course.models) are followed as above.  So a new helper, or an edit of one the
      notebook does not call, leaves its digest alone; the module docstring and comments between
      definitions are not part of any.
    - The requirement files and constraints.txt (the exact torch and torchvision a venv of the course gets).

    Why this and not, as before, nbhelpers.py whole and everything its text and its modules' text name: it
    names lessons 0, 4, 7 and 9 (in its docstring and a comparison), which made every notebook depend on those
    lessons and all they import, and course/ modules name launchers in their messages (the Slurm scripts
    followed), so that an edit of any of about nine shared files made all 24 notebooks stale, to be executed
    again by tests/test_notebooks.py and rebuilt for nothing.

    Too broad, knowingly: the unit followed is a whole module, reached by its imports, not by the code a run
    takes.  Lesson 6's notebook runs every lesson under torchrun, which never starts the fork server that
    preloads course/launching/gc_paused.py, yet that file is one of its inputs (lesson 6 imports the launcher
    that names it): which path a run takes depends on how it is launched and on the machine (the fork
    server where a GPU is visible), and a digest too broad costs one execution, one too narrow a notebook
    that shows what the code no longer does.  Not seen, as before: files a shell script finds only when it
    runs (slurm/submit.sh's slurm/<lesson>.sh and slurm/sites/<site>.env, for lesson 9's dry run), and what
    the repository does not hold (torch itself, which constraints.txt pins; the data; the machine)."""
    return list(_inputs(name))


def inputs_sha256(name: str) -> str:
    digest = hashlib.sha256()
    for entry, data in _inputs(name).items():
        digest.update(entry.encode() + b"\0" + data + b"\0")
    return digest.hexdigest()


def recorded_sha256(nb: nbformat.NotebookNode):
    """The inputs digest an executed notebook was committed with (None: never executed by this script)."""
    return nb.metadata.get("course", {}).get("inputs_sha256")


def stale(names) -> list:
    """The notebooks whose committed outputs are not a run of the current code."""
    return [n for n in names
            if recorded_sha256(nbformat.read(HERE / f"{n}.ipynb", as_version=4)) != inputs_sha256(n)]


RECORDED = re.compile(r'"inputs_sha256": "([0-9a-f]{64})"')


def previous_scheme(path) -> object:
    """The inputs_sha256 of another version of this file (the one the notebooks were stamped with, e.g.
    `git show HEAD:notebooks/build_notebooks.py > /tmp/previous.py`), computed on this checkout."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("previous_build_notebooks", path)
    previous = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(previous)
    previous.HERE, previous.SRC, previous.REPO = HERE, SRC, REPO
    return previous.inputs_sha256


def restamp(names, previous_sha256) -> list:
    """After a change of inputs() alone: record each notebook's digest under the current scheme, without
    executing it, where its recorded digest is the one `previous_sha256` (the scheme it was stamped with,
    previous_scheme()) computes now, i.e. its outputs are a run of exactly the current code.  Only the digest's
    64 characters change in the file, nothing else of it.  Returns the notebooks it refused: never executed,
    or stale under the previous scheme (rebuild those)."""
    refused = []
    for name in names:
        path = HERE / f"{name}.ipynb"
        text = path.read_bytes().decode("utf-8")
        recorded = recorded_sha256(nbformat.reads(text, as_version=4))
        found = [m for m in RECORDED.finditer(text) if m.group(1) == recorded]
        if recorded is None or recorded != previous_sha256(name) or len(found) != 1:
            refused.append(name)
            continue
        start, end = found[0].span(1)
        path.write_bytes((text[:start] + inputs_sha256(name) + text[end:]).encode("utf-8"))
        assert recorded_sha256(nbformat.read(path, as_version=4)) == inputs_sha256(name)
    return refused


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
    p.add_argument("--restamp", metavar="PREVIOUS", type=Path,
                   help="after a change of inputs(): record each notebook's digest anew without running it, if it "
                        "was current under PREVIOUS, the build_notebooks.py it was stamped with (git show "
                        "HEAD:notebooks/build_notebooks.py > /tmp/previous.py); exit 1 if any was not")
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
    if args.restamp:
        refused = restamp(names, previous_scheme(args.restamp))
        for name in refused:
            print(f"{name}.ipynb: not restamped: its outputs are not a run of the current code under "
                  f"{args.restamp} (python notebooks/build_notebooks.py {name})")
        print(f"restamped {len(names) - len(refused)} of {len(names)} notebooks")
        return 1 if refused else 0
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
