"""The notebooks: one per lesson, built from their sources, in step with the scripts' options, and each one
executes headless from the repository, failing when the lesson run inside it fails.

What a notebook runs is read from its code, not guessed: every call of `run_lesson(...)` (or
`subprocess.run/Popen/...`) names a script (`day1/...py`, `day2/...py`, `data_tools/...py`) and, after it,
the `--options` it passes, including those held in variables the notebook assigns (`SIZE = ["--quick"]`).
"""
import ast
import functools
import os
import re
import sys

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from conftest import PYTHON, REPO, help_texts_of, run

NOTEBOOKS = REPO / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))
import build_notebooks  # noqa: E402

SCRIPT = re.compile(r"^(day\d+|data_tools)/[\w.\-]+\.py$")
RUNNERS = {"run_lesson", "run", "Popen", "check_call", "check_output", "call"}
CELL_TIMEOUT = 600  # seconds per cell: a notebook's lesson runs take 5-30 s each on a 2-core machine
MAX_NOTEBOOK_BYTES = 400_000


def lessons() -> dict:
    """{name: script}: every numbered lesson of day1/ and day2/, test-profile and create_mnist_h5."""
    found = {p.stem: p for p in REPO.glob("day*/*.py") if re.match(r"\d+_", p.name)}
    for extra in ("day1/test-profile.py", "data_tools/create_mnist_h5.py"):
        if (REPO / extra).exists():
            found[(REPO / extra).stem] = REPO / extra
    return {name: path.relative_to(REPO).as_posix() for name, path in found.items()}


def notebook_names() -> list:
    return sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))


def code_of(nb) -> str:
    """The notebook's code cells as one Python text (IPython syntax such as %magics turned into Python)."""
    from IPython.core.inputtransformer2 import TransformerManager

    return "\n\n".join(TransformerManager().transform_cell(c.source) for c in nb.cells if c.cell_type == "code")


# ------------------------------------------------------------------------------------------ reading the code

def _strings(node, assigned, seen):
    """The string constants of an expression in source order, following names to what they were assigned."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):  # f"--lr={x}": its constant start is what matters
        first = node.values[0] if node.values else None
        return [first.value] if isinstance(first, ast.Constant) and isinstance(first.value, str) else []
    if isinstance(node, ast.Name):
        if node.id in seen:
            return []
        out = []
        for value in assigned.get(node.id, []):
            out += _strings(value, assigned, seen | {node.id})
        return out
    out = []
    for child in ast.iter_child_nodes(node):
        out += _strings(child, assigned, seen)
    return out


def _func_name(call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def lesson_calls(code: str) -> list:
    """[(script, [--options], call node)] for every call in `code` that runs a script."""
    tree = ast.parse(code)
    assigned = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        assigned.setdefault(name.id, []).append(node.value)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name) and node.value:
            assigned.setdefault(node.target.id, []).append(node.value)
    calls = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _func_name(node) in RUNNERS):
            continue
        strings = [s for arg in node.args for s in _strings(arg, assigned, frozenset())]
        scripts = [i for i, s in enumerate(strings) if SCRIPT.match(s)]
        if scripts:
            first = scripts[0]
            options = [s.split("=")[0] for s in strings[first + 1:] if s.startswith("--")]
            calls.append((strings[first], options, node))
    return calls


def unknown_options(code: str) -> list:
    """[(script, option)] for every option a notebook passes that the script's --help does not list."""
    bad = []
    for script, options, _ in lesson_calls(code):
        text = help_text(script)
        bad += [(script, o) for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text)]
    return bad


def help_text(script: str) -> str:
    assert (REPO / script).is_file(), f"a notebook runs {script}, which does not exist"
    texts = help_texts()
    return texts[script] if script in texts else help_texts_of([script])[script]


@functools.lru_cache(maxsize=None)
def help_texts() -> dict:
    """{script: its --help text} for every script the notebooks run, all from one process."""
    return help_texts_of({script for name in notebook_names() for script, _, _ in
                          lesson_calls(code_of(nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)))
                          if (REPO / script).is_file()})


# ------------------------------------------------------------------------------------------ structure

