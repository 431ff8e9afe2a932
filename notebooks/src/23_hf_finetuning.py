# %% [markdown]
# # Lesson 23: fine-tuning a Hugging Face model across nodes
#
# Script: [`day5/23_hf_finetuning.py`](../day5/23_hf_finetuning.py).
#
# What learners most often do with a cluster after a course like this is not to pre-train a model but to
# **fine-tune weights somebody else trained**, usually published in Hugging Face's format. This lesson takes
# such a directory, fine-tunes it with FSDP2 on question/answer pairs, and writes it back in the same format:
#
# - **Weights in**: a Hugging Face model directory is `config.json` (the sizes) and `*.safetensors` files (the
#   tensors, by name). The course's GPT carries Llama's names, so the model is built on the meta device from
#   `config.json`, sharded with `fully_shard`, and each rank reads only its own rows of each tensor:
#   `dcp.load` with torch's `HuggingFaceStorageReader`. No rank holds the whole model.
# - **Masked fine-tuning**: each row is a question and its answer. The loss counts only the answer's tokens
#   (the question's targets are -100, which `F.cross_entropy` skips), averaged over the answer tokens of the
#   **whole global batch**.
# - **A pitfall**: evaluating the loaded model under `torch.no_grad()` leaves FSDP2's root parameters
#   gathered; an optimizer built then trains copies. `model.reshard()` first.
# - **Weights out**: `HuggingFaceStorageWriter` writes each rank's shards and joins them into a directory that
#   `transformers` loads.
#
# The model fine-tuned here is the one lesson 22 pre-trains, run first below.

# %%
from nbhelpers import *

# The one switch. False: lesson 22's GPT (131 904 parameters) pre-trained for 150 steps on 2 CPU processes, then
# fine-tuned for 100 steps by 4 CPU processes. True: a wider GPT (width 256, depth 4) pre-trained 1000 steps, and
# fine-tuned 300 steps, in float32 on this node's GPUs, one process each.
FULL_SIZE = False
NPROC = max((n for n in (2, 4, 8, 16) if n <= gpu_count()), default=2) if FULL_SIZE else 4
PRETRAIN = ["--max-steps", "1000", "--width", "256", "--depth", "4", "--hidden", "688"] if FULL_SIZE else \
    ["--max-steps", "150"]
STEPS, GLOBAL = (300, 32) if FULL_SIZE else (100, 16)  # pairs a step, in every run
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
RUN = run_dir("23_hf_finetuning")

# %% [markdown]
# ## The model to fine-tune: lesson 22's, in Hugging Face's format
#
# Lesson 22 writes its weights twice at the end: `model.pt` (the course's format) and `hf/` (Hugging Face's).

# %%
run_lesson("day5/22_gpt_pretraining.py", *PRETRAIN, *DEVICE, "--batch-size", "16", "--sample-tokens", "40",
           "--nproc", "2", "--run-dir", RUN / "pretrained")
MODEL = RUN / "pretrained" / "hf"
print((REPO / MODEL / "config.json").read_text())
print(*sorted(p.name for p in (REPO / MODEL).iterdir()), sep="\n")

# %% [markdown]
# `config.json` names the sizes as `transformers`' `LlamaConfig` does; `model.safetensors` holds every tensor
# under its parameter's name; `SHA256SUMS` lets anyone check the files (`sha256sum -c SHA256SUMS`), and the
# lesson checks them before any rank starts.
#
# ## The pairs, and what the loss counts

# %%
from data_tools import instructions

train, held, said = instructions.load(192)
md(said + ". The first:")
prompt, answer = train.items[0]
print(prompt + answer)
x, y = train[0]
n = len(prompt.encode())
show_table([{"position": i, "input": repr(chr(int(x[i]))), "target": "-100 (skipped)" if int(y[i]) == -100 else
             repr(chr(int(y[i])))} for i in range(n - 3, n + 4)])
md(f"Positions 0 to {n - 2} would predict the question's own bytes: their targets are -100. From position {n - 1} "
   f"on, each target is the answer's next byte, and the answer's last byte is followed by the end token (byte 0), "
   f"so the model learns where an answer stops. The rest of the row is padding, skipped too: this row's loss "
   f"counts {int((y != -100).sum())} of its {len(y)} positions.")

# %% [markdown]
# ## What changed against lesson 22
#
# The data (pairs, padded, masked), the model's source (a directory instead of a seed), the loss's mean, the
# evaluation before training and its `reshard()`, the writing back, a greedy answer instead of a sampled text,
# and a plainer optimizer (a constant learning rate, no weight decay, fp32 only). Lesson 22's tensor-parallel
# plans and its throughput accounting go. The distributed lines, tagged:

# %%
show_diff_stats("day5/22_gpt_pretraining.py", "day5/23_hf_finetuning.py")
show_tagged("day5/23_hf_finetuning.py")

# %% [markdown]
# ## Fine-tune: FSDP2, one process, and the pitfall
#
# The same global batch of pairs every step in each run: FSDP2 over the ranks, one process with them all, and
# FSDP2 again with `--skip-reshard` (no `model.reshard()` after the evaluation under `no_grad`).

