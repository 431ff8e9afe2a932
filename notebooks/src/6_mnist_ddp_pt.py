# %% [markdown]
# # Lesson 6: PyTorch's `DistributedDataParallel`
#
# Script: [`day1/6_mnist_ddp_pt.py`](../day1/6_mnist_ddp_pt.py).
#
# Wrapping the model in `DistributedDataParallel` (DDP) replaces lesson 4's two manual steps, and does them
# better:
#
# - **At wrap time** DDP broadcasts rank 0's parameters and buffers to every rank: no broadcast loop.
# - **During backward** DDP's hooks collect finished gradients into **buckets** (25 MB by default). Backward
#   computes the gradients from the last layer to the first; as soon as a bucket is full its `all_reduce`
#   starts, while backward is still computing the earlier layers. Communication **overlaps** computation,
#   and many small tensors travel as a few large messages (lesson 4's `--sync flat`, made concurrent).
#   When `loss.backward()` returns, the gradients are already averaged.
#
# What stays the same: the `DistributedSampler` and `set_epoch`, the per-rank batch, and the result. Lesson
# 6 computes exactly lesson 4's training run; this notebook checks that.

# %%
from nbhelpers import *

# The one switch. False: --quick on 2 CPU processes. True: full epochs, one process per GPU of this node.
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick"]
NPROC = full_size_nproc() if FULL_SIZE else 2
# one GPU per rank, or every rank on the CPU (NCCL cannot put two ranks on one GPU)
DEVICE = [] if gpu_count() >= NPROC else ["--device", "cpu"]
RUN = run_dir("6_mnist_ddp_pt")

# %% [markdown]
# ## The picture: buckets and overlap
#
# The MLP's four parameter tensors in the order backward produces their gradients, packed into buckets. With
# the default 25 MB the whole MLP (0.4 MB of gradients) is one bucket; the picture uses a small bucket size
# (`--bucket-cap-mb 0.2`) to show how a larger model is cut up: the first bucket's all_reduce runs while
# backward computes the rest.

# %%
from course.models import build_model

params = list(build_model("mlp", 0).named_parameters())
draw_buckets([p.numel() for _, p in params], bucket_cap=0.2 * 2**20 / 4, names=[n for n, _ in params])

# %% [markdown]
# ## What changed against lesson 4
#
# Lesson 5 (between the two) is lesson 4 under the profiler, so the diff that shows this lesson's idea is
# the one against lesson 4: the broadcast loop, the manual gradient all_reduce and the shard bookkeeping go;
# one `DDP(...)` line comes in.

# %%
show_diff("day1/4_mnist_manual_ddp.py", "day1/6_mnist_ddp_pt.py")

# %% [markdown]
# ## Run it, and lesson 4 with the same settings

# %%
run_lesson("day1/6_mnist_ddp_pt.py", *SIZE, *DEVICE, "--run-dir", RUN, nproc=NPROC)
run_lesson("day1/4_mnist_manual_ddp.py", *SIZE, *DEVICE, "--run-dir", RUN / "lesson4", nproc=NPROC)

# %% [markdown]
# ## Same training run
#
# Both synchronize by averaging the same gradients, so the loss of every step and the final weights agree,
# to the last bit on the CPU.

# %%
from course.output import load_weights

m6, m4 = read_json(RUN / "metrics.json"), read_json(RUN / "lesson4" / "metrics.json")
fig, ax = plt.subplots()
ax.plot(m4["loss_per_step"], lw=4, alpha=0.4, label="lesson 4: manual all_reduce")
ax.plot(m6["loss_per_step"], lw=1, label="lesson 6: DDP")
ax.set(xlabel="step", ylabel="training loss (mean over ranks)",
       title=f"{m6['world_size']} ranks, lesson 4 vs lesson 6")
ax.legend()
plt.show()

w6, w4 = load_weights(REPO / RUN / "model.pt"), load_weights(REPO / RUN / "lesson4" / "model.pt")
worst = max(((w6[k] - w4[k]).abs().max() / w4[k].abs().max()).item() for k in w4)
show_table([{"lesson": 4, "steps": m4["steps"], "train_seconds": m4["train_seconds"],
             "samples_per_second": m4["samples_per_second"], "test_accuracy": m4["test_accuracy"]},
            {"lesson": 6, "steps": m6["steps"], "train_seconds": m6["train_seconds"],
             "samples_per_second": m6["samples_per_second"], "test_accuracy": m6["test_accuracy"]}])
print(f"largest weight difference: {worst:.1e} of the largest weight")
if not FULL_SIZE:
    assert worst < 1e-5

# %% [markdown]
# ## Try it yourself
#
# - `--model cnn`: a model with more layers, where overlap has more to hide.
# - `--bucket-cap-mb 0.1`: several buckets for the MLP. Lesson 5's `--compare` measures what bucketing and
#   overlap buy.
#
# Next: [lesson 7](7_mnist_ddp_pt_timing.ipynb) times this run for 1, 2, ... ranks.
