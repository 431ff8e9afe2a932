# %% [markdown]
# # Lesson 11: streaming the training set from a chunked HDF5 file
#
# Script: [`day2/11_mnist_ddp_pt_multinode_streaming.py`](../day2/11_mnist_ddp_pt_multinode_streaming.py);
# the file comes from [the create_mnist_h5 notebook](create_mnist_h5.ipynb) (`data_tools/create_mnist_h5.py`).
#
# Real datasets do not fit in memory: they are read from disk while training. Two ways to get that wrong:
# read sample by sample, and every read pays for a whole HDF5 chunk (the unit HDF5 stores and reads); read
# whole chunks in a fixed order, and the model sees the data in the same order every epoch. This lesson
# (with `data_tools/h5stream.py`) makes **the chunk the unit of sharding**:
#
# - each epoch the chunk ids are shuffled with `seed + epoch` (the same order on every rank) and dealt
#   round-robin: rank *r* reads the chunks at positions *r*, *r+W*, ... of that shuffled list (positions,
#   not chunk ids). One aligned read per chunk; then the samples of the
#   chunk are shuffled. Together the ranks read every chunk once: **each sample exactly once per epoch**;
# - the file is opened lazily by whichever process reads it (a DataLoader worker, `--workers`), never
#   inherited through `fork` or pickled;
# - **no padding**: `DistributedSampler` repeats samples so that all ranks get equal shares; here the ranks'
#   chunk counts may differ by one (and the last chunk may be short), so they run out of batches at different
#   steps. DDP's `join()` lets the
#   ranks that are done keep answering the others' all_reduces until all are done.
#
# On a parallel filesystem (Lustre, GPFS) export `HDF5_USE_FILE_LOCKING=FALSE` for other HDF5 tools; this
# lesson reads without locks.
#
# ## On a cluster
#
# ```bash
# python data_tools/create_mnist_h5.py          # once, on the login node: data/fashion-mnist-chunk1000.h5
# salloc --nodes 2 --ntasks-per-node=2 --time=00:30:00
# ./day2/multinode_setup_and_run.sh 11_mnist_ddp_pt_multinode_streaming.py --quick
# ```
#
# Here: two torchrun agents on this machine, as in lessons 9 and 10.

# %%
from nbhelpers import *

# The one switch. False: --quick, 2 pretend nodes x 2 CPU ranks, a file written into this notebook's run dir.
# True: full epochs, 2 pretend nodes x (GPUs / 2) ranks, the file in the data dir (made once, then reused).
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick"]
PER_NODE = max(1, gpu_count() // 2) if FULL_SIZE else 2
# a GPU per rank (each pretend node gets GPUs of its own), or every rank on the CPU
DEVICE = [] if gpu_count() >= 2 * PER_NODE else ["--device", "cpu"]
RUN = run_dir("11_mnist_ddp_pt_multinode_streaming")
H5 = REPO / "data" / "fashion-mnist-chunk1000.h5" if FULL_SIZE else RUN / "fashion-mnist-chunk1000.h5"

# %% [markdown]
# ## What changed against lesson 10
#
# The in-memory dataset and the `DistributedSampler` give way to `ChunkShardSampler` (one permutation of the
# chunks, dealt round-robin) and a DataLoader handing over whole chunks, which `rebatch` cuts into batches;
# the loop runs inside `model.join()`, and after it the ranks that stopped early get the momentum. The
# bookkeeping is `course/training/coverage.py`'s: every rank's steps, how often each sample was trained on, each
# step's loss, the time waited for data, and whether the replicas ended identical.

# %%
show_diff("day2/10_mnist_ddp_pt_multinode.py", "day2/11_mnist_ddp_pt_multinode_streaming.py")

# %% [markdown]
# ## The file: written once, before any training

# %%
run_lesson("data_tools/create_mnist_h5.py", "--chunk-samples", 1000, "--output", H5)

# %% [markdown]
# ## Train from it on two pretend nodes
#
# `--save-order` makes the run write `order.json`: the sample indices each rank trained on, epoch by epoch.

# %%
run_lesson("day2/11_mnist_ddp_pt_multinode_streaming.py", *SIZE, *DEVICE, "--h5-file", H5, "--save-order",
           "--run-dir", RUN, nproc=PER_NODE, nnodes=2)

# %% [markdown]
# ## Which rank read which chunk
#
# From `order.json`: the chunk of every sample each rank trained on in epoch 0. Chunks are whole: no chunk
# is split between ranks, and no chunk is read twice.

# %%
m = read_json(RUN / "metrics.json")
order = read_json(RUN / "order.json")["epochs"][0]
chunk = m["chunk_samples"]
owner = {}
for rank, indices in enumerate(order):
    for i in indices:
        assert owner.setdefault(i // chunk, rank) == rank  # a chunk belongs to one rank
n_samples = m["per_epoch"][0]["samples"]
draw_chunks(n_samples, chunk, m["world_size"], owner,
            title=f"epoch 0: {len(owner)} chunks of {chunk} samples, dealt to {m['world_size']} ranks")
show_table(m["per_epoch"], ["epoch", "samples", "trained", "seen_once", "seen_never", "seen_more",
                            "chunks_per_rank", "steps_per_rank"])

# %% [markdown]
# ## Inside a chunk the order is shuffled too
#
# The first two and a half chunks' worth of samples rank 0 trained on: the sample index jumps around within
# a chunk (a band of 1000 indices), then moves on to the rank's next chunk.

# %%
first = order[0][:2 * chunk + chunk // 2]  # two and a half chunks
fig, ax = plt.subplots()
ax.plot(first, ".", ms=2)
ax.set(xlabel="position in rank 0's epoch", ylabel="sample index",
       title=f"rank 0, epoch 0: the first {len(first)} samples (chunks of {chunk})")
plt.show()
print(f"steps per rank {m['per_epoch'][0]['steps_per_rank']} (ranks with fewer samples, one chunk less or the "
      f"short last chunk, run out early: "
      f"join() covers for them); replicas identical at the end: {m['replicas_identical']}; "
      f"time waiting for data per rank: {m['data_wait_seconds']} s")
assert m["replicas_identical"] and m["per_epoch"][0]["seen_once"] == n_samples

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/11_mnist_ddp_pt_multinode_streaming.md`](../solutions/11_mnist_ddp_pt_multinode_streaming.md).
#
# 1. `--workers 2`: two DataLoader worker processes per rank read chunks ahead, instead of the default one
#    (`--workers 0` reads in the rank itself). You should see the same samples trained on, each once per
#    epoch (`seen_once` = all samples), and a different `time waiting for data` per rank.
# 2. A file written with `--chunk-samples 100`, then lesson 11 with `--h5-file` pointing at it. You should
#    see 128 chunks in epoch 0 instead of 13, still each sample exactly once.
# 3. `--source memory`: the same chunks in the same order, from memory. You should see the same losses and
#    the same final weights as from the file.
#
# Next: [lesson 12](12_ddp_fault_tolerance.ipynb): surviving time limits, preemption and crashes.
