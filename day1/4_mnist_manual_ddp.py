"""Lesson 4: data parallelism by hand: DistributedSampler + an all_reduce of the gradients.

    python day1/4_mnist_manual_ddp.py --nproc 2 --quick
    python day1/4_mnist_manual_ddp.py --nproc 4 --sync flat           # one all_reduce per step
    torchrun --nproc_per_node=4 day1/4_mnist_manual_ddp.py
    srun --ntasks=4 python day1/4_mnist_manual_ddp.py

Three lines turn lesson 3's N copies into one training run on N times the data per step:
1. identical starting weights: rank 0's are broadcast to everyone;
2. a DistributedSampler gives each rank its own disjoint shard of every epoch (`set_epoch` reshuffles);
3. after backward, gradients are averaged across ranks with all_reduce, so every rank takes the same step.
With W ranks of batch b each, one step equals one process stepping on the global batch of W*b samples
(lesson 2 with --batch-size W*b): the mean of W per-rank mean gradients is the mean gradient of the union.

`--sync per-param` (the default, as the original workshop) calls all_reduce once per parameter tensor;
`--sync flat` copies all gradients into one buffer and reduces it once: fewer, larger messages, the idea
behind torch DDP's gradient buckets (lesson 6).  --batch-size is per rank.
--loader dataloader (the default) is the loop to write for any dataset: a DataLoader over the
DistributedSampler; --loader memory gives the same batches in the same order from the in-memory tensors.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
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
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from course.launching import cli
from course.launching.launch import backend_for, launch, setup_device
from course.measuring.profiling import add_profile_args, maybe_profile
from course.models import build_model
from course.training import results
from course.training.evaluate import evaluate
from course.training.output import rank_print, write_json
from data_tools.datasets import InMemoryMNIST, batches, require


def average_gradients(model, world_size):
    """The original workshop's version: one all_reduce per parameter tensor (4 for the MLP)."""
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)  # DDP: sum of every rank's gradient...
        p.grad /= world_size                           # DDP: ...divided by W is their mean


def average_gradients_flat(model, world_size):
    """All gradients in one contiguous buffer, one all_reduce: fewer messages, less latency."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # DDP: one message instead of len(grads)
    flat /= world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def worker(info, args):
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
    require(args.dataset, args.data_dir)
    train_set = InMemoryMNIST(args.dataset, "train", args.data_dir, device, limit=args.train_samples or 0)
    test_set = InMemoryMNIST(args.dataset, "test", args.data_dir, device)

    # Each rank draws its own random weights (seed + rank makes that visible)...
    model = build_model(args.model, args.seed + rank).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)  # DDP: ...and then takes rank 0's, so all ranks start identical
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sync = {"per-param": average_gradients, "flat": average_gradients_flat}[args.sync]

    # DDP: rank r gets every W-th index of the epoch's shuffled order; padded so all shards are equal
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    shards = [None] * world_size
    dist.all_gather_object(shards, list(sampler))  # DIST: epoch 0's shards, to show they are disjoint
    if args.loader == "dataloader":  # the loop to write for your own dataset
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    else:  # the same batches, each gathered from the in-memory tensors at once (data_tools/datasets.py)
        loader = batches(train_set, sampler, args.batch_size)

    prof = maybe_profile(args, rank, device)  # --profile: lesson 5's traces and TensorBoard scalars
    losses, step, start = [], 0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            sync(model, world_size)  # DDP: every rank now holds the same averaged gradient
            optimizer.step()
            losses.append(loss.detach())
            step += 1
            prof.step(loss, world_size * len(y))
            if step == args.max_steps:
                break
        accuracy, test_loss, counted = evaluate(model, test_set, rank, world_size)
        prof.epoch(epoch, accuracy, test_loss)
        if rank == 0:
            rank_print(rank, f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {accuracy:.4f} "
                             f"({counted} test images, each counted once)")
        if step == args.max_steps:
            break
    seconds = time.perf_counter() - start
    prof.close()
    rank_print(rank, f"{step} steps in {seconds:.1f} s (this rank's shard: {len(sampler)} samples per epoch)")

    losses = results.mean_over_ranks(losses)  # DIST: the loss of each global batch, averaged over ranks
    if rank == 0:  # DIST: one process writes the outputs
        # metrics.json, model.pt, loss.png and the line that sums it up
        results.write(args, model, losses, seconds, accuracy, test_loss, len(sampler), sync=args.sync)
        write_json(args.run_dir / "shards.json", {"dataset_size": len(train_set), "epoch": 0, "shards": shards})
    dist.destroy_process_group()


def build_parser():
    p = cli.add_loader(cli.add_distributed(cli.parser(__doc__, "day1/4_mnist_manual_ddp.py", nproc_default=2)))
    return add_profile_args(cli.add_sync(p))  # --sync per-param or flat; --profile


if __name__ == "__main__":
    cli.main(lambda args: (require(args.dataset, args.data_dir), launch(worker, args)), build_parser())
