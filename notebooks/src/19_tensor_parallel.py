# %% [markdown]
# # Lesson 19: tensor parallelism
#
# Script: [`day4/19_tensor_parallel.py`](../day4/19_tensor_parallel.py).
#
# DDP and FSDP2 split the **batch**: every rank computes the whole model on its share of the samples.
# Tensor parallelism (TP) splits the **layers**: each of T ranks holds 1/T of every attention and MLP
# matrix, computes 1/T of each layer's output for the whole batch, and the ranks add their partial results
# up with all_reduces inside the forward and backward passes. All ranks take the same batches, so T ranks
# train what one process with that batch trains, up to float32 rounding.
#
# - **A device mesh of T ranks in a row named "tp"** (`init_device_mesh`) and **`parallelize_module`** on
#   each transformer block with a plan written in the lesson's worker: `qkv` and `mlp.0`
#   **column-wise** (rank r keeps the r-th piece of their output features: for qkv, whole heads; they need no
#   communication), `proj` and `mlp.2` **row-wise** (the matching input features; their output is a partial
#   sum, all_reduced). This pairing is Megatron-LM's: one all_reduce per pair in forward, one in backward.
# - The parameters the plan cuts become **DTensors**: `p.to_local()` is this rank's piece, `p.placements`
#   says how it was cut (`Shard(0)`: rows, `Shard(1)`: columns, `Replicate()`: whole). The embedding, the
#   layer norms and the classifier stay plain tensors, whole on every rank.
# - **`clip_grad_norm_`** refuses a mix of DTensors and plain tensors; under `implicit_replication()` it
#   takes the plain ones as whole (replicated) DTensors and computes the norm one process would.
# - **Counting the collectives**: torch's `CommDebugMode` records every collective DTensor issues; the
#   lesson counts step 1's (with a `CommDebugMode` that also keeps each call's group and tensor) and prices
#   them where they run: each sent again on the mesh's "tp" group (`mesh.get_group("tp")`) with the tensor
#   the step sent, timed, times the calls per step; and it says whether that group spans nodes.

# %%
from nbhelpers import *

# The one switch. False: 20 steps on 640 samples, 2 CPU processes. True: the lesson's 2 epochs over the
# whole training set, one process per GPU.
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick", "--train-samples", "640", "--max-steps", "20"]
NPROC = full_size_nproc() if FULL_SIZE else 2
HEADS = 4 if 4 % NPROC == 0 else NPROC  # every rank computes whole heads: T must divide --heads
WIDTH, DEPTH, BATCH = 16 * HEADS, 4, 32
# the same weights, batches, learning rate and gradient clip (at a norm of 0.5) in every run
ARGS = ["--width", str(WIDTH), "--depth", str(DEPTH), "--heads", str(HEADS), "--batch-size", str(BATCH),
        "--precision", "fp32", "--clip-grad-norm", "0.5", "--lr", "0.5", "--seed", "5", "--loader", "memory"]
# one GPU per rank, or every rank on the CPU (NCCL cannot put two ranks on one GPU)
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
RUN = run_dir("19_tensor_parallel")

# %% [markdown]
# ## The picture: what each rank keeps of a block
#
# The plan applied to one block of this notebook's ViT, read from the model's shapes before anything runs
# (`nn.Linear` stores its weight as output features x input features).

# %%
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from course.models import ViT

