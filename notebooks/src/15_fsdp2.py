# %% [markdown]
# # Lesson 15: sharding with FSDP2
#
# Script: [`day3/15_fsdp2.py`](../day3/15_fsdp2.py).
#
# Under DDP every rank holds a **full replica**: all parameters, all gradients and all of the optimizer's
# state. Adding ranks makes the batch larger, never the replica smaller: once a model's replica outgrows one
# GPU, DDP cannot train it on any number of GPUs. FSDP2 (`torch.distributed.fsdp.fully_shard`) shards it:
#
# - **`fully_shard` on each transformer block, then on the root**, on an explicit device mesh
#   (`init_device_mesh("cpu", (W,))` with gloo here, `"cuda"` with NCCL on GPUs). Every parameter becomes a
#   **DTensor sharded on dim 0**: rank r stores its rows (`p.to_local()`). Its gradient and its momentum
#   buffer are sharded the same way, because the optimizer only ever sees the shards.
# - **Built on the meta device**: under `torch.device("meta")` the model has shapes but no memory;
#   `fully_shard` shards it, and `model.to_empty(device=...)` allocates this rank's shards alone. No rank ever
#   holds the whole model, which is the point for a model that does not fit one GPU. The shards then get
#   lesson 13's initial weights: every rank makes the model again on the CPU one part at a time (embedding,
#   one block, the next block, ...) under the same seed and keeps only its own rows of each
#   (`course/training/sharded_init.py`). `reset_parameters()` on the shards would not do: each rank would draw its rows
#   from its own random generator, not the rows a whole model gets.
# - **Forward**: before a block runs, its shards are **all_gathered** into whole parameters; after it they
#   are freed again (`reshard_after_forward=True`, ZeRO-3) or kept until backward (`False`, ZeRO-2).
# - **Backward**: each block's gradients are **reduce_scattered**: every rank receives the average of its
#   own rows only, and updates only its own shard.
#
# Same global batches, same weights as lesson 13's DDP, up to float rounding; each rank holds about 1/W of
# the bytes.

# %%
from nbhelpers import *

# The one switch. False: --quick (20 steps, width 64) on 2 CPU processes. True: the lesson's defaults (full
# epochs, width 128), one process per GPU.
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick", "--max-steps", "20", "--width", "64"]
NPROC = full_size_nproc() if FULL_SIZE else 2
# one GPU per rank, or every rank on the CPU (NCCL cannot put two ranks on one GPU)
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
RUN = run_dir("15_fsdp2")

# %% [markdown]
# ## The picture: what a rank holds, before anything runs
#
# The lesson computes, from the model's shapes alone (built on PyTorch's `meta` device, which allocates
# nothing), what rank 0 will hold under DDP and under FSDP2: parameters + gradients + SGD's momentum, 3
# copies of the model in fp32. Its default ViT (width 128, depth 4) against its default budget of 4 MB per
# rank, a stand-in for one GPU's memory:

# %%
import sys

sys.path.insert(0, str(REPO))
from course.measuring.memory import MB, plan
from course.models import ViT

plans = {w: plan(lambda: ViT(7, 128, 4, 4), w) for w in (1, 2, 4, 8)}
show_table([{"ranks": w, "DDP MB per rank": p["ddp"] / MB, "FSDP2 MB per rank": p["fsdp"] / MB,
             "FSDP2 / DDP": p["fsdp"] / p["ddp"], "fits 4 MB under DDP": p["ddp"] <= 4 * MB,
             "fits 4 MB under FSDP2": p["fsdp"] <= 4 * MB} for w, p in plans.items()])
md(f"{plans[1]['parameters']:,} parameters: DDP needs {plans[2]['ddp'] / MB:.2f} MB on every rank whatever "
   f"the number of ranks; FSDP2 needs {plans[2]['fsdp'] / MB:.2f} MB per rank over 2 ranks and "
   f"{plans[4]['fsdp'] / MB:.2f} MB over 4. Rank 0 holds slightly more than 1/W: a parameter whose dim 0 "
   f"does not divide by W gives rank 0 the larger piece (the position embedding's dim 0 is 1: rank 0 holds "
   f"all of it).")

