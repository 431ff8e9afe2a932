# %% [markdown]
# # Lesson 4: data parallelism by hand
#
# Script: [`day1/4_mnist_manual_ddp.py`](../day1/4_mnist_manual_ddp.py).
#
# Three changes turn lesson 3's N copies into *one* training run that processes N times the data per step:
#
# 1. **Identical starting weights**: rank 0's weights are broadcast to every rank (`dist.broadcast`).
# 2. **A shard of the data per rank**: `DistributedSampler` shuffles the epoch's indices (the same shuffle
#    on every rank, seeded with `seed + epoch`; `set_epoch` reshuffles) and gives rank *r* every W-th index
#    starting at *r*. The shards are disjoint and together cover the data (padded with a few repeats when the
#    dataset does not divide evenly, so that every rank takes the same number of steps).
# 3. **Averaged gradients**: after `backward()`, each gradient is summed over ranks with `all_reduce` and
#    divided by W. Every rank then holds the same gradient and takes the same optimizer step, so the weights
#    stay identical without ever being sent again.
#
# Why this is *the same training*: with W ranks of batch *b*, the mean of the W per-rank mean gradients is
# the mean gradient over all W*b samples. One step here equals one step of lesson 2 with batch W*b. This
# notebook runs both and compares them.

# %%
from nbhelpers import *

# The one switch. False: --quick on 2 CPU processes (seconds per run).
# True: full epochs, one process per GPU of this node.
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick"]
NPROC = full_size_nproc() if FULL_SIZE else 2
# one GPU per rank, or every rank on the CPU (NCCL cannot put two ranks on one GPU)
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
BATCH = 64  # per rank
RUN = run_dir("4_mnist_manual_ddp")

# %% [markdown]
# ## What changed against lesson 3
#
# Read the `# DDP:` comments: the broadcast, the sampler with `set_epoch`, the gradient all_reduce
# (`--sync per-param`, as the original workshop; `--sync flat` does it in one message), and the evaluation
# that counts each test image exactly once across ranks.

# %%
show_diff("day1/3_mnist_distributed.py", "day1/4_mnist_manual_ddp.py")

# %% [markdown]
# ## Run it under torchrun

# %%
out = run_lesson("day1/4_mnist_manual_ddp.py", *SIZE, *DEVICE, "--batch-size", BATCH, "--run-dir", RUN,
                 nproc=NPROC)

# %% [markdown]
# ## The shards
#
# Rank 0 saved epoch 0's shards (`shards.json`): the sample indices each rank trained on. Each sample
# belongs to exactly one rank, and every rank has the same number of samples, hence of steps.

# %%
layout = read_json(RUN / "shards.json")
shards = layout["shards"]
draw_shards(shards, layout["dataset_size"], BATCH)
seen = [i for shard in shards for i in shard]
print(f"{len(seen)} indices handed out, {len(set(seen))} distinct, of {layout['dataset_size']} samples; "
      f"overlap between ranks: {len(seen) - len(set(seen))} (the sampler's padding)")

# %% [markdown]
# ## The same steps as one process on the global batch
#
# Now lesson 2, one process, with batch `NPROC` x 64 on the same data. Its loss curve should lie on top of
# lesson 4's, and its weights should equal lesson 4's up to float rounding (the ranks add their gradients
# in a different order than one process does).

# %%
RUN2 = run_dir("4_mnist_manual_ddp/single_process")
run_lesson("day1/2_mnist_training.py", *SIZE, *DEVICE, "--batch-size", NPROC * BATCH, "--run-dir", RUN2)

# %%
import torch

from course.training.output import load_weights

m4, m2 = read_json(RUN / "metrics.json"), read_json(RUN2 / "metrics.json")
fig, ax = plt.subplots()
ax.plot(m2["loss_per_step"], lw=4, alpha=0.4, label=f"lesson 2: 1 process, batch {m2['batch_size']}")
ax.plot(m4["loss_per_step"], lw=1, label=f"lesson 4: {m4['world_size']} ranks x batch {m4['batch_size']}")
ax.set(xlabel="step", ylabel="training loss", title="the same training run, done by one process or by several")
ax.legend()
plt.show()

w4, w2 = load_weights(REPO / RUN / "model.pt"), load_weights(REPO / RUN2 / "model.pt")
worst = max(((w4[k] - w2[k]).abs().max() / w2[k].abs().max()).item() for k in w2)
print(f"after {m4['steps']} steps: largest weight difference {worst:.1e} of the largest weight "
      f"(float32 rounding); test accuracy {m4['test_accuracy']:.4f} vs {m2['test_accuracy']:.4f}")
if not FULL_SIZE:  # on GPUs, non-deterministic kernels add their own rounding over thousands of steps
    assert worst < 1e-3 and m4["steps"] == m2["steps"]
md(f"This notebook compares results, not speed: the {m4['world_size']} ranks trained for {m4['train_seconds']:.2f} s "
   f"and the single process for {m2['train_seconds']:.2f} s, on {'GPUs' if not DEVICE else 'the same CPU cores'} "
   "and with different thread counts. [Lesson 7](7_mnist_ddp_pt_timing.ipynb) measures what more ranks buy, "
   "and why.")

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/4_mnist_manual_ddp.md`](../solutions/4_mnist_manual_ddp.md).
#
# 1. `--sync flat`: one all_reduce per step for all gradients instead of one per parameter tensor. You
#    should see the same test accuracy as the run above, to the last digit printed: the same sums, in fewer
#    messages (the idea behind DDP's buckets in lesson 6).
# 2. Set `NPROC = 3` in the first cell and run the notebook again. 12 800 samples do not divide by 3: you
#    should see `12801 indices handed out, 12800 distinct` and an overlap of 1: the sampler repeats one
#    sample so that every rank takes the same number of steps.
#
# Next: [lesson 5](5_mnist_manual_ddp_profile.ipynb) profiles this run and shows what the all_reduce
# costs; [lesson 6](6_mnist_ddp_pt.ipynb) lets PyTorch's DDP do the synchronization.
