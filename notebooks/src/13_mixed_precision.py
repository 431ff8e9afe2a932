# %% [markdown]
# # Lesson 13: mixed precision under DDP
#
# Script: [`day3/13_mixed_precision.py`](../day3/13_mixed_precision.py).
#
# Day 3 trains a larger model than the MLP: a small **Vision Transformer** (`course/models.py`). Each 28x28
# image is cut into 7x7 patches, 16 tokens; `--depth` transformer blocks mix them. Larger models make the
# next problems real: steps that are slow, and memory that runs out. This lesson is the first answer to
# both: compute in 16 bits instead of 32.
#
# - **`torch.autocast(device, dtype)`** runs the forward pass's matrix products in bf16 or fp16: half the
#   bytes to move, and the tensor cores of a GPU. Operations that need the range or the precision (layer
#   norms, the loss; on GPUs softmax too) stay in fp32, and so do the weights, their gradients and the
#   optimizer: DDP all_reduces fp32 gradients exactly as in lesson 6.
# - **fp16 needs a GradScaler.** fp16 has few exponent bits: small gradients become 0. GradScaler multiplies
#   the loss by a large scale (65536 to start) before backward, so that the gradients are large enough, and
#   divides them by it again before the step. bf16 has fp32's range and needs none.
# - **`scaler.unscale_(optimizer)` before `clip_grad_norm_`**: clipping must see the true gradients.
# - **A skipped step is skipped on every rank.** If the gradients hold inf or NaN, GradScaler skips the step
#   and halves the scale. Each rank checks only its own gradients, but after DDP's all_reduce they are the
#   same on every rank, inf included.

# %%
from nbhelpers import *

# The one switch. False: --quick (24 steps) on 2 CPU processes. True: full epochs, one process per GPU.
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick", "--max-steps", "24"]
NPROC = full_size_nproc() if FULL_SIZE else 2
# one GPU per rank, or every rank on the CPU (NCCL cannot put two ranks on one GPU)
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
RUN = run_dir("13_mixed_precision")

# %% [markdown]
# ## The picture: three number formats
#
# What each format can hold, read from torch itself: the largest number, the smallest normal one, and the
# spacing of numbers near 1 (the relative rounding error is half of it).

# %%
import torch

formats = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
show_table([{"format": name, "bits": torch.finfo(t).bits, "largest": torch.finfo(t).max,
             "smallest normal": torch.finfo(t).tiny, "spacing near 1": torch.finfo(t).eps}
            for name, t in formats.items()])
gradient = torch.tensor(1e-8)
scale = 65536.0
md(f"A gradient of {gradient.item():g} stored in fp16 becomes **{gradient.half().item():g}**; multiplied by "
   f"GradScaler's first scale {scale:g} it is stored as {(gradient * scale).half().item():.4g} and divided "
   f"back in fp32: {((gradient * scale).half().float() / scale).item():.4g}. In bf16 it survives without "
   f"a scale: {gradient.bfloat16().item():.4g}, with bf16's coarser rounding.")

# %% [markdown]
# ## What changed against lesson 6
#
# The model (the ViT instead of the MLP), `torch.autocast` around the forward pass, GradScaler around
# backward and step, and clipping after `unscale_`; `--compile` (at the end of this notebook). At the end
# the ranks compare their weights.

# %%
show_diff("day1/6_mnist_ddp_pt.py", "day3/13_mixed_precision.py")

# %%
show_tagged("day3/13_mixed_precision.py")

# %% [markdown]
# ## Run it in fp32, bf16 and fp16
#
# Three runs with the same seed, the same data and the same number of steps; only `--precision` differs.

# %%
PRECISIONS = ["fp32", "bf16", "fp16"]
for precision in PRECISIONS:
    run_lesson("day3/13_mixed_precision.py", *SIZE, *DEVICE, "--precision", precision,
               "--run-dir", RUN / precision, nproc=NPROC)

# %% [markdown]
# ## The same training, at a different speed
#
# 16-bit arithmetic rounds differently, so the curves are not identical; they should lie on top of each
# other to within the step-to-step noise of the loss.

# %%
m = {p: read_json(RUN / p / "metrics.json") for p in PRECISIONS}
fig, ax = plt.subplots()
for p in PRECISIONS:
    ax.plot(range(1, m[p]["steps"] + 1), m[p]["loss_per_step"], label=p)
ax.set(xlabel="step", ylabel="training loss (mean over ranks)",
       title=f"ViT, {m['fp32']['world_size']} ranks x batch {m['fp32']['batch_size']}")
ax.legend()
plt.show()
show_table([{"precision": p, "steps": m[p]["steps"], "skipped": len(m[p]["skipped_steps"]),
             "train_seconds": m[p]["train_seconds"], "test_accuracy": m[p]["test_accuracy"]} for p in PRECISIONS])

# %%
import numpy as np

