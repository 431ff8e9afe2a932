# %% [markdown]
# # Lesson 7: timing DDP at several world sizes: what scales and what does not
#
# Script: [`day1/7_mnist_ddp_pt_timing.py`](../day1/7_mnist_ddp_pt_timing.py).
#
# "I used 4 GPUs and it got slower" is one of the most common questions about data parallelism. A
# data-parallel training step, on each of W ranks, has three parts:
#
# - **compute**: forward and backward on *b* samples per rank (and the `zero_grad` before), *c_W* ms;
# - **communication not overlapped**: what the gradient all_reduce adds to backward (the part DDP could not
#   hide behind it, waiting for the slowest rank included), *m_W* ms;
# - **fixed costs**: the rest of a step (the next batch and the optimizer's step), *f_W* ms.
#
# $$s_W = c_W + m_W + f_W$$
#
# W ranks process W*b samples per step in s_W ms; one process processes b samples in s_1 ms. So
#
# $$\text{speed-up} = \frac{W \, s_1}{s_W}$$
#
# Before training, the script times each part on its own, a few times, and keeps the medians: forward +
# backward inside DDP's `no_sync()` (compute alone), the same with the all_reduce (the difference is m_W),
# and the rest of a step with a twin of the optimizer whose learning rate is 0 (the same work, the weights
# stay as they are). After training it compares the parts with the step the training measured, and the
# predicted speed-up with the measured one.
#
# On a GPU node every rank brings its own GPU, c_W and f_W stay c_1 and f_1, and only communication stands
# between you and a speed-up of W. On one CPU the ranks share the same cores, so more ranks add no cores: at
# best they use the cores better than one process's threads do. And a small model (the MLP: a 0.4 MB
# all_reduce after very little compute per step; the tables below have this machine's milliseconds) has
# too little work per step to hide its communication.
#
# `--sweep` runs world sizes 1, 2, ..., N one after another; every run adds a row to `timings.csv`, and
# rank 0 rewrites the table (`scaling.md`, `scaling.csv`) and the plot (`scaling.png`).

# %%
from nbhelpers import *

# The one switch. False: --quick sweeps of 1 and 2 CPU ranks. True: full epochs, 1 .. all GPUs of this node.
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick", "--probe-steps", 10]
NPROC = full_size_nproc() if FULL_SIZE else 2
# one GPU per rank, or every rank on the CPU (NCCL cannot put two ranks on one GPU)
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
RUN = run_dir("7_mnist_ddp_pt_timing")

# %% [markdown]
# ## What changed against lesson 6
#
# Lesson 6's training, with clocks around it (and `torch.cuda.synchronize()` before reading them on a GPU,
# where work is asynchronous), the probe that times the parts of a step, the CPU time other programs took
# during training, and the table kept across runs.

# %%
show_diff("day1/6_mnist_ddp_pt.py", "day1/7_mnist_ddp_pt_timing.py")

# %% [markdown]
# ## Run two sweeps
#
# The MLP at the default batch of 64 per rank, and the CNN at batch 512 per rank: much more compute per
# step for fewer bytes to all_reduce (the CNN's 44 426 parameters make 0.18 MB of gradients, the MLP's
# 101 770 make 0.41 MB). The script explains each world size's result with the
# formula above: the parts, how much of the training's step they account for, and the prediction.

# %%
run_lesson("day1/7_mnist_ddp_pt_timing.py", NPROC, "--sweep", "--fresh", *SIZE, *DEVICE, "--run-dir", RUN)
run_lesson("day1/7_mnist_ddp_pt_timing.py", NPROC, "--sweep", *SIZE, *DEVICE, "--model", "cnn",
           "--batch-size", 512, "--run-dir", RUN)

# %% [markdown]
# ## The timing table
#
# `scaling.csv`: the latest run of each world size, per model and batch size, with its speed-up over 1 rank
# and that speed-up's noise (from the spread of the speeds of blocks of steps in both runs), the speed-up
# the parts predict, the parts (ms per step, timed before training), their sum, the step the training
# measured, and how many cores other programs kept busy during training.

# %%
table = read_csv(RUN / "scaling.csv")
show_table(table, ["model", "batch_per_rank", "world_size", "threads_per_rank", "samples_per_second", "speedup",
                   "speedup_noise", "predicted", "compute_ms", "comm_ms", "fixed_ms", "parts_ms", "step_ms",
                   "median_step_ms", "other_cores"])
for r in table:  # keep a record of these rows (the same configuration runs in other notebooks too)
    record_result("day1/7_mnist_ddp_pt_timing.py", lesson="7_mnist_ddp_pt_timing", model=r["model"],
                  batch_per_rank=int(r["batch_per_rank"]), world_size=int(r["world_size"]), device=r["device"],
                  threads_per_rank=int(r["threads_per_rank"]), samples=int(r["samples"]),
                  train_seconds=float(r["train_seconds"]), samples_per_second=float(r["samples_per_second"]),
                  speedup=float(r["speedup"]) if r["speedup"] else None,
                  speedup_noise=float(r["speedup_noise"]) if r.get("speedup_noise") else None,
                  predicted=float(r["predicted"]) if r["predicted"] else None, compute_ms=float(r["compute_ms"]),
                  comm_ms=float(r["comm_ms"]), fixed_ms=float(r["fixed_ms"]), step_ms=float(r["step_ms"]),
                  other_cores=float(r["other_cores"]))

