# %% [markdown]
# # Lesson 9: lesson 0's `all_reduce` across nodes
#
# Script: [`day2/9_torch_dist_multi_node.py`](../day2/9_torch_dist_multi_node.py).
#
# On day 1 one process started all ranks, so it knew every rank number. Across nodes each process is started
# by someone else, on another machine, and must learn four facts from its environment:
#
# | fact | why | from Slurm (`srun`) | from `torchrun` |
# |---|---|---|---|
# | global rank, world size | which share of the work | `SLURM_PROCID`, `SLURM_NTASKS` | `RANK`, `WORLD_SIZE` |
# | local rank | which GPU of its node | `SLURM_LOCALID` | `LOCAL_RANK` |
# | node | which machine | `SLURM_NODEID` | `GROUP_RANK` |
# | where rank 0 listens | to join the group | first host of `SLURM_JOB_NODELIST` + a port | `MASTER_ADDR`, `MASTER_PORT` |
#
# `MASTER_ADDR` must be a name every node can reach: "localhost" on the second node (node 1) is that node
# itself, and its ranks would wait for a rank 0 that is not there (a classic hang at `init_process_group`).
#
# ## How it runs on a cluster
#
# Get an allocation of two nodes, then start the lesson on all of them with the course's launcher:
#
# ```bash
# salloc --nodes 2 --ntasks-per-node=2 --time=00:30:00          # plus --account/--partition/--gpus-per-node
# ./day2/multinode_setup_and_run.sh 9_torch_dist_multi_node.py  # srun: one task per rank
# ./day2/multinode_setup_and_run.sh --launcher torchrun 9_torch_dist_multi_node.py   # one torchrun per node
# ```
#
# The launcher sets `MASTER_ADDR` to the first node of the allocation and derives `MASTER_PORT` from the job
# id (two jobs on one node never share a port), then either lets `srun` start one task per rank, or starts
# one `torchrun` agent per node that starts that node's ranks. Or as a batch job:
# `slurm/submit.sh 9 --site <your site>` (see `slurm/sites/`).
#
# This notebook has no cluster, so it does what a cluster does on one machine: **two torchrun agents, one
# per pretend node**, meeting at node 0's address. The script cannot tell the difference.

# %%
from nbhelpers import *

# The one switch. False: 2 pretend nodes x 2 CPU ranks on this machine.
# True: 2 pretend nodes x (GPUs of this node / 2) ranks, NCCL (a real multi-node run needs Slurm: see above).
FULL_SIZE = False
PER_NODE = max(1, gpu_count() // 2) if FULL_SIZE else 2
# a GPU per rank (each pretend node gets GPUs of its own), or every rank on the CPU
DEVICE = [] if gpu_count() >= 2 * PER_NODE else ["--device", "cpu"]

# %% [markdown]
# ## The picture
#
# Two nodes with 4 GPUs each, 8 ranks. The `salloc` above asks for 2 ranks a node, 4 in all, as the run
# below starts them.

# %%
draw_nodes(2, 4)

# %% [markdown]
# ## What changed against lesson 0
#
# The all_reduce is lesson 0's. New: reading the rank facts from Slurm's or torchrun's variables (by hand,
# so you see them), finding `MASTER_ADDR` from the node list, and a report of who ran where.

# %%
show_diff("day1/0_torch_dist.py", "day2/9_torch_dist_multi_node.py")

# %% [markdown]
# ## What a batch job would submit
#
# `slurm/submit.sh` turns a site profile into sbatch options; `--dry-run` prints the command without
# submitting anything (here with the profile for a CPU-only cluster).

# %%
import subprocess

result = subprocess.run(["slurm/submit.sh", "9", "--site", "cpu-only", "--dry-run"], cwd=REPO, check=True,
                        capture_output=True, text=True)
print(result.stdout.replace(str(REPO) + "/", "").replace(str(REPO), "."))

# %% [markdown]
# ## Run it: two nodes on this machine
#
# Two `torchrun` agents, each started with `--nnodes=2 --node_rank=<0|1> --master_addr=127.0.0.1
# --master_port=<free port> --nproc_per_node=2`, the commands of the script's docstring with a free port. Each line
# of output says which agent (pretend node) printed it.

# %%
out = run_lesson("day2/9_torch_dist_multi_node.py", *DEVICE, nproc=PER_NODE, nnodes=2)

# %% [markdown]
# ## Who ran where
#
# Collected from the run's output: the global rank numbers the whole group, the local rank restarts at 0
# on every node.

# %%
import re

placement = [{"rank": int(g), "local_rank": int(l), "node": int(n)}
             for g, l, n in re.findall(r"\[rank (\d+)\] local rank (\d+) on node (\d+)", out)]
show_table(sorted(placement, key=lambda p: p["rank"]), ["rank", "node", "local_rank"])
draw_nodes(placement=placement, device="cpu" if DEVICE else "cuda",
           title="this run: 2 pretend nodes, as reported by the ranks")
assert sorted(p["rank"] for p in placement) == list(range(2 * PER_NODE))

# %% [markdown]
# ## Started without a launcher, it says how to launch
#
# A multi-node lesson never spawns its own processes: with plain `python` there is no group to join. It
# stops at once with the commands to use (and a non-zero exit, which the cell below expects).

# %%
try:
    run_lesson("day2/9_torch_dist_multi_node.py")
except subprocess.CalledProcessError as e:
    print(f"\nexit code {e.returncode}, as expected")
else:
    raise AssertionError("plain python should have refused to start")

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/9_torch_dist_multi_node.md`](../solutions/9_torch_dist_multi_node.md).
#
# 1. In two terminals, the two commands printed above (`python -m torch.distributed.run` is `torchrun`;
#    `--node_rank=0` and `--node_rank=1`, the same free `--master_port`): start one, wait, start the other.
#    You should see the first print nothing until the second arrives (it waits at the rendezvous), then both
#    nodes' ranks print `all_reduce(SUM) = 10, mean = 2.5`.
# 2. On a cluster: `salloc --nodes 2 --ntasks-per-node=2 ...` and
#    `./day2/multinode_setup_and_run.sh 9_torch_dist_multi_node.py`. You should see 4 ranks on 2 host names,
#    local ranks 0-1 on each, and `all_reduce(SUM) = 10, mean = 2.5` on every rank (the run above, on two
#    real machines).
#
# Next: [lesson 10](10_mnist_ddp_pt_multinode.ipynb): DDP training across nodes.
