# %% [markdown]
# # Lesson 1: the same `all_reduce` on GPUs: NCCL, one rank per GPU
#
# Script: [`day1/1_torch_dist_gpu.py`](../day1/1_torch_dist_gpu.py).
#
# Lesson 0 used the **gloo** backend: tensors in CPU memory, sent over ordinary sockets. On GPUs the backend
# is **NCCL** (NVIDIA's collective library): it moves GPU memory between GPUs directly, over NVLink, PCIe or
# InfiniBand, without a detour through the CPU. Two rules come with it:
#
# 1. **One GPU per rank.** NCCL cannot put two ranks on the same GPU, so a node runs at most as many ranks
#    as it has GPUs.
# 2. **`torch.cuda.set_device(local_rank)` before `init_process_group`.** The *local rank* is the rank's
#    number on its own node (0..GPUs-1) and picks its GPU. Without `set_device`, every rank would create
#    its CUDA context on GPU 0: out-of-memory errors, or NCCL hanging. `init_process_group(...,
#    device_id=device)` then tells NCCL that GPU at once, so it connects there (None on the CPU).
#
# The tensor to reduce must live on the rank's GPU (`device=cuda:<local_rank>`). On a machine without a GPU
# (a laptop, CI) the script says so and runs lesson 0's gloo path instead, so this notebook runs anywhere;
# set `FULL_SIZE = True` on a GPU node to see NCCL.

# %%
from nbhelpers import *

# The one switch. False: 2 processes (gloo on the CPU when there is no GPU; at most one per GPU otherwise).
# True: one process per GPU of this node (NCCL), or 2 CPU processes if it has none.
FULL_SIZE = False
NPROC = full_size_nproc() if FULL_SIZE else min(2, gpu_count()) or 2

# %% [markdown]
# ## The picture

# %%
draw_gpus(4)

# %% [markdown]
# ## What changed against lesson 0
#
# The `all_reduce` is the same. New: choosing the backend, checking there is a GPU for every rank,
# `set_device` before init, `device_id=` at init (on GPUs), and the tensor created on the rank's device.

# %%
show_diff("day1/0_torch_dist.py", "day1/1_torch_dist_gpu.py")

# %% [markdown]
# ## Run it
#
# `--backend auto` (the default) chooses NCCL when GPUs are visible and gloo otherwise.

# %%
out = run_lesson("day1/1_torch_dist_gpu.py", "--nproc", NPROC)

# %% [markdown]
# ## Which rank ran where
#
# Each rank printed its device. On a GPU node you see `cuda:0`, `cuda:1`, ...: one GPU per rank. On a CPU
# machine every rank says `cpu`.

# %%
import re

rows = [{"rank": int(r), "world size": int(n), "device": dev, "device name": name, "mean after all_reduce": mean}
        for (r, n, dev, name), mean in zip(
            re.findall(r"\[rank (\d+)\] of (\d+) on (\S+) \((.*?)\)", out),
            re.findall(r"mean = ([\d.]+)", out))]
show_table(sorted(rows, key=lambda r: r["rank"]))

# %% [markdown]
# ## The rule, enforced: no NCCL rank without a GPU of its own
#
# The cell below asks for one NCCL rank more than this machine has GPUs (on a machine without a GPU, that is
# a single rank). The script stops at once with a one-line explanation instead of hanging later. The cell
# expects that failure (`CalledProcessError`) and says which of the script's two checks this machine hit.

# %%
import subprocess

GPUS = gpu_count()
try:
    run_lesson("day1/1_torch_dist_gpu.py", "--backend", "nccl", "--nproc", GPUS + 1)
except subprocess.CalledProcessError as e:
    if GPUS == 0:
        md(f"Exit code {e.returncode}. This machine has no GPU, so even one NCCL rank is one too many: the script "
           "says that NCCL needs CUDA GPUs and none is visible. On a GPU node the same call asks for one rank "
           "more than the node has GPUs, and the message names both numbers.")
    else:
        md(f"Exit code {e.returncode}. This machine has {GPUS} GPU(s), so {GPUS + 1} NCCL ranks are one too many: "
           "the message names both numbers, before any rank is started.")
else:
    raise AssertionError("more NCCL ranks than GPUs should have failed")

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/1_torch_dist_gpu.md`](../solutions/1_torch_dist_gpu.md).
#
# 1. On a GPU node: `torchrun --nproc_per_node=4 day1/1_torch_dist_gpu.py`, and `nvidia-smi` in another
#    terminal while it runs. You should see `[rank r] of 4 on cuda:r (<GPU name>)` for r = 0..3, and in
#    `nvidia-smi` one python process on each of the 4 GPUs.
# 2. On a GPU node: `NCCL_DEBUG=INFO` before the same command. You should see lines starting with
#    `NCCL INFO` that name the transport NCCL picked between the GPUs (`P2P` for NVLink/PCIe, `NET` for
#    sockets or InfiniBand).
# 3. Anywhere: `python day1/1_torch_dist_gpu.py --backend gloo --nproc 3`. You should see 3 ranks on `cpu`,
#    each with `mean = 2`: gloo works on any machine, with or without GPUs.
#
# Next: [lesson 2](2_mnist_training.ipynb), the single-process training run that the rest of day 1
# distributes.
