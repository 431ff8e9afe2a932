"""Lesson 9: lesson 0's all_reduce across nodes: where ranks come from when Slurm or torchrun starts them.

Inside a Slurm allocation (salloc --nodes 2 --ntasks-per-node=2 ..., or in an sbatch script):

    ./day2/multinode_setup_and_run.sh 9_torch_dist_multi_node.py                      # srun: a task per rank
    ./day2/multinode_setup_and_run.sh --launcher torchrun 9_torch_dist_multi_node.py  # srun: torchrun per node
    srun python day2/9_torch_dist_multi_node.py         # plain srun works too: MASTER_ADDR from the node list

On one machine, two "nodes" (two torchrun agents, in two terminals), or one.  The port is derived from
your user id, so that two users on one node do not collide (as one fixed port would):

    PORT=$((20000 + $(id -u) % 20000))
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=2 --master_addr=127.0.0.1 --master_port=$PORT \\
        day2/9_torch_dist_multi_node.py
    torchrun --nnodes=2 --node_rank=1 --nproc_per_node=2 --master_addr=127.0.0.1 --master_port=$PORT \\
        day2/9_torch_dist_multi_node.py
    torchrun --standalone --nproc_per_node=2 day2/9_torch_dist_multi_node.py

On day 1 one process started all ranks, so it knew every rank number.  Across nodes, each process is started
by someone else and must learn four facts from its environment: its global rank and the world size (which
share of the work), its local rank on its node (which GPU), its node, and where rank 0 listens
(MASTER_ADDR:MASTER_PORT).  MASTER_ADDR must be a name the other nodes can reach: "localhost" on node 1 (the
second node) is node 1 itself, and its ranks would wait for a rank 0 that is not there.
- plain srun starts one task per rank and sets SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NODEID;
  rank 0 runs on the first node of the node list, which `scontrol show hostnames` expands;
- torchrun (one agent per node) sets RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK and MASTER_ADDR/PORT itself.
Started with plain python, outside both, there is nothing to join: the lesson says how to launch and stops.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/
from course.launching.requires import require  # noqa: E402
require(__file__)  # before torch: a torch or package this lesson lacks is one line, not an ImportError

import torch
import torch.distributed as dist

from course.launching import cli
from course.launching.launch import backend_for, check_launch_environment, how_to_launch, setup_device
from course.training.output import rank_print


def where_am_i():
    """(rank, local_rank, world_size, node, launcher) from the launcher's variables, or None if there is none.

    On return MASTER_ADDR and MASTER_PORT are in the environment, where init_process_group looks for them.
    course/launching/launch.py does the same for every later lesson.
    """
    check_launch_environment()  # each variable below a whole number in its range, or one line naming it
    env = os.environ
    if all(k in env for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        # DIST: torchrun (alone, or one per node under srun) agreed on everything in its rendezvous
        return (int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]), int(env["GROUP_RANK"]),
                "torchrun")
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:  # inside an srun step, not a batch shell
        rank = int(env["SLURM_PROCID"])         # DIST: 0 .. W-1 over all nodes of the step
        local_rank = int(env["SLURM_LOCALID"])  # DIST: 0 .. (tasks on this node) - 1: picks the GPU
        world_size = int(env["SLURM_NTASKS"])   # DIST: tasks in this step
        node = int(env["SLURM_NODEID"])         # DIST: this node's index in the node list
        if "MASTER_ADDR" not in env:  # multinode_setup_and_run.sh exports it; a plain srun does not
            nodelist = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]  # e.g. "node[1-2]"
            try:
                hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                       text=True, check=True, timeout=30).stdout.split()
            except (OSError, subprocess.SubprocessError) as e:  # never fall back to localhost silently
                raise cli.CourseError(f"cannot expand the node list {nodelist!r} with scontrol ({e}); "
                                      f"export MASTER_ADDR=<first node's hostname>") from None
            env["MASTER_ADDR"] = hosts[0]  # DIST: rank 0 runs on the first node of the list
        # DIST: the same on every rank, different for two jobs sharing a node; never a fixed port
        env.setdefault("MASTER_PORT", str(10_000 + int(env["SLURM_JOB_ID"]) % 20_000))
        return rank, local_rank, world_size, node, "srun"
    return None


def run(args):
    who = where_am_i()
    if who is None:
        raise cli.CourseError(how_to_launch("day2/9_torch_dist_multi_node.py"))
    rank, local_rank, world_size, node, launcher = who
    device = setup_device(args.device, local_rank)  # the local rank picks this node's GPU (lesson 1)
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
    host = socket.gethostname()
    value = torch.tensor([float(rank + 1)], device=device)
    rank_print(rank, f"local rank {local_rank} on node {node} ({host}) of world size {world_size}, "
                     f"{launcher}, {device}: my value is {value.item():g}")
    dist.all_reduce(value, op=dist.ReduceOp.SUM)  # DIST: the values of all ranks, on all nodes
    rank_print(rank, f"all_reduce(SUM) = {value.item():g}, mean = {value.item() / world_size:g}")

    placement = [None] * world_size
    dist.all_gather_object(placement, (rank, local_rank, node, host))  # DIST: who runs where
    if rank == 0:
        nodes = sorted({(n, h) for _, _, n, h in placement})
        print(f"{world_size} ranks on {len(nodes)} node(s), launched by {launcher}; rank 0 listened on "
              f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}; all_reduce(SUM) = {value.item():g}",
              flush=True)
        for n, h in nodes:
            ranks = " ".join(f"{r}(local {lr})" for r, lr, n2, _ in placement if n2 == n)
            print(f"  node {n} ({h}): ranks {ranks}", flush=True)
    dist.destroy_process_group()


def build_parser():
    p = cli.add_distributed(cli.parser(__doc__, "day2/9_torch_dist_multi_node.py", data=False, outputs=False))
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: the GPU of this rank's local rank when CUDA is available (NCCL), else the CPU")
    return p


if __name__ == "__main__":
    cli.main(run, build_parser())
