# %% [markdown]
# # Lesson 6: PyTorch's `DistributedDataParallel`
#
# Script: [`day1/6_mnist_ddp_pt.py`](../day1/6_mnist_ddp_pt.py).
#
# Wrapping the model in `DistributedDataParallel` (DDP) replaces lesson 4's two manual steps, and does them
# better:
#
# - **At wrap time** DDP broadcasts rank 0's parameters and buffers to every rank: no broadcast loop.
# - **During backward** DDP's hooks collect finished gradients into **buckets** (25 MB by default). Backward
#   computes the gradients from the last layer to the first; as soon as a bucket is full its `all_reduce`
#   starts, while backward is still computing the earlier layers. Communication **overlaps** computation,
#   and many small tensors travel as a few large messages (lesson 4's `--sync flat`, made concurrent).
#   When `loss.backward()` returns, the gradients are already averaged.
#
# What stays the same: the `DistributedSampler` and `set_epoch`, the per-rank batch, and the result. Lesson
# 6 computes exactly lesson 4's training run; this notebook checks that.

# %%
from nbhelpers import *

# The one switch. False: --quick on 2 CPU processes. True: full epochs, one process per GPU of this node.
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick"]
NPROC = full_size_nproc() if FULL_SIZE else 2
# one GPU per rank, or every rank on the CPU (NCCL cannot put two ranks on one GPU)
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
RUN = run_dir("6_mnist_ddp_pt")

# %% [markdown]
# ## The picture: buckets and overlap
#
# The buckets DDP really uses, found by wrapping the model in DDP and asking it after a first backward
# (`ddp_buckets` in [`nbhelpers.py`](nbhelpers.py)). Parameters are listed in the order backward produces
# their gradients; a bucket closes once it holds at least `bucket_cap_mb`. The MLP's four tensors (0.4 MB)
# fit in one bucket at the default 25 MB, so its single all_reduce starts only when backward is done:
# nothing to overlap. The CNN with a small cap (`--bucket-cap-mb 0.01`) is cut into several buckets, and the
# first ones travel while backward still computes the earlier layers.

# %%
from course.models import build_model

for model, cap in (("mlp", 25.0), ("cnn", 0.01)):
    params = list(build_model(model, 0).named_parameters())
    buckets = ddp_buckets(model, cap)
    draw_buckets([p.numel() for _, p in params], names=[n for n, _ in params], buckets=buckets,
                 title=f"{model}, --bucket-cap-mb {cap:g}: {len(buckets)} bucket(s), as DDP built them")

# %% [markdown]
# ## What changed against lesson 4
#
# Lesson 5 (between the two) is lesson 4 under the profiler, so the diff that shows this lesson's idea is
# the one against lesson 4: the broadcast loop, the manual gradient all_reduce and the shard bookkeeping go;
# one `DDP(...)` line comes in.

# %%
show_diff("day1/4_mnist_manual_ddp.py", "day1/6_mnist_ddp_pt.py")

# %% [markdown]
# ## Run it, and lesson 4 with the same settings

# %%
run_lesson("day1/6_mnist_ddp_pt.py", *SIZE, *DEVICE, "--run-dir", RUN, nproc=NPROC)
run_lesson("day1/4_mnist_manual_ddp.py", *SIZE, *DEVICE, "--run-dir", RUN / "lesson4", nproc=NPROC)

# %% [markdown]
# ## Same training run
#
# Both synchronize by averaging the same gradients, so the loss of every step and the final weights agree,
# to the last bit on the CPU.

# %%
from course.training.output import load_weights

m6, m4 = read_json(RUN / "metrics.json"), read_json(RUN / "lesson4" / "metrics.json")
fig, ax = plt.subplots()
ax.plot(m4["loss_per_step"], lw=4, alpha=0.4, label="lesson 4: manual all_reduce")
ax.plot(m6["loss_per_step"], lw=1, label="lesson 6: DDP")
ax.set(xlabel="step", ylabel="training loss (mean over ranks)",
       title=f"{m6['world_size']} ranks, lesson 4 vs lesson 6")
ax.legend()
plt.show()

