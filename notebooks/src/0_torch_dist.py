# %% [markdown]
# # Lesson 0: processes, ranks, a process group, one `all_reduce`
#
# Script: [`day1/0_torch_dist.py`](../day1/0_torch_dist.py). Everything later in the course is built on the
# four words in the title, so this notebook takes them one at a time.
#
# - A **process** is one running Python program. Data-parallel training starts *N copies of the same
#   script*, usually one per GPU.
# - Each copy gets a **rank**, a number from 0 to N-1, and learns the **world size** N. The code is the same
#   in every copy; the rank is what makes them behave differently (rank 0 writes the files, rank r reads the
#   r-th shard of the data, ...).
# - `dist.init_process_group(...)` makes them a **process group**: every rank connects to rank 0, which
#   listens at `MASTER_ADDR:MASTER_PORT`. The call returns once all N have arrived; if one never comes, the
#   others wait until `--timeout`.
# - A **collective** such as `all_reduce` takes one tensor from every rank, combines them (here: the sum),
#   and gives every rank the result. Averaging gradients in lesson 4 is exactly this call.
#
# In the script, rank r holds the number r + 1; after `all_reduce(SUM)` each rank divides by N and holds the
# mean of 1..N.
#
# Run this notebook from top to bottom (JupyterLab: *Run > Run All Cells*). It starts the real script as a
# separate program, the same way you would in a terminal. (The notebooks hide a few lines PyTorch prints on
# some machines that say nothing about the lesson, such as torchrun's banner about `OMP_NUM_THREADS` or,
# in the profiling lessons, `gpuGetDeviceCount failed` on a machine without a GPU: `NOISE` in
# [`nbhelpers.py`](nbhelpers.py) lists them. In a terminal you will see them; they are harmless.)

# %%
from nbhelpers import *

# The one switch. False: a laptop-sized run (2 processes on the CPU, seconds).
# True: the script's own default of 4 processes (lesson 0 runs on the CPU either way).
FULL_SIZE = False
NPROC = 4 if FULL_SIZE else 2

# %% [markdown]
# ## The picture
#
# Before: every rank holds its own value. `all_reduce(SUM)` is one call made by every rank at the same time;
# after it returns, every rank holds the same sum.

# %%
draw_allreduce([r + 1 for r in range(NPROC)])

# %% [markdown]
# ## What is new
#
# This is the first lesson, so there is no previous script to compare with. The distributed lines of every
# lesson carry a tag comment (`# DDP:` for what makes training data-parallel, `# DIST:` for the other
# torch.distributed lines); here are the ones of lesson 0 (later notebooks show the diff against the lesson
# before).

# %%
show_tagged("day1/0_torch_dist.py")

# %% [markdown]
# ## Where ranks come from: two processes started by hand
#
# A rank is not magic. A launcher starts N ordinary processes and tells each one four things in its
# environment: `RANK` (who am I), `WORLD_SIZE` (how many of us), `MASTER_ADDR` and `MASTER_PORT` (where rank
# 0 listens; every process goes there to meet the others). `init_process_group` reads them. Here are two
# plain Python processes, started with those variables by this notebook, without any launcher (the course's
# scripts also want `LOCAL_RANK`, the rank within one machine; it picks the GPU in lesson 1).

# %%
import os
import socket
import subprocess
import sys

