# %% [markdown]
# # Lesson 18: what the hardware allows
#
# Script: [`day4/18_hardware_limits.py`](../day4/18_hardware_limits.py).
#
# Day 4 splits the model itself over the ranks (tensor parallelism in the next lesson). Every way of
# splitting trades memory per rank for bytes sent between ranks, so before choosing one we measure the two
# numbers that price those bytes on this machine, with lesson 13's DDP loop (fp32 by default) as the
# workload:
#
# - **How fast the collectives are.** Before training, every rank runs `all_reduce`, `all_gather` and
#   `reduce_scatter` on float32 tensors of `--sizes-mib` MiB, timed back to back as
#   [nccl-tests](https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md) times them (t: the
#   slowest rank's seconds per call, nccl-tests' `-a 3`; by default nccl-tests averages the ranks' times).
#   With S the size of the whole tensor and n ranks, the **algorithm bandwidth** is algbw = S / t, and
#   the **bus bandwidth** busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for the other two. busbw is
#   what each rank's link carries per second when the collective runs as a ring (an all_reduce is a
#   reduce_scatter followed by an all_gather, each sending (n-1)/n of S per rank): the number to compare
#   with a link's speed, and across world sizes.
# - **How many bytes really went out.** With gloo the ranks talk over TCP, and the kernel counts every byte
#   this machine's network interfaces send (loopback included). The lesson reads each interface's counter
#   before and after the calls, sums the differences over the interfaces present at both reads (one that
#   appears or vanishes in between, say another job's, would otherwise add or remove its whole count), and
#   sets the bytes per rank against the ring formula's.
# - **How fast the arithmetic is.** The FLOP/s of one large square matrix product in the run's precision
#   (2 n^3 FLOPs in t seconds), timed a few times: a rough ceiling for what a training step could get from
#   this device (on a shared machine it moves from run to run: read a run's utilization against its own
#   peak).
# - **How much arithmetic a step needs.** torch counts the FLOPs of step 1's forward and backward passes
#   (`torch.utils.flop_counter.FlopCounterMode`: every matrix product and convolution, 2 x m x n x k each),
#   next to the rule of thumb for transformers: 6 x parameters x tokens, plus the attention's share.
# - **Hardware FLOPs utilization (HFU) against the measured peak**: the FLOPs torch counted (executed,
#   recomputation included) per second of the training steps, over that peak. **MFU**, as torchtitan defines
#   it (torchtitan/tools/utils.py), is the model's analytic FLOPs (6 x parameters x tokens plus the attention's)
#   per second over the datasheet's peak: usually lower for the same run.

# %%
from nbhelpers import *

# The one switch. False: --quick (20 steps) on 2 CPU processes, collectives of 0.25-16 MiB. True: full
# epochs, one process per GPU, the lesson's own sweep (on GPUs 0.25 to 1024 MiB).
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick", "--max-steps", "20"]
SIZES = [] if FULL_SIZE else ["--sizes-mib", "0.25", "1", "4", "16"]
NPROC = full_size_nproc() if FULL_SIZE else 2
WIDTH, DEPTH, HEADS = 64, 4, 4  # the ViT of lesson 13
MODEL = ["--width", str(WIDTH), "--depth", str(DEPTH), "--heads", str(HEADS)]
# one GPU per rank, or every rank on the CPU (NCCL cannot put two ranks on one GPU)
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
RUN = run_dir("18_hardware_limits")

# %% [markdown]
# ## The picture: what a rank must send
#
# The ring formulas, before any measurement: the bytes each rank sends per call, as a multiple of the
# tensor's size S. An all_reduce sends 2(n-1)/n S per rank: S at 2 ranks, approaching 2S as ranks are
# added; an all_gather or a reduce_scatter (n-1)/n S, approaching S. With a link of its own per rank the
# time of a large message's call therefore grows with n by at most these factors (a small message's fixed
# costs grow with the ring's 2(n-1) steps), while algbw = S / t falls: busbw, not algbw, is the number to
# compare across world sizes.

# %%
show_table([{"ranks n": n, "all_reduce: bytes sent per rank / S = busbw / algbw": 2 * (n - 1) / n,
             "all_gather, reduce_scatter: bytes sent per rank / S": (n - 1) / n} for n in (2, 4, 8, 64)])

# %% [markdown]
# ## What changed against lesson 13
#
# The sweep of the collectives before training (`bandwidth`, its timing and the interface counters in
# `course/measuring/hardware.py`), the matrix-product peak, a `FlopCounterMode` around step 1 (with the FLOP formulas
# of the CPU's attention kernel, which torch's counter lacks), and the FLOPs and HFU in the outputs.
# Lesson 13's GradScaler, fp16, `--overflow-at` and `--compile` are gone: fp32 or bf16 only.

