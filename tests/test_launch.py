"""How `python lesson.py --nproc N` starts its ranks (course/launching/launch.py and supervise.py): forked from
one fork server that has imported torch, each with the environment of its own launch; COURSE_START_METHOD=spawn
for fresh interpreters instead."""
import os
import re

import pytest

from conftest import PYTHON, REPO, run
from course.launching.ports import free_port

TWICE = REPO / "tests" / "launch_twice.py"


def torch_imports(stderr: str) -> int:
    """Processes that imported torch, from PYTHONPROFILEIMPORTTIME's line for the top-level module."""
    return len(re.findall(r"^import time:.*\| *torch$", stderr, flags=re.M))


@pytest.mark.parametrize("method, imports", [("", 1), ("fork", 1), ("forkserver", 2),
                                             pytest.param("spawn", 1 + 2 + 3, marks=pytest.mark.slow)])
def test_ranks_see_their_own_launch_and_torch_is_imported_once_for_all(method, imports):
    """Two launches (2 ranks, then 3) from one process, as lesson 7's sweep makes them.  Every rank sees the
    environment of its own launch (its MASTER_PORT, the variable set just before it), although a fork
    server started with the first one.  torch is imported by the launching process only (the default on a
    machine without GPUs: fork), by it and the fork server (forkserver), not again by each of the 5 ranks
    (spawn: by every rank).  The fork server imports without Python's garbage collector
    (course/launching/gc_paused.py); every rank has it on."""
    proc = run([PYTHON, TWICE], env={"COURSE_START_METHOD": method, "PYTHONPROFILEIMPORTTIME": "1"}, timeout=180)
    seen = sorted(re.findall(r"^launch=(\d) rank=(\d) world=(\d) port=(\d+) gc=1$", proc.stdout, flags=re.M))
    assert [(launch, rank, world) for launch, rank, world, _ in seen] == \
        [("2", "0", "2"), ("2", "1", "2"), ("3", "0", "3"), ("3", "1", "3"), ("3", "2", "3")], proc.stdout
    ports = {launch: {port for l, _, _, port in seen if l == launch} for launch in ("2", "3")}
    assert len(ports["2"]) == len(ports["3"]) == 1 and ports["2"] != ports["3"], ports
    assert torch_imports(proc.stderr) == imports


def test_an_unknown_start_method_is_one_line():
    proc = run([PYTHON, TWICE], env={"COURSE_START_METHOD": "thread"}, check=False, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "COURSE_START_METHOD=thread is not a way to start ranks here; use fork or forkserver or spawn" \
        in lines[0]
    assert "launch=" not in proc.stdout


def test_a_process_whose_threads_have_run_is_not_forked(monkeypatch):
    """A process whose OpenMP threads have run would give each forked rank a parallel region that waits for
    ever (measured: the next test); such a process, or one that sees a GPU, gets the fork server,
    and an explicit COURSE_START_METHOD=fork there is one line."""
    import torch

    from course.launching import supervise
    from course.launching.cli import CourseError

    monkeypatch.delenv("COURSE_START_METHOD", raising=False)
    monkeypatch.setattr(supervise, "_THREADS_AT_IMPORT", supervise._thread_count())
    assert supervise._why_not_fork() is None
    monkeypatch.setattr(supervise, "_THREADS_AT_IMPORT", supervise._thread_count() - 2)
    assert supervise._why_not_fork() == "it has started 2 thread(s) since torch was imported"
    assert supervise.start_method() == "forkserver"
    monkeypatch.setenv("COURSE_START_METHOD", "fork")
    with pytest.raises(CourseError, match="this process cannot be forked safely .it has started 2 thread"):
        supervise.start_method()
    monkeypatch.setattr(supervise, "_THREADS_AT_IMPORT", supervise._thread_count())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert supervise._why_not_fork() == "a GPU is visible"


def test_forking_after_threads_have_run_hangs_which_is_why_it_is_refused():
    """The reason the rule above exists, measured: a child forked after the parent ran a parallel region
    with 2 threads never finishes its own; forked after single-threaded work, it does at once."""
    code = ("import os, sys, torch\n"
            "torch.set_num_threads(int(sys.argv[1])); a = torch.randn(600, 600); a @ a\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    torch.set_num_threads(2); a @ a; os._exit(0)\n"
            "import time; deadline = time.monotonic() + float(sys.argv[2])\n"
            "while time.monotonic() < deadline:\n"
            "    if os.waitpid(pid, os.WNOHANG)[0]: print('finished'); sys.exit(0)\n"
            "    time.sleep(0.1)\n"
            "os.kill(pid, 9); print('stuck')\n")
    assert run([PYTHON, "-c", code, "1", "60"], env={"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": "PASSIVE"}
               ).stdout.strip() == "finished"
    # passive: the stuck child sleeps instead of spinning on a core for those seconds
    assert run([PYTHON, "-c", code, "2", "8"], env={"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": "PASSIVE"}
               ).stdout.strip() == "stuck"


ONE_CPU = ("import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "  # as taskset -c N would
           "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


@pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda _: ())(0)) < 2, reason="needs 2 CPUs to leave one out")
@pytest.mark.parametrize("how", ["affinity of one CPU, --nproc 1", "srun task with --cpus-per-task=1"])
def test_a_rank_computes_with_the_threads_of_the_cpus_it_may_use(how):
    """A rank's threads, as the lesson's launch set them (tests/threads_of_rank.py): 1 in a process that may
    run on one CPU (taskset, a Slurm binding) and in an srun task given --cpus-per-task=1 (simulated: the
    variables of a one-task step).  The old rule counted the machine's CPUs, os.cpu_count(): 2 or more here."""
    cmd = [PYTHON, REPO / "tests" / "threads_of_rank.py", REPO / "day1" / "0_torch_dist.py"]
    env = {"OMP_NUM_THREADS": None, **{n: None for n in os.environ if n.startswith("SLURM_")}}
    if how.startswith("affinity"):
        cmd = [PYTHON, "-c", ONE_CPU, *cmd[1:], "--nproc", "1"]
    else:
        env.update(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
                   SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1", SLURM_CPUS_PER_TASK="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = run(cmd, env=env, timeout=120).stdout
    assert re.search(r"^threads of rank \S+: 1 \(OMP_NUM_THREADS=None\)$", out, flags=re.M), out
