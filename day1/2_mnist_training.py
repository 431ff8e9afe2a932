"""Lesson 2: the single-process baseline: data, model, training loop, loss curve, test accuracy.

    python day1/2_mnist_training.py                 # 2 epochs of Fashion-MNIST with the MLP
    python day1/2_mnist_training.py --quick         # 1 epoch on 12 800 samples: seconds on a laptop
    python day1/2_mnist_training.py --model cnn --dataset mnist

Everything later lessons distribute is here in its simplest form.  Two choices matter later:
- the whole dataset lives in memory as one float32 tensor (188 MB; the files hold it as 47 MB of uint8),
  and a batch is one tensor index;
- the shuffle of epoch e is seeded with `seed + e`, exactly as DistributedSampler seeds it, so lessons 4 and
  6 can be checked against this script: W ranks with batch b must match this script with batch W*b.
Tags (from lesson 3 on): `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed
line.  This lesson has neither.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/
from course.launching.requires import require  # noqa: E402
require(__file__)  # before torch: a torch or package this lesson lacks is one line, not an ImportError

import torch
import torch.nn.functional as F
from torch.utils.data import RandomSampler

from course.launching import cli
from course.launching.launch import detect_launcher, setup_device
from course.models import build_model
from course.training.evaluate import evaluate
from course.training.output import plot_curves, save_weights, write_json
from data_tools.datasets import InMemoryMNIST, batches, require


def train(args):
    device = setup_device(args.device, local_rank=0)
    require(args.dataset, args.data_dir)
    train_set = InMemoryMNIST(args.dataset, "train", args.data_dir, device, limit=args.train_samples or 0)
    test_set = InMemoryMNIST(args.dataset, "test", args.data_dir, device)
    model = build_model(args.model, args.seed).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    shuffle = torch.Generator()
    losses = []  # one 0-d tensor per step; .item() each step would wait for the GPU every step
    step, start = 0, time.perf_counter()
    for epoch in range(args.epochs):
        shuffle.manual_seed(args.seed + epoch)  # the order DistributedSampler(num_replicas=1) would give
        for x, y in batches(train_set, RandomSampler(train_set, generator=shuffle), args.batch_size):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
            step += 1
            if step == args.max_steps:
                break
        accuracy, test_loss, _ = evaluate(model, test_set)
        print(f"epoch {epoch}: train loss {losses[-1].item():.4f}, test loss {test_loss:.4f}, "
              f"test accuracy {accuracy:.4f}", flush=True)
        if step == args.max_steps:
            break
    seconds = time.perf_counter() - start

    losses = torch.stack(losses).tolist()
    samples = min(step * args.batch_size, args.epochs * len(train_set))
    run = args.run_dir
    write_json(run / "metrics.json", {
        "lesson": "2_mnist_training", "dataset": args.dataset, "model": args.model, "world_size": 1,
        "batch_size": args.batch_size, "global_batch_size": args.batch_size, "lr": args.lr,
        "epochs": args.epochs, "steps": step, "samples_seen": samples, "train_seconds": seconds,
        "samples_per_second": samples / seconds, "test_accuracy": accuracy, "test_loss": test_loss,
        "loss_per_step": losses})
    save_weights(run / "model.pt", model)
    plot_curves(run / "loss.png", {"1 process": (range(1, step + 1), losses)}, "step",
                "training loss (cross-entropy)", f"{args.model} on {args.dataset}, batch {args.batch_size}")
    print(f"trained {step} steps ({samples} samples) in {seconds:.1f} s ({samples / seconds:,.0f} samples/s) "
          f"on {device}; test accuracy {accuracy:.4f} over the {len(test_set)} test images")
    print(f"outputs: {run}/metrics.json, {run}/loss.png, {run}/model.pt")


def run(args):
    if detect_launcher() != "self":
        import os

        if int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_STEP_NUM_TASKS", "1"))) > 1:
            raise cli.CourseError("lesson 2 is the single-process baseline: start it with one process "
                                  "(lesson 3 shows what N copies of it do)")
    train(args)


if __name__ == "__main__":
    cli.main(run, cli.parser(__doc__, "day1/2_mnist_training.py", batch_help="one process"))
