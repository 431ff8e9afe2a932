"""pytest plugin: the session-scoped `slurm_cluster` fixture (a real two-node Slurm, see slurm_cluster.py),
and `site_probe`, a site profile that shows where its site_setup reached.

Load it from conftest.py with `pytest_plugins = ["slurm_fixture"]` (tests/ on sys.path).
"""

import os
import re
import secrets
import sys
from pathlib import Path

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


# Imported by every Python process that has the probe's directory on PYTHONPATH; a day-2 lesson's process
# (not a torchrun agent, not the port check) prints the token it sees, with its rank and host.
PROBE_SITECUSTOMIZE = r"""
import os, socket, sys
if os.path.basename(os.path.dirname(os.path.abspath(sys.argv[0]))) == "day2":
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "?"))
    line = f"site probe: rank {rank} on {socket.gethostname()} sees {os.environ.get('COURSE_SITE_PROBE', '-')}\n"
    os.write(1, line.encode())  # one write: the ranks of a node share the output pipe, lines must not mix
"""


class SiteProbe:
    """A site profile (a file in a temporary directory, given by path) whose site_setup prints one line
    each time it runs, exports COURSE_SITE_PROBE=<a random token>, activates the tests' venv, and puts a
    sitecustomize.py on PYTHONPATH: every rank of a day-2 lesson prints the token it sees."""

    def __init__(self, root: Path):
        self.token = secrets.token_hex(8)
        (root / "sitecustomize.py").write_text(PROBE_SITECUSTOMIZE)
        self.path = root / "probe.env"
        self.path.write_text(f"""
SITE_DESCRIPTION="site probe"
SITE_GPU_FLAG=none
SITE_TASKS_PER_NODE=2
SITE_CPUS_PER_TASK=1
site_setup() {{
    echo "site probe: site_setup ran in job $SLURM_JOB_ID on $(hostname)"
    if [[ -f {sys.prefix}/bin/activate ]]; then
        source {sys.prefix}/bin/activate
    else
        export PYTHON={sys.executable}
    fi
    export COURSE_SITE_PROBE={self.token}
    export PYTHONPATH={root}${{PYTHONPATH:+:$PYTHONPATH}}
}}
""")

    def check(self, output: str, hosts=("node1", "node1", "node2", "node2")) -> None:
        """site_setup ran exactly once, and rank r on hosts[r] saw the token, for every rank."""
        assert output.count("site probe: site_setup ran in job") == 1, output
        seen = sorted(re.findall(r"site probe: rank (\S+) on (node\d) sees ([0-9a-f]+|-)$", output, flags=re.M))
        assert seen == [(str(r), host, self.token) for r, host in enumerate(hosts)], output


@pytest.fixture(scope="session")
def site_probe(tmp_path_factory):
    return SiteProbe(tmp_path_factory.mktemp("site-probe"))
