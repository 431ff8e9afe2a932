"""How `python lesson.py --nproc N` starts its ranks (course/launch.py, course/supervise.py): forked from one
fork server that has imported torch, each with the environment of its own launch; COURSE_START_METHOD=spawn
for fresh interpreters instead."""
import re

import pytest

from conftest import PYTHON, REPO, run

TWICE = REPO / "tests" / "launch_twice.py"


def torch_imports(stderr: str) -> int:
    """Processes that imported torch, from PYTHONPROFILEIMPORTTIME's line for the top-level module."""
    return len(re.findall(r"^import time:.*\| *torch$", stderr, flags=re.M))


@pytest.mark.parametrize("method, imports", [("", 2), ("forkserver", 2), ("spawn", 1 + 2 + 3)])
def test_ranks_see_their_own_launch_and_torch_is_imported_once_for_all(method, imports):
    """Two launches (2 ranks, then 3) from one process, as lesson 7's sweep makes them.  Every rank sees the
    environment of its own launch (its MASTER_PORT, the variable set just before it), although the fork
    server started with the first one.  torch is imported by the launching process and the fork server,
    not again by each of the 5 ranks (spawn: by every rank).  The fork server imports without Python's garbage
    collector (course/gc_paused.py); every rank has it on."""
    proc = run([PYTHON, TWICE], env={"COURSE_START_METHOD": method, "PYTHONPROFILEIMPORTTIME": "1"}, timeout=180)
    seen = sorted(re.findall(r"^launch=(\d) rank=(\d) world=(\d) port=(\d+) gc=1$", proc.stdout, flags=re.M))
    assert [(launch, rank, world) for launch, rank, world, _ in seen] == \
        [("2", "0", "2"), ("2", "1", "2"), ("3", "0", "3"), ("3", "1", "3"), ("3", "2", "3")], proc.stdout
    ports = {launch: {port for l, _, _, port in seen if l == launch} for launch in ("2", "3")}
    assert len(ports["2"]) == len(ports["3"]) == 1 and ports["2"] != ports["3"], ports
    assert torch_imports(proc.stderr) == imports


def test_an_unknown_start_method_is_one_line():
    proc = run([PYTHON, TWICE], env={"COURSE_START_METHOD": "fork"}, check=False, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "COURSE_START_METHOD=fork is not a way to start ranks here; use forkserver or spawn" in lines[0]
    assert "launch=" not in proc.stdout
