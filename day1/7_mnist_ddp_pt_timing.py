"""Lesson 7: time DDP training at several world sizes, and measure what decides whether more ranks pay off.

    python day1/7_mnist_ddp_pt_timing.py 2 --sweep --quick        # world sizes 1 and 2, one after another
    python day1/7_mnist_ddp_pt_timing.py 2 --sweep --quick --model cnn --batch-size 512
    python day1/7_mnist_ddp_pt_timing.py 4                         # one run with 4 ranks (same as --nproc 4)
    torchrun --nproc_per_node=4 day1/7_mnist_ddp_pt_timing.py     # one run; every call adds one row
    srun --ntasks=4 python day1/7_mnist_ddp_pt_timing.py

A data-parallel step is compute (forward + backward on b samples per rank) plus communication (the
all_reduce of the gradients, and waiting for the slowest rank).  Before training, every rank times a few
steps inside DDP's `no_sync()` (compute alone) and a few without it (compute + all_reduce); the difference
is what communication costs per step.  W ranks do W*b samples per step in c_W + m_W ms, one process does
b samples in c_1 ms, so

    speed-up = W * c_1 / (c_W + m_W)

On a GPU node each rank brings its own GPU, c_W stays c_1, and only communication stands between you and
a speed-up of W.  On one CPU the ranks share the same cores (each gets cores // ranks threads), so W ranks
cannot add cores, only use them differently: more ranks pay off only when one process could not keep its
threads busy (the CNN's small convolutions at batch 512) and the all_reduce is small next to a step.  The
MLP's step is so short that the all_reduce of its 0.4 MB of gradients eats any gain.  On an idle 2-core
VM (--quick) 2 ranks x 1 thread ran the CNN at batch 512 1.05-1.31x faster than 1 process x 2 threads
(this sweep and benchmarks/bench.py, 2026-11-22), and the MLP slower at every batch size.  On a busy
machine (load above the number of cores) threads wait for cores and stall each other, and 1 process x 2
threads crawls: at load 6-8 on 2 cores 2 ranks x 1 thread were 3.5x (CNN) to 15-25x (MLP) faster, which
says more about the load than about DDP.  So every row records the load, and the lesson warns when it is
high.  Training time excludes the evaluation.  A speed-up is judged against 1.0 with its noise: the spread
of the speeds of blocks of consecutive steps within each run (course/timing.py says how).

Each run appends a row to run_dir/timings.csv; rank 0 rewrites the table (scaling.md, scaling.csv) and the
plot (scaling.png) from the latest run of each world size and configuration; --fresh starts over
(course/timing.py keeps the table).  --loader memory (the default here, so that the timings are of
training, not of batching) or dataloader, as in lesson 6.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import os
import statistics
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from course import cli, results, timing
from course.evaluate import evaluate
from course.launch import backend_for, detect_launcher, launch, setup_device
from course.models import build_model
from course.output import rank_print
from course.profiling import add_profile_args, maybe_profile
from data_tools.datasets import InMemoryMNIST, batches, require


def wait_for(device):
    """GPU work is asynchronous: a clock read before it finishes measures nothing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(model, x, y, steps, device):
    """Median ms of forward + backward on this rank: (without the gradient all_reduce, with it)."""
    def one(sync):
        model.zero_grad(set_to_none=True)
        dist.barrier()  # DIST: all ranks start together, so one rank's head start is not counted as waiting
        wait_for(device)
        start = time.perf_counter()
        with nullcontext() if sync else model.no_sync():  # DDP: no_sync() skips the all_reduce
            F.cross_entropy(model(x), y).backward()
        wait_for(device)
        return (time.perf_counter() - start) * 1000

    for _ in range(3):  # warm-up: the first calls allocate memory and pick kernels
        one(False), one(True)
    compute, synced = zip(*[(one(False), one(True)) for _ in range(steps)])  # interleaved: same noise
    model.zero_grad(set_to_none=True)
    return statistics.median(compute), statistics.median(synced)


