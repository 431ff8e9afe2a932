"""Shared test helpers: run a lesson for real, the way a user would, and read what it wrote."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# fixtures: slurm_cluster (a real two-node Slurm, tests/slurm_cluster.py), the chunked HDF5 file of day 2
pytest_plugins = ["slurm_fixture", "h5_fixture"]

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# One thread per process in everything the tests start (lessons, notebooks' kernels, Slurm jobs), unless the
# caller chose a number.  The suite runs two test streams at once on a machine that may have only two cores;
# a lesson with 2 threads then shares its cores with the other stream, and each of its parallel regions
# waits for a thread that is not running: one epoch of lesson 2 took 8.2 s instead of 1.4 s next to one busy
# process.  course/launching/launch.py gives each rank OMP_NUM_THREADS threads when it is set, the CPUs it may use
# // ranks when not (course/launching/devices.py, share_cpu_cores);
# tests/test_lesson7_timing.py checks the default with the variable unset.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# CPU-only by default, on a GPU node too: everything the tests start runs the CPU path with gloo, as in CI.
# Tests marked gpu (tests/test_gpu.py) run with GPU_ENV, the GPUs this run was started with.
GPU_ENV = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}  # None: unset, every GPU
os.environ["CUDA_VISIBLE_DEVICES"] = ""


def environ(*changes) -> dict:
    """This process's environment with `changes` applied in order; a value of None removes a variable."""
    merged = dict(os.environ)
    for change in changes:
        merged.update(change or {})
    return {k: v for k, v in merged.items() if v is not None}


def run(cmd, *, timeout=300, check=True, env=None, cwd=REPO) -> subprocess.CompletedProcess:
    """Run a command as a learner would (a fresh process, started by the launcher the command names), capture
    its output, and on an unexpected exit code show all of it.  env: variables to set on top of this
    process's, a value of None removes one.  COURSE_RUN_LOG=FILE appends a JSON line per command: the test,
    the command, its CPU and wall seconds."""
    cmd, merged = [str(c) for c in cmd], environ(env)
    cpu_before, wall_before = _cpu_so_far(), time.monotonic()
    # its own session, as a shell's job has its own process group: on a timeout the whole job goes, the ranks
    # and torchrun's workers (sessions of their own) included, and nothing is left to write into a test's dir
    with subprocess.Popen(cmd, cwd=cwd, env=merged, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            end_process_tree(popen.pid)
            expired.output, expired.stderr = popen.communicate()
            raise
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if os.environ.get("COURSE_RUN_LOG"):  # one JSON line per command: which test, its CPU and wall seconds
        with open(os.environ["COURSE_RUN_LOG"], "a") as log:
            log.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "cmd": cmd[1:],
                                  "cpu": round(_cpu_so_far() - cpu_before, 2),
                                  "wall": round(time.monotonic() - wall_before, 2)}) + "\n")
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def end_process_tree(pid: int) -> None:
    """SIGKILL to a process, its process group and every process below it (torchrun starts its workers in
    sessions of their own)."""
    import signal

    import psutil

    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        tree = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    for process in tree:
        try:
            process.kill()
        except psutil.Error:
            pass


def lesson(script, *args, launcher="self", nproc=2, **kw) -> subprocess.CompletedProcess:
    """Run day1/... or day2/... with its own launcher (`--nproc`) or torchrun (`--nproc_per_node`)."""
    script = REPO / script
    if launcher == "self":
        cmd = [PYTHON, script, *args]
    elif launcher == "torchrun":
        cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    else:
        raise ValueError(launcher)
    return run(cmd, **kw)


def help_texts_of(scripts) -> dict:
    """{script: its --help text}.  tests/help_texts.py runs each script as `python SCRIPT --help` would (the
    same text), in one process: torch is imported once instead of once per script."""
    return json.loads(run([PYTHON, REPO / "tests" / "help_texts.py", *sorted(scripts)], timeout=300).stdout)


def require_chromium():
    """Skip a browser test where Chromium is missing; under CI (CI=true) fail instead: CI must run it."""
    from headless_chromium import find_chromium
    if find_chromium() is None:
        message = "chromium is not installed (apt-get install -y chromium)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + "; CI must run the browser test")
        pytest.skip(message)


