# %% [markdown]
# # Lesson 14: gradient accumulation and activation checkpointing
#
# Script: [`day3/14_accumulation_checkpointing.py`](../day3/14_accumulation_checkpointing.py).
#
# A batch that does not fit in memory, and a model whose activations do not: two problems that lesson 13's
# 16 bits only halve. This lesson adds two answers to lesson 13's loop, each one flag away, and measures
# what each saves.
#
# - **Gradient accumulation, `--accumulate K`.** An optimizer step takes K micro-batches of `--batch-size` b
#   per rank, one after the other; their gradients add up in `.grad` and the optimizer steps once. The loss
#   of each micro-batch is divided by K, so the sum is the gradient of the mean over all K x b samples: the
#   global batch per step is W x K x b, with the memory of a batch of b.
# - **`model.no_sync()` for the first K-1 micro-batches**, forward and backward inside it: DDP sends
#   nothing and only accumulates; the last micro-batch's backward all_reduces the summed gradients once.
#   One round of all_reduce per optimizer step instead of K: 1/K of the bytes per sample.
# - **Activation checkpointing, `--checkpoint-activations`.** Each transformer block runs under
#   `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`: autograd keeps only the block's
#   input, not its intermediate tensors, and backward runs the block's forward again to get them back. Less
#   memory for more compute, and the same arithmetic: the same gradients.
#
# What each saves is counted while the run trains (course/measuring/accumulation.py): a DDP communication hook counts
# every bucket it all_reduces, and saved-tensor hooks count the bytes autograd keeps for backward. And what
# it saves in memory is measured: every rank measures its third step (course/measuring/memory.py's `StepPeak`), the
# bytes it held as the step's first forward began and the most it held above that until `optimizer.step()`
# (on a GPU `torch.cuda.max_memory_allocated`, on the CPU the live tensors).

# %%
from nbhelpers import *

# The one switch. False: --quick (10 steps) on 2 CPU processes. True: full epochs, one process per GPU.
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick", "--max-steps", "10"]
NPROC = full_size_nproc() if FULL_SIZE else 2
# one GPU per rank, or every rank on the CPU (NCCL cannot put two ranks on one GPU)
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
# lesson 13's bf16 where a GPU computes in it; fp32 on the CPU, where lesson 13's bf16 steps took longer
PRECISION = ["--precision", "bf16"] if not DEVICE else ["--precision", "fp32"]
RUN = run_dir("14_accumulation_checkpointing")

# %% [markdown]
# ## What changed against lesson 13
#
# The inner loop over K micro-batches with `no_sync()` around all but the last, the loss divided by K, and
# a `checkpoint` around each block's forward. Mixed precision stays as it was; lesson 13's `--compile` is
# not carried over.

# %%
show_diff("day3/13_mixed_precision.py", "day3/14_accumulation_checkpointing.py")

# %%
show_tagged("day3/14_accumulation_checkpointing.py")

# %% [markdown]
# ## Four runs
#
# - **one batch**: K = 1 micro-batch of 64 per rank;
# - **accumulated**: K = 4 micro-batches of 16 per rank: the same global batch, a quarter of the batch in memory;
# - **small batch**: K = 1 micro-batch of 16 per rank: the same micro-batch as *accumulated*, a quarter of its global batch;
# - **checkpointed**: *accumulated* with every block checkpointed.

# %%
RUNS = {"one batch": ["--batch-size", "64"],
        "accumulated": ["--batch-size", "16", "--accumulate", "4"],
        "small batch": ["--batch-size", "16"],
        "checkpointed": ["--batch-size", "16", "--accumulate", "4", "--checkpoint-activations"]}
for name, extra in RUNS.items():
    run_lesson("day3/14_accumulation_checkpointing.py", *SIZE, *DEVICE, *PRECISION, *extra,
               "--run-dir", RUN / name.replace(" ", "-"), nproc=NPROC)

