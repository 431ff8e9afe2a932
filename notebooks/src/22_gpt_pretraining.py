# %% [markdown]
# # Lesson 22: pre-training a small GPT, offline
#
# Script: [`day5/22_gpt_pretraining.py`](../day5/22_gpt_pretraining.py).
#
# Days 3 and 4 trained a Vision Transformer on images. Most of what learners train on a cluster after the
# workshop is a **language model**: a decoder-only transformer (a GPT) that reads a text one token at a time
# and learns to predict the next. This lesson trains a small one with the tools of days 3 and 4, on text that
# every Python installation carries, so that a compute node without internet has it:
#
# - **The text**: Python's own documentation topics (what `help("assert")` shows), bundled with Python as
#   `pydoc_data.topics`; or the standard library's sources (`--corpus python-stdlib`); or your files
#   (`--text-dir`). A **token is a byte**: the vocabulary is 256, nothing is trained to tokenize. Byte 0 ends
#   each document.
# - **Packing**: the documents are laid end to end and cut into rows of `--seq-len` + 1 tokens; a row's first
#   `--seq-len` tokens are the input, its last `--seq-len` (shifted by one) the targets. **Every position is a training
#   example**: the loss is the cross-entropy of each position's next token, averaged over all tokens of the batch.
# - **The model** (`course/gpt.py`, `GPT`) is laid out and named as Hugging Face's Llama (causal attention
#   with rotary positions, a gated MLP, RMSNorm), so that its weights are a `LlamaForCausalLM`'s.
# - **Two layouts**, built on the meta device: `fsdp` (lesson 15's sharding over all ranks) and `fsdp-tp`
#   (lesson 20's 2-D mesh, with torchtitan's tensor-parallel plan for Llama and sequence parallelism in each
#   row). One process builds the model whole: the reference both must equal.
# - **Throughput in tokens**: tokens/s per rank, and MFU as torchtitan computes it.

# %%
from nbhelpers import *

# The one switch. False: 150 steps, the lesson's default GPT (131 904 parameters), 4 CPU processes. True: 1000
# steps of a wider GPT in bf16 on this node's GPUs, one process each: 2, 4, 8 or 16 of them (the most it has).
FULL_SIZE = False
STEPS = 1000 if FULL_SIZE else 150
SEQ = 256 if FULL_SIZE else 64
SIZE = ["--max-steps", str(STEPS), "--seq-len", str(SEQ)] + (
    ["--width", "256", "--depth", "4", "--hidden", "688", "--precision", "bf16"] if FULL_SIZE else [])
NPROC = max((n for n in (2, 4, 8, 16) if n <= gpu_count()), default=2) if FULL_SIZE else 4
INNER, GLOBAL = 2, 32  # rows of 2 ranks under fsdp-tp; 32 rows of tokens a step in every run
ARGS = ["--seed", "0", "--sample-tokens", "300"]
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
RUN = run_dir("22_gpt_pretraining")

# %% [markdown]
# ## The text, as the model sees it

# %%
from data_tools import text

docs = text.documents("python-docs")
train_docs, held_docs = text.split(docs)
name, data = docs[0]
md(f"{len(docs)} documents, {sum(len(d) for _, d in docs):,} bytes (and one end-of-document token each: "
   f"{sum(len(d) + 1 for _, d in docs):,} tokens); the first, {name!r}, begins:\n\n```text\n{data[:300].decode()}\n```")
rows = text.PackedText(text.stream(train_docs), SEQ)
x, y = rows[0]
show_table([{"position": i, "input byte": int(x[i]), "input": repr(chr(int(x[i]))), "target byte": int(y[i]),
             "target": repr(chr(int(y[i])))} for i in range(8)])
md(f"{len(train_docs)} documents train, {len(held_docs)} are held out (every tenth). Packed into rows of {SEQ} + 1 "
   f"tokens, the training text makes **{len(rows):,} rows**; each row is {SEQ} training examples, one per position: "
   f"the target at each position is the input's next byte.")