# %% [markdown]
# ## What changed against lesson 13
#
# DDP's wrapper is gone; `init_device_mesh`, a `MixedPrecisionPolicy` and `fully_shard` per block and on the
# root take its place, on a model built on the meta device (`to_empty`, then `init_vit_shards`). The
# policy computes in `--precision` and reduce_scatters the gradients in fp32 unless `--reduce-dtype` says
# otherwise. The GradScaler stays for fp16 and works on shards: each rank checks only its own shards for
# inf/NaN, and torch all_reduces that finding across the ranks, so `--overflow-at` now puts an inf into one
# rank's shard alone and every rank still skips the step. Lesson 13's `--compile` is gone. At the end the
# ranks count their bytes, and `get_model_state_dict` gathers the whole weights one tensor at a time onto
# rank 0's CPU, the only place that needs them (it writes model.pt).

# %%
show_diff("day3/13_mixed_precision.py", "day3/15_fsdp2.py")

# %%
show_tagged("day3/15_fsdp2.py")

# %% [markdown]
# ## Run it: FSDP2 both ways, and lesson 13's DDP on the same batches
#
# Three runs with the same seed, the same data and the same steps, in fp32: FSDP2 with
# `--reshard-after-forward true` (ZeRO-3) and `false` (ZeRO-2), and lesson 13 with `--precision fp32`.
# The quick runs use a ViT of width 64 (a quarter of the default's compute); the bytes scale with it.

# %%
COMMON = [*SIZE, *DEVICE, "--seed", "3"]
runs = {"FSDP2, reshard": ("day3/15_fsdp2.py", ["--reshard-after-forward", "true"], "reshard"),
        "FSDP2, keep": ("day3/15_fsdp2.py", ["--reshard-after-forward", "false"], "keep"),
        "DDP (lesson 13)": ("day3/13_mixed_precision.py", ["--precision", "fp32"], "ddp")}
for name, (script, extra, folder) in runs.items():
    run_lesson(script, *COMMON, *extra, "--run-dir", RUN / folder, nproc=NPROC)

# %%
import torch

dirs = {name: REPO / RUN / folder for name, (_, _, folder) in runs.items()}
m = {name: read_json(d / "metrics.json") for name, d in dirs.items()}
w = {name: torch.load(d / "model.pt", weights_only=True) for name, d in dirs.items()}
flat = {name: torch.cat([v[k].flatten() for k in sorted(v)]) for name, v in w.items()}
fig, ax = plt.subplots()
for name in runs:
    ax.plot(range(1, m[name]["steps"] + 1), m[name]["loss_per_step"], label=name, alpha=0.7)
ax.set(xlabel="step", ylabel="training loss (mean over ranks)", title=f"ViT, {m['DDP (lesson 13)']['world_size']} ranks")
ax.legend()
plt.show()
ref = flat["DDP (lesson 13)"]
diff = {name: ((flat[name] - ref).norm() / ref.norm()).item() for name in runs if name.startswith("FSDP2")}
same = torch.equal(flat["FSDP2, reshard"], flat["FSDP2, keep"])
md(f"After {m['DDP (lesson 13)']['steps']} steps the FSDP2 weights differ from DDP's by "
   f"{diff['FSDP2, reshard']:.1e} (relative, the whole weight vector): float32 rounding, because some sums "
   f"run in another order (the gradient clip's norm, for one: over each rank's shards, then across the "
   f"ranks). The two FSDP2 runs are "
   + ("**bit for bit the same**: keeping the gathered parameters changes where they live, not the arithmetic."
      if same else f"{((flat['FSDP2, reshard'] - flat['FSDP2, keep']).norm() / ref.norm()).item():.1e} apart."))

# %% [markdown]
# ## What each rank holds
#
# Each rank counts its own bytes from the tensors (`p.to_local()` for a DTensor) after training; lesson 13's
# DDP ranks hold the whole model.

# %%
rows = []
for name in ("FSDP2, reshard", "FSDP2, keep"):
    for rank, r in enumerate(m[name]["per_rank_bytes"]):
        rows.append({"run": name, "rank": rank, "parameters MB": r["parameters"] / MB,
                     "gradients MB": r["gradients"] / MB, "momentum MB": r["optimizer_state"] / MB,
                     "total MB": r["total"] / MB, "held forward->backward MB": r["after_forward"] / MB})
