"""A class shares one prepared data directory that learners may only read (a trainer's project space): the
set-up's data step and the lessons use it as it is, writing nothing into it; a shared directory that holds no
prepared dataset stops with one line.

The data directory is a read-only bind mount in a private mount namespace (for root, a chmod would not stop
a write), as in tests/test_setup.py for the shared venv.
"""
import shlex
import shutil

import pytest

from conftest import PYTHON, REPO, run
from test_setup import namespaces_or_skip


def read_only_data(data_dir, commands, **kw):
    """Run the shell lines `commands`, one after the other, while `data_dir` is mounted read-only, with
    COURSE_DATA_DIR pointing at it."""
    namespaces_or_skip("mount")
    d = shlex.quote(str(data_dir))
    script = " && ".join([f"mount --bind -o ro {d} {d}", "touch {}/probe 2>/dev/null && exit 99 || true".format(d),
                          *commands])
    return run(["unshare", "--mount", "bash", "-c", script], env={"COURSE_DATA_DIR": str(data_dir)}, **kw)


@pytest.fixture(scope="module")
def shared_data(tmp_path_factory, dataset):
    """A data dir as a trainer prepares it: the dataset and lesson 11's HDF5 file."""
    from data_tools.datasets import spec

    data_dir = tmp_path_factory.mktemp("shared-data")
    shutil.copytree(REPO / "data" / spec(dataset).folder, data_dir / spec(dataset).folder)
    run([PYTHON, REPO / "data_tools" / "create_mnist_h5.py", "--data-dir", data_dir], timeout=120)
    return data_dir


@pytest.mark.slow
def test_a_prepared_read_only_data_dir_serves_the_set_up_and_the_lessons(shared_data, tmp_path):
    start = tmp_path / "start"
    start.touch()
    q = shlex.quote
    runs = tmp_path / "runs"
    result = read_only_data(shared_data, [
        f"{q(PYTHON)} data_tools/prepare_data.py",
        f"{q(PYTHON)} day1/2_mnist_training.py --quick --max-steps 3 --run-dir {q(str(runs / '2'))}",
        f"{q(PYTHON)} -m torch.distributed.run --standalone --nproc_per_node=2 "
        f"day2/11_mnist_ddp_pt_multinode_streaming.py --quick --max-steps 3 "
        f"--run-dir {q(str(runs / '11'))}",
    ], timeout=300)
    assert "already prepared in" in result.stdout
    assert (runs / "2" / "metrics.json").is_file() and (runs / "11" / "metrics.json").is_file()
    written = run(["find", shared_data, "-newer", start, "-print", "-quit"]).stdout
    assert written == "", f"written into the shared data dir: {written}"


def test_a_read_only_data_dir_without_the_dataset_is_one_line(tmp_path):
    empty = tmp_path / "empty-share"
    empty.mkdir()
    result = read_only_data(empty, [f"{shlex.quote(PYTHON)} data_tools/prepare_data.py"], check=False, timeout=60)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"is not prepared in {empty} (COURSE_DATA_DIR), and it cannot be prepared there" in lines[0]
    assert "COURSE_DATA_DIR" in lines[0]