def max_rel_diff(a: dict, b: dict) -> float:
    """The largest difference between two state dicts, per tensor relative to the tensor's largest magnitude."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in a)


def metrics(run_dir) -> dict:
    return json.loads((Path(run_dir) / "metrics.json").read_text())


@pytest.fixture
def lesson_main(monkeypatch):
    """Run a lesson's `if __name__ == "__main__"` block in this process, as `python script args...` would,
    for errors found before any rank starts: the same parser, checks and messages, without the seconds of a
    fresh interpreter importing torch.  Starting ranks would be a test failure."""
    import contextlib
    import io
    import runpy
    import signal
    from types import SimpleNamespace

    import torch

    import course.launching.launch

    def never(*_, **__):
        raise AssertionError("the lesson started its ranks: the bad input was not caught")

    monkeypatch.setattr(course.launching.launch, "_run", never)  # one rank in this process (torchrun, srun, --nproc 1)
    monkeypatch.setattr(torch.multiprocessing, "start_processes", never)  # ranks spawned by --nproc N
    monkeypatch.setattr(sys, "path", list(sys.path))

    def main(script, *args, env=None):
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(sys, "argv", [str(REPO / script), *map(str, args)])
        previous, err = signal.getsignal(signal.SIGUSR1), io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                runpy.run_path(str(REPO / script), run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            signal.signal(signal.SIGUSR1, previous)
        return SimpleNamespace(returncode=code, stderr=err.getvalue())
    return main


@pytest.fixture(scope="session")
def gpus() -> int:
    """How many CUDA GPUs the tests marked gpu may use (GPU_ENV); skips the test where there is none."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    n = int(run([PYTHON, "-c", code], env=GPU_ENV).stdout.split()[-1])
    if n == 0:
        pytest.skip("no CUDA GPU is visible: the GPU path is checked on a GPU node (pytest -m gpu)")
    return n


@pytest.fixture(scope="session")
def dataset():
    """The real default dataset, prepared once (CI prepares it in .ci/run; here it is idempotent)."""
    from data_tools.datasets import DEFAULT_DATASET, prepare

    prepare(DEFAULT_DATASET, log=lambda *_: None)
    return DEFAULT_DATASET


# ------------------------------------------------------------------------- where the suite's time goes

# The order in which run_tests.sh hands whole files to the workers (--dist loadfile --no-loadscope-reorder: in
# collection order): the longest first, so that no long file is left to run alone at the end.  How long each
# test took (setup, call and teardown) comes from this checkout's runs (LAST_DURATIONS: every run updates the
# tests it ran, so a run of one file or one test changes only those) or, in a fresh clone, from the committed
# DURATIONS (`cp .pytest-durations.json tests/durations.json` renews it).  A file is the sum of its tests; one
# in neither record goes first: a new file may be long.
DURATIONS = REPO / "tests" / "durations.json"
LAST_DURATIONS = REPO / ".pytest-durations.json"


def recorded_seconds() -> dict:
    """{test id: worker-seconds of its last run}: the committed record, updated by this checkout's own."""
    seconds = {}
    for path in (DURATIONS, LAST_DURATIONS):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            seconds.update({k: v for k, v in record.items() if isinstance(v, (int, float))})
    return seconds


# The tests marked quick(ID) that this session collected, when it collected the whole suite (tests/test_tiers.py
# reads them instead of collecting the suite again in a pytest of its own: 30-40 CPU-seconds).  Kept before
# -m and -k deselect any: what the suite holds, not what this run runs.
QUICK_COLLECTED = pytest.StashKey[list]()


def collected_the_whole_suite(config) -> bool:
    return all(Path(a).resolve() == REPO / "tests" for a in config.args)


@pytest.hookimpl(tryfirst=True)  # before the mark plugin's deselection
def pytest_collection_modifyitems(config, items):
    if collected_the_whole_suite(config):
        from quick_marks import quick_tests

        config.stash[QUICK_COLLECTED] = quick_tests(items)
    per_file = {}
    for test, seconds in recorded_seconds().items():
        per_file[test.split("::")[0]] = per_file.get(test.split("::")[0], 0.0) + seconds
    # stable: a file's tests keep their order
    items.sort(key=lambda item: -per_file.get(item.nodeid.split("::")[0], float("inf")))


_seconds_per_test = {}
_cpu_per_file = {}
_cpu_per_test = {}
_notebooks = {}  # "executed" or "unchanged": how tests/test_notebooks.py checked each notebook
_CPU_AT_START = pytest.StashKey[float]()