# %% [markdown]
# ## What changed against lesson 20
#
# The whole data path (text in place of images), the model, the loss over every position, the plan for a whole
# Llama (embedding and head included), tokens/s and MFU, the sample at the end: all at once, so the diff is
# long (the lesson's docstring lists what changes). The distributed lines, tagged:

# %%
show_diff_stats("day4/20_device_mesh_2d.py", "day5/22_gpt_pretraining.py")
show_tagged("day5/22_gpt_pretraining.py")

# %% [markdown]
# ## Run both layouts, and one process

# %%
md(f"FSDP2 over {NPROC} ranks ({GLOBAL // NPROC} rows each), FSDP2 x TP on a {NPROC // INNER} x {INNER} mesh "
   f"({GLOBAL // (NPROC // INNER)} rows a row of the mesh), and one process with all {GLOBAL} rows: the same {GLOBAL} "
   f"rows of {SEQ} tokens every step.")
run_lesson("day5/22_gpt_pretraining.py", *SIZE, *DEVICE, *ARGS, "--batch-size", str(GLOBAL // NPROC),
           "--nproc", str(NPROC), "--run-dir", RUN / "fsdp")
run_lesson("day5/22_gpt_pretraining.py", *SIZE, *DEVICE, *ARGS, "--batch-size", str(GLOBAL // (NPROC // INNER)),
           "--layout", "fsdp-tp", "--inner", str(INNER), "--run-dir", RUN / "fsdp-tp", nproc=NPROC)
run_lesson("day5/22_gpt_pretraining.py", *SIZE, *DEVICE, *ARGS, "--batch-size", str(GLOBAL),
           "--run-dir", RUN / "one", nproc=1)

# %% [markdown]
# ## The same training

# %%
import math

import torch

from course.training.output import load_weights

LABELS = {"fsdp": f"FSDP2, {NPROC} ranks", "fsdp-tp": f"FSDP2 x TP, {NPROC // INNER} x {INNER}",
          "one": "one process"}
m = {k: read_json(RUN / k / "metrics.json") for k in LABELS}
flat = {k: torch.cat([v.flatten() for _, v in sorted(load_weights(REPO / RUN / k / "model.pt").items())])
        for k in LABELS}
fig, ax = plt.subplots()
for (k, label), style in zip(LABELS.items(), ("o", "x", "-")):
    ax.plot(range(1, m[k]["steps"] + 1), m[k]["loss_per_step"], style, label=label, alpha=0.6, markersize=3)
ax.axhline(math.log(256), color="grey", linestyle=":", label="ln 256: a byte guessed uniformly")
ax.set(xlabel="step", ylabel="next-token loss (nats per byte)", title=f"GPT, {m['one']['parameters']:,} parameters")
ax.legend()
plt.show()
rows = [{"layout": LABELS[k], "tokens a step": m[k]["tokens_per_step"],
         "largest loss difference (relative)": max(abs(a - b) / b for a, b in
                                                   zip(m[k]["loss_per_step"], m["one"]["loss_per_step"])),
         "weights' difference (relative)": ((flat[k] - flat["one"]).norm() / flat["one"].norm()).item(),
         "held-out loss": f"{m[k]['heldout_loss']:.4f}"} for k in ("fsdp", "fsdp-tp")]
show_table(rows, floatfmt="{:.2g}")
worst = max(r["weights' difference (relative)"] for r in rows)
loss_worst = max(r["largest loss difference (relative)"] for r in rows)
held = {f"{m[k]['heldout_loss']:.4f}" for k in LABELS}
md(f"The loss starts at {m['one']['loss_per_step'][0]:.2f} nats, near ln 256 = {math.log(256):.2f} (a byte guessed "
   f"uniformly), and one process ends at a held-out loss of {m['one']['heldout_loss']:.2f} nats per byte after "
   f"{m['one']['steps']} steps. "
   + (f"Both layouts train as the one process does: every step's loss within {loss_worst:.1e} (relative) of the "
      "one process's, "
      + (f"the same held-out loss to 4 decimals ({held.pop()}), " if len(held) == 1 else "")
      + f"the weights within {worst:.1e}: {m['one']['precision']} rounding of sums taken in another order, grown "
      f"over {m['one']['steps']} AdamW steps (AdamW divides by the square root of small second moments, which "
      "magnifies differences in the last digits)." if loss_worst < (1e-2 if FULL_SIZE else 1e-4) else
      f"The losses differ by up to {loss_worst:.1e} (relative): more than rounding."))

# %% [markdown]
# ## Tokens per second, MFU and memory
#
# tokens/s per rank is every token a step trained, over the step's time and the ranks. MFU multiplies it by
# the FLOPs a token costs (torchtitan's count: 6 per parameter outside the embedding, plus attention's
# 12 x depth x width x sequence length) and divides by the device's peak: a GPU's datasheet number for bf16, on a
# CPU a matmul timed by the lesson (there is no datasheet for a CPU core), so an MFU here is not comparable with
# a GPU's. Each run times its own matmul on all its ranks at once and takes the slowest rank's time, as lesson 18
# does: with several ranks on a few cores, that peak is a rank's share of the machine, and the MFUs of runs with
# different numbers of ranks have different denominators.
#
# Memory comes twice. Before training, the lesson asks day 4's "Will it fit?" (`course/fit.py`) for rank 0's
# bytes: this model's step, in this layout and with this batch, run on fake tensors, with nothing allocated.
# Then every rank measures its third step (held when it began, the most above that during it); rank 0's line
# adds the estimate and measured / estimated.

# %%
import os

from course.measuring.memory import MB

show_table([{"layout": LABELS[k], "ranks": m[k]["world_size"], "tokens/s per rank": m[k]["tokens_per_second_per_rank"],
             "FLOPs per token": m[k]["flops_per_token"], "peak GFLOP/s": m[k]["peak_flops"] / 1e9, "MFU": m[k]["mfu"],
             "held at step 3, MB": m[k]["memory"]["held_before_bytes"] / MB,
             "most above it, MB": m[k]["memory"]["peak_above_bytes"] / MB,
             "peak, MB": m[k]["memory"]["peak_bytes"] / MB,
             "estimated peak, MB": m[k]["memory_estimate"]["peak_bytes"] / MB} for k in LABELS], floatfmt="{:.3g}")
one, fsdp = m["one"], m["fsdp"]
off = {k: m[k]["memory"]["peak_bytes"] - m[k]["memory_estimate"]["peak_bytes"] for k in LABELS}
md("The estimates printed before training equal the measured peaks to the byte in every run above."
   if not any(off.values()) else
   "The estimates printed before training differ from the measured peaks by "
   + ", ".join(f"{off[k]:+,} bytes ({LABELS[k]})" for k in LABELS)
   + (": on a GPU the measurement also holds what the estimate leaves out (cuBLAS's workspaces, the caching "
      "allocator's rounding, the temporaries of the lesson's foreach AdamW where the estimate runs the fused one)."
      if not DEVICE else "."))
md(f"Each of the {fsdp['world_size']} FSDP2 ranks held {fsdp['memory']['held_before_bytes'] / MB:.3f} MB when step 3 "
   f"began (its shards of the parameters, gradients and AdamW's two moments) against "
   f"{one['memory']['held_before_bytes'] / MB:.3f} MB in one process "
   f"({fsdp['memory']['held_before_bytes'] / one['memory']['held_before_bytes']:.2f}x). Per rank, "
   f"{fsdp['tokens_per_second_per_rank']:,.0f} tokens/s against one process's {one['tokens_per_second_per_rank']:,.0f}; "
   f"all {fsdp['world_size']} ranks together "
   f"{fsdp['tokens_per_second_per_rank'] * fsdp['world_size'] / one['tokens_per_second_per_rank']:.2f}x of one process. "
   + (f"Here the {fsdp['world_size']} ranks share the {os.cpu_count()} cores one process had to itself, and a model "
      "this small gives a step little compute against its collectives: splitting it buys memory per rank, not "
      "speed. " if DEVICE else "")
   + "The same model is far too small to fill a GPU; tokens/s and MFU are the numbers to compare between layouts "
   "of a model that does fill one.")

# %% [markdown]
# ## What it learnt
#
# Rank 0 gathers the weights whole at the end and continues the prompt "The " byte by byte, each byte drawn from
# the model's next-token probabilities (temperature 0.8).

# %%
for k in ("one", "fsdp-tp"):
    print(f"{LABELS[k]}:\n{m[k]['sample']}\n")
same = m["one"]["sample"] == m["fsdp-tp"]["sample"]
md(f"After {m['one']['steps'] * m['one']['tokens_per_step']:,} tokens a byte-level model has learnt the shape of the "
   "text (words, spaces, punctuation) more than its sense. "
   + ("The two samples are the same text: the same weights, to float32 rounding, and the same seed." if same else
      "The two samples part where the weights' rounding tips one draw to another byte; from there each "
      "continues its own way."))

# %% [markdown]
# ## Stopped, and resumed
#
# A job on a cluster ends at its time limit, or is preempted. Here the FSDP2 run is cut in two: the first half
# (half the `--max-steps`, a checkpoint every third of it) ends with a DCP checkpoint, and the same command with
# the whole `--max-steps` and `--resume` goes on from it: the model, AdamW's moments, the warm-up's step and the
# position in the text come back. Under Slurm a signal does the cutting: `slurm/22_gpt_pretraining.sh` passes
# SIGUSR1 on to the ranks before the time limit, every rank stops after the same step (one `all_reduce` a
# step tells them), writes its shards, and the job requeues itself.

# %%
HALF = STEPS // 2
FSDP = [*SIZE, *DEVICE, *ARGS, "--batch-size", str(GLOBAL // NPROC), "--nproc", str(NPROC),
        "--checkpoint-every", str(max(HALF // 3, 1)), "--run-dir", RUN / "halves"]
run_lesson("day5/22_gpt_pretraining.py", *FSDP, "--max-steps", str(HALF))
run_lesson("day5/22_gpt_pretraining.py", *FSDP, "--resume")
halves, whole = (load_weights(REPO / RUN / k / "model.pt") for k in ("halves", "fsdp"))
same = halves.keys() == whole.keys() and all(torch.equal(halves[k], whole[k]) for k in whole)
losses_same = read_json(RUN / "halves" / "metrics.json")["loss_per_step"] == m["fsdp"]["loss_per_step"]
md(f"Stopped after step {HALF} and resumed, the run ends with "
   + ("the same weights as the uninterrupted FSDP2 run, bit for bit" if same else "weights that differ from the "
      "uninterrupted run's")
   + (", and the same loss at every step." if losses_same else ", and other losses.")
   + " Resumed at another world size or on the 2-D mesh, DCP reshards the checkpoint: the run trains on alike, to "
     "float32 rounding (the sums come in another order).")

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/22_gpt_pretraining.md`](../solutions/22_gpt_pretraining.md).
#
# 1. Activation checkpointing on 2 ranks: the lesson with and without `--checkpoint-activations` (5 steps,
#    `--batch-size 8`). The losses, the held-out loss and the sample are the same to the last digit; step 3's
#    memory above what it began with is smaller (each block keeps only its input), the step slower.
# 2. `--layout fsdp-tp --inner 4 --hidden 66 --nproc 4`: the lesson stops before any rank starts, with one line
#    saying that 66 hidden features do not divide among 4 tensor-parallel ranks.
# 3. Your own text: `--text-dir docs/learners` trains on the course's pages for learners (every `*.md`, `*.txt`
#    and `*.rst` file a document). The first line counts the documents; after 20 steps the held-out loss is well
#    below ln 256; train longer and the sample looks like Markdown.
#
# Next: the [course map](../README.md#course-map), and [from the course to your own code](../docs/learners/your-own-code.md).
