# %% [markdown]
# # Lesson 2: the single-process baseline
#
# Script: [`day1/2_mnist_training.py`](../day1/2_mnist_training.py).
#
# Before distributing anything, one process trains a small classifier on Fashion-MNIST (28x28 grey images
# of clothes, 10 classes, 60 000 for training and 10 000 for testing). Everything the next lessons
# distribute is here in its simplest form:
#
# - **data**: the whole training set lives in memory as one float32 tensor (its size is printed below); a batch
#   is one index into it;
# - **model**: the original workshop's MLP, 784 -> 128 -> 10 (or `--model cnn`);
# - **loop**: for each batch, forward, loss, `backward()` for the gradients, `optimizer.step()`;
# - **result**: the loss per step, the test accuracy over all 10 000 test images, the weights.
#
# One detail matters later: the shuffle of epoch *e* is seeded with `seed + e`, exactly as PyTorch's
# `DistributedSampler` seeds it. That is what lets lessons 4 and 6 be checked against this script: W ranks
# with batch *b* each must take the same steps as this script with batch W*b.

# %%
from nbhelpers import *

# The one switch. False: --quick, 1 epoch on 12 800 samples (seconds on a laptop).
# True: the script's defaults, 2 epochs on all 60 000 samples (on a GPU if there is one).
FULL_SIZE = False
SIZE = [] if FULL_SIZE else ["--quick"]
RUN = run_dir("2_mnist_training")

# %% [markdown]
# ## What changed against lesson 1
#
# Nothing carries over: lessons 0 and 1 were about processes talking, this one is about training, with a
# single process and no communication at all. So instead of a diff, the size of the change:

# %%
show_diff_stats("day1/1_torch_dist_gpu.py", "day1/2_mnist_training.py")

# %% [markdown]
# ## The data
#
# A look at what the model learns to tell apart: the first test images and their labels, read from the
# prepared data dir as the script reads them.

# %%
from data_tools.datasets import DEFAULT_DATASET, load_split, spec

images, labels = load_split(DEFAULT_DATASET, "test")
classes = spec(DEFAULT_DATASET).classes
fig, axes = plt.subplots(1, 8, figsize=(9, 1.5))
for i, ax in enumerate(axes.flat):
    ax.imshow(images[i], cmap="gray_r")
    ax.set_title(classes[labels[i]], fontsize=8)
    ax.axis("off")
plt.show()
train_images, _ = load_split(DEFAULT_DATASET, "train")
n, pixels = len(train_images), train_images[0].numel()
md(f"The training set: {n:,} images of {pixels} pixels, {n * pixels / 1e6:.0f} MB as the uint8 files store them, "
   f"{n * pixels * 4 / 1e6:.0f} MB as the float32 tensor the script trains from: it fits in memory (and on a GPU).")

# %% [markdown]
# ## Run it

# %%
out = run_lesson("day1/2_mnist_training.py", *SIZE, "--run-dir", RUN)

# %% [markdown]
# ## What the run wrote
#
# `metrics.json` holds the numbers, including the loss of every step; `model.pt` the weights. The loss of a
# single batch is noisy, so the plot adds a moving mean over 20 steps.

# %%
m = read_json(RUN / "metrics.json")
loss = m["loss_per_step"]
window = 20
smooth = [sum(loss[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(loss))]
fig, ax = plt.subplots()
ax.plot(range(1, len(loss) + 1), loss, alpha=0.35, label="loss of each batch")
ax.plot(range(1, len(loss) + 1), smooth, label=f"moving mean over {window} steps")
ax.set(xlabel="step", ylabel="training loss (cross-entropy)",
       title=f"{m['model']} on {m['dataset']}, batch {m['batch_size']}: test accuracy {m['test_accuracy']:.3f}")
ax.legend()
plt.show()
show_table([{k: m[k] for k in ("steps", "samples_seen", "train_seconds", "samples_per_second", "test_accuracy")}])

# %% [markdown]
# ## The trained model at work
#
# Load `model.pt` (a plain state dict, on the CPU) and classify the first 16 test images. Titles are the
# model's answers; red ones are mistakes, with the true label in brackets.

# %%
import torch

from course.models import build_model
from course.training.output import load_weights
from data_tools.datasets import InMemoryMNIST

model = build_model(m["model"], seed=0)
model.load_state_dict(load_weights(REPO / RUN / "model.pt"))
model.eval()
test_set = InMemoryMNIST(DEFAULT_DATASET, "test")
x, y = test_set[list(range(16))]
with torch.no_grad():
    predicted = model(x).argmax(1)
fig, axes = plt.subplots(2, 8, figsize=(9, 3))
for i, ax in enumerate(axes.flat):
    ax.imshow(images[i], cmap="gray_r")
    right = predicted[i] == y[i]
    ax.set_title(classes[predicted[i]] + ("" if right else f"\n({classes[y[i]]})"), fontsize=8,
                 color="black" if right else "red")
    ax.axis("off")
plt.show()

# %% [markdown]
# ## Try it yourself
#
# Solutions, with the commands and what they print: [`solutions/2_mnist_training.md`](../solutions/2_mnist_training.md).
#
# 1. `--model cnn` (with `--quick`): fewer parameters than the MLP but much more compute per sample. You
#    should see the run take several times longer than the MLP's above, and, after the same 200 steps, a
#    *lower* test accuracy: the CNN has not caught up yet in so few steps (run without `--quick` to compare
#    after full epochs).
# 2. `--batch-size 128` (with `--quick`): you should see `trained 100 steps (12800 samples)`: half the
#    steps per epoch. Lesson 4 will show that 2 ranks with batch 64 each take *exactly* these steps (the same
#    test accuracy, to the last digit printed).
#
# Next: [lesson 3](3_mnist_distributed.ipynb) starts this script N times, and shows why that is not yet
# parallel training.
