# %% [markdown]
# # Tool: writing a chunked HDF5 dataset (`create_mnist_h5.py`)
#
# Script: [`data_tools/create_mnist_h5.py`](../data_tools/create_mnist_h5.py). It writes the file that
# [lesson 11](11_mnist_ddp_pt_multinode_streaming.ipynb) streams from.
#
# HDF5 stores a large array in **chunks**: fixed-size blocks, each stored (and compressed) as one piece.
# Reading one sample costs a whole chunk; reading a whole chunk costs about the same. So the chunk is the
# natural unit of reading, and lesson 11 makes it the unit of sharding across ranks too.
#
# The script writes the images as `uint8` (55 MB for both splits, 4x less than float32) into chunks of
# `--chunk-samples` samples:
#
# ```
# /train/images  uint8 (60000, 28, 28)  chunks of (1000, 28, 28)
# /train/labels  uint8 (60000,)         chunks of (1000,)
# /test/...      the same for the 10 000 test images
# ```
#
# Larger chunks mean fewer, larger reads (good on parallel filesystems such as Lustre and GPFS) but a
# coarser shuffle and more uneven shards across ranks. The file is written under a temporary name and
# renamed, so a reader never sees half a file. Run it **once**, on a login node or a laptop, never on every
# rank.
#
# This is a tool, not a step of the day-1/day-2 sequence: there is no previous lesson to compare it with,
# so this notebook shows the file it writes instead of a diff.

# %%
from nbhelpers import *

# The one switch. False: write the file into this notebook's run dir.
# True: write the file lesson 11 uses by default, data/fashion-mnist-chunk1000.h5 (reused if already there).
FULL_SIZE = False
RUN = run_dir("create_mnist_h5")
OUTPUT = REPO / "data" / "fashion-mnist-chunk1000.h5" if FULL_SIZE else RUN / "fashion-mnist-chunk1000.h5"

# %% [markdown]
# ## Run it

# %%
run_lesson("data_tools/create_mnist_h5.py", "--chunk-samples", 1000, "--output", OUTPUT)

# %% [markdown]
# ## What is in the file
#
# Opened with `h5py`, read-only: the datasets, their shapes, types and chunk shapes, and the attributes the
# script stores (lesson 11 checks them before training).

# %%
import h5py

rows = []
with h5py.File(REPO / OUTPUT, "r") as f:
    attributes = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
    f.visititems(lambda name, obj: rows.append(
        {"dataset": name, "shape": obj.shape, "dtype": str(obj.dtype), "chunks": obj.chunks,
         "number of chunks": -(-obj.shape[0] // obj.chunks[0])}) if isinstance(obj, h5py.Dataset) else None)
    first_chunk = f["train/images"][:16]
    first_labels = f["train/labels"][:16]
show_table(rows)
print(attributes)

# %% [markdown]
# ## The layout
#
# The 60 000 training samples in 60 chunks of 1000. Lesson 11 deals them out to the ranks, here drawn for
# 4 ranks in the order of the chunk ids (the real run shuffles the chunk order every epoch).

# %%
draw_chunks(60_000, 1000, 4)

# %% [markdown]
# ## The first images of the first chunk

# %%
from data_tools.datasets import spec

classes = spec(attributes["dataset"]).classes
fig, axes = plt.subplots(1, 8, figsize=(9, 1.5))
for i, ax in enumerate(axes):
    ax.imshow(first_chunk[i], cmap="gray_r")
    ax.set_title(classes[first_labels[i]], fontsize=8)
    ax.axis("off")
plt.show()

# %% [markdown]
# ## Why chunks matter: one sample at a time against one chunk at a time
#
# Reading the same 5 000 samples two ways: in random order one by one (every read decodes a chunk), and
# as 5 whole chunks. On a laptop's page cache the gap is already large; on a parallel filesystem, where
# every read is a network round trip, it is larger still.

# %%
import random
import time

with h5py.File(REPO / OUTPUT, "r") as f:
    images = f["train/images"]
    indices = random.Random(0).sample(range(5000), 5000)
    t0 = time.perf_counter()
    for i in indices:
        images[i]
    one_by_one = time.perf_counter() - t0
    t0 = time.perf_counter()
    for c in range(5):
        images[c * 1000:(c + 1) * 1000]
    by_chunk = time.perf_counter() - t0
fig, ax = plt.subplots(figsize=(6, 2.4))
ax.barh(["one sample at a time", "one chunk at a time"], [one_by_one * 1000, by_chunk * 1000])
ax.set(xlabel="ms to read 5 000 samples", title=f"{one_by_one / by_chunk:.0f}x faster by chunk")
plt.show()

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/create_mnist_h5.md`](../solutions/create_mnist_h5.md).
#
# 1. `--compression gzip` (and another `--output`): you should see a smaller file than the one above, and
#    the chunk-by-chunk read of the last cell take longer: every read now decompresses.
# 2. `--chunk-samples 100`: you should see 600 chunks for the training images instead of 60; then lesson 11
#    with `--h5-file` pointing at it (its notebook's exercise 2).
#
# Back to [lesson 11](11_mnist_ddp_pt_multinode_streaming.ipynb).
