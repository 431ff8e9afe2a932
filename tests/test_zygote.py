"""tests/zygote.py runs `python SCRIPT args`, and torchrun's agent and workers, as fresh interpreters would:
what the script sees is the same."""
import subprocess

from conftest import PYTHON, REPO, SESSION_ENV, _the_zygote

SCRIPT = '''
import os, signal, sys
print(sys.argv, os.getcwd(), os.environ.get("PROBE"), sys.path[0], __name__, __file__)
print([signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGPIPE)])
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, "gc", __import__("gc").isenabled())
if "RANK" in os.environ:  # a torchrun worker: its session too (a plain command's group is its launcher's)
    print("rank", os.environ["RANK"], os.environ["LOCAL_RANK"], "session leader", os.getsid(0) == os.getpid())
print("to stderr", file=sys.stderr)
import torch
torch.manual_seed(0); print(torch.rand(2).tolist(), torch.get_num_threads())
sys.exit(int(sys.argv[1]))
'''


def test_a_script_sees_the_same_through_the_zygote_as_in_a_fresh_interpreter(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    cmd = [PYTHON, str(script), "3", "an argument"]
    env = {**SESSION_ENV, "PROBE": "value"}
    zygote = _the_zygote()
    assert zygote is not None and zygote.serves(cmd, env, PYTHON)
    served = zygote.run(cmd, env, str(tmp_path), timeout=120)
    fresh = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert (served.returncode, served.stdout, served.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert served.returncode == 3 and " value " in served.stdout and "to stderr" in served.stderr
    # what torch, OpenMP or Python read while starting up makes a fresh interpreter instead
    assert not zygote.serves(cmd, {**env, "OMP_NUM_THREADS": "2"}, PYTHON)
    assert not zygote.serves([PYTHON, "-m", "venv", str(tmp_path)], env, PYTHON)
    assert (REPO / "tests" / "zygote.py").is_file()


def test_torchrun_and_its_workers_see_the_same_through_the_zygote_as_fresh_interpreters(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), "0", "an argument"]
    env = {**SESSION_ENV, "PROBE": "value"}
    zygote = _the_zygote()
    assert zygote is not None and zygote.serves(cmd, env, PYTHON)
    before = zygote.cpu_seconds
    served = zygote.run(cmd, env, str(tmp_path), timeout=120)
    assert zygote.cpu_seconds - before > 0.5  # the agent's and its two workers' CPU time
    fresh = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    lines = lambda text: sorted(text.splitlines())  # noqa: E731  (the two workers print in any order)
    assert (served.returncode, lines(served.stdout), lines(served.stderr)) == \
        (fresh.returncode, lines(fresh.stdout), lines(fresh.stderr))
    # each worker: its own rank, the session torchrun gives it (Popen(start_new_session=True))
    assert "rank 0 0 session leader True" in served.stdout
    assert "rank 1 1 session leader True" in served.stdout
    # a worker that fails: torchrun sees its exit code and says so, as with a fresh interpreter
    failing = [*cmd[:-2], "3", "x"]
    served, fresh = zygote.run(failing, env, str(tmp_path), timeout=120), subprocess.run(
        failing, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert served.returncode == fresh.returncode == 1
    for text in (served.stderr, fresh.stderr):
        assert "exitcode  : 3" in text and "ChildFailedError" in text
