"""Shared test helpers: run a lesson for real, the way a user would, and read what it wrote."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# fixtures: slurm_cluster (a real two-node Slurm, tests/slurm_cluster.py), the chunked HDF5 file of day 2
pytest_plugins = ["slurm_fixture", "h5_fixture"]

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def run(cmd, *, timeout=300, check=True, env=None, cwd=REPO) -> subprocess.CompletedProcess:
    """Run a command, capture its output, and on an unexpected exit code show all of it."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


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


def metrics(run_dir) -> dict:
    return json.loads((Path(run_dir) / "metrics.json").read_text())


@pytest.fixture(scope="session")
def dataset():
    """The real default dataset, prepared once (CI prepares it in .ci/run; here it is idempotent)."""
    from data_tools.datasets import DEFAULT_DATASET, prepare

    prepare(DEFAULT_DATASET, log=lambda *_: None)
    return DEFAULT_DATASET