# %%
show_diff("day3/13_mixed_precision.py", "day4/18_hardware_limits.py")

# %%
show_tagged("day4/18_hardware_limits.py")

# %% [markdown]
# ## Run it

# %%
run_lesson("day4/18_hardware_limits.py", *SIZE, *DEVICE, *MODEL, *SIZES, "--run-dir", RUN / "ddp", nproc=NPROC)

# %% [markdown]
# ## The collectives: latency, then bandwidth
#
# Rank 0's table, from the run's metrics.json: time per call, algorithm and bus bandwidth, and the bytes
# this machine's interfaces sent per rank against the ring formula's.

# %%
m = read_json(RUN / "ddp" / "metrics.json")
rows = m["collectives"]
OPS = ["all_reduce", "all_gather", "reduce_scatter"]
by = {op: [r for r in rows if r["op"] == op] for op in OPS}
show_table([{"collective": r["op"], "MiB": r["bytes"] / 2 ** 20, "ms per call": r["seconds"] * 1e3,
             "algbw GB/s": r["algbw_gbps"], "busbw GB/s": r["busbw_gbps"],
             "sent / formula": f"{r['sent'] / r['formula_per_rank']:.3f}" if r["sent"] and r["formula_per_rank"]
             else "n/a"} for r in rows])
from matplotlib.ticker import FuncFormatter, NullFormatter

fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
for i, op in enumerate(OPS):
    mib = [r["bytes"] / 2 ** 20 for r in by[op]]
    left.plot(mib, [r["seconds"] * 1e3 for r in by[op]], "o-", color=RANK_COLORS[i], label=op)
    right.plot(mib, [r["busbw_gbps"] for r in by[op]], "o-", color=RANK_COLORS[i], label=op)
left.set(yscale="log", ylabel="ms per call", title="time per call")
ticks = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}".lstrip("0.")[:1] in "125" else "")  # 1, 2, 5, 10, ...
left.yaxis.set_major_formatter(ticks)
left.yaxis.set_minor_formatter(ticks)
right.set(ylabel="busbw, GB/s", title=f"bus bandwidth, {m['world_size']} ranks, {m['backend']}")
for ax in (left, right):
    ax.set(xscale="log", xlabel="tensor size S, MiB")
    ax.set_xticks(mib, [f"{v:g}" for v in mib])
    ax.xaxis.set_minor_formatter(NullFormatter())
right.legend()
fig.tight_layout()
plt.show()

# %%
ar = by["all_reduce"]
if m["world_size"] == 1:
    md("One rank: a collective over one process sends nothing, so there is no bus bandwidth to read (run it "
       "with more ranks).")
else:
    small, large, best = ar[0], ar[-1], max(ar, key=lambda r: r["busbw_gbps"])
    grew, slower = large["bytes"] / small["bytes"], large["seconds"] / small["seconds"]
    mib = lambda r: f"{r['bytes'] / 2 ** 20:g}"
    longer = [i for i, r in enumerate(ar[1:], 1) if r["seconds"] > 1.1 * small["seconds"]]
    flat = ar[1:longer[0] if longer else len(ar)]  # the sizes after the smallest, up to the first slower one
    faster = [(op, r, by[op][0]) for op in OPS for r in by[op][1:] if r["seconds"] < 0.9 * by[op][0]["seconds"]]
    peaks = {op: max(by[op], key=lambda r: r["busbw_gbps"]) for op in OPS}
    fell = [op for op in OPS if peaks[op] is not by[op][0] and by[op][-1]["busbw_gbps"] < 0.9 * peaks[op]["busbw_gbps"]]
    md(f"The all_reduce's bus bandwidth went from {small['busbw_gbps']:.3f} GB/s at "
       f"{small['bytes'] / 2 ** 20:g} MiB to {best['busbw_gbps']:.3f} GB/s at {best['bytes'] / 2 ** 20:g} MiB "
       f"({best['busbw_gbps'] / small['busbw_gbps']:.1f}x). From {small['bytes'] / 2 ** 20:g} to "
       f"{large['bytes'] / 2 ** 20:g} MiB the tensor grew {grew:.0f}x and the time per call "
       + (f"only {slower:.1f}x: each call pays a fixed cost (starting it, a round trip between the ranks, "
          f"waking the threads that move the bytes) that a small message cannot hide. Small messages measure "
          f"latency, large ones bandwidth." if slower < grew / 2 else
          f"{slower:.1f}x, about as much: at these sizes the bytes, not the fixed cost of a call, set the "
          f"time.")
       + (f" Up to {mib(flat[-1])} MiB an all_reduce took no longer than at {mib(small)} MiB (within 10%): there the "
          f"fixed cost is the whole call." if flat else "")
       + (" Some larger calls were even faster than their collective's smallest: "
          + "; ".join(f"{op} at {mib(r)} MiB, {r['seconds'] * 1e3:.2f} against {first['seconds'] * 1e3:.2f} ms"
                      for op, r, first in faster)
          + ". At the smallest sizes the fixed cost varies from call to call by more than the bytes add: that "
            "size's bandwidth, and the gains from it, move with it." if faster else "")
       + (" " + "; ".join(f"The {op}'s bus bandwidth peaked at {mib(peaks[op])} MiB ({peaks[op]['busbw_gbps']:.3f} "
                          f"GB/s) and fell after it" for op in fell)
          + ": read each curve at its peak, not at its last point." if fell else "")
       + " Each size is timed over 5 calls, and on a shared machine every size varies from run to run."
       + f" {m['world_size']} ranks on {'GPUs' if not DEVICE else 'this machine'} with {m['backend']}: "
       + ("the ranks share this machine's cores, and the bytes go through the kernel's loopback, which makes "
          "these numbers this machine's, not a network's." if DEVICE else
          "compare the largest busbw with the link's speed (NVLink, InfiniBand) to see how much of it the "
          "collectives get."))