# %%
COMMON = [*DEVICE, "--max-steps", str(STEPS), "--model-dir", MODEL]
run_lesson("day5/23_hf_finetuning.py", *COMMON, "--batch-size", str(GLOBAL // NPROC), "--nproc", str(NPROC),
           "--run-dir", RUN / "fsdp")
run_lesson("day5/23_hf_finetuning.py", *COMMON, "--batch-size", str(GLOBAL), "--nproc", "1", "--run-dir", RUN / "one")
run_lesson("day5/23_hf_finetuning.py", *COMMON, "--batch-size", str(GLOBAL // NPROC), "--nproc", str(NPROC),
           "--skip-reshard", "--run-dir", RUN / "pitfall")

# %% [markdown]
# ## The same fine-tuning, and the drift

# %%
import torch
from safetensors.torch import load_file

LABELS = {"fsdp": f"FSDP2, {NPROC} ranks", "one": "one process", "pitfall": f"FSDP2, {NPROC} ranks, no reshard"}
m = {k: read_json(RUN / k / "metrics.json") for k in LABELS}
flat = {k: torch.cat([v.flatten() for _, v in sorted(load_file(REPO / RUN / k / "hf" /
                                                                "model-00001-of-00001.safetensors").items())])
        for k in LABELS}
fig, ax = plt.subplots()
for (k, label), style in zip(LABELS.items(), ("o", "-", "x")):
    ax.plot(range(1, m[k]["steps"] + 1), m[k]["loss_per_step"], style, label=label, alpha=0.6, markersize=3)
ax.set(xlabel="step", ylabel="loss over the answers' tokens (nats per byte)", title="fine-tuning")
ax.legend()
plt.show()
diff = {k: ((flat[k] - flat["one"]).norm() / flat["one"].norm()).item() for k in ("fsdp", "pitfall")}
loaded = load_file(REPO / MODEL / "model.safetensors")
stuck = load_file(REPO / RUN / "pitfall" / "hf" / "model-00001-of-00001.safetensors")
root_stuck = all(torch.equal(stuck[k], loaded[k]) for k in ("model.embed_tokens.weight", "model.norm.weight",
                                                             "lm_head.weight"))
show_table([{"run": LABELS[k], "held-out loss as loaded": m[k]["heldout_loss_before"],
             "held-out loss after": m[k]["heldout_loss"],
             "weights against one process (relative)": diff.get(k, 0.0)} for k in LABELS], floatfmt="{:.4g}")
md(f"As loaded, every run measures the same held-out loss ({m['one']['heldout_loss_before']:.4f} nats per byte of "
   f"the answers): the sharded model read from the file is the model. FSDP2 fine-tunes what one process "
   f"fine-tunes, to {diff['fsdp']:.1e} in the weights after {STEPS} steps (float32 sums in another order). "
   f"Without `reshard()` the run ends {diff['pitfall']:.1e} away, and no warning or error says so: the "
   f"optimizer was given the root's gathered parameters (the embedding, the final norm, the head), copies that "
   f"the next all_gather overwrites from the shards, which nothing stepped: "
   + ("those three tensors end bit for bit as loaded, " if root_stuck else "")
   + "while the blocks trained around them.")
held = {k: m[k]["memory"]["held_before_bytes"] for k in ("fsdp", "pitfall")}
estimated = {k: (m[k]["memory_estimate"] or {}).get("held_before_bytes") for k in ("fsdp", "pitfall")}
if estimated["fsdp"] and estimated["fsdp"] == estimated["pitfall"] and held["pitfall"] < held["fsdp"]:
    md(f"The memory lines show it too. Both runs printed the same estimate of rank 0's bytes before training "
       f"(course/fit.py runs the correct step): {estimated['fsdp']:,} bytes held as step 3 begins. The run with "
       f"`reshard()` held {held['fsdp']:,}"
       + (", as estimated" if held["fsdp"] == estimated["fsdp"] else "")
       + f"; the pitfall's run {held['pitfall']:,}, {held['fsdp'] - held['pitfall']:,} fewer: no AdamW state (two "
       f"moments and a step count each) for the root's shards, which its optimizer never holds.")

# %% [markdown]
# ## The answer, and `transformers` loading the result
#
# At the end every rank runs the same forward, byte by byte, taking the likeliest byte each time, to answer a
# question held out of training. The directory the lesson wrote loads with `transformers` as any Hugging Face
# model does, and its `generate` gives the same answer.

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's, in a notebook without widgets
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

transformers_logging.disable_progress_bar()

print(m["fsdp"]["question"] + m["fsdp"]["answer"])
theirs = AutoModelForCausalLM.from_pretrained(str(REPO / RUN / "fsdp" / "hf"), dtype=torch.float32).eval()
ids = torch.tensor([list(m["fsdp"]["question"].encode())])
out = theirs.generate(ids, max_new_tokens=120, do_sample=False, eos_token_id=0, pad_token_id=0)
said = bytes(out[0, ids.shape[1]:].tolist()).split(b"\0")[0].decode(errors="replace")
md(f"`transformers` answers: {said!r}. " + ("The same answer, byte for byte." if said == m["fsdp"]["answer"] else
                                              "A different answer: the two models' logits are not the same."))

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/23_hf_finetuning.md`](../solutions/23_hf_finetuning.md).
#
# 1. Catch the pitfall: after the optimizer is built, on more than one rank, check that every parameter it holds
#    is a `DTensor`. Run with `--skip-reshard` and the check stops the run before its first step.
# 2. A mean per rank: make `masked_loss` divide each rank's sum by its own count of answer tokens. Two ranks no
#    longer fine-tune what one process does.
# 3. A damaged copy: copy the model directory, change one byte of its safetensors file, and give the copy to the
#    lesson: it stops before any rank starts, with one line naming the file.
#
# Next: [from the course to your own model](../docs/learners/your-own-model.md), and [to your own code](../docs/learners/your-own-code.md).