def _cpu_so_far() -> float:
    """CPU seconds of this worker and of its children that ended (subprocess.run, Popen: the commands it ran,
    with whatever they waited for).  Not counted: the test Slurm's jobs (the processes of slurmd, not of this
    worker)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_AT_START] = _cpu_so_far()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and _CPU_AT_START in item.stash:  # the test's setup, call and teardown
        outcome.get_result().user_properties.append(("cpu", _cpu_so_far() - item.stash[_CPU_AT_START]))


def pytest_runtest_logreport(report):
    """Setup, call and teardown seconds, summed per test (under xdist: in the controller, from every worker's
    reports)."""
    path = report.nodeid.split("::")[0]
    _seconds_per_test[report.nodeid] = _seconds_per_test.get(report.nodeid, 0.0) + report.duration
    for key, value in report.user_properties:
        if key == "notebook" and report.when == "call":
            _notebooks[value] = _notebooks.get(value, 0) + 1
        if key == "cpu":
            _cpu_per_file[path] = _cpu_per_file.get(path, 0.0) + value
            _cpu_per_test[report.nodeid] = value


def pytest_sessionfinish(session, exitstatus):
    """At the end of a whole run in CI, in which every test ran (CI=true: no component may be missing), every
    reference run of tests/reference_runs.py was read by some test: a run nobody reads is a run nobody needs.
    (A name a test asks for that is not there fails that test.)"""
    config = session.config
    whole = not config.option.keyword and not config.option.markexpr and not config.option.collectonly and \
        collected_the_whole_suite(config)
    if hasattr(config, "workerinput") or not whole or exitstatus != 0 or os.environ.get("CI", "").lower() != "true":
        return
    from catalogue import shared_root, unread
    from reference_runs import RUNS

    never = unread(shared_root(config, config._tmp_path_factory), RUNS)
    if never:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        config.get_terminal_writer().line(f"tests/reference_runs.py: no test read {never}: remove them or read them",
                                          red=True)


def pytest_terminal_summary(terminalreporter, config):
    """A table of the test files that took longest, in worker-seconds: what to make cheaper first."""
    if hasattr(config, "workerinput") or not _seconds_per_test:
        return
    if not config.option.collectonly and os.environ.get("COURSE_RECORD_DURATIONS", "1") != "0":
        seconds = recorded_seconds()
        seconds.update({test: round(s, 2) for test, s in _seconds_per_test.items()})
        seconds = {test: s for test, s in seconds.items() if (REPO / test.split("::")[0]).is_file()}  # still there
        partial = LAST_DURATIONS.with_name(f"{LAST_DURATIONS.name}.{os.getpid()}")
        try:
            partial.write_text(json.dumps(dict(sorted(seconds.items())), indent=0))
            os.replace(partial, LAST_DURATIONS)  # a worker of the next run reads a whole record or the old one
        except OSError:  # a read-only checkout: the order stays the committed one
            partial.unlink(missing_ok=True)
    per_file = {}
    for test, seconds in _seconds_per_test.items():
        per_file[test.split("::")[0]] = per_file.get(test.split("::")[0], 0.0) + seconds
    total = sum(per_file.values())
    terminalreporter.section("worker-seconds per test file")
    for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:4.1f} %  {path}")
    terminalreporter.write_line(f"{total:8.1f} s  in all, {len(per_file)} files")
    if _cpu_per_file:  # what the 2 cores spent on each file: the suite is CPU-bound
        total = sum(_cpu_per_file.values())
        terminalreporter.section("CPU-seconds per test file (its processes; not the test Slurm's jobs)")
        for path, seconds in sorted(_cpu_per_file.items(), key=lambda kv: -kv[1])[:15]:
            terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:4.1f} %  {path}")
        terminalreporter.write_line(f"{total:8.1f} s  in all, {len(_cpu_per_file)} files")
        terminalreporter.section("most CPU-seconds per test (setup, call and teardown)")
        for nodeid, seconds in sorted(_cpu_per_test.items(), key=lambda kv: -kv[1])[:25]:
            terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")
    if _notebooks:
        terminalreporter.write_line(
            f"notebooks: {_notebooks.get('executed', 0)} executed; {_notebooks.get('unchanged', 0)} unchanged since "
            f"their committed run, checked without executing (COURSE_EXECUTE_NOTEBOOKS=all executes them)")


@pytest.fixture(scope="session")
def catalogue(request, tmp_path_factory, dataset):
    """catalogue(name): the reference run of that name (tests/reference_runs.py), launched once per test
    session and shared by every xdist worker (tests/catalogue.py)."""
    from catalogue import Catalogue, shared_root
    from reference_runs import RUNS

    return Catalogue(shared_root(request.config, tmp_path_factory), RUNS)
