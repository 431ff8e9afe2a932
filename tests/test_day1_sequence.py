"""The quick sequence (`./quickstart.sh`, `python -m course.day1_sequence`): what it starts, and how.

Running it whole takes minutes and is what quickstart.sh does; here: its plan, without starting anything.
"""
import os

import pytest

from conftest import PYTHON, REPO, help_texts_of, run
from course.day1_sequence import plan


@pytest.fixture(scope="module")
def helps():
    return help_texts_of({script for script, *_ in plan(2, "cpu", quick=True)})


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_lesson_with_a_device_option_gets_the_planned_device(helps, device):
    """On a node with one GPU the data-parallel lessons run on the CPU (one GPU cannot hold two NCCL ranks):
    a lesson started without --device would pick the GPU for every rank and stop."""
    steps = plan(2, device, quick=True)
    for script, args, _, _ in steps:
        if "--device" in helps[script]:
            assert "--device" in args and args[args.index("--device") + 1] == device, (script, args)


def test_every_planned_option_exists(helps):
    steps = plan(2, "cpu", quick=True)
    for script, args, _, _ in steps:
        assert (REPO / script).is_file()
        for option in (a for a in args if a.startswith("--")):
            assert option in helps[script], (script, option)


def fake_sinfo(tmp_path, code: int):
    """An `sinfo` first on PATH that exits with `code` (0: a Slurm controller answers)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "sinfo").write_text(f"#!/bin/sh\nexit {code}\n")
    (bin_dir / "sinfo").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": None}


def test_on_a_slurm_login_node_the_sequence_says_where_to_run_it_instead(tmp_path):
    """sinfo answers and no job holds this shell: a login node.  One message with the srun command, exit 1,
    nothing started (no lesson line); --here runs it anyway (checked with --help's parse only)."""
    done = run([PYTHON, "-m", "course.day1_sequence", "--quick"], env=fake_sinfo(tmp_path, 0), check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "this is a login node of a Slurm cluster" in done.stderr and "slurm/submit.sh --interactive --site NAME" in done.stderr
    assert "./quickstart.sh --here" in done.stderr and "$ python" not in done.stdout


def test_a_machine_with_slurm_commands_but_no_cluster_is_no_login_node(tmp_path, monkeypatch):
    from course import day1_sequence

    for key, value in fake_sinfo(tmp_path, 1).items():  # sinfo fails: no controller (a laptop, CI)
        monkeypatch.setenv(key, value) if value else monkeypatch.delenv(key, raising=False)
    assert not day1_sequence.on_login_node()
    for key, value in fake_sinfo(tmp_path, 0).items():
        monkeypatch.setenv(key, value) if value else monkeypatch.delenv(key, raising=False)
    assert day1_sequence.on_login_node()
    monkeypatch.setenv("SLURM_JOB_ID", "42")  # inside an allocation: a compute node's shell
    assert not day1_sequence.on_login_node()