# %% [markdown]
# ## The bytes on the wire
#
# The ring formula says what each rank must send; the interface counters say what this machine sent.

# %%
ratio = {op: [r["sent"] / r["formula_per_rank"] for r in by[op] if r["sent"] and r["formula_per_rank"]]
         for op in OPS}
if not all(ratio.values()):
    md("No bytes went through this machine's network interfaces: NCCL moves data between GPUs over NVLink, "
       "shared memory or InfiniBand, which bypass the kernel's counters. The sent/formula column needs gloo "
       "(`--device cpu`).")
else:
    between = lambda v: f"{min(v):.3f}" + (f" to {max(v):.3f}" if f"{min(v):.3f}" != f"{max(v):.3f}" else "")
    span = {op: between(v) for op, v in ratio.items()}
    rs = sum(ratio["reduce_scatter"]) / len(ratio["reduce_scatter"])
    like_all_reduce = {r["bytes"]: r["sent"] for r in by["all_reduce"]}
    same = [r["sent"] / like_all_reduce[r["bytes"]] for r in by["reduce_scatter"] if like_all_reduce.get(r["bytes"])]
    md(f"Sent over the ring formula's bytes, per size: all_reduce {span['all_reduce']}, all_gather "
       f"{span['all_gather']}, reduce_scatter {span['reduce_scatter']}. "
       f"The all_reduce and the all_gather send what the ring sends, to within "
       f"{max(abs(x - 1) for op in ('all_reduce', 'all_gather') for x in ratio[op]):.1%} (TCP's headers, "
       f"and any other program's traffic on this machine meanwhile). "
       + (f"gloo's reduce_scatter sends about **twice** its formula: as much as an all_reduce of the same "
          f"tensor ({between(same)}x the all_reduce's bytes at the same sizes), because "
          f"torch's gloo backend runs it as an all_reduce of a copy of the input, of which each rank keeps its "
          f"piece. Its busbw, computed with nccl-tests' (n-1)/n for a true reduce_scatter (NCCL's), counts half "
          f"of what the link carried." if 1.8 < rs < 2.2 else
          f"reduce_scatter sends {rs:.2f}x its formula on average."))

# %% [markdown]
# ## FLOPs: counted against the rule of thumb
#
# A transformer's forward pass does about 2 FLOPs per parameter and token (one multiply, one add), its
# backward about 4 (the gradients of the inputs and of the weights): 6 x parameters x tokens. The
# attention adds what no parameter accounts for: scores and their weighted sum, 4 x tokens x width per
# token and block forward, twice that backward: 12 x depth x width x tokens^2 per image.

# %%
from course.models import ViT

