# %% [markdown]
# # Lesson 12: surviving time limits, preemption and crashed ranks
#
# Script: [`day2/12_ddp_fault_tolerance.py`](../day2/12_ddp_fault_tolerance.py).
#
# Jobs end before training does: a time limit, preemption by a more important job, a crashed rank or node.
# Four things make a run that can stop after any step and go on later as if nothing had happened:
#
# 1. **A checkpoint** every `--checkpoint-every` steps and at the end: the model, the optimizer (its
#    momentum is part of the training state), the position (epoch and batch within it), and every rank's
#    random-number state. Global rank 0 writes it to a temporary file, flushes it to the disk and renames it:
#    a crash while writing leaves the previous checkpoint, never half a new one. Its sha256 goes beside it
#    (`step-NNNNNNNNN.pt.sha256`, the format `sha256sum -c` reads): `torch.load` checks no checksum, so a
#    file with bytes flipped by a failing disk would load without a word; rank 0 checks the digest first and
#    skips a damaged checkpoint with one line naming it.
# 2. **A clean stop on request.** `SIGTERM` (scancel, the end of the time limit) and `SIGUSR1` (what
#    `sbatch --signal=B:USR1@120` sends 120 s before the limit) only set a flag: the signal handler may run in
#    the middle of a collective, where no checkpoint can be written. After every step the flag is combined
#    across ranks with an all_reduce, so **all ranks stop after the same step**, even when the signal reached
#    only one of them. Then a checkpoint, and exit 0.
# 3. **Requeue and resume**: the Slurm launcher (`slurm/12_ddp_fault_tolerance.sh`) passes the signal on,
#    waits for the checkpoint and runs `scontrol requeue`; the same command, started again, finds the newest
#    checkpoint and resumes.
# 4. **Restarts**: under `torchrun --max-restarts=N` a crashed rank makes the agent restart all ranks, which
#    resume from the newest checkpoint.
#
# Resumed, the run *is* the run that was never interrupted, bit for bit on the CPU: same data order, same
# weights, same losses. This notebook shows it: it stops a run with a signal, resumes it, and compares it
# with a run that was never stopped.
#
# ## On a cluster
#
# ```bash
# slurm/submit.sh 12_ddp_fault_tolerance --site <your site> -- --epochs 20   # requeued at the time limit
# ```

# %%
from nbhelpers import *