def test_every_lesson_has_exactly_one_notebook_and_every_notebook_one_lesson():
    have, want = set(notebook_names()), set(lessons())
    assert not want - have, f"lessons without a notebook: {sorted(want - have)}"
    assert not have - want, f"notebooks without a lesson: {sorted(have - want)}"
    assert set(build_notebooks.sources()) == have, "each notebook has one source in notebooks/src/"


def test_committed_notebooks_are_built_from_their_sources():
    """`python notebooks/build_notebooks.py` regenerates all notebooks; what is committed is its output."""
    proc = run([PYTHON, NOTEBOOKS / "build_notebooks.py", "--check"], check=False, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_source_check_notices_an_edited_notebook(tmp_path, monkeypatch):
    name = notebook_names()[0]
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nb.cells[0].source += "\nedited by hand"
    monkeypatch.setattr(build_notebooks, "HERE", tmp_path)
    nbformat.write(nb, tmp_path / f"{name}.ipynb")
    assert build_notebooks.check([name], build_notebooks.sources()) == 1


@pytest.mark.parametrize("name", notebook_names())
def test_notebook_is_committed_with_outputs_of_a_real_run(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "every code cell was executed"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "at least one picture"
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "$ python" in printed, "the lesson's command and output are shown"
    assert re.search(r"^FULL_SIZE = False\b", code_of(nb), re.M), "the one visible switch, off"
    assert (NOTEBOOKS / f"{name}.ipynb").stat().st_size < MAX_NOTEBOOK_BYTES
    assert build_notebooks.recorded_sha256(nb), "executed by build_notebooks.py"


@pytest.mark.parametrize("name", notebook_names())
def test_notebook_runs_its_own_lesson_through_a_checked_call(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    code = code_of(nb)
    assert lessons()[name] in [script for script, _, _ in lesson_calls(code)]
    raw = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert not re.search(r"^\s*!", raw, re.M), "no `!command`: a failing one does not fail the cell"
    assert "%system" not in raw and "%sx" not in raw
    assert "os.system" not in code
    for call in ast.walk(ast.parse(code)):  # subprocess.run(...) without check=True would hide a failure
        if isinstance(call, ast.Call) and _func_name(call) == "run" and isinstance(call.func, ast.Attribute):
            assert any(k.arg == "check" and getattr(k.value, "value", None) is True for k in call.keywords)
    diffs = re.findall(r"show_diff(?:_stats)?\(\"([^\"]+)\", \"([^\"]+)\"\)", code)
    assert all(new == lessons()[name] for _, new in diffs), "a diff ends at this notebook's lesson"
    if re.match(r"\d+_", name) and not name.startswith("0_"):  # lesson 0 and the tools have no predecessor
        assert diffs and all((REPO / old).is_file() for old, _ in diffs), "the diff against an earlier lesson"


@pytest.mark.parametrize("name", [n for n in notebook_names() if lessons().get(n, "").startswith("day2/")])
def test_day2_notebook_runs_its_lesson_on_two_local_nodes(name):
    code = code_of(nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4))
    nodes = [kw.value.value for _, _, call in lesson_calls(code) for kw in call.keywords
             if kw.arg == "nnodes" and isinstance(kw.value, ast.Constant)]
    assert nodes and max(nodes) >= 2, "a day-2 notebook runs its script as a 2-node job on this machine"


# ------------------------------------------------------------------------------------------ options in step

@pytest.mark.parametrize("name", notebook_names())
def test_notebook_uses_only_options_its_scripts_have(name):
    code = code_of(nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4))
    assert lesson_calls(code), "the notebook runs at least one script"
    assert unknown_options(code) == []


def test_the_option_check_catches_an_option_a_script_no_longer_has():
    code = ('SIZE = [] if FULL_SIZE else ["--quick", "--max-steps", 5]\n'
            'run_lesson("day1/4_mnist_manual_ddp.py", *SIZE, "--sync", "flat", nproc=2)\n'
            'EXTRA = ["--no-such-option"]\n'
            'out = run_lesson("day1/4_mnist_manual_ddp.py", *SIZE, *EXTRA, "--run-dir", RUN)\n'
            'subprocess.run([sys.executable, "day1/0_torch_dist.py", "--nproc=2", f"--gone={n}"], check=True)\n')
    calls = [(s, o) for s, o, _ in lesson_calls(code)]
    assert calls == [("day1/4_mnist_manual_ddp.py", ["--quick", "--max-steps", "--sync"]),
                     ("day1/4_mnist_manual_ddp.py", ["--quick", "--max-steps", "--no-such-option", "--run-dir"]),
                     ("day1/0_torch_dist.py", ["--nproc", "--gone"])]
    assert unknown_options(code) == [("day1/4_mnist_manual_ddp.py", "--no-such-option"),
                                     ("day1/0_torch_dist.py", "--gone")]


# ------------------------------------------------------------------------------------------ execution

def execute(nb, timeout=CELL_TIMEOUT):
    """Run a notebook as JupyterLab does: its own directory as working directory, a fresh kernel."""
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


@pytest.mark.slow
@pytest.mark.parametrize("name", notebook_names())
def test_notebook_executes_headless(name, dataset, request):
    """Executed here, with fresh outputs, whenever anything that can change its outputs changed since its
    committed run (build_notebooks.inputs(): the notebook, the scripts it names, everything of course/ and
    data_tools/ they import, the parts of nbhelpers.py its cells use, the requirements and the pinned torch
    of constraints.txt).  A notebook whose inputs are byte for byte those of its committed run is not
    executed again: its committed outputs are a run of exactly this code, made by build_notebooks.py with
    the same nbclient, and they are checked instead.  COURSE_EXECUTE_NOTEBOOKS=all executes every notebook.
    The run's last lines count both kinds."""
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    unchanged = build_notebooks.recorded_sha256(nb) == build_notebooks.inputs_sha256(name)
    if unchanged and os.environ.get("COURSE_EXECUTE_NOTEBOOKS") != "all":
        request.node.user_properties.append(("notebook", "unchanged"))
        outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
        assert all(c.execution_count for c in nb.cells if c.cell_type == "code")
        assert not [o for o in outputs if o.output_type == "error"]
        assert lessons()[name] in "".join(o.get("text", "") for o in outputs), "the lesson ran (its command)"
        return
    request.node.user_properties.append(("notebook", "executed"))
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    execute(nb)
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert f"{lessons()[name]}" in printed, "the lesson ran (its command is printed)"


def _repository_copy(tmp_path, monkeypatch):
    """The repository's code (no notebook) in tmp_path, with build_notebooks pointed at it."""
    import shutil

    for part in ("course", "data_tools", "day1", "day2", "day3", "day4", "slurm", "scripts", "notebooks"):
        shutil.copytree(REPO / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__", "*.ipynb"))
    for req in [*REPO.glob("requirements*.txt"), REPO / "constraints.txt"]:
        shutil.copy(req, tmp_path)
    monkeypatch.setattr(build_notebooks, "REPO", tmp_path)
    monkeypatch.setattr(build_notebooks, "HERE", tmp_path / "notebooks")
    monkeypatch.setattr(build_notebooks, "SRC", tmp_path / "notebooks" / "src")
    return tmp_path


def _edit(path, old, new):
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} once in {path}"
    path.write_text(text.replace(old, new))


def test_the_inputs_digest_changes_with_any_file_a_notebook_depends_on(tmp_path, monkeypatch):
    """A copy of the repository: changing the notebook's source, its lesson, a module the lesson imports, one its
    launcher preloads by name (course/launching/gc_paused.py: lesson 6 imports the launcher that names it,
    although this notebook's torchrun runs never start that fork server; a digest follows whole modules),
    the requirements or the pinned torch (constraints.txt) changes the digest; a README does not, nor a lesson
    only nbhelpers.py's docstring names (lesson 9: before, every notebook depended on it and on all it
    imports)."""
    repo = _repository_copy(tmp_path, monkeypatch)
    name = "6_mnist_ddp_pt"
    names = set(build_notebooks.inputs(name))
    assert {"day1/6_mnist_ddp_pt.py", "day1/4_mnist_manual_ddp.py", "course/models.py",
            "course/launching/gc_paused.py", "data_tools/datasets.py", "notebooks/nbhelpers.py:run_lesson",
            "notebooks/src/6_mnist_ddp_pt.py", "requirements.txt", "constraints.txt"} <= names
    assert not {"notebooks/nbhelpers.py", "day2/9_torch_dist_multi_node.py", "day1/0_torch_dist.py",
                "day1/7_mnist_ddp_pt_timing.py", "course/measuring/timing.py", "slurm/submit.sh"} & names
    before = build_notebooks.inputs_sha256(name)
    for unchanged in ("README.md", "day2/9_torch_dist_multi_node.py", "course/measuring/timing.py"):
        with open(repo / unchanged, "a") as f:
            f.write("\n# changed\n")
        assert build_notebooks.inputs_sha256(name) == before, unchanged
    for changed in ("notebooks/src/6_mnist_ddp_pt.py", "day1/6_mnist_ddp_pt.py", "course/models.py",
                    "course/launching/gc_paused.py", "requirements.txt", "constraints.txt"):
        with open(repo / changed, "a") as f:
            f.write("\n# changed\n")
        assert build_notebooks.inputs_sha256(name) != before, changed
        before = build_notebooks.inputs_sha256(name)


def test_the_inputs_digest_follows_only_the_helpers_a_notebook_uses(tmp_path, monkeypatch):
    """Of notebooks/nbhelpers.py a notebook's digest covers what its cells use: a helper it does not call
    (draw_allreduce), a new helper, do not change it; one it calls (draw_buckets), one those call in turn
    (run_lesson -> _stream -> is_noise), the plotting setup every import runs, and taking a used name out of
    __all__ do.  The course modules a used helper imports are inputs, those of the others are not."""
    repo = _repository_copy(tmp_path, monkeypatch)
    helpers, name = repo / "notebooks" / "nbhelpers.py", "6_mnist_ddp_pt"
    before = build_notebooks.inputs_sha256(name)
    _edit(helpers, "figsize=(1.9 * n + 1.5, 3.2)", "figsize=(1.9 * n + 1.6, 3.2)")  # in draw_allreduce
    assert build_notebooks.inputs_sha256(name) == before, "a helper the notebook does not call"
    _edit(helpers, '"plot_trace"]', '"plot_trace", "new_helper"]')
    with open(helpers, "a") as f:
        f.write("\n\ndef new_helper():\n    return 1\n")
    assert build_notebooks.inputs_sha256(name) == before, "a new helper"
    for old, new, what in (
            ("bucket_cap=None, names=None", "bucket_cap=0, names=None", "draw_buckets, which it calls"),
            ("for p in NOISE)", "for p in NOISE[:])", "is_noise, which run_lesson calls through _stream"),
            ('"figure.dpi": 80', '"figure.dpi": 81', "the plotting setup of every import"),
            ('"draw_buckets",', "", "draw_buckets taken out of __all__")):
        _edit(helpers, old, new)
        assert build_notebooks.inputs_sha256(name) != before, what
        before = build_notebooks.inputs_sha256(name)

    src = repo / "notebooks" / "src"
    (src / "traces.py").write_text("# %%\nfrom nbhelpers import *\n\n# %%\nplot_trace(['a.json'])\n")
    (src / "buckets.py").write_text("# %%\nfrom nbhelpers import *\n\n# %%\nddp_buckets('mlp')\n")
    traces, buckets = set(build_notebooks.inputs("traces")), set(build_notebooks.inputs("buckets"))
    assert "course/measuring/profiling.py" in traces - buckets, "plot_trace imports it inside its body"
    assert "course/models.py" in buckets - traces, "ddp_buckets runs code that imports it (python -c)"
    assert "notebooks/nbhelpers.py:plot_trace" in traces - buckets
    assert not {"course/launching/launch.py", "notebooks/nbhelpers.py:run_lesson"} & (traces | buckets)
    before = build_notebooks.inputs_sha256("traces")
    with open(repo / "course" / "models.py", "a") as f:
        f.write("\n# changed\n")
    assert build_notebooks.inputs_sha256("traces") == before, "a module only an unused helper imports"
    with open(repo / "course" / "measuring" / "profiling.py", "a") as f:
        f.write("\n# changed\n")
    assert build_notebooks.inputs_sha256("traces") != before, "the module plot_trace imports"


def test_restamping_changes_only_the_digest_and_refuses_a_stale_notebook(tmp_path, monkeypatch):
    """`build_notebooks.py --restamp PREVIOUS` after a change of the digest's rule: a notebook whose recorded
    digest is what the previous rule computes now gets the new digest, its file otherwise byte for byte the
    same; one whose code changed since its run (stale under the previous rule) is refused and left alone."""
    _repository_copy(tmp_path, monkeypatch)
    current, stale, old = "6_mnist_ddp_pt", "7_mnist_ddp_pt_timing", "f" * 64  # old: as the previous rule stamped
    original = {}
    for name in (current, stale):
        text = (NOTEBOOKS / f"{name}.ipynb").read_text()
        recorded = build_notebooks.recorded_sha256(nbformat.reads(text, as_version=4))
        original[name] = text.replace(recorded, old).encode()
        (tmp_path / "notebooks" / f"{name}.ipynb").write_bytes(original[name])
    previous = {current: old, stale: "0" * 64}.get  # what the previous rule computes now: 7's code changed
    assert build_notebooks.stale([current, stale]) == [current, stale]
    assert build_notebooks.restamp([current, stale], previous) == [stale]
    assert (tmp_path / "notebooks" / f"{stale}.ipynb").read_bytes() == original[stale]
    new = (tmp_path / "notebooks" / f"{current}.ipynb").read_bytes()
    assert new == original[current].replace(old.encode(), build_notebooks.inputs_sha256(current).encode())
    assert build_notebooks.stale([current, stale]) == [stale]


@pytest.mark.slow
@pytest.mark.parametrize("launch", ['nproc=2', '"--nproc", 2'])
def test_a_failing_lesson_run_fails_its_notebook(launch, dataset):
    """The same helper the notebooks use: a lesson that exits non-zero must stop the notebook.  The first
    run succeeds (the harness works and a run that exits 0 passes); the second asks lesson 4 for 0 epochs,
    which the script refuses (exit 2, in every rank under torchrun)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("from nbhelpers import *"),
                nbformat.v4.new_code_cell('run_lesson("day1/4_mnist_manual_ddp.py", "--help")'),
                nbformat.v4.new_code_cell(f'run_lesson("day1/4_mnist_manual_ddp.py", "--epochs", 0, {launch})'),
                nbformat.v4.new_code_cell('print("not reached")')]
    with pytest.raises(CellExecutionError) as failure:
        execute(nb, timeout=300)
    assert "CalledProcessError" in str(failure.value)
    assert "--sync" in "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert [o.ename for o in nb.cells[2].outputs if o.output_type == "error"] == ["CalledProcessError"]
    assert "must be at least 1" in "".join(o.get("text", "") for o in nb.cells[2].outputs)
    assert nb.cells[3].outputs == [] and nb.cells[3].execution_count is None


# ------------------------------------------------------------------------------------------ what a learner reads

def test_known_harmless_lines_are_hidden_and_the_lessons_lines_are_not():
    import nbhelpers

    noise = ["ERROR:2026-11-22 14:30:53 8235:8235 DeviceProperties.cpp:42] gpuGetDeviceCount failed with code 35",
             "USDT:2026-11-22 14:30:53 8235:8235 SyncActivityProfilerHandler.cpp:39] profiler_start",
             "*****************************************",
             "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your "
             "system being overloaded, please further tune the variable for optimal performance in your "
             "application as needed.",
             "[rank0]:[W1124 01:04:41.900936531 CPUAllocator.cpp:245] Memory block of unknown size was allocated "
             "before the profiling started, profiler results will not include the deallocation event"]
    lesson = ["[rank 0] all_reduce(SUM) = 3, mean = 1.5", "ddp               1.0    407.1     5.61      4.33",
              "[rank 0] error: the process group could not be set up", "| mlp | 64 | cpu | 1 x 2 |"]
    assert [nbhelpers.is_noise(line) for line in noise] == [True] * len(noise)
    assert [nbhelpers.is_noise(line) for line in lesson] == [False] * len(lesson)


@pytest.mark.parametrize("name", notebook_names())
def test_committed_outputs_hold_no_known_noise(name):
    import nbhelpers

    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    printed = [line for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "stream"
               for line in o.text.splitlines()]
    assert [line for line in printed if nbhelpers.is_noise(line)] == []