params = sum(p.numel() for p in ViT(7, WIDTH, DEPTH, HEADS).parameters())
tokens, batch = (28 // 7) ** 2, m["batch_size"]
weights_part, attention_part = 6 * params * tokens * batch, 12 * DEPTH * WIDTH * tokens ** 2 * batch
show_table([{"": "6 x parameters x tokens x batch", "GFLOP": weights_part / 1e9},
            {"": "12 x depth x width x tokens^2 x batch (attention)", "GFLOP": attention_part / 1e9},
            {"": "formula", "GFLOP": m["flops_formula"] / 1e9},
            {"": "counted by FlopCounterMode, step 1 on one rank", "GFLOP": m["flops_per_step"] / 1e9}],
           floatfmt="{:.4f}")
md(f"{params:,} parameters, {tokens} tokens per image, a batch of {batch} per rank: torch counted "
   f"**{m['flops_per_step'] / m['flops_formula']:.3f}** of the formula. The formula charges 6 FLOPs per token to "
   f"every parameter; torch counts the products that actually run: biases, layer norms and the position "
   f"embedding multiply nothing, the classifier runs once per image (on the mean token) instead of once per "
   f"token, and no gradient is computed for the images themselves. One count goes the other way: torch "
   f"charges the attention's backward five matrix products, not four, as it recomputes the scores (2.5x the "
   f"forward, where the formula has 2x).")

# %% [markdown]
# ## Peak, utilization, and what DDP's all_reduce costs a step

# %%
from course.measuring.hardware import all_reduce_seconds

peak, hfu = m["matmul_peak_flops"], m["hfu"]
step = m["flops_per_step"] / (hfu * peak) if hfu else float("nan")  # seconds per timed step, from the HFU
grads = 4 * params  # fp32 gradients, all_reduced by DDP every step
seconds, how = all_reduce_seconds(rows, grads)
md(f"One large square matrix product reached **{peak / 1e9:.1f} GFLOP/s** on each rank's "
   f"{'GPU' if not DEVICE else 'share of the CPU'}; the training steps reached {hfu * peak / 1e9:.1f} GFLOP/s: "
   f"**HFU {hfu:.3f} against the measured peak**. A step multiplies matrices of {batch * tokens} x {WIDTH} "
   f"by {WIDTH} x {3 * WIDTH} and "
   f"smaller, far from the shape that reaches the peak, and spends time on what counts no FLOPs: layer norms, "
   f"softmax, GELU, the gradient clip, the optimizer, Python, and DDP's all_reduce.\n\n"
   + (f"DDP all_reduces the {grads / 1e6:.3f} MB of gradients every step. Timed from the table ({how}), "
      f"that takes about {seconds * 1e3:.1f} ms when it runs alone, "
      f"{seconds / step:.0%} of the {step * 1e3:.0f} ms a step took. DDP overlaps it with the backward pass "
      f"(each bucket's all_reduce starts while earlier layers' gradients are computed): the time alone is the most "
      f"it can add to the step. Whatever splits the model instead "
      f"(next lesson) sends other bytes at other moments, on groups of fewer ranks; lessons 19 and 20 time "
      f"those calls themselves, on their own groups at the sizes their steps send." if m["world_size"] > 1 else
      "With one rank DDP sends nothing."))

# %% [markdown]
# On a GPU node the same run reports NCCL's bandwidth over NVLink and the GPU's matrix-product peak; in
# bf16 (`--precision bf16`) the peak is that of the tensor cores. Expect a far lower HFU there for a model
# this small: its matrices are too small to keep thousands of cores busy. Widening the model
# (exercise 3) makes the matrices larger; in the exercise's runs the FLOP/s reached rose with it.
#
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/18_hardware_limits.md`](../solutions/18_hardware_limits.md).
#
# 1. `--sizes-mib 0.0625 1 16 64` with a small ViT (`--width 32 --depth 2`): the all_reduce's bus
#    bandwidth grows several times over from 0.0625 to 64 MiB: the 0.0625 MiB call takes several times
#    longer than its bytes would at 64 MiB's bandwidth, a fixed cost per call (latency) dominates it.
# 2. The same with `--nproc 4 --sizes-mib 1 16`: each rank now sends 1.5 S per all_reduce instead of S (the
#    formula's 25.166 MB against 16.777 MB at 16 MiB), and busbw = 1.5 x algbw instead of 1 x: bus bandwidth
#    is the number that stays comparable across world sizes, algorithm bandwidth is not.
# 3. `--width 64` against `--width 32` (depth 2): step 1's FLOPs grow 3.6x (0.122 to 0.445 GFLOP per rank)
#    for twice the width, the step time grows less, so the FLOP/s the steps reach rise: in the solution's runs the
#    larger matrices used the core better.
#
# Next: [lesson 19](19_tensor_parallel.ipynb): tensor parallelism, every layer's matrices cut over the ranks.
