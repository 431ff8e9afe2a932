# %% [markdown]
# # Lesson 21: pipeline parallel: stages and micro-batches
#
# Script: [`day4/21_pipeline_parallel.py`](../day4/21_pipeline_parallel.py).
#
# Tensor parallelism (lesson 19) cuts every layer and adds the ranks' parts up at every layer: four
# all_reduces of activations per block and step, on the fast links inside a node. A **pipeline** cuts the
# model between layers instead: rank r holds **stage r**, a run of consecutive blocks (stage 0 also the patch
# embedding, the last stage the final norm and the head), and passes its output activations to the next
# stage's rank, and their gradients back: point to point, one tensor per micro-batch and stage boundary.
# Little traffic, so the stages may span nodes.
#
# - **Micro-batches.** With the whole batch at once, only one stage would work at a time. The batch is cut
#   into m micro-batches (`--microbatches`, numbered from 0): while stage 1 computes micro-batch 0, stage 0
#   computes micro-batch 1.
# - **The schedule** (`torch.distributed.pipelining`, `--schedule`) decides the order. **GPipe**: every
#   forward, then every backward; a stage keeps the activations of all m micro-batches until their
#   backward. **1F1B**: after a warm-up of p - r forwards on rank r, it waits for the first backward, then
#   alternates: at most p micro-batches' activations kept, the same waiting time; it needs m >= p. **Interleaved 1F1B**: two
#   stages per rank (rank r holds stages r and r + p, each half the blocks).
# - **The bubble.** The first stage cannot start its first backward before the last stage has done its
#   first forward and backward: with p stages and m micro-batches of equal compute time, each rank waits
#   (p - 1) / (m + p - 1) of a step. `--stage-ms f` adds a fixed compute time to every stage (a sleep: f ms
#   per micro-batch forward, 2f backward), so that the measured waiting can be held against the formula.
# - **The same training.** `loss_fn` is one micro-batch's mean loss, and the schedule divides the summed
#   gradients by m (`scale_grads=True`): the gradient of the batch's mean loss, as one process computes it.
#   The gradient clip adds the squared norms of all stages (one all_reduce).

# %%
from nbhelpers import *

# The one switch. False: 5 steps on 640 samples, 4 and 2 CPU processes. True: the lesson's 2 epochs over the
# whole training set, with 4 and 2 processes on the GPUs of this node.
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick", "--train-samples", "640", "--max-steps", "5"]
P, M = 4, 8  # 4 stages, 8 micro-batches (m = 2p)
WIDTH, DEPTH, HEADS, BATCH = 32, 4, 4, 32
STAGE_MS = 40  # simulated compute per stage and micro-batch: 40 ms forward, 80 ms backward
# the same weights, batches, learning rate and gradient clip (at 0.5) in every run
ARGS = ["--width", str(WIDTH), "--depth", str(DEPTH), "--heads", str(HEADS), "--batch-size", str(BATCH),
        "--precision", "fp32", "--clip-grad-norm", "0.5", "--lr", "0.5", "--seed", "5", "--loader", "memory"]
# one GPU per rank, or every rank on the CPU (NCCL cannot put two ranks on one GPU)
DEVICE = [] if gpu_count() >= P else ["--device", "cpu"]
RUN = run_dir("21_pipeline_parallel")

# %% [markdown]
# ## The plan: which stage holds what
#
# The lesson's worker writes the split (`plan`): consecutive blocks per stage, the embedding on the first, the
# norm and the head on the last; the ViT's definition does not change. Each rank builds only its stages, from
# the ViT's parts drawn one at a time in order under the seed: no rank holds the whole model while training
# (evaluation gathers it, below), and together the stages start from one process's weights. The same split,
# computed here by `pipeline_plan` ([`course/models.py`](../course/models.py)):

# %%
from course.models import pipeline_plan

show_table([{"stage (= rank)": s, "holds": ", ".join(parts)} for s, parts in enumerate(pipeline_plan(DEPTH, P))])
show_table([{"stage": s, "holds": ", ".join(parts), "on rank": s % 2}
            for s, parts in enumerate(pipeline_plan(DEPTH, 4))][:4])
