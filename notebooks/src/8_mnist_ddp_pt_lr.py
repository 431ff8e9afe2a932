# %% [markdown]
# # Lesson 8: a larger global batch needs a larger learning rate
#
# Script: [`day1/8_mnist_ddp_pt_lr.py`](../day1/8_mnist_ddp_pt_lr.py).
#
# With W ranks of batch *b*, every step averages the gradients of W*b samples (the **global batch**), and
# an epoch has W times fewer steps. Keep the learning rate of the 1-process run and each step moves the
# weights about as far as one step on *b* samples did: after the same number of samples seen, the W-rank
# model has moved about W times less, and its loss curve **lags behind** the 1-process curve.
#
# The **linear scaling rule** (Goyal et al. 2017, *Accurate, Large Minibatch SGD*) multiplies the learning
# rate by W: one step of lr·W on W*b samples then goes about as far as W steps of lr on *b* samples, as long
# as the gradient changes little over those W steps. Early in training it changes fast, which is why a
# short **warm-up** from lr to lr·W helps at large W (`--warmup-steps`).
#
# The script compares every run with a 1-process reference (lr, batch *b*) **at equal samples seen**, both
# curves smoothed with a moving mean, and prints the largest gap. Started with plain python and `--nproc`,
# it makes the reference itself first.

# %%
from nbhelpers import *

# The one switch. False: --quick (3 epochs of 12 800 samples) with 2 CPU ranks.
# True: full epochs with one rank per GPU of this node.
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick"]
NPROC = full_size_nproc() if FULL_SIZE else 2
# one GPU per rank, or every rank on the CPU (NCCL cannot put two ranks on one GPU)
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
RUN = run_dir("8_mnist_ddp_pt_lr")

# %% [markdown]
# ## The rule, drawn
#
# The learning rate per world size, with a 20-step warm-up (base lr 0.01 for batch 64 per rank).

# %%
draw_lr_schedule(0.01, [1, 2, 4], warmup_steps=20, steps=60)

# %% [markdown]
# ## What changed against lesson 6
#
# Lesson 7 (timing) sits between the two, so the diff against lesson 6 shows this lesson's idea: the scaled
# learning rate and its warm-up, the samples seen per step, and the comparison with the reference curve.

# %%
show_diff("day1/6_mnist_ddp_pt.py", "day1/8_mnist_ddp_pt_lr.py")

# %% [markdown]
# ## Run it: the reference, then `NPROC` ranks with the scaled learning rate

# %%
run_lesson("day1/8_mnist_ddp_pt_lr.py", "--nproc", NPROC, *SIZE, *DEVICE, "--run-dir", RUN)

# %% [markdown]
# ## And the same without scaling
#
# `--no-scale` keeps the base learning rate. This run goes to its own directory, with a copy of the
# reference curve so that the script compares against the same reference instead of making it again (and
# of the scaled run's gap, so that it prints both side by side). It runs under torchrun, which never makes a
# reference itself.

# %%
import shutil

NO_SCALE = run_dir("8_mnist_ddp_pt_lr/no-scale")
for kept in [*(REPO / RUN).glob("reference_ws1_*.csv"), *(REPO / RUN).glob("gaps.json")]:
    shutil.copy(kept, REPO / NO_SCALE)  # the same reference, and the scaled run's gap to compare with
run_lesson("day1/8_mnist_ddp_pt_lr.py", *SIZE, *DEVICE, "--no-scale", "--run-dir", NO_SCALE, nproc=NPROC)

# %% [markdown]
# ## The loss curves at equal samples seen
#
# The x axis is samples seen by all ranks together, not steps: that is the fair comparison, since the
# W-rank runs take W times fewer steps for the same data. Each curve is a moving mean over 2 560 samples.

# %%
import bisect


def smooth(samples, losses, window=2560):
    sums = [0.0]
    for loss in losses:
        sums.append(sums[-1] + loss)
    xs, ys = [], []
    for i, x in enumerate(samples):
        if x >= window:
            lo = bisect.bisect_right(samples, x - window)
            xs.append(x)
            ys.append((sums[i + 1] - sums[lo]) / (i + 1 - lo))
    return xs, ys


reference = read_csv(next((REPO / RUN).glob("reference_ws1_*.csv")))
scaled, unscaled = read_json(RUN / "metrics.json"), read_json(NO_SCALE / "metrics.json")
fig, ax = plt.subplots()
ax.plot(*smooth([int(r["samples_seen"]) for r in reference], [float(r["loss"]) for r in reference]), lw=3,
        alpha=0.5, color="black", label=f"1 process, batch {scaled['batch_size']}, lr {scaled['base_lr']:g}")
for m, style in ((scaled, "-"), (unscaled, "--")):
    ax.plot(*smooth(m["samples_seen_per_step"], m["loss_per_step"]), style,
            label=f"{m['world_size']} ranks x batch {m['batch_size']}, lr {m['lr']:g}"
                  + ("" if m["scaled"] else " (not scaled)"))
ax.set(xlabel="samples seen (all ranks)", ylabel="training loss (moving mean)",
       title="against the 1-process curve at equal samples seen")
ax.legend()
plt.show()
show_table([{"run": "scaled lr" if m["scaled"] else "base lr", "world size": m["world_size"], "lr": m["lr"],
             "max gap to reference": m["deviation"]["max_abs"], "mean |gap|": m["deviation"]["mean_abs"],
             "mean gap (+ = behind)": m["deviation"]["mean"], "test accuracy": m["test_accuracy"]}
            for m in (scaled, unscaled)])
behind_scaled, behind_unscaled = scaled["deviation"]["mean"], unscaled["deviation"]["mean"]
far_scaled, far_unscaled = scaled["deviation"]["mean_abs"], unscaled["deviation"]["mean_abs"]
md(f"On average over the curve, the run with the scaled lr {scaled['lr']:g} is {behind_scaled:+.4f} behind the "
   f"1-process loss and the run with the base lr {unscaled['lr']:g} {behind_unscaled:+.4f} (+ = higher loss, "
   f"behind). " + (f"Measured as the mean |gap| (signed gaps of both signs cancel), the unscaled run's curve is "
                   f"{far_unscaled / far_scaled:.1f}x as far from the 1-process curve as the scaled one's "
                   f"({far_unscaled:.4f} against {far_scaled:.4f}): the ratio the script printed above."
                   if far_scaled > 0 and far_unscaled > far_scaled else
                   "Here the unscaled run is not further from the 1-process curve than the scaled one (mean |gap| "
                   f"{far_unscaled:.4f} against {far_scaled:.4f}): look at the curves."))

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/8_mnist_ddp_pt_lr.md`](../solutions/8_mnist_ddp_pt_lr.md).
#
# 1. `--nproc 4 --no-scale` (with `--quick`, in the same `--run-dir` as a `--nproc 2 --no-scale` run, so
#    that both use one reference). You should see the 4-rank run lag further (a larger "on average ...
#    behind" in its last lines) than the 2-rank run: 4 ranks take 4 times fewer steps of the same length.
# 2. `--nproc 4` with the scaled lr (the default): you should see it stay much closer to the reference than
#    the unscaled 4-rank run: lr x 4 makes up for the 4 times fewer steps.
#
# Next: day 2, [lesson 9](9_torch_dist_multi_node.ipynb): the ranks leave the single machine.
