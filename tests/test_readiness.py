"""The trainer's readiness check (scripts/readiness_check.sh) end to end on the course's two-node Slurm, with the
CPU-only profile (gloo): one job on 2 nodes x 2 ranks checks both nodes, runs lesson 9's all_reduce across
them, measures all_reduce bus bandwidth, runs lessons 10 and 15 quickly, and prints its verdict table.  A
second job, whose data directory holds no dataset, must say NOT READY and name what to fix.
"""
import re
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def checks(slurm_cluster, dataset, tmp_path_factory):
    """Both readiness checks, started at once (each job takes both nodes, 2 of their 4 CPUs): (exit, output)."""
    from data_tools.datasets import default_data_dir, spec
    from data_tools.h5layout import default_h5_path

    work = tmp_path_factory.mktemp("readiness")
    data = work / "data"
    data.mkdir()
    (data / spec(dataset).folder).symlink_to(default_data_dir() / spec(dataset).folder)
    subprocess.run([sys.executable,
                    REPO / "data_tools" / "create_mnist_h5.py", "--data-dir", data], check=True, timeout=120,
                   capture_output=True)
    assert default_h5_path(dataset, data).is_file()
    (work / "empty").mkdir()
    started = {}
    for name, data_dir in (("ready", data), ("no data", work / "empty")):
        env = {**slurm_cluster.env, "SITE_TASKS_PER_NODE": "2", "SITE_CPUS_PER_TASK": "1",
               "COURSE_DATA_DIR": str(data_dir), "READINESS_MAX_MIB": "4"}
        cwd = work / name.replace(" ", "-")
        cwd.mkdir()
        started[name] = subprocess.Popen([REPO / "scripts" / "readiness_check.sh", "--site", "cpu-only"], cwd=cwd,
                                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = {}
    for name, proc in started.items():
        out, _ = proc.communicate(timeout=600)
        log = next((work / name.replace(" ", "-") / "logs").glob("readiness-*.out"))
        done[name] = (proc.returncode, out, log.read_text())
    return done


def test_the_readiness_check_passes_on_a_ready_cluster_and_reports_its_bandwidth(checks):
    code, out, log = checks["ready"]
    print(out)  # the verdict table, for `pytest -s` or -rP
    assert code == 0, out + log
    assert "READY: every check passed" in out
    for step in ("environment and data", "all_reduce across nodes", "bus bandwidth", "DDP lesson (10)",
                 "day-3 lesson (15)"):
        assert re.search(rf"^  {re.escape(step)} +pass +\d+ s$", out, flags=re.M), (step, out)
    for node in ("node1", "node2"):
        assert re.search(rf"^  node {node} +pass +torch 2\.\d+", out, flags=re.M), (node, out)
    bw = re.search(r"^  all_reduce bus bandwidth +([\d.]+) GB/s +at [\d.]+ MiB, gloo, 4 ranks on 2 nodes$", out,
                   flags=re.M)
    assert bw and float(bw.group(1)) > 0, out
    # the table of sizes, nccl-tests' columns, up to READINESS_MAX_MIB
    assert re.search(r"^\s+4194304\s+[\d.]+\s+[\d.]+\s+[\d.]+$", log, flags=re.M), log
    assert "all_reduce(SUM) = 10, mean = 2.5" in log  # lesson 9 on 4 ranks
    # Every step of the job listens on the job's derived port: the previous step's port, left in TIME_WAIT, is
    # free to listen on, and no step walks into the next job's derived port (both jobs run at once here).
    ports = set(re.findall(r"rank 0 at node1:(\d+)", log))
    assert len(ports) == 1 and "is in use" not in log, log


def test_a_cluster_without_the_data_is_not_ready_and_the_verdict_says_what_to_fix(checks):
    code, out, log = checks["no data"]
    assert code == 1, out + log
    assert "NOT READY; to fix:" in out
    assert re.search(r"^  environment and data +pass", out, flags=re.M)  # the node check itself ran
    assert re.search(r"^  node node1 +FAIL", out, flags=re.M)
    assert "node node1: data: fashion-mnist is not prepared in" in out
    assert re.search(r"^  DDP lesson \(10\) +FAIL \(exit \d+\)", out, flags=re.M), out
    assert re.search(r"^  all_reduce across nodes +pass", out, flags=re.M)  # the network is fine