md(f"The second table is interleaved 1F1B on 2 ranks: 4 stages of one block, rank 0 holds stages 0 and 2, "
   f"rank 1 stages 1 and 3.")

# %% [markdown]
# ## What changed against lesson 19
#
# The tensor-parallel mesh and plan are gone, and with them lesson 19's measurement of the collectives:
# each rank builds only its stages (the split, written in the worker), wraps each in torch's `PipelineStage`
# (around the stage, two marks that time its chunks: `StageBook.wrap`, plain autograd functions and gradient
# hooks) and runs the schedule's
# `step` instead of the forward and backward calls: stage 0 gets the images, the last stage the labels, and
# it returns the logits. As in lesson 19 every rank takes the same batches. The gradient clip adds the
# stages' squared norms; every rank gathers the stages' weights to evaluate the whole model.

# %%
show_diff("day4/19_tensor_parallel.py", "day4/21_pipeline_parallel.py")

# %%
show_tagged("day4/21_pipeline_parallel.py")

# %% [markdown]
# ## Run GPipe and 1F1B on 4 stages, and one process
#
# The same model, batches and simulated stage time under both schedules, with the lesson's own launcher;
# then lesson 18 on one process with the same batch of 32.

# %%
for schedule in ("gpipe", "1f1b"):
    run_lesson("day4/21_pipeline_parallel.py", *SIZE, *DEVICE, *ARGS, "--schedule", schedule, "--microbatches",
               str(M), "--stage-ms", str(STAGE_MS), "--nproc", str(P), "--run-dir", RUN / schedule)
run_lesson("day4/18_hardware_limits.py", *SIZE, *DEVICE, *ARGS, "--sizes-mib", "0.25", "--run-dir", RUN / "one",
           nproc=1)

# %% [markdown]
# ## The same training

# %%
import torch

from course.training.output import load_weights

LABELS = {"gpipe": f"GPipe, {P} stages, {M} micro-batches", "1f1b": f"1F1B, {P} stages, {M} micro-batches",
          "one": "one process (lesson 18)"}
m = {k: read_json(RUN / k / "metrics.json") for k in LABELS}
flat = {k: torch.cat([v.flatten() for _, v in sorted(load_weights(REPO / RUN / k / "model.pt").items())])
        for k in LABELS}
rows = []
for k in ("gpipe", "1f1b"):
    rows.append({"run": LABELS[k],
                 "largest loss difference (relative)": max(abs(a - b) / abs(b) for a, b in
                                                           zip(m[k]["loss_per_step"], m["one"]["loss_per_step"])),
                 "weights' difference (relative)": ((flat[k] - flat["one"]).norm() / flat["one"].norm()).item(),
                 "test accuracy": f"{m[k]['test_accuracy']:.4f}"})
show_table(rows, floatfmt="{:.2g}")
worst = max(r["weights' difference (relative)"] for r in rows)
md(f"One process reached test accuracy {m['one']['test_accuracy']:.4f} after {m['one']['steps']} steps. "
   + ("Both schedules train what it trains: their weights differ from its by at most "
      f"{worst:.1e} (relative), float32 rounding: the micro-batches' gradients are added up one by one and "
      "divided by m, where one process takes the mean over the whole batch at once." if worst < 1e-5 else
      f"The weights differ by up to {worst:.1e} (relative): more than the rounding of a few steps."))

# %% [markdown]
# ## The bubble, measured
#
# Each rank adds up the seconds its stages computed (each forward and backward chunk, timed between the marks
# around the stage) and the seconds the schedule's `step` took; what is left is waiting. Step 1 is not timed (it also sends a
# forward and backward pass through the stages to learn the activations' shapes), nor step 3 (its memory is
# measured, and tracking every tensor slows the compute down); the table shows rank 0's median timed step.