# %%
m = {name: read_json(RUN / name.replace(" ", "-") / "metrics.json") for name in RUNS}
show_table([{"run": name, "K": r["accumulate"], "batch per rank": r["batch_size"],
             "global batch": r["global_batch_size"], "all_reduce rounds per step": r["allreduce_rounds_per_step"],
             "KB sent per step": r["allreduce_bytes_per_step"] / 1024,
             "bytes sent per sample": r["allreduce_bytes_per_sample"],
             "MB kept for backward per micro-batch": r["saved_for_backward_bytes"] / 2 ** 20,
             "MB held as step 3 began": r["memory"]["held_before_bytes"] / 2 ** 20,
             "MB peak above that": r["memory"]["peak_above_bytes"] / 2 ** 20,
             "ms per step": r["step_seconds"] * 1000,
             "training samples/s": r["global_batch_size"] / r["step_seconds"]} for name, r in m.items()])

# %% [markdown]
# ## Accumulation: the same training, one all_reduce per step
#
# *one batch* and *accumulated* see the same 64 x W samples in every step, so their losses should lie on top
# of each other: the gradients differ only in the order of the sums.

# %%
import numpy as np
import torch

from course.training.output import load_weights


def weights(name):
    w = load_weights(REPO / RUN / name.replace(" ", "-") / "model.pt")
    return torch.cat([w[k].flatten().float() for k in sorted(w)])


fig, ax = plt.subplots()
for name in ("one batch", "accumulated", "small batch"):
    ax.plot(range(1, m[name]["steps"] + 1), m[name]["loss_per_step"], label=f"{name} (global batch "
            f"{m[name]['global_batch_size']})", linestyle="--" if name == "accumulated" else "-")
ax.set(xlabel="optimizer step", ylabel="training loss (mean over ranks)", title="ViT, lesson 14")
ax.legend()
plt.show()
one, acc, small, ckpt = (m[n] for n in RUNS)
rel = ((weights("accumulated") - weights("one batch")).norm() / weights("one batch").norm()).item()
gap = np.abs(np.array(acc["loss_per_step"]) - np.array(one["loss_per_step"])).max()
md(f"After {acc['steps']} steps the weights of *accumulated* differ from *one batch*'s by {rel:.1e} (relative), "
   f"the losses by at most {gap:.1e}: the same training. Each step sent "
   f"{acc['allreduce_rounds_per_step']:g} round of all_reduce in both, {acc['allreduce_bytes_per_step'] / 1024:.1f} KB "
   f"(every gradient once). Per sample, *accumulated* sent {acc['allreduce_bytes_per_sample']:.0f} bytes and "
   f"*small batch*, with the same micro-batch in memory, {small['allreduce_bytes_per_sample']:.0f}: "
   f"{acc['allreduce_bytes_per_sample'] / small['allreduce_bytes_per_sample']:.3g}x, 1/K with K = {acc['accumulate']}.")

# %% [markdown]
# What accumulation costs: a step of *accumulated* computes K micro-batches, as K steps of *small batch* do,
# but it all_reduces and updates the weights once instead of K times: about K times as long as one step of
# *small batch*, less what the K - 1 saved all_reduces and optimizer steps cost, where that is more than the
# run-to-run noise. The times are the median time of an optimizer step (the evaluation of the test set at the
# end left out).

# %%
speed = {name: r["global_batch_size"] / r["step_seconds"] for name, r in m.items()}
md(f"A step of *accumulated* took {acc['step_seconds'] * 1000:.0f} ms, one of *small batch* "
   f"{small['step_seconds'] * 1000:.0f} ms: {acc['step_seconds'] / small['step_seconds']:.1f}x for K = "
   f"{acc['accumulate']}"
   + (" (more than K: here what accumulation saves is smaller than the noise between one run and another)"
      if acc['step_seconds'] / small['step_seconds'] > acc['accumulate'] else "")
   + f". Per sample: *accumulated* {speed['accumulated']:.0f} samples/s, *small batch* "
   f"{speed['small batch']:.0f}, *one batch* {speed['one batch']:.0f}"
   + (" (a larger batch keeps the hardware busier; accumulation gives its gradient, not its speed)."
      if speed["accumulated"] < 0.95 * speed["one batch"] else
      ": *accumulated* ran about as fast per sample as *one batch* here (on this CPU a batch of "
      f"{acc['global_batch_size'] // acc['world_size']} per rank is no more efficient per sample than "
      f"{acc['accumulate']} x {acc['batch_size']}); what it gains over *small batch* is the "
      f"{acc['accumulate'] - 1} all_reduces and optimizer steps it skips."))