# The one switch. False: --quick, 2 pretend nodes x 2 CPU ranks on this machine.
# True: full epochs, 2 pretend nodes x (GPUs / 2) ranks (bit-for-bit equality is then not guaranteed: GPU
# kernels are not all deterministic).
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick"]
PER_NODE = max(1, gpu_count() // 2) if FULL_SIZE else 2
# a GPU per rank (each pretend node gets GPUs of its own), or every rank on the CPU
DEVICE = [] if gpu_count() >= 2 * PER_NODE else ["--device", "cpu"]
RUN = run_dir("12_ddp_fault_tolerance")

# %% [markdown]
# ## What changed against lesson 10
#
# The training step is lesson 10's; around it: the stop flag, all_reduced with the step's loss; a checkpoint
# every `--checkpoint-every` steps and at the stop or the end, written by rank 0 with every rank's random
# state; and the resume at the right batch of the right epoch, which is why the batches come from
# `batches()` over the sampler's order instead of lesson 10's DataLoader. Lesson 10's placement report,
# per-node line and launcher check are gone (`--nproc` works). The bookkeeping is `course/checkpoints/files.py`'s:
# deterministic kernels, the directory's lock (two runs never share it) and the pid lines (`prepare`); the
# position and the records (`new_state`, `after_step`, `record_stop`, `end_epoch`); `save` and `restore`;
# and the closing `report`.

# %%
show_diff("day2/10_mnist_ddp_pt_multinode.py", "day2/12_ddp_fault_tolerance.py")

# %% [markdown]
# ## Run 1: stopped by a signal
#
# Each rank prints its process id. When rank 0 reports step 40, the notebook sends `SIGUSR1` to **the first
# rank of node 1 only**, as a scheduler might reach one node before the other. All ranks stop after the
# same step,
# rank 0 writes a checkpoint, and the run exits with 0. (`--step-sleep` slows the steps down a little so that
# the signal lands mid-run; `--checkpoint-every 25` also checkpoints along the way.)

# %%
import os
import re
import signal

pids, sent = {}, []


def stop_node_1(line):
    if m := re.match(r"\[rank (\d+)\] pid (\d+)", line):
        pids[int(m.group(1))] = int(m.group(2))
    if not sent and re.match(r"\[rank 0\] step 40 ", line):
        os.kill(pids[PER_NODE], signal.SIGUSR1)  # global rank PER_NODE: local rank 0 of node 1
        sent.append(40)


ARGS = [*SIZE, *DEVICE, "--checkpoint-every", 25, "--log-every", 10, "--step-sleep", 0.02]
run_lesson("day2/12_ddp_fault_tolerance.py", *ARGS, "--run-dir", RUN, nproc=PER_NODE, nnodes=2,
           on_output=stop_node_1)
print(f"\nSIGUSR1 sent to rank {PER_NODE} (pid {pids[PER_NODE]}) when rank 0 reported step {sent[0]}")
print("checkpoints now:", sorted(p.name for p in (REPO / RUN / "checkpoints").glob("step-*.pt")))

# %% [markdown]
# ## Run 2: the same command again
#
# It finds the newest checkpoint, resumes at the batch after the stop, and trains to the end.

# %%
run_lesson("day2/12_ddp_fault_tolerance.py", *ARGS, "--run-dir", RUN, nproc=PER_NODE, nnodes=2)

# %% [markdown]
# ## Run 3: never interrupted, for comparison
#
# The same world size on one pretend node (`torchrun --standalone`): lesson 10 showed that the placement of
# the ranks does not change the training.

# %%
REFERENCE = run_dir("12_ddp_fault_tolerance/uninterrupted")
run_lesson("day2/12_ddp_fault_tolerance.py", *ARGS, "--run-dir", REFERENCE, nproc=2 * PER_NODE)

# %% [markdown]
# ## Stopped and resumed = never stopped
#
# The loss of every step of the stopped-and-resumed run against the uninterrupted one, and the final
# weights.

# %%
from course.training.output import load_weights

resumed, reference = read_json(RUN / "metrics.json"), read_json(REFERENCE / "metrics.json")
fig, ax = plt.subplots()
steps = range(1, len(reference["loss_per_step"]) + 1)  # step 1 is the first step's loss
ax.plot(steps, reference["loss_per_step"], lw=4, alpha=0.4, label="never stopped")
ax.plot(range(1, len(resumed["loss_per_step"]) + 1), resumed["loss_per_step"], lw=1, label="stopped, then resumed")
for stop in resumed["stops"]:
    ax.axvline(stop["step"] + 0.5, color="crimson", ls="--")  # after the stop's step, before the next
    ax.text(stop["step"], ax.get_ylim()[1], f" stop: {', '.join(stop['signals'].values())} to rank "
            f"{', '.join(map(str, stop['signals']))}\n after step {stop['step']}; resumed from its checkpoint", va="top", fontsize=8,
            color="crimson")
ax.set(xlabel="step", ylabel="training loss (mean over ranks)", title="one training run, in two jobs")
ax.legend(loc="center right")
plt.show()
w1, w2 = load_weights(REPO / RUN / "model.pt"), load_weights(REPO / REFERENCE / "model.pt")
same = all((w1[k] == w2[k]).all() for k in w1)
print(f"stops: {resumed['stops']}; resumed at steps {resumed['resumed_at']}")
print(f"losses identical: {resumed['loss_per_step'] == reference['loss_per_step']}; weights identical: {same}")
if not FULL_SIZE:
    assert same and resumed["loss_per_step"] == reference["loss_per_step"] and resumed["resumed_at"]

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/12_ddp_fault_tolerance.md`](../solutions/12_ddp_fault_tolerance.md).
#
# 1. In a terminal: `python day2/12_ddp_fault_tolerance.py --nproc 2 --quick --step-sleep 0.05 --run-dir
#    runs/t12`, then `kill -USR1 <a pid it printed>` from another terminal while it trains, then the same
#    command again. You should see the first run end with exit code 0 after a stop and a checkpoint, and the
#    second print that it resumes from that checkpoint and train to step 100.
# 2. `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=3
#    day2/12_ddp_fault_tolerance.py --quick --step-sleep 0.05 --checkpoint-every 25 --run-dir runs/t12b` and
#    `kill -9` one rank's pid while it trains. You should see the agent report the failed worker and restart
#    both ranks, which resume from the newest checkpoint and finish (exit code 0). The variable gives the
#    restarted ranks a fresh store (without it, restarts can fail with `Connection refused`; see the
#    script's docstring).
#
# Next: day 3, [lesson 13](13_mixed_precision.ipynb): mixed precision.