# %%
bubbles = []
for k in ("gpipe", "1f1b"):
    b = m[k]["pipeline"]
    bubbles.append({"run": LABELS[k], "timed steps": b["timed_steps"], "step ms": b["seconds"] * 1e3,
                    "rank 0 computed ms": b["busy_seconds"] * 1e3, "of which simulated ms": b["simulated_seconds"] * 1e3,
                    "bubble measured": b["measured"], "formula (p-1)/(m+p-1)": b["formula"],
                    "measured / formula": b["measured"] / b["formula"]})
show_table(bubbles, floatfmt="{:.4g}")
g, o = bubbles
real = g["rank 0 computed ms"] - g["of which simulated ms"]
md(f"Of the {g['step ms']:.0f} ms a GPipe step took, rank 0 computed {g['rank 0 computed ms']:.0f} ms: "
   f"{g['of which simulated ms']:.0f} ms simulated ({M} micro-batches x 3 x {STAGE_MS} ms) and {real:.0f} ms "
   f"of real compute; it waited the rest, **{g['bubble measured']:.3f}** of the step, against "
   f"{g['formula (p-1)/(m+p-1)']:.3f} = {P - 1}/{M + P - 1} by the formula ({g['measured / formula']:.2f}x). "
   f"1F1B waited {o['bubble measured']:.3f} ({o['measured / formula']:.2f}x): the same bubble, in another "
   f"order. What the formula leaves out counts as waiting here: the sends, the schedule's own Python, and "
   f"stages that are not quite equal (the last one also computes the loss, outside its chunks).")

# %% [markdown]
# ## The two schedules, drawn from the run
#
# Every forward (F) and backward (B) chunk of the last step, on every rank, as the lesson recorded them
# (`metrics.json`, "timeline"); the number is the micro-batch.

# %%
fig, axes = plt.subplots(2, 1, figsize=(11, 4.5), sharex=True)
for ax, k in zip(axes, ("gpipe", "1f1b")):
    for rank, stage, kind, mb, start, end in m[k]["timeline"]:
        ax.barh(rank, (end - start) * 1e3, left=start * 1e3, color="tab:blue" if kind == "F" else "tab:orange",
                edgecolor="white")
        ax.text((start + end) / 2 * 1e3, rank, f"{kind}{mb}", ha="center", va="center", fontsize=7)
    ax.set(ylabel="rank", title=LABELS[k], yticks=range(P))
    ax.invert_yaxis()
axes[-1].set_xlabel("ms from the step's first chunk")
plt.tight_layout()
plt.show()
first_b = {k: min(s[4] for s in m[k]["timeline"] if s[0] == 0 and s[2] == "B") * 1e3 for k in ("gpipe", "1f1b")}
md(f"Rank 0 waits, in both, after its forwards until the first backward comes back from the last stage "
   f"({first_b['gpipe']:.0f} ms into the GPipe step, {first_b['1f1b']:.0f} ms into the 1F1B step), and the "
   f"ranks further down start later and end earlier. GPipe runs all {M} forwards first; 1F1B runs {P} - r "
   f"forwards on rank r, then alternates a backward and a forward, so a stage never holds more than {P} "
   f"micro-batches' activations.")

# %% [markdown]
# ## What 1F1B saves: memory

# %%
from course.measuring.memory import MB

mem = {k: m[k]["memory"] for k in ("gpipe", "1f1b")}
show_table([{"run": LABELS[k], "rank 0 held before step 3 MB": mem[k]["held_before_bytes"] / MB,
             "most above that during it MB": mem[k]["peak_above_bytes"] / MB, "peak MB": mem[k]["peak_bytes"] / MB}
            for k in mem], floatfmt="{:.3f}")
ratio = mem["1f1b"]["peak_above_bytes"] / mem["gpipe"]["peak_above_bytes"]
md(f"Rank 0 (stage 0) measured its live tensors during step 3: above what it held before the step, 1F1B "
   f"needed {ratio:.2f}x of GPipe's. GPipe keeps the activations of all {M} micro-batches for their "
   f"backward, 1F1B at most {P} at a time; what it held before the step (parameters, momentum, the batch, "
   f"torch's buffers for the gradients it receives) is the same in both.")

