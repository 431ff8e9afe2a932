"""Lesson 3: N processes each running lesson 2: N times the work, no speed-up, and why.

    python day1/3_mnist_distributed.py --nproc 4 --quick
    torchrun --nproc_per_node=4 day1/3_mnist_distributed.py
    srun --ntasks=4 python day1/3_mnist_distributed.py

Starting a training script N times is not data parallelism.  With the same seed every process draws the
same weights, shuffles the data into the same order, takes the same steps and ends with the same model:
N copies of one result for N times the electricity.  They even slow each other down, sharing the cores.
The process group is used only at the end, to compare what the ranks did; lesson 4 makes them cooperate.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import hashlib
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/
from course.launching.requires import require  # noqa: E402
require(__file__)  # before torch: a torch or package this lesson lacks is one line, not an ImportError

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import RandomSampler

from course.launching import cli
from course.launching.launch import backend_for, launch, setup_device
from course.models import build_model
from course.training import replicas
from course.training.evaluate import evaluate
from course.training.output import rank_print
from data_tools.datasets import InMemoryMNIST, batches, require


def worker(info, args):
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
    require(args.dataset, args.data_dir)
    train_set = InMemoryMNIST(args.dataset, "train", args.data_dir, device, limit=args.train_samples or 0)
    test_set = InMemoryMNIST(args.dataset, "test", args.data_dir, device)
    model = build_model(args.model, args.seed).to(device)  # the same seed everywhere: the same weights
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    shuffle = torch.Generator()
    order = hashlib.sha256()  # what this rank trained on, in order
    step, start = 0, time.perf_counter()
    for epoch in range(args.epochs):
        shuffle.manual_seed(args.seed + epoch)  # lesson 2's shuffle: every rank gets the same order
        indices = list(RandomSampler(train_set, generator=shuffle))
        order.update(torch.tensor(indices).numpy().tobytes())
        for x, y in batches(train_set, indices, args.batch_size):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # no communication: each rank's gradient stays its own
            optimizer.step()
            step += 1
            if step == args.max_steps:
                break
        accuracy, test_loss, counted = evaluate(model, test_set)  # every rank evaluates all: duplicated work
        if rank == 0:
            rank_print(rank, f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {accuracy:.4f} "
                             f"({counted} test images, on every rank)")
        if step == args.max_steps:
            break
    seconds = time.perf_counter() - start
    rank_print(rank, f"{step} steps in {seconds:.1f} s (every rank trains on all {len(train_set)} samples per epoch)")

    mine = replicas.notes(rank, model, order, step, seconds)  # fingerprints of the weights and data order
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)  # DIST: the only communication: compare notes at the end
    if rank == 0:  # DIST: one process writes the outputs
        replicas.report(everyone, args, step, accuracy, model)  # side by side, metrics.json, model.pt
    dist.destroy_process_group()


if __name__ == "__main__":
    p = cli.add_distributed(cli.parser(__doc__, "day1/3_mnist_distributed.py", nproc_default=2,
                                       batch_help="per process (each runs lesson 2)"))
    cli.main(lambda args: (require(args.dataset, args.data_dir), launch(worker, args)), p)
