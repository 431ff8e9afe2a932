"""tests/zygote.py runs `python SCRIPT args` as a fresh interpreter would: what the script sees is the same."""
import subprocess

from conftest import PYTHON, REPO, SESSION_ENV, _the_zygote

SCRIPT = '''
import os, signal, sys
print(sys.argv, os.getcwd(), os.environ.get("PROBE"), sys.path[0], __name__, __file__)
print([signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGPIPE)])
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, "gc", __import__("gc").isenabled())
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
    assert not zygote.serves([PYTHON, "-m", "torch.distributed.run", str(script)], env, PYTHON)
    assert (REPO / "tests" / "zygote.py").is_file()
