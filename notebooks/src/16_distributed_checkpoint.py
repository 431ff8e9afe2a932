# %% [markdown]
# # Lesson 16: distributed checkpoints
#
# Script: [`day3/16_distributed_checkpoint.py`](../day3/16_distributed_checkpoint.py).
#
# Lesson 12's checkpoint is one file: rank 0 writes the whole model and optimizer with `torch.save`, every
# rank loads all of it. That works while every rank holds the whole model (DDP). Under FSDP2 (lesson 15) no
# rank does: writing one file means gathering the whole model onto rank 0 first (the memory sharding
# saved) and one process writing every byte while the others wait. **torch.distributed.checkpoint** (DCP)
# saves the shards where they are:
#
# - **save**: `get_state_dict(model, optimizer)` gives this rank's shards (DTensors) keyed by parameter
#   name; `dcp.save` writes each rank's shards to a file of its own, all ranks at once, and rank 0 writes a
#   `.metadata` file last: which rows of which tensor are in which file;
# - **load at any world size**: `dcp.load` reads the rows each rank's shards need from whichever files hold
#   them: a checkpoint saved by 4 ranks resumes on 2, and the other way round;
# - **published atomically**: the lesson writes every checkpoint into a temporary directory and renames it
#   into place once every rank has finished, with `complete.json` (every file's size and sha256, each rank
#   having hashed the file it wrote) written last; a torn or unfinished checkpoint is skipped, never loaded;
# - **verified before use**: at a resume each rank hashes its share of the files and compares with
#   `complete.json`; one `all_reduce` tells every rank, before any rank loads, whether all are intact (bytes
#   flipped in place keep the sizes, and `torch.load` checks no checksum);
# - **asynchronous**: `dcp.async_save` copies ("stages") the shards to CPU memory and returns; `dcp.save`
#   itself, its planning collectives included, then runs in a background thread (or, with
#   `--async-save process`, a background process per rank) while training goes on;
# - **one file for inference**: in one process, without a process group, `dcp.load` assembles whole tensors
#   from all ranks' files.

# %%
from nbhelpers import *

# The one switch. False: a small ViT (width 32, depth 2), 12 steps, on CPU processes. True: the lesson's
# default ViT (width 128, depth 4) for 200 steps, one process per GPU where there are enough.
FULL_SIZE = False
STEPS = 200 if FULL_SIZE else 12
HALF, EVERY = STEPS // 2, STEPS // 6  # the first run's checkpoint, and how often the resumed runs save
WIDTH, DEPTH, HEADS = (128, 4, 4) if FULL_SIZE else (32, 2, 2)
SIZE = ["--epochs", "1", "--max-steps", str(STEPS), "--width", str(WIDTH), "--depth", str(DEPTH), "--heads", str(HEADS)]
if not FULL_SIZE:
    SIZE += ["--train-samples", "1280"]
COMMON = [*SIZE, "--seed", "5", "--lr", "0.5", "--clip-grad-norm", "0.5", "--loader", "memory"]
GLOBAL_BATCH = 64  # the same global batches at every world size: 4 ranks x 16, 2 ranks x 32
DEVICE = {w: [] if gpu_count() >= w else ["--device", "cpu"] for w in (2, 4)}
RUN = run_dir("16_distributed_checkpoint")


