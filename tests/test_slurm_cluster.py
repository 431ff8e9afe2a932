"""The test harness's own Slurm cluster behaves like a real two-node cluster.

These are the facts the Slurm lessons (9-11, multinode_setup_and_run.sh) rely on: two nodes with
distinct hostnames and IPs, per-task SLURM_* ids, and a gloo all_reduce across nodes with plain srun.
"""

import sys
import textwrap

import pytest


pytestmark = pytest.mark.slurm


def test_sinfo_shows_two_idle_nodes(slurm_cluster):
    slurm_cluster.wait_for_idle_nodes()  # the cluster is shared by the session: earlier jobs may be ending
    shown = slurm_cluster.run(["sinfo", "--noheader", "--Node", "--format=%N %P %T %c %G"])
    assert shown.returncode == 0, shown.stderr
    assert sorted(shown.stdout.splitlines()) == [
        "node1 debug* idle 4 gpu:2", "node2 debug* idle 4 gpu:2",
    ]


def test_srun_runs_one_task_on_each_node(slurm_cluster):
    ran = slurm_cluster.run(["srun", "-N2", "hostname"])
    assert ran.returncode == 0, ran.stderr
    assert sorted(ran.stdout.split()) == ["node1", "node2"]


def test_each_node_has_its_own_ip(slurm_cluster):
    ran = slurm_cluster.run(["srun", "-N2", "--label", "hostname", "--ip-address"])
    assert ran.returncode == 0, ran.stderr
    ips = dict(line.split(": ") for line in ran.stdout.splitlines())  # "0: 10.213.x.11"
    assert sorted(ips.values()) == sorted(slurm_cluster.node_ip.values())
    assert len(set(ips.values())) == 2
    assert not any(ip.startswith("127.") for ip in ips.values())


def test_salloc_then_srun(slurm_cluster):
    # salloc runs its command on the submitting machine; only srun reaches the compute nodes.
    ran = slurm_cluster.run(["salloc", "-N2", "--ntasks-per-node=2", "srun", "hostname"])
    assert ran.returncode == 0, ran.stderr
    assert sorted(ran.stdout.split()) == ["node1", "node1", "node2", "node2"]


def test_sbatch_tasks_get_node_proc_and_local_ids(slurm_cluster):
    script = slurm_cluster.workdir / "ids.sh"
    script.write_text(textwrap.dedent("""\
        #!/bin/bash
        #SBATCH --nodes=2
        #SBATCH --ntasks-per-node=2
        set -euo pipefail
        # The batch script body itself runs once, on the first node, and is not a task of a step.
        echo "body $(hostname) STEP_NUM_TASKS=${SLURM_STEP_NUM_TASKS:-unset}"
        srun bash -c 'echo "task $(hostname) $SLURM_NODEID $SLURM_PROCID $SLURM_LOCALID $SLURM_STEP_NUM_TASKS"'
    """))
    job_id, exit_code, output = slurm_cluster.sbatch_wait(script, timeout=60)
    assert exit_code == 0, output
    assert "body node1 STEP_NUM_TASKS=unset" in output
    tasks = sorted(line.split()[1:] for line in output.splitlines() if line.startswith("task "))
    assert tasks == [
        ["node1", "0", "0", "0", "4"],
        ["node1", "0", "1", "1", "4"],
        ["node2", "1", "2", "0", "4"],
        ["node2", "1", "3", "1", "4"],
    ]


def test_sbatch_reports_the_scripts_exit_code(slurm_cluster):
    script = slurm_cluster.workdir / "fails.sh"
    script.write_text("#!/bin/bash\necho before\nexit 3\n")
    _, exit_code, output = slurm_cluster.sbatch_wait(script, timeout=60)
    assert (exit_code, output) == (3, "before\n")


@pytest.mark.parametrize("gpu_request", ["--gres=gpu:2", "--gpus-per-node=2", "--gpus=4"])
def test_gpu_requests_are_schedulable(slurm_cluster, gpu_request):
    checked = slurm_cluster.run(["sbatch", "--test-only", "-N2", gpu_request, "--wrap", "true"])
    assert checked.returncode == 0, checked.stderr
    assert "to start at" in checked.stderr


def test_unknown_partition_is_refused(slurm_cluster):
    checked = slurm_cluster.run(["sbatch", "--test-only", "--partition=nosuch", "--wrap", "true"])
    assert checked.returncode != 0
    assert "invalid partition" in checked.stderr.lower()


ALL_REDUCE = textwrap.dedent("""\
    import os, subprocess
    import torch
    import torch.distributed as dist

    # Everything from Slurm, as lesson 9 does: no torchrun, no hard-coded address or port.
    rank, world_size = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()
    os.environ["MASTER_ADDR"] = hosts[0]
    os.environ["MASTER_PORT"] = str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"rank {rank} of {world_size} on {os.uname().nodename} sum {total.item():g}", flush=True)
    dist.destroy_process_group()
""")


def test_gloo_all_reduce_across_two_nodes_with_plain_srun(slurm_cluster):
    pytest.importorskip("torch")
    # The tests' own interpreter (the venv) is on the shared filesystem, so the nodes can run it.
    ran = slurm_cluster.run(
        ["srun", "-N2", "--ntasks-per-node=2", "--kill-on-bad-exit=1", sys.executable, "-c", ALL_REDUCE],
        timeout=180,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    lines = sorted(line for line in ran.stdout.splitlines() if line.startswith("rank "))
    assert lines == [
        "rank 0 of 4 on node1 sum 10",
        "rank 1 of 4 on node1 sum 10",
        "rank 2 of 4 on node2 sum 10",
        "rank 3 of 4 on node2 sum 10",
    ]