# the lesson's plan, as its worker writes it
plan = {"qkv": ColwiseParallel(), "proj": RowwiseParallel(), "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
block = ViT(7, WIDTH, DEPTH, HEADS).blocks[0]
rows = []
for name, style in plan.items():
    out_features, in_features = block.get_submodule(name).weight.shape
    column = type(style).__name__ == "ColwiseParallel"
    rows.append({"layer": name, "plan": type(style).__name__, "weight, whole": f"{out_features} x {in_features}",
                 f"a rank's weight, T = {NPROC}": f"{out_features // NPROC} x {in_features}" if column
                 else f"{out_features} x {in_features // NPROC}",
                 "a rank's bias": f"{out_features // NPROC}" if column else f"{out_features} (whole)",
                 "its output": f"1/{NPROC} of the features" if column else "a partial sum: all_reduced"})
show_table(rows)
md(f"`qkv`'s {3 * WIDTH} output rows are ordered head by head, so a rank's {3 * WIDTH // NPROC} rows are the "
   f"query, key and value of {HEADS // NPROC} whole head(s) out of {HEADS}: attention runs on them without "
   f"communicating. `proj` then multiplies those heads' outputs by its matching {WIDTH // NPROC} input "
   f"columns; adding the {NPROC} ranks' products gives the whole output: the forward pass's all_reduce. The "
   f"MLP is the same pair: `mlp.0` makes 1/{NPROC} of the hidden features, GELU works on each feature alone, "
   f"`mlp.2` sums.")

# %% [markdown]
# ## What changed against lesson 18
#
# DDP's wrapper and the DistributedSampler's split of the batch are gone: one sampler over the whole
# dataset, the same on every rank, and `parallelize_module` per block on a "tp" mesh. `CommDebugMode`
# replaces `FlopCounterMode` around step 1; `implicit_replication` wraps the gradient clip; the evaluation
# runs the whole test set on every rank; `get_model_state_dict` gathers the whole weights for model.pt. The
# report at the end (`course/measuring/parallel.py`) counts each rank's pieces.

# %%
show_diff("day4/18_hardware_limits.py", "day4/19_tensor_parallel.py")

# %%
show_tagged("day4/19_tensor_parallel.py")

# %% [markdown]
# ## Run it, and one process with the same arguments
#
# The tensor-parallel run, then lesson 18 on one process (DDP over one rank: plain training) with the same
# weights, batches and steps. `--batch-size` is the whole batch in both: every TP rank computes on all of it.

# %%
run_lesson("day4/19_tensor_parallel.py", *SIZE, *DEVICE, *ARGS, "--run-dir", RUN / "tp", nproc=NPROC)
run_lesson("day4/18_hardware_limits.py", *SIZE, *DEVICE, *ARGS, "--sizes-mib", "0.25", "--run-dir", RUN / "one",
           nproc=1)  # one rank: its sweep sends nothing, one small size keeps it short

# %% [markdown]
# ## The same training

# %%
import torch

from course.training.output import load_weights

LABELS = {"tp": f"tensor parallel, {NPROC} ranks", "one": "one process (lesson 18)"}
m = {k: read_json(RUN / k / "metrics.json") for k in LABELS}
w = {k: load_weights(REPO / RUN / k / "model.pt") for k in LABELS}
flat = {k: torch.cat([v[n].flatten() for n in sorted(v)]) for k, v in w.items()}
fig, ax = plt.subplots()
for (k, label), style in zip(LABELS.items(), ("o", "-")):
    ax.plot(range(1, m[k]["steps"] + 1), m[k]["loss_per_step"], style, label=label, alpha=0.8)
ax.set(xlabel="step", ylabel="training loss", title=f"ViT width {WIDTH}, depth {DEPTH}, batch {BATCH}")
ax.legend()
plt.show()
rel = ((flat["tp"] - flat["one"]).norm() / flat["one"].norm()).item()
gap = max(abs(a - b) / abs(b) for a, b in zip(m["tp"]["loss_per_step"], m["one"]["loss_per_step"]))
norms = m["tp"]["grad_norm_per_step"]
same_keys = sorted(w["tp"]) == sorted(w["one"]) and all(w["tp"][k].shape == w["one"][k].shape for k in w["one"])
md(f"After {m['tp']['steps']} steps the losses differ by at most {gap:.1e} (relative), the test accuracies are "
   f"{m['tp']['test_accuracy']:.4f} and {m['one']['test_accuracy']:.4f}, and the whole weight vectors differ "
   f"by **{rel:.1e}** (relative). "
   + ("That is float32 rounding: the row-wise layers add their partial sums in another order than one "
      "matrix product does. " if rel < 1e-5 else
      "Larger than float32 rounding of a few steps: rounding differences grow over many steps of SGD with "
      "momentum; compare the loss curves. ")
   + ("model.pt holds the same tensors with the same shapes as the one process's: `get_model_state_dict` "
      "gathered the pieces into whole weights." if same_keys else "model.pt's tensors differ from the one "
      "process's in names or shapes.")
   + f" The parameters TP left whole stayed identical on all ranks: **{m['tp']['identical_weights']}**."
   + (f" Every step's gradient norm was above 0.5 ({min(norms):.2f} to {max(norms):.2f}): the clip scaled every "
      f"step, with the norm taken over DTensors and plain tensors together." if min(norms) > 0.5 else
      f" The gradient norms went from {min(norms):.2f} to {max(norms):.2f}: the clip at 0.5 scaled the steps "
      f"above it."))

# %% [markdown]
# ## What each rank holds
#
# Each rank counts its bytes from its tensors (`p.to_local()` for a DTensor) after training.

# %%
from course.measuring.memory import MB as MiB  # 2 ** 20 bytes

params = sum(p.numel() for p in ViT(7, WIDTH, DEPTH, HEADS).parameters())
replica = 3 * 4 * params  # parameters, gradients and SGD's momentum in fp32: what one process or a DDP rank holds
per_rank = m["tp"]["per_rank_bytes"]
show_table([{"rank": r, "cut parameters: its pieces MiB": b["cut"] / MiB, "of the whole MiB": b["cut_whole"] / MiB,
             "share": b["cut"] / b["cut_whole"], "parameters + gradients + momentum MiB": b["total"] / MiB}
            for r, b in enumerate(per_rank)], floatfmt="{:.4g}")
uncut = 4 * params - per_rank[0]["cut_whole"]
fullest = max(b["total"] for b in per_rank)
peaks = {k: m[k]["memory"]["peak_bytes"] for k in LABELS}
md(f"Each rank holds **{max(b['cut'] / b['cut_whole'] for b in per_rank):.4f}** of the cut parameters "
   f"(1/{NPROC} = {1 / NPROC:.4f}) and the whole of the rest ({uncut / MiB:.3f} MiB of parameters: embedding, "
   f"position, layer norms, classifier, the row-wise layers' biases). With gradients and momentum that is "
   f"{fullest / MiB:.3f} MiB on the fullest rank against {replica / MiB:.3f} MiB for the one process "
   f"({fullest / replica:.2f}x). Step 3's peak ({m['tp']['memory']['how']}) was {peaks['tp'] / MiB:.2f} MiB on "
   f"a TP rank and {peaks['one'] / MiB:.2f} MiB for the one process ({peaks['tp'] / peaks['one']:.2f}x, not "
   f"1/{NPROC}): inside the attention and the MLP each rank holds 1/{NPROC} of the activations, but TP without "
   f"sequence parallelism leaves whole on every rank the blocks' inputs and outputs (the residual stream, "
   f"[batch, tokens, width]), the layer norms' inputs and outputs (and dropout's, in a model that has it), "
   f"and the uncut parameters with their gradients and momentum.")

# %% [markdown]
# ## The collectives, counted and priced

# %%
comms = m["tp"]["collectives_step_1"]
show_table([{"phase": phase, "collective": op, "calls in step 1": n, "per block": n / DEPTH}
            for phase, ops in comms.items() for op, n in ops.items()])
tokens = (28 // 7) ** 2
activation = BATCH * tokens * WIDTH * 4  # one [batch, tokens, width] tensor in fp32
count = sum(n for ops in comms.values() for op, n in ops.items() if op == "all_reduce")
priced = m["tp"]["collectives_priced"]  # each kind of call of step 1, sent again on its group, timed
show_table([{"mesh dimension": r["dim"], "group of rank 0": str(r["group"]),
             "link": "across nodes" if r["inter_node"] else "inside a node", "collective": r["op"],
             "dtype": r["dtype"], "MB": r["bytes"] / 1e6, "calls per step": r["calls"], "ms per call": r["seconds"] * 1e3,
             "busbw GB/s": r["busbw_gbps"], "ms per step": r["seconds_per_step"] * 1e3} for r in priced],
           floatfmt="{:.3g}")
tp = m["tp"]["collectives_per_dimension"]["tp"]
tp_seconds, link = tp["seconds"], "across nodes" if tp["inter_node"] else "inside one node"
step_tp = m["tp"]["step_seconds"]
step_one = m["one"]["flops_per_step"] / (m["one"]["hfu"] * m["one"]["matmul_peak_flops"])
grads = 4 * params
md(f"Step 1 issued {sum(comms.get('forward', {}).values())} all_reduces in forward and "
   f"{sum(comms.get('backward', {}).values())} in backward over {DEPTH} blocks: per block one for each "
   f"row-wise layer's output in forward, and one for each column-wise layer's input gradient in backward "
   f"(that input is a layer norm's output, whole on every rank; each rank's rows of the weight give a part of "
   f"its gradient). Each adds up "
   f"one activation [{BATCH}, {tokens}, {WIDTH}] of {activation / 1e6:.3f} MB: {count * activation / 1e6:.2f} MB "
   f"per step in {count} calls. Each kind of call was sent again after training on the mesh's \"tp\" group "
   f"({tp['ranks']} ranks, {link}) with the tensor the step sent ({priced[0]['bytes'] / 1e6:.3f} MB), and "
   f"timed: {tp['calls']} calls take about {tp_seconds * 1e3:.1f} ms of the {step_tp * 1e3:.0f} ms a TP step "
   f"took.\n\n"
   f"DDP over the same {NPROC} ranks would all_reduce the {grads / 1e6:.3f} MB of gradients once per step, "
   f"whatever the batch. TP sends {count * activation / grads:.1f}x those bytes here, and its all_reduces grow "
   f"with the batch (exercise 3); every one of them sits between two layers, so the rank waits for it. "
   f"A TP step took {step_tp * 1e3:.0f} ms and the one process's step {step_one * 1e3:.0f} ms "
   f"({step_tp / step_one:.2f}x, one run each)"
   + (f". The all_reduces, priced above, account for about {min(1, tp_seconds / (step_tp - step_one)):.0%} "
      f"of the difference. This run does not break down the rest; two costs it does not time are likely part "
      f"of it: before every operation on a DTensor torch works out how its inputs are cut and how its output "
      f"will be (in C++, from a cache after the operation's first call) and wraps the result in Python, a cost "
      f"per operation that matters for matrix products as small as this model's; "
      f"and each rank multiplies matrices 1/{NPROC} as large, which uses the device less well. TP pays at "
      f"scale: where the global batch leaves data parallelism no more samples to split over more GPUs, or "
      f"FSDP2's calls over many ranks get small and dominated by their latency; inside a node, with a link as fast as "
      f"NVLink; with matrices large enough to keep every device busy with 1/T of them; and, rarely, where a "
      f"layer is too large for one device." if step_tp > step_one else
      ": faster than one process here, each rank doing 1/T of the matrix products."))

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/19_tensor_parallel.md`](../solutions/19_tensor_parallel.md).
#
# 1. `--nproc 4` (4 heads: one per rank) next to `--nproc 2` and lesson 18 on one process, all with the
#    same small ViT (`--width 32 --depth 2`) and arguments: the three print the same test loss and
#    accuracy, their losses agree to 1e-7 or better and their weights to about 3e-8 (relative), and each of
#    the 4 ranks holds 0.2500 of the cut parameters.
# 2. `--heads 4 --nproc 3`: the lesson stops before any rank starts, with one line saying that 4 heads do
#    not divide among 3 ranks; `--heads 3` alone stops at the next check (the width must be a multiple of
#    the heads).
# 3. `--batch-size 128` against exercise 1's `--batch-size 32` at 2 ranks: each all_reduce adds up 4 times
#    the bytes (0.262 MB against 0.066 MB), while DDP's gradient all_reduce (lesson 18's line) stays 0.078
#    MB per step at any batch.
#
# Next: [lesson 20](20_device_mesh_2d.ipynb): two dimensions, FSDP2 across the rows of a mesh and tensor parallelism
# inside each row; and HSDP.