def lesson_args(world_size, run, *extra):
    return [*COMMON, *DEVICE[world_size], "--batch-size", str(GLOBAL_BATCH // world_size), "--run-dir", run, *extra]

# %% [markdown]
# ## What changed against lesson 15
#
# The training loop is lesson 15's. New: before training, rank 0 lists the complete checkpoints, every rank
# hashes its share of the newest one's files, one `all_reduce` gives every rank the verdict, and every rank
# loads its rows of the newest intact one; in the loop, a save every `--checkpoint-every` steps and one at the end;
# the loop skips the batches a resumed epoch has already trained on. The file plumbing (temporary
# directories, the digests, `complete.json`, skipping damaged ones, the export) is in
# [`course/checkpoints/dcp.py`](../course/checkpoints/dcp.py).

# %%
show_diff("day3/15_fsdp2.py", "day3/16_distributed_checkpoint.py")

# %% [markdown]
# ## Save at 4 ranks
#
# The uninterrupted run: 4 ranks train all the steps, with a checkpoint half way and one at the end.

# %%
import torch

A = RUN / "w4"
run_lesson("day3/16_distributed_checkpoint.py", *lesson_args(4, A, "--checkpoint-every", HALF), nproc=4)
half = REPO / A / "checkpoints" / f"step-{HALF:09d}"
files = sorted(half.iterdir())
show_table([{"file": f.name, "bytes": f.stat().st_size} for f in files])
shards = [f.stat().st_size for f in files if f.suffix == ".distcp"]
held = [r["parameters"] + r["optimizer_state"] for r in read_json(REPO / A / "metrics.json")["per_rank_bytes"]]
tensors = len(torch.load(REPO / A / "model.pt", weights_only=True))
extra = sum(shards) / len(shards) - sum(held) / len(held)
md(f"One `.distcp` file per rank, each written by its own rank at the same time: {min(shards):,} to "
   f"{max(shards):,} bytes, for the {min(held):,} to {max(held):,} bytes of weights and momentum each rank "
   f"holds. The difference, {extra / 1000:.0f} kB per file, is a fixed cost per tensor: DCP writes each of "
   f"the rank's {2 * tensors} tensors (weights and momentum) with a header of its own. With this small ViT that "
   f"is most of the file; with the lesson's default model (width 128, depth 4) each file is about a quarter of "
   f"the whole state plus the headers of its tensors (about twice as many). `.metadata` says where every row is; `complete.json`, written "
   f"last, lists every file with its size and sha256, and records the sha256 of its own content.")

# %% [markdown]
# ## Resume at 2 ranks, past a torn checkpoint
#
# A copy of the half-way checkpoint in a new directory, as if the run had stopped there. Beside it, two
# damaged ones that must never be loaded: the final checkpoint with one rank's file cut short (a copy that
# ran out of disk), and a temporary directory that was never published (a save killed half way). Then 2
# ranks resume with `--resume`, twice the batch per rank (the same global batch), saving asynchronously.

# %%
import shutil


def resume_dir(name):
    d = REPO / RUN / name
    shutil.copytree(half, d / half.name)
    return d


torn_dir = resume_dir("ckpt-torn")
final = REPO / A / "checkpoints" / f"step-{STEPS:09d}"
shutil.copytree(final, torn_dir / final.name)
shard = torn_dir / final.name / "__1_0.distcp"
shard.write_bytes(shard.read_bytes()[:1000])
(torn_dir / f".step-{STEPS + 1:09d}.123.tmp").mkdir()
B = RUN / "w2-async"
out_b = run_lesson("day3/16_distributed_checkpoint.py", *lesson_args(
    2, B, "--resume", "--async-save", "--checkpoint-every", EVERY, "--checkpoint-dir", torn_dir), nproc=2)
skipped = [line.split("] ", 1)[1] for line in out_b.splitlines() if "skipping" in line]
md("What rank 0 said before loading:\n\n" + "\n".join(f"- `{line.replace(str(REPO) + '/', '')}`" for line in skipped))

# %% [markdown]
# The same checkpoint once more, resumed by 2 ranks with ordinary, synchronous saves at the same steps: the
# comparison of the two kinds of save below.

# %%
C = RUN / "w2-sync"
run_lesson("day3/16_distributed_checkpoint.py", *lesson_args(
    2, C, "--resume", "--checkpoint-every", EVERY, "--checkpoint-dir", resume_dir("ckpt-sync")), nproc=2)

# %%
dirs = {"4 ranks, uninterrupted": A, "2 ranks, resumed (async saves)": B, "2 ranks, resumed (sync saves)": C}
m = {name: read_json(REPO / d / "metrics.json") for name, d in dirs.items()}
w = {name: torch.load(REPO / d / "model.pt", weights_only=True) for name, d in dirs.items()}
flat = {name: torch.cat([v[k].flatten() for k in sorted(v)]) for name, v in w.items()}
ref = flat["4 ranks, uninterrupted"]
fig, ax = plt.subplots()
for name, r in m.items():
    ax.plot(range(r["first_step"] + 1, r["steps"] + 1), r["loss_per_step"], label=name, alpha=0.7,
            marker="o" if r["first_step"] else None, markersize=3)
ax.axvline(HALF + 0.5, color="grey", lw=0.8)
ax.set(xlabel="step", ylabel="training loss (mean over ranks)", title=f"global batch {GLOBAL_BATCH}")
ax.legend()
plt.show()
rel = ((flat["2 ranks, resumed (async saves)"] - ref).norm() / ref.norm()).item()
gap = max(abs(a - b) for a, b in zip(m["2 ranks, resumed (async saves)"]["loss_per_step"],
                                     m["4 ranks, uninterrupted"]["loss_per_step"][HALF:]))
same = torch.equal(flat["2 ranks, resumed (async saves)"], flat["2 ranks, resumed (sync saves)"])
rb = m["2 ranks, resumed (async saves)"]
md(f"Saved by 4 ranks at step {HALF}, resumed by {rb['world_size']} to step {rb['steps']}: the weights differ "
   f"from the uninterrupted 4-rank run's by **{rel:.1e}** (relative, the whole weight vector), the loss of "
   f"each resumed step by at most {gap:.1e}. Not bit for bit: 2 ranks add the gradients and the clip's norm "
   f"in another order than 4, and float32 sums round differently in another order. The two resumed runs, "
   f"same world size, are " + ("**bit for bit the same**: the kind of save changes when the bytes reach the "
                               "disk, not the training." if same else "not the same."))

# %% [markdown]
# ## What a save costs the training loop
#
# The lesson measures, for every save, how long the training loop waited: for `dcp.save` the whole write;
# for `dcp.async_save` (torch 2.14.1) the call itself, which copies ("stages") the shards to CPU memory and
# returns (the copy timed on its own in the lesson's `Writer.stage`), plus any wait for the previous save
# still being written. The coordination between the ranks
# (which rank writes what) is not part of the call: it runs with the rest of `dcp.save` in the background
# thread, as the writes do.

# %%
rows = []
for name in ("2 ranks, resumed (sync saves)", "2 ranks, resumed (async saves)"):
    r = m[name]
    for path, s in zip(r["checkpoints"], r["save_stall_seconds"]):
        rows.append({"run": name, "checkpoint": path.rsplit("/", 1)[1], "loop waited ms": 1000 * s})
show_table(rows)
stall = {name: m[name]["save_stall_seconds"] for name in list(dirs)[2:0:-1]}  # sync, then async
sync, asyn = stall["2 ranks, resumed (sync saves)"], stall["2 ranks, resumed (async saves)"]
ratio = (sum(asyn) / len(asyn)) / (sum(sync) / len(sync))
per_step = {k: m[k]["train_seconds"] / (m[k]["steps"] - m[k]["first_step"]) for k in stall}
slower = per_step["2 ranks, resumed (async saves)"] / per_step["2 ranks, resumed (sync saves)"]
md(f"Per save the loop waited {1000 * sum(sync) / len(sync):.0f} ms with `dcp.save` "
   f"({1000 * min(sync):.0f} to {1000 * max(sync):.0f}) and {1000 * sum(asyn) / len(asyn):.0f} ms with "
   f"`dcp.async_save` ({1000 * min(asyn):.0f} to {1000 * max(asyn):.0f}): **{ratio:.2f}x** (1.0: no gain). "
   + ("Every asynchronous save waited less than every synchronous one. " if max(asyn) < min(sync) else
      "The two ranges overlap: with three saves each, the difference is within what this machine varies "
      "from save to save. ")
   + f"Of the asynchronous saves' wait, {1000 * sum(rb['save_copy_seconds']) / len(asyn):.0f} ms per save "
   f"went to the copy to CPU memory inside `async_save`, "
   f"{1000 * (sum(rb['save_call_seconds']) - sum(rb['save_copy_seconds'])) / len(asyn):.0f} ms to the rest of "
   f"`get_state_dict` and the call, and {1000 * sum(rb['save_wait_seconds']) / len(asyn):.0f} ms to waiting "
   f"for the previous save. This "
   f"checkpoint is small ({sum(f.stat().st_size for f in sorted((REPO / RUN / 'ckpt-sync').glob('step-*'))[-1].glob('__*.distcp')) / 1e6:.2f} MB over both ranks' files) and this machine has 2 CPU "
   f"cores: the background thread, which plans with the other ranks, writes and hashes, competes with "
   f"training for the same cores and for Python's interpreter lock. The resumed runs took "
   f"{per_step['2 ranks, resumed (sync saves)']:.2f} s per step with `dcp.save` and "
   f"{per_step['2 ranks, resumed (async saves)']:.2f} s with `dcp.async_save`, saves and the evaluation "
   f"included"
   + (f": with asynchronous saves the run was {slower:.1f}x slower per step, because the writes still "
      f"happen, on the same 2 cores, and the run waits for the last one before it ends. " if slower > 1.05
      else f" ({slower:.2f}x). ")
   + "On GPU nodes with a checkpoint of many GB the write itself dominates: `async_save` takes it off the "
   "training loop, which then waits only for the copy from GPU to CPU memory. `--async-save process` moves "
   "the save into a process of its own per rank (no shared interpreter lock), at the price of starting it at "
   "the first save and of a second copy, into shared memory, to hand the state over (the "
   "[benchmark](../benchmarks/README.md) measures every kind of save on this machine).")

# %% [markdown]
# ## One ordinary file for inference
#
# `--export PATH` runs in one process, without a process group: `dcp.load(..., no_dist=True)` reads the
# shards of every rank that saved and assembles whole tensors into the plain ViT's state dict, saved with
# `torch.save`. Anyone can then load it with `torch.load(PATH, weights_only=True)`, which refuses anything
# but tensors and plain containers (no code runs while loading).

# %%
exported = REPO / RUN / "model-export.pt"
run_lesson("day3/16_distributed_checkpoint.py", "--export", exported, "--checkpoint-dir", torn_dir)
from course.models import ViT
from data_tools.datasets import InMemoryMNIST

state = torch.load(exported, weights_only=True)
trained = torch.load(REPO / B / "model.pt", weights_only=True)
test_set = InMemoryMNIST(rb["dataset"], "test", None, torch.device("cpu"))
predictions = []
for weights in (state, trained):
    model = ViT(7, WIDTH, DEPTH, HEADS)
    model.load_state_dict(weights)
    with torch.no_grad():
        predictions.append(model.eval()(test_set.images).argmax(1))
agree = (predictions[0] == predictions[1]).float().mean().item()
identical = all(torch.equal(state[k], trained[k]) for k in trained)
md(f"The exported file holds {len(state)} tensors, "
   f"{sum(v.numel() * v.element_size() for v in state.values()) / 2 ** 20:.3f} MB of weights (a "
   f"{exported.stat().st_size / 1e6:.2f} MB file with torch.save's headers); they are "
   + ("bit for bit the weights the resumed run gathered at its end. " if identical else "not the run's weights. ")
   + f"One process with that file predicts the same class as the run's own model for {agree:.2%} of the "
   f"{len(test_set.labels):,} test images (test accuracy {(predictions[0] == test_set.labels).float().mean():.4f}, "
   f"the run's {rb['test_accuracy']:.4f}). "
   f"`torch.distributed.checkpoint.format_utils.dcp_to_torch_save` does the same for the whole checkpoint, "
   f"optimizer included.")

# %% [markdown]
# ## Bad input: one line
#
# A world size that does not divide the global batch the checkpoint was trained with: the lesson stops
# before any rank starts.

# %%
import subprocess

try:
    run_lesson("day3/16_distributed_checkpoint.py", *COMMON, "--max-steps", 2 * STEPS, "--nproc", "3",
               "--batch-size", "21", "--resume", "--checkpoint-dir", REPO / A / "checkpoints", "--run-dir", RUN / "w3")
    raise RuntimeError("the lesson should have stopped before any rank started")
except subprocess.CalledProcessError as e:
    said = [line for line in e.output.splitlines() if "error:" in line][-1]
    md(f"Exit code {e.returncode}, one line: `{said.split('error: ', 1)[1].replace(str(REPO) + '/', '')}`")

# %% [markdown]
# ## When lesson 12's checkpoint is enough, and when it is not
#
# | | lesson 12: rank 0, `torch.save` | lesson 16: every rank, DCP |
# |---|---|---|
# | who holds the whole model | every rank (DDP) | no rank (FSDP2, or any sharding) |
# | memory to save | what rank 0 already holds | each rank its own shards |
# | writers | one process, every byte | every rank at once, 1/W each |
# | resume at another world size | possible (every rank loads all); lesson 12 keeps W to resume bit for bit | yes: `dcp.load` reshards |
# | file | one ordinary file | a directory, one file per rank; `--export` makes one file |
#
# Keep lesson 12's way while every rank holds the whole model and one file of it writes in seconds: it is
# simpler, and one ordinary file is what inference wants anyway. Move to sharded checkpoints once the
# model is sharded (gathering it onto rank 0 needs the memory sharding saved, and may not fit), or once
# one writer takes long: a checkpoint of many GB written by one process stalls every rank, and a
# parallel file system writes from many nodes at once much faster than from one.

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print:
# [`solutions/16_distributed_checkpoint.md`](../solutions/16_distributed_checkpoint.md).
#
# 1. Save with 2 ranks (`--nproc 2 --batch-size 32 --max-steps 6 --checkpoint-every 3`, the small ViT of
#    this notebook), copy its step-3 checkpoint into a new directory and resume it in **one** process:
#    `--nproc 1 --batch-size 64 --resume --checkpoint-dir` that directory. You should see `resumed from ...
#    (saved by 2 ranks): step 3`, `steps 4 to 6 (3 steps)`, and final weights that differ from the 2-rank
#    run's only by float rounding (a relative difference of the order of 1e-8).
# 2. Delete `complete.json` from the newest checkpoint in that directory (the one-process run's step 6) and
#    resume again with `--max-steps 9`. You should see that checkpoint skipped (`no complete.json: never
#    finished`), the run resume from step 3, train steps 4 to 9 and publish its own checkpoints.
# 3. Run exercise 2's resume command a second time, unchanged. You should see one line, `nothing to train:
#    ... is at step 9 ...`, and exit code 0: a job submitted again after it finished does no harm.
#
# Next: [lesson 17](17_debugging_hangs.ipynb): debugging a hung or mismatched job.
