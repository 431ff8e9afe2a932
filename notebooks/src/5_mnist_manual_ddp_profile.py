# %% [markdown]
# # Lesson 5: profiling the training run: one trace per rank, TensorBoard, and what gradient sync costs
#
# Script: [`day1/5_mnist_manual_ddp_profile.py`](../day1/5_mnist_manual_ddp_profile.py).
#
# Lesson 4 trains correctly; this lesson asks where the time goes. `torch.profiler.profile` records every
# operator a rank runs, with input shapes, memory and Python call stacks, for a few training steps chosen
# by a **schedule**: skip `--wait` steps, trace `--warmup` steps and throw them away (the profiler's own
# start-up cost), then record `--active` steps. `tensorboard_trace_handler` writes **one trace per rank**
# (`rank0.<time>.pt.trace.json`, `rank1...`) into `--log-dir`, next to TensorBoard scalars from rank 0.
#
# The new question a process group raises: how long does each rank **compute**, how long does it
# **communicate**, and how long does it **wait** for the others? The script names its phases with
# `record_function("forward" / "backward" / "gradient sync")` so they are easy to find, and `--compare`
# trains three times with three ways of synchronizing the gradients:
#
# | `--sync` | what it does | messages per step |
# |---|---|---|
# | `per-param` | lesson 4's default: one all_reduce per parameter tensor, after backward | 4 (the MLP) |
# | `flat` | all gradients copied into one buffer, one all_reduce after backward | 1 |
# | `ddp` | lesson 6's torch DDP: bucketed all_reduce started from inside backward | 1 bucket |

# %%
from nbhelpers import *

# The one switch. False: 2 CPU ranks, 20 steps per variant (the profiler records 3 of them).
# True: full epochs, one rank per GPU of this node (the traces then include the GPU kernels).
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick", "--max-steps", 20]
NPROC = full_size_nproc() if FULL_SIZE else 2
# one GPU per rank, or every rank on the CPU (NCCL cannot put two ranks on one GPU)
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
RUN = run_dir("5_mnist_manual_ddp_profile")
LOG = RUN / "log"

# %% [markdown]
# ## The profiler's schedule
#
# Only the *active* steps are recorded. They are slower than normal steps (the profiler is watching), so
# compare proportions between phases and variants, not absolute times.

# %%
draw_profiler_schedule(wait=1, warmup=1, active=3)

# %% [markdown]
# ## What changed against lesson 4
#
# Lesson 4's training loop, unchanged, inside `with profile(...)`, plus `profiler.step()` after every step,
# the `record_function` labels, a TensorBoard `SummaryWriter` on rank 0, and the `ddp` variant.

# %%
show_diff("day1/4_mnist_manual_ddp.py", "day1/5_mnist_manual_ddp_profile.py")

# %% [markdown]
# ## Run it: three synchronization variants, profiled
#
# Rank 0 prints, for each variant, the costliest operators of the recorded steps (`prof.key_averages()`),
# and at the end a table computed from every rank's trace: all_reduce calls and bytes per step,
# communication time, and how much of it overlaps backward. (On a machine without a GPU, PyTorch's CUDA
# build prints `gpuGetDeviceCount failed with code 35` each time the profiler stops, and the profiler prints
# `USDT: ... profiler_start/profiler_stop` lines: harmless, so the notebook hides them; in a terminal you
# will see them.)

# %%
out = run_lesson("day1/5_mnist_manual_ddp_profile.py", *SIZE, *DEVICE, "--compare", "--log-dir", LOG,
                 "--run-dir", RUN, nproc=NPROC)

# %% [markdown]
# ## Where the time goes, rank by rank
#
# The traces are Chrome trace files. TensorBoard draws them in its *Trace* view; here is the same
# information drawn with matplotlib for the `per-param` variant: on each rank's main thread the forward
# pass, backward, the gradient sync and the optimizer step, and below it the collectives that gloo runs on
# its own threads. With one message per parameter tensor, the "gradient sync" phase is a chain of small
# all_reduces, each a round trip between the ranks. Where one rank reaches its sync later than the other,
# the other's all_reduce bars grow: that time is waiting, not transfer.

# %%
plot_trace(sorted((REPO / LOG / "per-param" / "chrome_trace").glob("rank*.json")), title="--sync per-param")