ref = np.array(m["fp32"]["loss_per_step"])
noise = np.abs(np.diff(ref)).mean()  # how much the loss moves from one step to the next
gaps = {p: np.abs(np.array(m[p]["loss_per_step"]) - ref).mean() for p in ("bf16", "fp16")}
ratio = {p: m[p]["train_seconds"] / m["fp32"]["train_seconds"] for p in ("bf16", "fp16")}
md(f"Mean distance from the fp32 curve: bf16 {gaps['bf16']:.1e}, fp16 {gaps['fp16']:.1e}; the fp32 loss itself "
   f"moves by {noise:.1e} from one step to the next. "
   + ("Both 16-bit curves stay well inside that noise: the same training. " if max(gaps.values()) < noise / 2 else
      "The 16-bit curves are as far from fp32 as the step-to-step noise: look at the plot before trusting them. ")
   + f"The runs took {ratio['bf16']:.2f}x (bf16) and {ratio['fp16']:.2f}x (fp16) as long as fp32 "
   f"(the same steps and the same fp32 evaluation of the test set at the end).")

# %% [markdown]
# **Why slower here?** The run above is on the CPU unless this machine has GPUs. 16-bit arithmetic is fast
# only where the hardware computes in it: tensor cores on GPUs since Volta (fp16) and Ampere (bf16), and on
# CPUs the `avx512_bf16` or `amx_bf16` instructions. Without them every 16-bit matrix product converts its
# inputs and computes in fp32, which costs more than fp32 alone. With them, autocast still adds its casts
# (every weight converted to 16 bits at every step), and what the products gain must pay for those. The
# flags of this machine's CPU:

# %%
from pathlib import Path

flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
md("This CPU has " + (", ".join(f"`{f}`" for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags)
                       or "none of `avx512_bf16`, `amx_bf16`, `amx_tile`")
   + f"; {gpu_count()} GPU(s) are visible to this notebook"
   + (f". Here bf16 took {ratio['bf16']:.2f}x as long as fp32 all the same: at this model's size, with "
      f"one thread per rank, the casts cost more than the bf16 products saved; whether a larger --width "
      f"gains is a measurement to make, not a rule." if {"avx512_bf16", "amx_bf16"} & flags and ratio["bf16"] > 1
      else "."))

# %% [markdown]
# ## An overflow on one rank: every rank skips the step
#
# `--overflow-at 5` multiplies rank 1's loss by inf at step 5. Rank 0's own loss is finite. Watch what each
# rank prints.

# %%
out = run_lesson("day3/13_mixed_precision.py", "--quick", "--max-steps", "10", *DEVICE, "--precision", "fp16",
                 "--overflow-at", "5", "--overflow-rank", "1", "--run-dir", RUN / "overflow", nproc=2)

# %%
import re

o = read_json(RUN / "overflow" / "metrics.json")
said = re.findall(r"\[rank (\d)\] step (\d+) skipped \(inf/NaN gradients; own loss (\S+)\)", out)
md(f"Skipped steps: {o['skipped_steps']}. "
   + " ".join(f"Rank {r} skipped step {s} (its own loss: {l})." for r, s, l in said)
   + f" Weights identical on all ranks after {o['steps']} steps: **{o['identical_weights']}**. Rank 0 found "
   "the inf in gradients it did not compute itself: DDP's all_reduce had added rank 1's inf gradients to its own.")

# %% [markdown]
# ## Compiling the model: `--compile`
#
# `torch.compile` turns the model's Python into fused kernels. Under DDP it is applied **after** wrapping:
# dynamo then cuts the graph at DDP's bucket boundaries, so each bucket's all_reduce still starts while the
# rest of backward runs (compiled before wrapping, the model would be one graph whose gradients all arrive at
# its end). The first forward and backward compile; the lesson runs them once before training
# (`course/training/precision.py`'s `warm_up`; their gradients are thrown away), so the step times are training's
# alone, and rank 0 says how long compiling took:
#
# ```bash
# python day3/13_mixed_precision.py --nproc 2 --quick --precision fp32 --compile
# TORCH_LOGS=ddp_graphs python day3/13_mixed_precision.py --nproc 2 --quick --precision fp32 --compile \
#     --width 128 --bucket-cap-mb 1     # gradients over several 1 MB buckets: the graph in pieces
# ```
#
# This notebook does not run it: compiling takes tens of seconds on a CPU. Measured on the course's 2-core
# machine (2026-11-25, `OMP_NUM_THREADS=1 python benchmarks/bench.py --sections precision`, the default
# ViT, batch 64, 1 thread): compiling took 19.2 s, and the compiled fp32 step then took 0.91x the eager
# step's time (26.7 vs 29.2 ms). On this CPU and this small model, compiling pays off after thousands of
# steps; the compiled gradients equal the eager ones to about 1e-6 (relative).

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/13_mixed_precision.md`](../solutions/13_mixed_precision.md).
#
# 1. Move `scaler.unscale_(optimizer)` below `clip_grad_norm_` in a copy of the script and run `--precision
#    fp16`: `grad_norm_per_step` in metrics.json is ~65536 times larger than in fp32, every step is clipped
#    to a tiny one, and the loss barely falls in 24 steps.
# 2. `--precision bf16 --overflow-at 5`: there is no GradScaler in bf16, so nothing skips the step; the
#    weights become NaN on every rank (identical, NaN for NaN), the test loss is nan and the test accuracy
#    0.1: the argmax of NaN logits is class 0, a tenth of the test set.
# 3. `--precision fp16 --overflow-at 1 --overflow-rank 0`: the very first step is skipped on both ranks, and
#    the loss scale goes from 65536 to 32768 before any weight has changed.
#
# Next: [lesson 14](14_accumulation_checkpointing.ipynb): gradient accumulation and activation checkpointing.