w6, w4 = load_weights(REPO / RUN / "model.pt"), load_weights(REPO / RUN / "lesson4" / "model.pt")
worst = max(((w6[k] - w4[k]).abs().max() / w4[k].abs().max()).item() for k in w4)
show_table([{"lesson": 4, "steps": m4["steps"], "train_seconds": m4["train_seconds"],
             "samples_per_second": m4["samples_per_second"], "test_accuracy": m4["test_accuracy"]},
            {"lesson": 6, "steps": m6["steps"], "train_seconds": m6["train_seconds"],
             "samples_per_second": m6["samples_per_second"], "test_accuracy": m6["test_accuracy"]}])
print(f"largest weight difference: {worst:.1e} of the largest weight")
if not FULL_SIZE:
    assert worst < 1e-5
added, removed = diff_counts("day1/4_mnist_manual_ddp.py", "day1/6_mnist_ddp_pt.py")
md(f"What DDP gives here: the same training run (largest weight difference {worst:.1e}) in {removed - added} "
   f"fewer lines than lesson 4 ({added} added, {removed} removed): no broadcast loop, no gradient all_reduce "
   "to write or to get wrong. Overlap is not what it gives on this model: one bucket leaves nothing to overlap "
   "(a difference in the times above comes from the number of messages: lesson 4 sends one per parameter "
   "tensor). Where the overlap can pay off is shown next.")

# %% [markdown]
# ## Where the overlap can happen: several buckets
#
# Lesson 5's profiler, on the CNN with `--sync ddp`: once with the default buckets (one), once with
# `--bucket-cap-mb 0.01` (several, as drawn above). Its table says how many all_reduces a step makes and how
# much of their time ran while backward was still computing gradients.

# %%
from course.measuring.profiling import comm_summary

PROFILE = ["--quick", "--max-steps", 20] if not FULL_SIZE else []
overlap = {}
for cap in (25, 0.01):
    run_lesson("day1/5_mnist_manual_ddp_profile.py", *PROFILE, *DEVICE, "--model", "cnn", "--sync", "ddp",
               "--bucket-cap-mb", cap, "--run-dir", RUN / f"cnn_{cap}", "--log-dir", RUN / f"cnn_{cap}" / "log",
               nproc=NPROC)
    overlap[cap] = comm_summary(REPO / RUN / f"cnn_{cap}" / "log")  # the table lesson 5 printed, from its traces
show_table([{"--bucket-cap-mb": cap, "all_reduce per step": r["collectives_per_step"],
             "comm ms per step": r["comm_ms_per_step"], "overlap with backward": f"{r['overlap_fraction']:.0%}",
             "step ms": r["step_ms"]} for cap, r in overlap.items()])
one, several = overlap[25], overlap[0.01]
times = (f"{several['step_ms']:.1f} ms against {one['step_ms']:.1f} ms with one bucket (communication "
         f"{several['comm_ms_per_step']:.2f} ms against {one['comm_ms_per_step']:.2f} ms per step)")
md(f"With {several['collectives_per_step']:g} buckets, {several['overlap_fraction']:.0%} of the communication time ran "
   f"while backward was still computing (with one bucket: {one['overlap_fraction']:.0%}). That time is hidden "
   "only if communication and computation do not compete for the same resources: on GPUs, NCCL moves data "
   "over its own links while the GPU computes; on a CPU, gloo's threads share the cores with backward, so "
   + (f"the step need not get faster: here it took {times}, one short profiled run each. " if several["step_ms"] >= one["step_ms"] else
      f"a faster step is no proof of overlap: here it took {times}, one short profiled run each, too few "
      "steps to credit the buckets with the difference. ")
   + "Large models on GPUs are where DDP's buckets and overlap pay off.")

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/6_mnist_ddp_pt.md`](../solutions/6_mnist_ddp_pt.md).
#
# 1. `--bucket-cap-mb 0.005`: small enough to split the MLP (a bucket closes once it holds at least the cap,
#    so any cap up to the 5.7 KB of its three small tensors closes a bucket before the large first-layer
#    weight). You should see exactly the same weights as with the default (largest difference 0): buckets
#    change *when* gradients travel, not what they are.
# 2. `--model cnn` for both lesson 6 and lesson 4 (as in the cell "Run it"). You should see the same
#    weights again, to the last bit on the CPU: DDP and lesson 4's manual all_reduce agree for any model.
#
# Next: [lesson 7](7_mnist_ddp_pt_timing.ipynb) times this run for 1, 2, ... ranks.