def worker(info, args):
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout))
    if rank == 0 and info.launcher != "self" and args.asked and args.asked != world_size:
        rank_print(rank, f"{info.launcher} started {world_size} ranks; the {args.asked} asked for is ignored")
    require(args.dataset, args.data_dir)
    train_set = InMemoryMNIST(args.dataset, "train", args.data_dir, device, limit=args.train_samples or 0)
    test_set = InMemoryMNIST(args.dataset, "test", args.data_dir, device)

    model = build_model(args.model, args.seed + rank).to(device)
    # DDP: broadcasts rank 0's weights at wrap time, then all_reduces gradient buckets during backward
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # DDP: rank r gets every W-th index of the epoch's shuffled order; padded so all shards are equal
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    if args.loader == "dataloader":  # the loop to write for your own dataset
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    else:  # the same batches, each gathered from the in-memory tensors at once (data_tools/datasets.py)
        loader = batches(train_set, sampler, args.batch_size)
    x, y = next(iter(batches(train_set, sampler, args.batch_size)))  # a real batch; no optimizer step
    numel = sum(p.numel() for p in model.parameters())
    compute_ms, synced_ms = time_steps(model, x, y, args.probe_steps, device)
    allreduce_ms = timing.time_allreduce(numel, args.probe_steps, device)  # the wire cost alone
    probe = torch.tensor([compute_ms, synced_ms, allreduce_ms], dtype=torch.float64, device=device)
    dist.all_reduce(probe)  # DIST: the mean over ranks of each rank's medians
    compute_ms, synced_ms, allreduce_ms = (probe / world_size).tolist()
    comm_ms = max(0.0, synced_ms - compute_ms)

    load = os.getloadavg()[0]  # processes wanting a core, averaged over the last minute: others' too
    prof = maybe_profile(args, rank, device)  # --profile: lesson 5's traces and TensorBoard scalars
    losses, step, step_seconds = [], 0, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        ticks = [time.perf_counter()]  # the clock stops before the evaluation
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP: gradients arrive averaged over ranks when backward returns
            optimizer.step()
            losses.append(loss.detach())
            step += 1
            prof.step(loss, world_size * len(y))
            ticks.append(time.perf_counter())  # step times: their spread is the noise of samples/s
            if step == args.max_steps:
                break
        wait_for(device)
        ticks[-1] = time.perf_counter()
        step_seconds += [b - a for a, b in zip(ticks, ticks[1:])]
        accuracy, test_loss, counted = evaluate(model.module, test_set, rank, world_size)
        prof.epoch(epoch, accuracy, test_loss)
        if rank == 0:
            rank_print(rank, f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {accuracy:.4f} "
                             f"({counted} test images, each counted once)")
        if step == args.max_steps:
            break
    seconds = sum(step_seconds)
    prof.close()
    rank_print(rank, f"{step} steps in {seconds:.1f} s (this rank's shard: {len(sampler)} samples per epoch)")

    losses = results.mean_over_ranks(losses)  # DIST: the loss of each global batch, averaged over ranks
    if rank == 0:  # DIST: one process writes the outputs
        samples = min(step * world_size * args.batch_size, args.epochs * world_size * len(sampler))
        run = args.run_dir
        row = timing.row(args, world_size, device, epoch + 1, samples, step_seconds, compute_ms, comm_ms,
                         allreduce_ms, load)
        table = timing.record(run, row, fresh=args.fresh)  # timings.csv, scaling.csv/.md/.png
        # metrics.json, model.pt, loss.png; this lesson's closing lines are the table and its verdict
        results.write(args, model, losses, seconds, accuracy, test_loss, len(sampler), line=False, timing=row)
        print(timing.markdown(table), flush=True)
        timing.explain(row, table, numel, run)  # does this world size pay off, and why
    dist.destroy_process_group()


def run(args, parser):
    launcher = detect_launcher()
    args.asked = args.nproc = timing.world_size_asked(args, parser)  # under torchrun/srun the launcher's wins
    args.nproc = args.nproc or 2
    require(args.dataset, args.data_dir)
    if args.fresh and launcher == "self":
        (args.run_dir / "timings.csv").unlink(missing_ok=True)
        args.fresh = False  # a sweep starts over once, then adds a row per world size
    for world_size in range(1, args.nproc + 1) if args.sweep else [args.nproc]:
        launch(worker, args, nproc=world_size)  # a sweep: a fresh set of processes for every world size


def build_parser():
    p = cli.add_loader(cli.add_distributed(cli.parser(__doc__, "day1/7_mnist_ddp_pt_timing.py")), "memory")
    timing.add_world_size(p)  # `python 7_mnist_ddp_pt_timing.py 4`, as in the original workshop, or --nproc 4
    p.add_argument("--sweep", action="store_true",
                   help="run world sizes 1, 2, ..., N one after another, N from world_size or --nproc "
                        "(plain python only)")
    p.add_argument("--fresh", action="store_true", help="drop the earlier rows of run_dir/timings.csv first")
    p.add_argument("--probe-steps", type=cli.positive_int, default=20,
                   help="steps timed with and without the gradient all_reduce before training")
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0,
                   help="DDP's gradient bucket size in MB (the MLP's gradients are 0.4 MB: one bucket)")
    return add_profile_args(p)


if __name__ == "__main__":
    parser = build_parser()
    cli.main(lambda args: run(args, parser), parser)