# %% [markdown]
# ## Checkpointing: fewer bytes kept, the same numbers
#
# The bytes autograd keeps between a micro-batch's forward and its backward (counted with
# `torch.autograd.graph.saved_tensors_hooks` during the first forward pass; the parameters themselves are not
# counted). With checkpointing a block keeps only its input.

# %%
fig, ax = plt.subplots(figsize=(6, 2.2))
names = ["accumulated", "checkpointed"]
ax.barh(names, [m[n]["saved_for_backward_bytes"] / 2 ** 20 for n in names], color=["tab:blue", "tab:green"])
ax.set(xlabel="MB kept for backward per micro-batch of 16", title="ViT, depth 4")
plt.show()
same = torch.equal(weights("checkpointed"), weights("accumulated"))
slower = ckpt["step_seconds"] / acc["step_seconds"]
md(f"Kept for backward per micro-batch: {acc['saved_for_backward_bytes'] / 2 ** 20:.3f} MB without checkpointing, "
   f"{ckpt['saved_for_backward_bytes'] / 2 ** 20:.3f} MB with it "
   f"({ckpt['saved_for_backward_bytes'] / acc['saved_for_backward_bytes']:.2f}x). Weights after "
   f"{ckpt['steps']} steps equal bit for bit: **{same}**: backward recomputed exactly what forward had computed. "
   + (f"A checkpointed step took {slower:.2f}x as long: the recompute, about one more forward pass per backward, "
      f"and checkpoint's own bookkeeping per block, which weighs more the smaller the micro-batch."
      if slower > 1 else
      f"A checkpointed step took {slower:.2f}x as long, although it computes more: other programs kept this "
      f"machine busier during one of the two runs. Time them again on an idle machine."))

# %% [markdown]
# What the step really held, measured on rank 0 during step 3: checkpointing can only shrink what a step adds
# above what it began with; the parameters, the momentum and DDP's gradient bucket are held before it and
# stay.

# %%
held = {n: m[n]["memory"] for n in ("one batch", "accumulated", "small batch", "checkpointed")}
fig, ax = plt.subplots(figsize=(6, 2.6))
ax.barh(list(held), [h["held_before_bytes"] / 2 ** 20 for h in held.values()], color="tab:gray",
        label="held as the step began")
ax.barh(list(held), [h["peak_above_bytes"] / 2 ** 20 for h in held.values()],
        left=[h["held_before_bytes"] / 2 ** 20 for h in held.values()], color="tab:orange", label="most above that")
ax.set(xlabel=f"MB, step 3, rank 0 ({held['accumulated']['how']})")
ax.legend(fontsize=8)
plt.show()
a, c, o = held["accumulated"], held["checkpointed"], held["one batch"]
saved = c["peak_above_bytes"] / a["peak_above_bytes"]
md(f"Above what the step began with ({a['held_before_bytes'] / 2 ** 20:.2f} MB without checkpointing, "
   f"{c['held_before_bytes'] / 2 ** 20:.2f} MB with it), the step rose at most "
   f"{a['peak_above_bytes'] / 2 ** 20:.2f} MB without checkpointing and {c['peak_above_bytes'] / 2 ** 20:.2f} MB "
   f"with it: {saved:.2f}x, " + ("a real saving" if saved < 0.9 else "hardly a saving at this size")
   + f", for a step {slower:.2f}x as long. It falls less than the bytes kept for backward "
   f"({ckpt['saved_for_backward_bytes'] / acc['saved_for_backward_bytes']:.2f}x): the gradients the step "
   f"creates and backward's temporaries, the recomputed block's activations among them, are there either way. "
   f"Accumulating 4 micro-batches of 16 rose {a['peak_above_bytes'] / o['peak_above_bytes']:.2f}x as high as "
   f"one batch of 64 did: each micro-batch's backward frees its activations before the next one's forward.")

