"""pytest plugin: the session-scoped `slurm_cluster` fixture (a real two-node Slurm, see slurm_cluster.py).

Load it from conftest.py with `pytest_plugins = ["slurm_fixture"]` (tests/ on sys.path).
"""

import os

import pytest

from slurm_cluster import SlurmCluster, skip_reason


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: needs the real two-node Slurm test cluster (root, slurm-wlm, munge)")


@pytest.fixture(scope="session")
def slurm_cluster():
    """One cluster for the whole session: bring-up is ~1 s, but jobs' state must not leak between sessions."""
    reason = skip_reason()
    if reason is not None:
        # CI installs everything the cluster needs: there a missing cluster is a broken setup, not a
        # machine that cannot run it, and skipping would hide the untested Slurm lessons.
        if os.environ.get("CI") == "true":
            pytest.fail(f"Slurm test cluster unavailable in CI: {reason}", pytrace=False)
        pytest.skip(f"Slurm test cluster unavailable: {reason}")
    with SlurmCluster() as cluster:
        yield cluster