show_table(rows)
p = m["FSDP2, reshard"]["planned"]
fullest = max(r["total"] for r in m["FSDP2, reshard"]["per_rank_bytes"])
keep = m["FSDP2, keep"]["per_rank_bytes"][0]["after_forward"]
free = m["FSDP2, reshard"]["per_rank_bytes"][0]["after_forward"]
t = {name: m[name]["train_seconds"] for name in runs}
fast = min(t["FSDP2, reshard"], t["FSDP2, keep"]) / t["DDP (lesson 13)"]
md(f"The fullest rank holds {fullest / MB:.2f} MB, **{fullest / p['ddp']:.3f}** of DDP's {p['ddp'] / MB:.2f} MB "
   f"(1/{len(m['FSDP2, reshard']['per_rank_bytes'])} would be "
   f"{1 / len(m['FSDP2, reshard']['per_rank_bytes']):.3f}), "
   + ("exactly the plan made before the run. " if fullest == p["fsdp"] else
      f"against {p['fsdp'] / MB:.2f} MB planned before the run. ")
   + f"Between forward and backward a rank keeps {keep / MB:.2f} MB of parameters gathered with "
   f"`--reshard-after-forward false` and {free / MB:.2f} MB with `true` (the root's whole parameters plus "
   f"the blocks' shards). Resharding costs a second all_gather of every block in backward: the runs took "
   f"{t['FSDP2, reshard']:.1f} s (reshard), {t['FSDP2, keep']:.1f} s (keep) and {t['DDP (lesson 13)']:.1f} s "
   f"(DDP) for the same steps and the test-set evaluation"
   + ("." if t["FSDP2, reshard"] > t["FSDP2, keep"] else
      ": here resharding was not the slower one, so the difference is smaller than this machine's noise "
      "from run to run (one run each, other programs sharing the cores).")
   + f" The faster FSDP2 run took {fast:.2f}x DDP's time"
   + (": DDP sends one all_reduce of the gradients, FSDP2 an all_gather and a reduce_scatter per block, in "
      "more and smaller messages." if fast > 1.1 else
      ", within this machine's noise; per step FSDP2 still sends more and smaller messages than DDP (an "
      "all_gather and a reduce_scatter per block against one all_reduce), which the benchmark measures with "
      "repeats."))

# %% [markdown]
# ## Measured: the peak of a step
#
# Counting the state is not the whole story: a step also holds activations, gathered blocks and the
# collectives' buffers. Every rank of lessons 13 and 15 measures its third step (course/measuring/memory.py's
# `StepPeak`: `torch.cuda.max_memory_allocated` on a GPU, the live tensors on the CPU) and prints what it
# held as the step's forward began and the most it held during the step. Rank 0's numbers from the runs
# above, and from two more runs of a model whose state dominates, a ViT of width 256 and depth 8 with a
# batch of 2 per rank:

# %%
BIG = ["--quick", "--max-steps", "3", "--width", "256", "--depth", "8", "--batch-size", "2", *DEVICE, "--seed", "3"]
big = {"DDP (lesson 13), w256 d8": ("day3/13_mixed_precision.py", ["--precision", "fp32"], "big-ddp"),
       "FSDP2, reshard, w256 d8": ("day3/15_fsdp2.py", ["--memory-budget-mb", "0"], "big-fsdp")}
for name, (script, extra, folder) in big.items():
    run_lesson(script, *BIG, *extra, "--run-dir", RUN / folder, nproc=NPROC)
    m[name] = read_json(REPO / RUN / folder / "metrics.json")
show_table([{"run": name, "MB held as step 3 began": m[name]["memory"]["held_before_bytes"] / MB,
             "MB most above that": m[name]["memory"]["peak_above_bytes"] / MB,
             "MB peak": m[name]["memory"]["peak_bytes"] / MB, "seconds": m[name]["train_seconds"]}
            for name in [*runs, *big]])