# %% [markdown]
# ## Watching the hardware while it trains
#
# The training lessons from 6 on take `--watch-hardware`: each rank samples its own process (CPU %, RSS)
# and, on a GPU, its own GPU through NVML (utilization, memory, power), into `RUN_DIR/hardware/rank{r}.json`
# and TensorBoard; [the guide](../docs/learners/monitoring.md) says how to watch a job on a cluster too.
# The checkpointed configuration once more, each rank sampled every 0.1 s:

# %%
WATCHED = RUN / "watched"
run_lesson("day3/14_accumulation_checkpointing.py", *SIZE, *DEVICE, *PRECISION, *RUNS["checkpointed"],
           "--watch-hardware", "--watch-interval", "0.1", "--run-dir", WATCHED, nproc=NPROC)
hw = [read_json(p) for p in sorted((REPO / WATCHED / "hardware").glob("rank*.json"))]
fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(6, 4))
for h in hw:
    t = [s["t"] for s in h["samples"]]
    top.plot(t, [s["cpu_percent"] for s in h["samples"]], label=f"rank {h['rank']}")
    bottom.plot(t, [s["step"] for s in h["samples"]], label=f"rank {h['rank']}")
top.set(ylabel="CPU % (100: one core)", title="checkpointed, watched")
bottom.set(xlabel="seconds since the rank started its loop", ylabel="optimizer steps done")
top.legend()
plt.show()
summaries = [h["summary"] for h in hw]
md(f"{len(hw)} ranks, " + ", ".join(str(s["samples"]) for s in summaries)
   + f" samples over {summaries[0]['seconds']:.1f} s: each "
   f"rank used on average " + ", ".join(f"{s['cpu_percent_mean']:.0f}%" for s in summaries)
   + f" of a core ({summaries[0]['torch_threads']} torch thread per rank), and held at most "
   + ", ".join(f"{s['rss_mb_max']:.0f}" for s in summaries)
   + f" MB of RAM (RSS): torch's libraries and the in-memory dataset, mostly. The "
   f"{(acc['saved_for_backward_bytes'] - ckpt['saved_for_backward_bytes']) / 2 ** 20:.1f} MB per micro-batch "
   f"that checkpointing saves are lost in that at this size, as they would be on a GPU in the peak the line adds "
   f"there (from step 3 to the end: the dataset held on the GPU, the evaluation): step 3's own peak above is "
   f"where they show. The steps rise together on every rank: in a hung job "
   f"(lesson 17) they stay flat and the CPU % of the waiting ranks drops.")

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/14_accumulation_checkpointing.md`](../solutions/14_accumulation_checkpointing.md).
#
# 1. In a copy of the script, replace `model.no_sync() if i < k - 1 else contextlib.nullcontext()` with
#    `contextlib.nullcontext()` and run `--accumulate 4`: the run prints 4 rounds of all_reduce per
#    optimizer step instead of 1 and four times the bytes per sample, yet ends with the same weights as the
#    unchanged script (to float rounding): no_sync saves communication, it does not change the result.
# 2. `--depth 8` with and without `--checkpoint-activations`: what a micro-batch keeps for backward grows
#    with the depth without checkpointing, and much more slowly with it (each block keeps only its input),
#    so the ratio falls below the depth-4 ratio above; the weights stay equal bit for bit.
# 3. `--precision fp16 --accumulate 4 --overflow-at 3`: rank 1's inf at step 3 reaches every micro-batch
#    of that step, yet GradScaler looks once per optimizer step: step 3 is skipped once, on both ranks, and
#    the loss scale halves once (65536 -> 32768).
#
# Next: [lesson 15](15_fsdp2.ipynb): sharding with FSDP2.
