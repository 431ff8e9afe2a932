"""Day 2 on a real two-node Slurm cluster (tests/slurm_cluster.py): lessons 9, 10 and 11 started by
day2/multinode_setup_and_run.sh inside salloc and sbatch allocations, with plain srun and with srun+torchrun.

Every command here is one a user types (see docs/learners/multinode.md), run from the cluster's work
directory, not the repository: the script must find its lessons and the repository's Python by itself.
"""
import json
import os
import re
import sys

import pytest
import torch

from conftest import REPO, lesson, metrics
from course.output import load_weights

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPT = REPO / "day2" / "multinode_setup_and_run.sh"
RANK_LINE = re.compile(r"\[rank (\d+)\] local rank (\d+) on node (\d+) \((\S+)\) of world size (\d+), "
                       r"(srun|torchrun), cpu: my value is (\d+)")
TWO_BY_TWO = ["--nodes=2", "--ntasks-per-node=2"]


def salloc(cluster, *args, timeout=300):
    ran = cluster.run(["salloc", *TWO_BY_TWO, str(SCRIPT), *map(str, args)], cwd=cluster.workdir, timeout=timeout)
    assert ran.returncode == 0, f"--- stdout\n{ran.stdout}\n--- stderr\n{ran.stderr}"
    return ran.stdout + ran.stderr


def check_lesson9(output, launcher):
    ranks = sorted(m.groups() for m in RANK_LINE.finditer(output))
    # global rank, local rank, node index, hostname, world size, launcher, the rank's value
    assert ranks == [("0", "0", "0", "node1", "4", launcher, "1"), ("1", "1", "0", "node1", "4", launcher, "2"),
                     ("2", "0", "1", "node2", "4", launcher, "3"), ("3", "1", "1", "node2", "4", launcher, "4")], \
        output
    assert output.count("all_reduce(SUM) = 10, mean = 2.5") == 4
    job, port = re.search(r"multinode: job (\d+), 2 node\(s\) \(node\[1-2\]\), launcher (?:\w+), "
                          r"rank 0 at node1:(\d+)", output).groups()
    assert int(port) == 10_000 + int(job) % 20_000  # derived from the job id (free here: nothing else runs)
    if launcher == "srun":  # torchrun's agents pick the workers' port themselves after their rendezvous
        assert f"rank 0 listened on node1:{port}" in output
    assert "  node 0 (node1): ranks 0(local 0) 1(local 1)" in output
    assert "  node 1 (node2): ranks 2(local 0) 3(local 1)" in output


# Lesson 9 runs with a site profile (--site, a path; tests/slurm_fixture.py): its site_setup runs once, in the
# allocation, and every rank on both nodes sees what it exported, with either launcher.
@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_lesson9_under_salloc(slurm_cluster, site_probe, launcher):
    output = salloc(slurm_cluster, "--site", site_probe.path, "--launcher", launcher, "9_torch_dist_multi_node.py")
    check_lesson9(output, launcher)
    site_probe.check(output)
    assert f"multinode: site profile {site_probe.path}: site_setup done (site probe)" in output


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_lesson9_under_sbatch(slurm_cluster, site_probe, launcher):
    # sbatch runs a copy of the script from Slurm's spool directory: it must still find day2/ and the venv.
    # The profile as an option of the script, or (torchrun) from COURSE_SITE in the submitting shell's
    # environment, as after `export COURSE_SITE=...`
    if launcher == "srun":
        site_option, site_args = [], ("--site", str(site_probe.path))
    else:
        site_option, site_args = [f"--export=ALL,COURSE_SITE={site_probe.path}"], ()
    job, code, output = slurm_cluster.sbatch_wait(
        SCRIPT, *TWO_BY_TWO, *site_option,
        script_args=(*site_args, "--launcher", launcher, "9_torch_dist_multi_node.py"), timeout=300)
    assert code == 0, output
    check_lesson9(output, launcher)
    site_probe.check(output)


HOLD_PORT = """
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("", int(sys.argv[1])))
s.listen()
open(sys.argv[2], "w").close()
time.sleep(300)
"""


