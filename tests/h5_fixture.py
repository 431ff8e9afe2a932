"""pytest plugin: `mnist_h5`, one chunked HDF5 file per session, written by the real create_mnist_h5.py.

Chunks of 700 samples divide neither split (60000 = 85 x 700 + 500, 10000 = 14 x 700 + 200), so the short
last chunk is always exercised.  Loaded by conftest.py.
"""
from types import SimpleNamespace

import pytest

from conftest import PYTHON, REPO, run

CHUNK = 700


@pytest.fixture(scope="session")
def mnist_h5(dataset, tmp_path_factory):
    # /tmp is one filesystem for the test Slurm cluster's nodes too
    path = tmp_path_factory.mktemp("h5") / f"{dataset}-chunk{CHUNK}.h5"
    made = run([PYTHON, REPO / "data_tools/create_mnist_h5.py", "--dataset", dataset,
                "--chunk-samples", CHUNK, "--output", path], timeout=120)
    return SimpleNamespace(path=path, dataset=dataset, chunk=CHUNK, stdout=made.stdout)