# %% [markdown]
# And the `ddp` variant. Here the all_reduce *starts* inside the `backward` span: DDP launches it from a
# hook on the gradients and waits for its buckets' results at the end of backward. The bar of the collective
# on gloo's own thread can still end after the main thread has moved on (past backward, sometimes past the
# end of the step): the two threads record their times independently. Starting inside backward is not the
# same as overlapping, though: the table below counts as overlap only the time during which backward was
# still *computing* gradients. The MLP's 0.4 MB of gradients make one bucket,
# whose all_reduce can only start when the last gradient exists, so its overlap is 0% or close to it.
# [Lesson 6](6_mnist_ddp_pt.ipynb) shows a model cut into several buckets, where it is not.

# %%
plot_trace(sorted((REPO / LOG / "ddp" / "chrome_trace").glob("rank*.json")), title="--sync ddp")

# %% [markdown]
# ## The three variants side by side
#
# `comparison.json` holds the table the run printed, computed from the traces (mean over ranks and
# recorded steps). The bytes are the same for all three: what differs is how many messages carry them and
# when they are sent.

# %%
rows = read_json(RUN / "comparison.json")
show_table([{"sync": name, "all_reduce per step": r["all_reduce_per_step"],
             "KB per step": r["bytes_per_step"] / 1000, "comm ms per step": r["comm_ms_per_step"],
             "overlap with backward": f"{r['overlap_fraction']:.0%}", "step ms": r["step_ms"]}
            for name, r in rows.items()])
fig, axes = plt.subplots(1, 2, figsize=(9, 3))
axes[0].bar(list(rows), [r["all_reduce_per_step"] for r in rows.values()], color=RANK_COLORS[:3])
axes[0].set(title="all_reduce calls per step")
axes[1].bar(list(rows), [r["step_ms"] - r["comm_ms_per_step"] for r in rows.values()], label="rest of the step")
axes[1].bar(list(rows), [r["comm_ms_per_step"] for r in rows.values()],
            bottom=[r["step_ms"] - r["comm_ms_per_step"] for r in rows.values()], label="communication")
axes[1].set(ylabel="ms per profiled step", title="a profiled step")
axes[1].legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Viewing the traces in TensorBoard
#
# Each variant's directory holds one `rank*.pt.trace.json` per rank and rank 0's TensorBoard scalars (loss,
# accuracy, samples/s). In a terminal, from the repository root:
#
# ```bash
# tensorboard --logdir runs/notebooks/5_mnist_manual_ddp_profile/log --host 127.0.0.1 --port 6006
# ```
#
# then open http://127.0.0.1:6006 and choose **PyTorch Profiler** (Overview, Operator, Trace, Memory,
# Module, and the **Distributed** view: computation, communication and waiting per rank). Inside JupyterLab
# the same works in a cell: `%load_ext tensorboard` then `%tensorboard --logdir ... --host 127.0.0.1`. On a
# cluster, start it on the compute node and reach it through the SSH tunnel described in
# [Profiling: viewing on a cluster](../docs/learners/profiling.md#viewing-on-a-cluster). The
# profiler page loads Google Charts from the internet, so the browser needs internet access; the traces also
# open in https://ui.perfetto.dev (the copies in `chrome_trace/`).

# %%
for path in sorted((REPO / LOG).glob("*/*.pt.trace.json")):
    print(f"{path.relative_to(REPO)}  {path.stat().st_size / 1e6:.1f} MB")

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/5_mnist_manual_ddp_profile.md`](../solutions/5_mnist_manual_ddp_profile.md).
#
# 1. `--model cnn --sync ddp`: more compute per step for fewer bytes (0.18 MB of gradients). You should see
#    177.7 KB per step instead of 407.1 and a longer `step ms` than the MLP's. `comm ms` counts the time a
#    rank waits in the all_reduce, including waiting for the slower rank, so its share of the step moves
#    with how busy the machine is: compare it between your two runs, not with a fixed number.
# 2. `--sync ddp --bucket-cap-mb 0.005`: a bucket closes once it holds at least the cap, so the MLP's three
#    small tensors (5.7 KB) make one bucket and its large first-layer weight another. You should see
#    `all_reduce per step` 2.0 instead of 1.0. (`0.1` is not small enough: the small tensors plus the large
#    one are the first bucket to reach 0.1 MB, and everything is still one bucket.)
# 3. `--model cnn --sync ddp --bucket-cap-mb 0.01`: you should see 3.0 all_reduces per step and an
#    `overlap with backward` above 0%: the first buckets travel while backward computes the earlier layers.
#
# Next: [lesson 6](6_mnist_ddp_pt.ipynb): DDP in its own script.