# %% [markdown]
# ## A step's parts against the training's step
#
# Each bar stacks the three parts of a step, timed before training (medians); the black line over it is
# the mean step the training then took (the dotted line: its median step; the mean is what samples/s and
# the speed-up are made of). Where the bars of both world sizes reach their lines, the parts account for
# the steps and the prediction can be trusted; where the communication part is as large as the time the
# ranks save on a step's work (the run's "from splitting the cores into ranks"), more ranks cannot pay off.

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
configs = sorted({(r["model"], r["batch_per_rank"]) for r in table})
for ax, (model, batch) in zip(axes, configs):
    rows = sorted((r for r in table if (r["model"], r["batch_per_rank"]) == (model, batch)),
                  key=lambda r: int(r["world_size"]))
    names = [f"{r['world_size']} rank(s)\nx {r['threads_per_rank']} thr." for r in rows]
    bottom = [0.0] * len(rows)
    for key, label in (("compute_ms", "compute"), ("comm_ms", "communication not overlapped"),
                       ("fixed_ms", "fixed costs")):
        part = [float(r[key]) for r in rows]
        ax.bar(names, part, bottom=bottom, label=label)
        bottom = [b + p for b, p in zip(bottom, part)]
    steps = [float(r["step_ms"]) for r in rows]
    ends = [i - 0.4 for i in range(len(rows))], [i + 0.4 for i in range(len(rows))]
    ax.hlines(steps, *ends, colors="k", label="training: mean step")
    ax.hlines([float(r["median_step_ms"]) for r in rows], *ends, colors="k", linestyles=":",
              label="training: median step")
    for i, r in enumerate(rows):
        if r["speedup"] and int(r["world_size"]) > 1:
            ax.text(i, max(bottom[i], steps[i]), f"{float(r['predicted']):.2f}x predicted\n"
                    f"{float(r['speedup']):.2f}x ± {float(r['speedup_noise'] or 0):.2f} measured",
                    ha="center", va="bottom", fontsize=8)
    ax.set(title=f"{model}, batch {batch} per rank", ylabel="ms per step",
           ylim=(0, 1.3 * max(bottom + steps)))
fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=5, fontsize=8)
fig.suptitle("the parts of a step, timed before training (bars), and the steps the training took (lines)")
fig.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()

# %% [markdown]
# ## Throughput against world size

# %%
fig, ax = plt.subplots(figsize=(6, 3.4))
for model, batch in configs:
    rows = sorted((r for r in table if (r["model"], r["batch_per_rank"]) == (model, batch)),
                  key=lambda r: int(r["world_size"]))
    ax.plot([int(r["world_size"]) for r in rows], [float(r["samples_per_second"]) for r in rows], "o-",
            label=f"{model}, batch {batch}")
ax.set(xlabel="world size (ranks)", ylabel="training samples per second", xticks=range(1, NPROC + 1))
ax.legend()
plt.show()

# %% [markdown]
# ## What the sweeps say, on this machine
#
# A speed-up is a ratio of two noisy runs: it says "more ranks pay off" or "more ranks cost time" only when
# 1.0 lies outside speed-up ± noise.

# %%
lines = []
for model, batch in configs:
    for r in table:
        if (r["model"], r["batch_per_rank"]) == (model, batch) and int(r["world_size"]) > 1 and r["speedup"]:
            s, n = float(r["speedup"]), float(r["speedup_noise"] or 0)
            verdict = ("more ranks pay off" if s - n > 1 else "more ranks cost time" if s + n < 1 else
                       "no measurable difference")
            others = float(r["other_cores"] or 0)
            lines.append(f"- {model}, batch {batch} per rank, {r['world_size']} ranks on {r['device']}: "
                         f"{s:.2f}x ± {n:.2f} against 1.0: **{verdict}** ({float(r['predicted']):.2f}x "
                         f"predicted from parts that add up to {float(r['parts_ms']) / float(r['step_ms']):.0%} "
                         f"of the training's step); communication is {float(r['comm_share']):.0%} of a step"
                         + (f"; other programs kept {others:.2f} cores busy meanwhile, so this says as much "
                            f"about them as about DDP." if others > 0.5 else "."))
md("\n".join(lines))

# %% [markdown]
# See the `threads_per_rank` column for what these ranks had. On a GPU node (`FULL_SIZE = True`) the
# compute and fixed parts should stay flat as ranks are added and the CNN's speed-up should approach W (not
# measured here: run `FULL_SIZE = True` on a GPU node).
# Timings depend on the machine and on whatever else runs on it: rerun the sweep before drawing
# conclusions. A busy machine hurts the 1-rank run most: its threads must run at the same time to make
# progress, and they wait for each other whenever another program holds a core, which makes the 1-rank
# run slower and the speed-up of more ranks look better than it is.
#
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/7_mnist_ddp_pt_timing.md`](../solutions/7_mnist_ddp_pt_timing.md).
#
# 1. `--batch-size 1024` for the MLP (with `--sweep` and the other options of the first run above, and a
#    new `--run-dir`): 16 times the compute per step for the same 0.4 MB all_reduce. You should see a
#    smaller `comm_share` at 2 ranks than at batch 64 (the speed-up tends to move up with it, but
#    `--quick`'s 12 800 samples make only 13 steps of batch 1024 on 1 rank and 7 on each of 2 ranks: it is
#    noisy).
# 2. Under torchrun or srun, each call adds one row: run
#    `torchrun --standalone --nproc_per_node=1 day1/7_mnist_ddp_pt_timing.py --quick --run-dir runs/t7`, then
#    the same with `--nproc_per_node=2`. You should see the table printed after the second call with two
#    rows, 1 and 2 ranks, and a speed-up for 2.
#
# Next: [lesson 8](8_mnist_ddp_pt_lr.ipynb): a larger global batch needs a larger learning rate.
