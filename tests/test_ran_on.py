"""docs/trainers/ran-on.md is made from the suite's records, and a record says what the tests really ran."""
import json
import subprocess
import sys

import pytest

from conftest import PYTHON, REPO, run

sys.path.insert(0, str(REPO / "scripts"))
import ran_on as page  # noqa: E402  scripts/ran_on.py
from tests.ran_on import classify, merge, worker_record  # noqa: E402


def test_the_page_is_what_the_records_give():
    assert (REPO / "docs/trainers/ran-on.md").read_text() == page.render(), "run python scripts/ran_on.py"


def test_commands_are_classified_by_lesson_launcher_and_world_size(tmp_path):
    cpu = {"CUDA_VISIBLE_DEVICES": ""}
    assert classify([PYTHON, REPO / "day1/6_mnist_ddp_pt.py", "--nproc", "4"], cpu) == \
        {("6", "own launcher", 4, "cpu")}
    assert classify([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                     REPO / "day2/12_ddp_fault_tolerance.py"], cpu) == {("12", "torchrun", 2, "cpu")}
    assert classify([PYTHON, REPO / "day1/1_torch_dist_gpu.py"], {}) == {("1", "own launcher", None, "gpu")}
    assert classify([PYTHON, REPO / "day1/test-profile.py"], cpu) == {("test-profile", "own launcher", None, "cpu")}
    assert classify([PYTHON, REPO / "data_tools/create_mnist_h5.py", "--out", tmp_path], cpu) == \
        {("create_mnist_h5", "own launcher", None, "cpu")}
    job = tmp_path / "job.sh"
    job.write_text("#!/bin/bash\nsrun python day3/15_fsdp2.py --quick\n")
    assert classify(["sbatch", "--parsable", job], cpu) == {("15", "Slurm (2 nodes)", None, "cpu")}
    assert classify(["sbatch", REPO / "slurm/6_mnist_ddp_pt.sh"], cpu) == {("6", "Slurm (2 nodes)", None, "cpu")}
    # the course's own script is not read for lesson names (its usage text names lesson 10)
    assert classify(["sbatch", "--nodes=2", REPO / "day2/multinode_setup_and_run.sh", "--launcher", "srun",
                     "9_torch_dist_multi_node.py"], cpu) == {("9", "Slurm (2 nodes)", None, "cpu")}
    # slurm/submit.sh submits a launcher; --dry-run submits nothing; "--dry-run" after "--" is the lesson's
    submit = ["bash", REPO / "slurm/submit.sh"]
    assert classify([*submit, "15_fsdp2", "--site", "cpu-only", "--", "--quick"], cpu) == \
        {("15", "Slurm (2 nodes)", None, "cpu")}
    assert classify([*submit, "9", "--site", "x.env"], cpu) == {("9", "Slurm (2 nodes)", None, "cpu")}
    assert classify([*submit, "test-profile", "--site", "cpu-only"], cpu) == \
        {("test-profile", "Slurm (2 nodes)", None, "cpu")}
    assert classify([*submit, "15_fsdp2", "--site", "cpu-only", "--dry-run"], cpu) == set()
    assert classify([*submit, "99", "--site", "cpu-only"], cpu) == set()  # no such launcher: nothing ran
    assert classify(["tensorboard", "--logdir", tmp_path], cpu) == set()
    # a command line in one argument: sbatch --wrap, bash -c, a string run through a shell
    assert classify(["sbatch", "--nodes=2", "--wrap", f"srun {PYTHON} -u {REPO}/day3/17_debugging_hangs.py --bug skip"],
                    cpu) == {("17", "Slurm (2 nodes)", None, "cpu")}
    assert classify(["bash", "-c", "cd /x && torchrun --nproc_per_node=2 day3/15_fsdp2.py --device cpu"], {}) == \
        {("15", "torchrun", 2, "cpu")}
    assert classify([f"srun --ntasks=4 {PYTHON} day2/9_torch_dist_multi_node.py"], cpu) == \
        {("9", "Slurm (2 nodes)", None, "cpu")}


def test_a_workers_record_reaches_the_controller_whole():
    """One test that ran a lesson with a world size and without one: the worker's record still sorts."""
    seen = {"t::a": {("17", "own launcher", None, "cpu"), ("17", "own launcher", 2, "cpu")},
            "t::b": {("9", "Slurm (2 nodes)", None, "cpu")}, "t::failed": {("1", "own launcher", 3, "cpu")}}
    merged = {}
    merge(merged, worker_record(seen, ["t::failed"]))
    assert merged == {k: v for k, v in seen.items() if k != "t::failed"}


@pytest.mark.slow
def test_a_session_that_passes_writes_its_record_and_one_that_fails_writes_none(tmp_path):
    record = tmp_path / "r.json"
    env = {"COURSE_RUN_RECORD": str(record), "COURSE_RECORD_DURATIONS": "0"}
    # two xdist workers, one test each: both workers' records reach the controller's.  (Two exercises' checks
    # run again here on purpose, in a pytest session of their own: the record is of what that session ran.)
    run([PYTHON, "-m", "pytest", "-p", "tests.ran_on", "-n", "2", "--dist", "load", "-q", "--durations=0",
         "tests/test_solutions_day1.py::test_1_3_gloo_anywhere", "tests/test_solutions_day1.py::test_0_3_torchrun"],
        env=env, timeout=300)
    r = json.loads(record.read_text())
    assert r["lessons"] == {"0": {"torchrun, cpu": [4]}, "1": {"own launcher, cpu": [3]}}, r
    assert r["machine"]["torch"] and r["machine"]["cores"] and r["tests_passed"] == 2
    record.unlink()
    proc = subprocess.run([PYTHON, "-m", "pytest", "-p", "tests.ran_on", "-n", "0", "-q",
                           "tests/test_solutions_day1.py", "-k", "no_such_test"], cwd=REPO, capture_output=True,
                          text=True, env={**__import__("os").environ, **env}, timeout=300)
    assert proc.returncode == 5 and not record.exists(), proc.stdout + proc.stderr