def test_the_script_moves_on_when_the_derived_port_is_taken(slurm_cluster):
    """Another job's rank 0 already listens on our derived port on node1: the script must not pick it."""
    work = slurm_cluster.workdir
    (work / "hold.py").write_text(HOLD_PORT)
    # a lesson given as a path relative to the current directory, not a name in day2/
    (work / "probe.py").write_text('import os\nprint("probe", os.environ["SLURM_PROCID"], os.environ["MASTER_ADDR"], '
                                   'os.environ["MASTER_PORT"], flush=True)\n')
    inside = f"""
        port=$((10000 + SLURM_JOB_ID % 20000))
        srun --overlap --nodes=1 --ntasks=1 --nodelist=node1 {sys.executable} hold.py $port listening &
        holder=$!
        for i in $(seq 100); do [[ -e listening ]] && break; sleep 0.2; done
        echo "derived port $port"
        {SCRIPT} probe.py && rc=0 || rc=$?
        kill $holder
        exit $rc
    """
    ran = slurm_cluster.run(["salloc", *TWO_BY_TWO, "bash", "-c", inside], cwd=work, timeout=120)
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0, output
    derived = int(re.search(r"derived port (\d+)", output).group(1))
    chosen = int(re.search(r"rank 0 at node1:(\d+)", output).group(1))
    assert f"port {derived} is in use on node1" in output
    assert chosen > derived
    probes = sorted(line.split()[1:] for line in output.splitlines() if line.startswith("probe "))
    assert probes == [[str(r), "node1", str(chosen)] for r in range(4)]  # every rank got the same address


def test_lesson10_on_two_nodes_ends_with_the_weights_of_one_node(slurm_cluster, dataset, tmp_path):
    args = ["--quick", "--max-steps", "25", "--seed", "3"]
    two_nodes = slurm_cluster.workdir / "lesson10"
    output = salloc(slurm_cluster, "10_mnist_ddp_pt_multinode.py", *args, "--run-dir", two_nodes)
    one_node = tmp_path / "one_node"
    lesson("day2/10_mnist_ddp_pt_multinode.py", *args, "--run-dir", one_node, launcher="torchrun", nproc=4)

    two, one = metrics(two_nodes), metrics(one_node)
    assert (two["world_size"], two["nodes"], two["launcher"]) == (4, 2, "srun")
    assert (one["world_size"], one["nodes"], one["launcher"]) == (4, 1, "torchrun")
    assert [(p["host"], p["local_rank"]) for p in two["placement"]] == [
        ("node1", 0), ("node1", 1), ("node2", 0), ("node2", 1)]
    assert two["written_by"] == [0, "node1"]  # global rank 0, not one writer per node
    assert sorted(os.listdir(two_nodes)) == ["loss.png", "metrics.json", "model.pt"]
    assert "[rank 0] local rank 0 of node 0 (node1), which runs global ranks [0, 1]" in output
    assert "[rank 2] local rank 0 of node 1 (node2), which runs global ranks [2, 3]" in output
    assert two["steps"] == one["steps"] == 25

    a, b = load_weights(two_nodes / "model.pt"), load_weights(one_node / "model.pt")
    worst = max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)
    print(f"lesson 10, 2 nodes vs 1 node: max relative weight difference {worst:.3g}")  # shown with -s
    assert worst <= 1e-6, f"max relative difference {worst:.3g}"  # measured: 0 (gloo sums in rank order)
    assert two["loss_per_step"] == pytest.approx(one["loss_per_step"], rel=1e-6)


def test_lesson11_streams_every_sample_once_on_two_nodes(slurm_cluster, mnist_h5):
    run_dir = slurm_cluster.workdir / "lesson11"
    # 6500 samples in chunks of 700: 10 chunks for 4 ranks, 3/3/2/2 of them, one only 200 samples: uneven
    output = salloc(slurm_cluster, "--launcher", "torchrun", "11_mnist_ddp_pt_multinode_streaming.py",
                    "--h5-file", mnist_h5.path, "--train-samples", "6500", "--epochs", "2", "--workers", "1",
                    "--save-order", "--run-dir", run_dir)
    m = metrics(run_dir)
    assert (m["world_size"], m["nodes"], m["launcher"], m["source"]) == (4, 2, "torchrun", "h5")
    assert [p["host"] for p in m["placement"]] == ["node1", "node1", "node2", "node2"]
    for epoch in m["per_epoch"]:
        assert (epoch["seen_once"], epoch["seen_never"], epoch["seen_more"]) == (6500, 0, 0)
        assert epoch["chunks_per_rank"] == [3, 3, 2, 2] and len(set(epoch["steps_per_rank"])) > 1
    assert m["replicas_identical"] is True
    for epoch in json.loads((run_dir / "order.json").read_text())["epochs"]:
        assert sorted(i for rank in epoch for i in rank) == list(range(6500))
    assert "each seen exactly once" in output
    assert torch.isfinite(torch.tensor(m["loss_per_step"])).all()