# %% [markdown]
# ## Interleaving: two stages per rank
#
# On 2 ranks with 4 micro-batches: 1F1B with 2 stages of 2 blocks, against interleaved 1F1B with 4 stages of
# one block (rank 0 holds stages 0 and 2). Each rank computes the same number of blocks (two; rank 0 now
# blocks 0 and 2 instead of 0 and 1); the simulated time of each stage is halved, so each rank's compute
# stays the same.

# %%
for schedule in ("1f1b", "interleaved-1f1b"):
    run_lesson("day4/21_pipeline_parallel.py", *SIZE, *DEVICE, *ARGS, "--schedule", schedule, "--microbatches", "4",
               "--stage-ms", str(STAGE_MS), "--nproc", "2", "--run-dir", RUN / f"{schedule}-p2")
two = {k: read_json(RUN / f"{k}-p2" / "metrics.json") for k in ("1f1b", "interleaved-1f1b")}
show_table([{"schedule": k, "stages": two[k]["pipeline"]["stages"], "bubble measured": two[k]["pipeline"]["measured"],
             "formula": two[k]["pipeline"]["formula"], "weights' difference from one process": (
                 (torch.cat([v.flatten() for _, v in sorted(load_weights(REPO / RUN / f"{k}-p2" / "model.pt").items())])
                  - flat["one"]).norm() / flat["one"].norm()).item()} for k in two], floatfmt="{:.3g}")
b1, bi = two["1f1b"]["pipeline"], two["interleaved-1f1b"]["pipeline"]
md(f"The formula for interleaving v = 2 stages per rank is (p - 1) / (2m + p - 1) = 1/9 = {bi['formula']:.3f}, "
   f"against 1/5 = {b1['formula']:.3f}. Measured: {bi['measured']:.3f} against {b1['measured']:.3f}"
   + (": smaller, " if bi["measured"] < b1["measured"] else ": not smaller here, ")
   + f"{bi['measured'] / bi['formula']:.2f}x its formula, where 1F1B was {b1['measured'] / b1['formula']:.2f}x. Each "
   f"chunk now computes half as long, while its sends and the schedule's own work per chunk stay the same: "
   f"per unit of compute, what the formula leaves out is twice as much.")

# %% [markdown]
# torch 2.14.1 also ships three schedules that split the backward: `ScheduleInterleavedZeroBubble`,
# `ScheduleZBVZeroBubble` and `ScheduleDualPipeV`. Each backward becomes the input's gradient (which the stage
# before waits for) and the weights' gradient (which nobody waits for), and the latter fill the bubble. The lesson does not
# run them: its simulated backward is one piece, and its marks cannot see the weights' half, which torch assigns
# to `.grad` itself; the [model-parallel guide](../docs/learners/model-parallel.md#pipelines-stages-micro-batches-and-the-bubble-lesson-21)
# says more.

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/21_pipeline_parallel.md`](../solutions/21_pipeline_parallel.md).
#
# 1. The bubble against m: on 2 ranks (`--depth 2`: one block per stage) with `--stage-ms 40` and
#    `--batch-size 64`, run GPipe with `--microbatches 1, 2, 4, 8`. The measured bubble follows
#    (p - 1) / (m + p - 1), whose values fall from 1/2 to 1/9, and ends a little above it at large m (the sends
#    and the schedule's Python between the chunks count as waiting); but every micro-batch here computes a fixed 120 ms whatever
#    its size, so the step grows with m, by about 120 ms per micro-batch. With real compute a smaller
#    micro-batch computes less: there more micro-batches shorten the step, until their fixed costs win.
# 2. What 1F1B saves: the same runs with `--schedule 1f1b` at `--microbatches 2` and `8`, against GPipe's:
#    stage 0's measured peak above what it held before the step. GPipe keeps the whole batch's activations
#    whatever m is; 1F1B those of at most 2 micro-batches: at m = 2 the same, at m = 8 far less.
# 3. `--schedule 1f1b --microbatches 2 --nproc 4`: the lesson stops before any rank starts, with one line
#    giving 1F1B's rule.
#
# Back to the [course map](../README.md#course-map).