with socket.socket() as s:  # a free port on this machine for rank 0 to listen on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
by_hand = []
for rank in range(2):
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    print(f"starting: RANK={rank} WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={port} python day1/0_torch_dist.py")
    by_hand.append(subprocess.Popen([sys.executable, "day1/0_torch_dist.py"], cwd=REPO, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
for rank, proc in enumerate(by_hand):
    text = proc.communicate(timeout=300)[0]
    print(f"\n--- what process {rank} printed (exit code {proc.returncode}):\n{text}", end="")
    if proc.returncode:  # a failed process fails the cell
        raise subprocess.CalledProcessError(proc.returncode, f"RANK={rank} python day1/0_torch_dist.py", text)

# %% [markdown]
# Each process printed only its own lines, and both got the same mean: they met at rank 0's port and
# all_reduced. Start only one of the two and it would wait at `init_process_group` for the other (until
# `--timeout`). Everything below starts processes the same way; the launchers just save you the typing.

# %% [markdown]
# ## Run it: the script starts its own processes
#
# `python day1/0_torch_dist.py --nproc 2` spawns the processes itself (`torch.multiprocessing`), picks a
# free port for rank 0 and gives each process its rank. `run_lesson` runs that command from the repository
# root, shows its output here, and fails the cell if the script fails.

# %%
out = run_lesson("day1/0_torch_dist.py", "--nproc", NPROC)

# %% [markdown]
# ## The same script under torchrun
#
# On a cluster you usually let a launcher start the processes: `torchrun` (or Slurm's `srun`, day 2). The
# launcher sets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` in each process's
# environment, and the script reads them instead of spawning. This is what `run_lesson(..., nproc=2)`
# does, written out with `subprocess.run(..., check=True)` so that you can see it: `check=True` turns a
# failed run into an exception, which fails the cell. (A bare `!torchrun ...` would not: a failing `!`
# command does not fail its cell, and `torchrun` may not even be on the notebook's PATH.)

# %%
result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                         f"--nproc_per_node={NPROC}", "day1/0_torch_dist.py"],
                        cwd=REPO, check=True, capture_output=True, text=True)
print(result.stdout)

# %% [markdown]
# ## Read the result
#
# Each rank printed its value before and its mean after. Collect them from both runs' output and plot them:
# different values before, one value after, on every rank and with either launcher.

# %%
import re


def before_after(text):
    before = {int(r): float(v) for r, v in re.findall(r"\[rank (\d+)\] of \d+: my value is ([\d.]+)", text)}
    after = {int(r): float(v) for r, v in re.findall(r"\[rank (\d+)\] all_reduce\(SUM\) = [\d.]+, mean = ([\d.]+)",
                                                     text)}
    return before, after


fig, axes = plt.subplots(1, 2, figsize=(9, 3), sharey=True)
for ax, (name, text) in zip(axes, [("own launcher (--nproc)", out), ("torchrun", result.stdout)]):
    before, after = before_after(text)
    ranks = sorted(before)
    ax.bar([r - 0.2 for r in ranks], [before[r] for r in ranks], width=0.4, label="value before")
    ax.bar([r + 0.2 for r in ranks], [after[r] for r in ranks], width=0.4, label="mean after all_reduce")
    ax.set(xticks=ranks, xlabel="rank", title=name)
    assert len(set(after.values())) == 1 and len(after) == NPROC  # every rank got the same mean
axes[0].legend()
plt.show()
print(f"mean of 1..{NPROC} = {(NPROC + 1) / 2:g}, on every rank")

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/0_torch_dist.md`](../solutions/0_torch_dist.md).
#
# 1. Start more processes than you have cores: `run_lesson("day1/0_torch_dist.py", "--nproc", 8)`. You
#    should see 8 ranks, each printing its value 1..8, and every rank ending with `all_reduce(SUM) = 36,
#    mean = 4.5`: ranks are processes, not cores (they just share the CPU).
# 2. Start only one of the two processes of "started by hand" above, with `--timeout 10` after the script
#    name. You should see it wait, then stop after about 10 s with an error naming the timeout (a non-zero
#    exit): a rank waits for the others at `init_process_group`, and the same holds for every collective.
#    Collectives must be called by *all* ranks, in the same order: this is the most common cause of hangs.
# 3. In a terminal: `torchrun --nproc_per_node=4 day1/0_torch_dist.py`. You should see 4 ranks and
#    `mean = 2.5` on each.
#
# Next: [lesson 1](1_torch_dist_gpu.ipynb) does the same on GPUs with NCCL.
