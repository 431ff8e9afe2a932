"""Lesson 7: time DDP training at several world sizes, and measure what decides whether more ranks pay off.

    python day1/7_mnist_ddp_pt_timing.py 2 --sweep --quick        # world sizes 1 and 2, one after another
    python day1/7_mnist_ddp_pt_timing.py 2 --sweep --quick --model cnn --batch-size 512
    python day1/7_mnist_ddp_pt_timing.py 4                         # one run with 4 ranks (same as --nproc 4)
    torchrun --nproc_per_node=4 day1/7_mnist_ddp_pt_timing.py     # one run; every call adds one row
    srun --ntasks=4 python day1/7_mnist_ddp_pt_timing.py

A data-parallel training step has three parts:

    step = compute + communication not overlapped + fixed costs
    s_W  = c_W     + m_W                          + f_W          (ms, on each of W ranks)

compute is forward + backward on b samples per rank (and the zero_grad before it); communication not
overlapped is what the gradient all_reduce adds to backward (the part DDP could not hide behind it,
waiting for the slowest rank included); fixed costs are the rest of a step: the next batch and the
optimizer's step.  Before training, every rank times each part on its own, a few times, interleaved:
forward + backward inside DDP's `no_sync()` (c), the same with the all_reduce (c + m), and the rest of a
step, with a twin of the optimizer whose learning rate is 0 (the same work, the weights stay as they are).
W ranks do W*b samples per step in s_W ms, one process does b samples in s_1 ms, so the lesson predicts

    speed-up = W * s_1 / s_W

and compares it with the speed-up measured over the whole training.  On a GPU node each rank brings its
own GPU, c_W and f_W stay c_1 and f_1, and only communication stands between you and a speed-up of W.
On one CPU the ranks share the same cores (each gets cores // ranks threads), so W ranks cannot add cores,
only use them differently: more ranks pay off only when one process could not keep its threads busy (small
operations split badly over threads: the sweep measures it for each model) and the all_reduce is small next to
a step.  The MLP's step is so short that the all_reduce of its 0.4 MB of gradients eats any gain.  Other
programs on the machine slow every part (a thread waiting for a core stalls the others), and the table records
how many cores they used during training.  Training time excludes the evaluation.  A speed-up is judged
against 1.0 with its noise: the spread of the speeds of blocks of consecutive steps within each run
(course/measuring/timing.py says how).

Each run appends a row to run_dir/timings.csv; rank 0 rewrites the table (scaling.md, scaling.csv) and the
plot (scaling.png) from the latest run of each world size and configuration; --fresh starts over
(course/measuring/timing.py keeps the table).  --loader memory (the default here, so that the timings are of
training, not of batching) or dataloader, as in lesson 6.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import statistics
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/
from course.launching.requires import require  # noqa: E402
require(__file__)  # before torch: a torch or package this lesson lacks is one line, not an ImportError

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from course.launching import cli
from course.launching.launch import backend_for, detect_launcher, launch, setup_device
from course.measuring import timing
from course.measuring.profiling import add_profile_args, maybe_profile
from course.models import build_model
from course.training import results
from course.training.evaluate import evaluate
from course.training.output import rank_print
from data_tools.datasets import InMemoryMNIST, batches, require


def wait_for(device):
    """GPU work is asynchronous: a clock read before it finishes measures nothing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def endless(loader):
    """The loader's batches, epoch after epoch: the probe may need more batches than one epoch holds."""
    while True:
        yield from loader


def time_steps(model, optimizer, loader, steps, device):
    """Median ms of the parts of a training step on this rank: (forward + backward without the gradient
    all_reduce, forward + backward with it, the rest of a step)."""
    twin = type(optimizer)(model.parameters(), **{**optimizer.defaults, "lr": 0.0})  # lr 0: weights stay
    source = endless(loader)
    x, y = next(source)

    def clocked(part, *args):
        dist.barrier()  # DIST: all ranks start together, so one rank's head start is not counted as waiting
        wait_for(device)
        start = time.perf_counter()
        part(*args)
        wait_for(device)
        return (time.perf_counter() - start) * 1000

    def forward_backward(sync):
        optimizer.zero_grad()  # as in training: backward starts without gradients
        with nullcontext() if sync else model.no_sync():  # DDP: no_sync() skips the all_reduce
            F.cross_entropy(model(x), y).backward()

    def rest():  # what a training step does besides zero_grad, forward and backward
        next(source), twin.step()

    times = [(clocked(forward_backward, False), clocked(forward_backward, True), clocked(rest))
             for _ in range(steps + 3)]  # interleaved: the same noise; the first 3 warm up (memory, kernels)
    return [statistics.median(part) for part in zip(*times[3:])]


def worker(info, args):
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
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
    numel = sum(p.numel() for p in model.parameters())
    compute_ms, synced_ms, fixed_ms = time_steps(model, optimizer, loader, args.probe_steps, device)
    allreduce_ms = timing.time_allreduce(numel, args.probe_steps, device)  # the wire cost alone
    probe = torch.tensor([compute_ms, synced_ms, fixed_ms, allreduce_ms], dtype=torch.float64, device=device)
    dist.all_reduce(probe)  # DIST: the mean over ranks of each rank's medians
    compute_ms, synced_ms, fixed_ms, allreduce_ms = (probe / world_size).tolist()
    comm_ms = max(0.0, synced_ms - compute_ms)

    cpu = timing.cpu_seconds()  # this node's busy CPU time and this rank's: what other programs took
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
    others = torch.tensor(timing.other_cores(cpu, info.local_world_size), dtype=torch.float64, device=device)
    dist.all_reduce(others)  # DIST: the cores other programs kept busy on every node during training
    prof.close()
    rank_print(rank, f"{step} steps in {seconds:.1f} s (this rank's shard: {len(sampler)} samples per epoch)")

    losses = results.mean_over_ranks(losses)  # DIST: the loss of each global batch, averaged over ranks
    if rank == 0:  # DIST: one process writes the outputs
        samples = min(step * world_size * args.batch_size, args.epochs * world_size * len(sampler))
        run = args.run_dir
        row = timing.row(args, world_size, device, epoch + 1, samples, step_seconds, compute_ms, comm_ms,
                         fixed_ms, allreduce_ms, others.item())
        table = timing.record(run, row, fresh=args.fresh)  # timings.csv, scaling.csv/.md/.png
        # metrics.json, model.pt, loss.png; this lesson's closing lines are the table and its verdict
        results.write(args, model, losses, seconds, accuracy, test_loss, len(sampler), line=False, timing=row)
        print(timing.markdown(table), flush=True)
        timing.explain(row, table, numel, run)  # does this world size pay off, and why
    dist.destroy_process_group()


def run(args, parser):
    launcher = detect_launcher(args)
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
    timing.add_args(p)  # `python 7_mnist_ddp_pt_timing.py 4`, as in the original workshop, --sweep, --fresh
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0,
                   help="DDP's gradient bucket size in MB (the MLP's gradients are 0.4 MB: one bucket)")
    return add_profile_args(p)


if __name__ == "__main__":
    parser = build_parser()
    cli.main(lambda args: run(args, parser), parser)