peak = {name: m[name]["memory"]["peak_bytes"] for name in m}
small = peak["FSDP2, reshard"] / peak["DDP (lesson 13)"]
large = peak["FSDP2, reshard, w256 d8"] / peak["DDP (lesson 13), w256 d8"]
cost = m["FSDP2, reshard, w256 d8"]["train_seconds"] / m["DDP (lesson 13), w256 d8"]["train_seconds"]
md(f"Measured ({m['DDP (lesson 13)']['memory']['how']}): at width 64 FSDP2's peak was {small:.2f}x DDP's, "
   + ("hardly less: the activations of the batch, which sharding does not divide, make most of it. "
      if small > 0.8 else "less, though the activations of the batch are not divided. ")
   + f"With the state dominating (width 256, depth 8, batch 2) FSDP2's peak on rank 0 was "
   f"{peak['FSDP2, reshard, w256 d8'] / MB:.1f} MB against DDP's {peak['DDP (lesson 13), w256 d8'] / MB:.1f} MB: "
   f"**{large:.2f}x** over {NPROC} ranks (1/{NPROC} would be {1 / NPROC:.2f}). DDP began the step holding "
   f"parameters, gradients, momentum and its gradient bucket (four copies of the model); FSDP2 its shards "
   f"of three, and during the step it added the gathered blocks and whole gradients waiting for their "
   f"reduce_scatter ({m['FSDP2, reshard, w256 d8']['memory']['peak_above_bytes'] / MB:.1f} MB), which do not "
   f"shrink with more ranks. The cost: the FSDP2 run took {cost:.2f}x DDP's time for the same 3 steps and "
   f"the evaluation.")

# %% [markdown]
# On a GPU node the gathered parameters are the largest part of the activations' peak for big models, and
# ZeRO-2 trades that memory for one fewer all_gather per block; on this CPU the collectives run over
# loopback between processes that share the cores, so the times say more about this machine than about
# FSDP2 (the [benchmark](../benchmarks/README.md) measures them at 2 and 4 ranks).
#
# ## A budget DDP cannot meet
#
# The lesson's default model (width 128) on one rank: FSDP2 over 1 rank holds everything, as DDP does, and
# the lesson stops before any rank starts.

# %%
import subprocess

try:
    run_lesson("day3/15_fsdp2.py", "--quick", *DEVICE, "--nproc", "1", "--run-dir", RUN / "one")
except subprocess.CalledProcessError as e:
    said = [line for line in e.output.splitlines() if "error:" in line][-1]
    md(f"Exit code {e.returncode}, one line: `{said.split('error: ', 1)[1]}`")

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/15_fsdp2.md`](../solutions/15_fsdp2.md).
#
# 1. `--nproc 4 --memory-budget-mb 2`: the fullest rank holds 1.56 MB, 0.253 of DDP's 6.18 MB, within the
#    budget; `--nproc 2 --memory-budget-mb 2` stops before any rank starts, with one line: FSDP2 over 2
#    ranks needs 3.10 MB.
# 2. `--width 64 --precision bf16 --max-steps 10` next to the same with `--precision fp32`: the parameters,
#    gradients and momentum a rank holds are the same bytes (the shards stay fp32; only what is gathered is
#    bf16: the root's parameters kept after forward shrink from 0.274 to 0.265 MB), and the loss of every
#    step is within 0.01 of fp32's.
# 3. In a copy of the script, replace the SGD line with `optimizer = torch.optim.AdamW(model.parameters(),
#    lr=1e-3)`: each rank's optimizer state doubles (two moments per parameter), the fullest rank holds 4.13
#    MB, over the 4 MB budget that the check before the run (which counts SGD's one state per parameter)
#    let through, and DDP's replica would be 8.24 MB.
# 4. In a copy of the script, accumulate 4 micro-batches per step with
#    `model.set_requires_gradient_sync(i == 3)` before each one's forward and the loss divided by 4 (the
#    solution shows the five lines), and run it with `--batch-size 64` next to the lesson with the same
#    batches in one piece: the same weights up to float rounding, with each block's gradients
#    reduce_scattered once per step instead of 4 times; between micro-batches every rank holds whole
#    gradients again.
#
# Next: [lesson 16](16_distributed_checkpoint.ipynb): distributed checkpoints.
