# %% [markdown]
# # Lesson 3: N copies of lesson 2 are not data parallelism
#
# Script: [`day1/3_mnist_distributed.py`](../day1/3_mnist_distributed.py).
#
# The first thing most people try: start the training script on N processes (N GPUs) and expect it to be N
# times faster. It is not. With the same seed, every process
#
# - draws the **same initial weights**,
# - shuffles the data into the **same order**,
# - takes the **same steps** on the same batches,
# - and ends with the **same model**.
#
# N copies of one result for N times the electricity; on a shared machine they compete for the same cores.
# The process group is used only at the very end, to compare notes (`all_gather_object`): which weights,
# which data order, how long. Lesson 4 makes the ranks cooperate instead.

# %%
from nbhelpers import *

# The one switch. False: --quick on 2 CPU processes (seconds). True: full epochs, one process per GPU.
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick"]
NPROC = full_size_nproc() if FULL_SIZE else 2
# one GPU per rank, or every rank on the CPU (NCCL cannot put two ranks on one GPU)
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
RUN = run_dir("3_mnist_distributed")

# %% [markdown]
# ## The picture
#
# Every rank walks through every batch of the epoch, in the same order.

# %%
draw_replicas(NPROC)

# %% [markdown]
# ## What changed against lesson 2
#
# The training loop is lesson 2's. Around it: the process group, a device per rank, and at the end a
# fingerprint of the weights and of the data order, gathered from every rank.

# %%
show_diff("day1/2_mnist_training.py", "day1/3_mnist_distributed.py")

# %% [markdown]
# ## Run it
#
# The script starts its own `NPROC` processes here (`--nproc`); under torchrun or srun it would take the
# ranks the launcher gives it.

# %%
out = run_lesson("day1/3_mnist_distributed.py", *SIZE, *DEVICE, "--nproc", NPROC, "--run-dir", RUN)

# %% [markdown]
# ## Read the result
#
# Rank 0 gathered every rank's notes into `metrics.json`: the fingerprints are identical.

# %%
m = read_json(RUN / "metrics.json")
show_table(m["ranks"], ["rank", "weights", "data_order", "steps", "train_seconds"])
print(f"identical weights: {m['identical_weights']}, identical data order: {m['identical_data_order']}")
assert m["identical_weights"] and m["identical_data_order"]

# %% [markdown]
# ## The cost: N times the work for one model
#
# The same run with a single process, for comparison. The `NPROC` ranks above share this machine's cores;
# the single process has them all (timings also move with whatever else runs on the machine). The useful
# result is one model either way.

# %%
run_lesson("day1/3_mnist_distributed.py", *SIZE, *DEVICE, "--nproc", 1, "--run-dir", RUN / "nproc1")
seconds = {1: [r["train_seconds"] for r in read_json(RUN / "nproc1" / "metrics.json")["ranks"]],
           NPROC: [r["train_seconds"] for r in m["ranks"]]}

fig, axes = plt.subplots(1, 2, figsize=(9, 3))
for i, n in enumerate(seconds):
    axes[0].bar([f"{n} proc.\nrank {r}" for r in range(n)], seconds[n], color=RANK_COLORS[i])
axes[0].set(ylabel="seconds", title="training time of each rank")
axes[1].bar([str(n) for n in seconds], [n * m["steps"] for n in seconds], label="steps computed")
axes[1].bar([str(n) for n in seconds], [m["steps"]] * len(seconds), label="steps that mattered")
axes[1].set(xlabel="processes", ylabel="steps", title="work done vs. work that mattered")
axes[1].legend()
fig.tight_layout()
plt.show()

import os

from course.launching.devices import usable_cpus
from course.training.output import load_weights

single = read_json(RUN / "nproc1" / "metrics.json")
slowest, alone = max(seconds[NPROC]), seconds[1][0]
ranks_w, single_w = load_weights(REPO / RUN / "model.pt"), load_weights(REPO / RUN / "nproc1" / "model.pt")
diff = max((ranks_w[k] - single_w[k]).abs().max().item() for k in ranks_w)
largest = max(w.abs().max().item() for w in ranks_w.values())
threads = {n: int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, usable_cpus() // n)
           for n in seconds}  # what course/launching/devices.py gives each rank
md(f"Here the slowest of the {NPROC} ranks trained for {slowest:.2f} s and the single process for {alone:.2f} s "
   f"({slowest / alone:.1f}x as long): {NPROC} x {m['steps']} steps computed, {m['steps']} of them useful. "
   + (f"Per step of {m['batch_size']} samples, each of {NPROC} processes x {threads[NPROC]} thread(s) took "
      f"{slowest / m['steps'] * 1000:.2f} ms against {alone / m['steps'] * 1000:.2f} ms for 1 process x "
      f"{threads[1]} thread(s): together {NPROC * alone / slowest:.2f}x the work of one process in the same time, "
      f"from the same cores. Lesson 7 measures this split again, on a step's work without the gradients' "
      f"all_reduce (its 'splitting the cores into ranks'). " if DEVICE else "")
   + ("The single process ended with exactly the ranks' weights." if diff == 0 else
      f"The single process's weights differ from the ranks' by at most {diff:.1e} (the largest weight is "
      f"{largest:.2f}; "
      + (f"the same test accuracy, {m['test_accuracy']:.4f}" if single["test_accuracy"] == m["test_accuracy"] else
         f"test accuracy {single['test_accuracy']:.4f} against the ranks' {m['test_accuracy']:.4f}")
      + f"): it ran on more threads, which add up the same numbers in a different order. Each step's results "
        f"differ in their last bits, and {m['steps']} steps of training carry those differences on and can "
        f"grow them."))

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/3_mnist_distributed.md`](../solutions/3_mnist_distributed.md).
#
# 1. Give each rank a different seed: in a copy of the script, build the model with `args.seed + rank`
#    instead of `args.seed`. You should see `identical weights on all 2 ranks: False; identical data order:
#    True`: N *different* models, each still trained on the whole dataset alone (an ensemble, not data
#    parallelism), and the data order unchanged because the shuffle has its own seed.
#
# Next: [lesson 4](4_mnist_manual_ddp.ipynb) splits the data across the ranks and averages their gradients.
