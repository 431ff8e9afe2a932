# %% [markdown]
# # Lesson 10: DDP training across nodes
#
# Script: [`day2/10_mnist_ddp_pt_multinode.py`](../day2/10_mnist_ddp_pt_multinode.py).
#
# The training is lesson 6's, unchanged: DDP neither knows nor cares which ranks share a node, and W ranks
# on two nodes train exactly like W ranks on one. What changes is **who does what**:
#
# - the **local rank** (0 .. ranks per node - 1) picks the device: `cuda:<local rank>` on every node. The
#   global rank would ask the second node (node 1) for GPUs it does not have: with 4 GPUs a node (the
#   picture below) for cuda:4..7, with 2 (the `salloc` below) for cuda:2..3;
# - **global rank 0**, one process in the whole job, writes the shared outputs (metrics, weights, plot) to
#   the shared filesystem. "Local rank 0" is one process *per node*: they would all write the same files;
# - **local rank 0 of each node** is the one for per-node work (here a line per node; on a real cluster,
#   e.g. copying the data to the node's local disk once).
#
# ## How it runs on a cluster
#
# ```bash
# salloc --nodes 2 --ntasks-per-node=2 --gpus-per-node=2 --time=00:30:00      # plus your site's options
# ./day2/multinode_setup_and_run.sh 10_mnist_ddp_pt_multinode.py --quick
# ./day2/multinode_setup_and_run.sh --launcher torchrun 10_mnist_ddp_pt_multinode.py
# ```
#
# or `slurm/submit.sh 10 --site <your site>` for a batch job. Here: two torchrun agents on this machine.

# %%
from nbhelpers import *

# The one switch. False: --quick, 2 pretend nodes x 2 CPU ranks on this machine.
# True: full epochs, 2 pretend nodes x (GPUs of this node / 2) ranks (on a cluster, use Slurm: see above).
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick"]
PER_NODE = max(1, gpu_count() // 2) if FULL_SIZE else 2
# a GPU per rank (each pretend node gets GPUs of its own), or every rank on the CPU
DEVICE = [] if gpu_count() >= 2 * PER_NODE else ["--device", "cpu"]
RUN = run_dir("10_mnist_ddp_pt_multinode")

# %% [markdown]
# ## The picture: the three kinds of "rank 0"

# %%
draw_nodes(2, 4, title="global rank 0 writes the files; local rank 0 (one per node) does per-node work")

# %% [markdown]
# ## What changed against lesson 6
#
# The device chosen by the local rank, a report of the placement, the per-node line from each local
# rank 0, and the refusal to start without a launcher. The training loop does not change; lesson 6's
# `--loader` option is gone: the batches always come through the DataLoader (lesson 6's default).

# %%
show_diff("day1/6_mnist_ddp_pt.py", "day2/10_mnist_ddp_pt_multinode.py")

# %% [markdown]
# ## Run it on two pretend nodes
#
# Watch the lines from each node's local rank 0, and which rank writes the files.

# %%
out = run_lesson("day2/10_mnist_ddp_pt_multinode.py", *SIZE, *DEVICE, "--run-dir", RUN / "two_nodes",
           nproc=PER_NODE, nnodes=2)

# %% [markdown]
# ## And the same world size on one node
#
# The same number of ranks, all on one node (`torchrun --standalone`). Same world size, same data, same
# steps: the weights must be the same; only the placement differs.

# %%
run_lesson("day2/10_mnist_ddp_pt_multinode.py", *SIZE, *DEVICE, "--run-dir", RUN / "one_node",
           nproc=2 * PER_NODE)

# %%
from course.training.output import load_weights

two, one = read_json(RUN / "two_nodes" / "metrics.json"), read_json(RUN / "one_node" / "metrics.json")
draw_nodes(placement=two["placement"], device="cuda" if two["backend"] == "nccl" else "cpu",
           title=f"the two-node run's placement; metrics written by global rank {two['written_by'][0]}")
fig, ax = plt.subplots()
ax.plot(one["loss_per_step"], lw=4, alpha=0.4, label=f"{one['world_size']} ranks on {one['nodes']} node")
ax.plot(two["loss_per_step"], lw=1, label=f"{two['world_size']} ranks on {two['nodes']} nodes")
ax.set(xlabel="step", ylabel="training loss (mean over ranks)", title="placement does not change training")
ax.legend()
plt.show()
local_zeros = sorted(p["rank"] for p in two["placement"] if p["local_rank"] == 0)
md(f"Local rank 0 exists once per node: global ranks {', '.join(map(str, local_zeros))} here, each of which printed "
   f"its node's line. Global rank 0 exists once in the whole job: global rank {two['written_by'][0]} wrote the "
   f"metrics, the weights and the plot, once for {two['world_size']} ranks on {two['nodes']} nodes.")
w1, w2 = load_weights(REPO / RUN / "one_node" / "model.pt"), load_weights(REPO / RUN / "two_nodes" / "model.pt")
worst = max(((w1[k] - w2[k]).abs().max() / w1[k].abs().max()).item() for k in w1)
print(f"largest weight difference between the two runs: {worst:.1e} of the largest weight")
if not FULL_SIZE:
    assert worst < 1e-5

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/10_mnist_ddp_pt_multinode.md`](../solutions/10_mnist_ddp_pt_multinode.md).
#
# 1. Change `PER_NODE` to 1 in the first cell: 2 nodes x 1 rank. You should see every rank print a
#    "local rank 0 of node ..." line (each is alone on its node) and still only global rank 0 write the
#    files; the weights still match the 2-rank run on one node.
# 2. On a cluster with GPUs (or any cluster): `NCCL_DEBUG=INFO` before the launcher. You should see
#    `NCCL INFO` lines naming the network NCCL uses between the nodes (`NET/IB` for InfiniBand, `NET/Socket`
#    for TCP, with the interface); `NCCL_SOCKET_IFNAME` picks the interface when it guesses wrong.
#
# Next: [lesson 11](11_mnist_ddp_pt_multinode_streaming.ipynb): a dataset too large for memory, streamed
# from an HDF5 file.
