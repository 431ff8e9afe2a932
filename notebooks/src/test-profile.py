# %% [markdown]
# # Tool: `test-profile.py`: does profiling work on this machine?
#
# Script: [`day1/test-profile.py`](../day1/test-profile.py).
#
# A small DDP training run on random data, profiled into `./log`: in under a minute it checks the whole
# chain before the real lessons:
#
# 1. the processes start and find each other (a process group, gloo on the CPU or NCCL on GPUs);
# 2. DDP synchronizes gradients;
# 3. `torch.profiler` writes one trace per rank (`rank{r}.<time>.pt.trace.json`);
# 4. rank 0 writes TensorBoard scalars;
# 5. `tensorboard --logdir ./log --host 127.0.0.1` shows them.
#
# No dataset is needed: the images and labels are random tensors, generated in memory with a fixed seed.
# It is a check, not a step of the lesson sequence, so there is no previous lesson to diff against;
# [lesson 5](5_mnist_manual_ddp_profile.ipynb) explains what the traces show.

# %%
from nbhelpers import *

# The one switch. False: 2 CPU ranks, 10 steps. True: one rank per GPU of this node, 50 steps.
FULL_SIZE = False
NPROC = full_size_nproc() if FULL_SIZE else 2
# one GPU per rank, or every rank on the CPU (NCCL cannot put two ranks on one GPU)
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
STEPS = 50 if FULL_SIZE else 10
RUN = run_dir("test-profile")
LOG = RUN / "log"

# %% [markdown]
# ## The profiler's schedule
#
# The script profiles steps 3-5: one step skipped, one traced and thrown away, three recorded.

# %%
draw_profiler_schedule(wait=1, warmup=1, active=3, steps=STEPS)

# %% [markdown]
# ## Run it
#
# Its default log dir is `./log`, as in the original workshop; here `--log-dir` keeps the notebook's files
# apart. (Without a GPU, PyTorch's CUDA build prints `gpuGetDeviceCount failed with code 35` when the
# profiler stops, and the profiler prints `USDT: ... profiler_start/profiler_stop` lines: harmless, so the
# notebook hides them; in a terminal you will see them.)

# %%
out = run_lesson("day1/test-profile.py", *DEVICE, "--steps", STEPS, "--log-dir", LOG, nproc=NPROC)

# %% [markdown]
# ## What it wrote

# %%
files = sorted(p for p in (REPO / LOG).iterdir() if p.is_file())
show_table([{"file": p.name, "KB": p.stat().st_size / 1000} for p in files], floatfmt="{:.0f}")
traces = sorted((REPO / LOG).glob("rank*.pt.trace.json"))
assert len(traces) == NPROC, "one trace per rank"

# %% [markdown]
# ## The traces, drawn
#
# The recorded steps of each rank: DDP's forward, the optimizer, and the gradient all_reduces that gloo (or
# NCCL) runs on its own thread (one bucket for this model: it starts when backward ends; lesson 5).

# %%
plot_trace(traces, spans=("DistributedDataParallel.forward", "Optimizer.zero_grad#SGD.zero_grad",
                          "Optimizer.step#SGD.step"))

# %% [markdown]
# ## The TensorBoard scalars, read back
#
# The same event file TensorBoard reads, opened with TensorBoard's own reader.

# %%
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

events = EventAccumulator(str(REPO / LOG)).Reload()
loss = events.Scalars("train/loss_rank0")
fig, ax = plt.subplots(figsize=(6, 2.6))
ax.plot([e.step for e in loss], [e.value for e in loss], "o-")
ax.set(xlabel="step", ylabel="loss (rank 0)", title="random labels: the loss stays near ln 10 = 2.3")
plt.show()
print("scalars:", events.Tags()["scalars"])

# %% [markdown]
# ## Look at it in TensorBoard
#
# ```bash
# tensorboard --logdir runs/notebooks/test-profile/log --host 127.0.0.1 --port 6006
# ```
#
# then http://127.0.0.1:6006, tab **PyTorch Profiler** (it needs `pip install torch-tb-profiler`, which is
# in requirements.txt; the page loads Google Charts, so the browser needs internet). In JupyterLab:
# `%load_ext tensorboard` and `%tensorboard --logdir ../runs/notebooks/test-profile/log --host 127.0.0.1`.
# On a cluster, run TensorBoard on the compute node and open it through an SSH tunnel (see
# [Profiling: viewing on a cluster](../docs/learners/profiling.md#viewing-on-a-cluster)).
