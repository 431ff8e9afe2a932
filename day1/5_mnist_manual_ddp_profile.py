"""Lesson 5: lesson 4 under torch.profiler: one trace per rank, TensorBoard, and what gradient sync costs.

    python day1/5_mnist_manual_ddp_profile.py --nproc 2 --quick
    tensorboard --logdir ./log_ddp --host 127.0.0.1                      # then open http://127.0.0.1:6006
    python day1/5_mnist_manual_ddp_profile.py --nproc 2 --quick --compare   # per-param vs flat vs ddp
    torchrun --nproc_per_node=4 day1/5_mnist_manual_ddp_profile.py --sync flat
    srun --ntasks=4 python day1/5_mnist_manual_ddp_profile.py

Lesson 4's training run, unchanged, inside `torch.profiler.profile`.  The profiler records every operator
each rank runs (with shapes, memory and Python stacks) for a few training steps chosen by a schedule:
skip `--wait` steps, trace `--warmup` steps and throw them away (the profiler's own start-up cost), then
record `--active` steps.  Each rank writes its own trace (`tensorboard_trace_handler`, worker `rank{r}`)
into --log-dir, next to TensorBoard scalars from rank 0 (loss, accuracy, samples/s, epoch time).
TensorBoard's PyTorch Profiler tab then shows the Overview, Operator, Trace, Memory and Module views and,
because the traces come from a process group, the Distributed view: how long each rank computes, talks,
and waits for the others.

Gradient synchronization is where data parallelism pays: `--sync per-param` (lesson 4's default, one
all_reduce per parameter tensor), `--sync flat` (one all_reduce of one buffer) and `--sync ddp` (lesson 6's
torch DDP: bucketed all_reduces launched from inside backward).  `--compare` trains with all three, one
after the other in the same processes (under any launcher), each into its own sub-directory of --log-dir,
and prints from the traces: all_reduce calls and bytes per step, communication time (of which moving data,
the rest is waiting for the slowest rank) and how much of it overlaps backward's computation.  The profiled
steps are slower than the others, and a shared machine is noisy: compare proportions, use --active 20.
--loader as in lesson 4 (memory by default here, so that the profile shows training, not batching).
Checking the schedule, the extra copies of each trace and the comparison table are course/measuring/profiling.py's.
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from course.launching import cli
from course.launching.launch import backend_for, launch, setup_device
from course.measuring import profiling
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


def already_averaged(model, world_size):
    """--sync ddp: DDP's hooks all_reduced the gradients during backward (lesson 6)."""


def worker(info, args):
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
    require(args.dataset, args.data_dir)
    train_set = InMemoryMNIST(args.dataset, "train", args.data_dir, device, limit=args.train_samples or 0)
    test_set = InMemoryMNIST(args.dataset, "test", args.data_dir, device)
    # --compare: the same ranks train once per --sync, from the same start, each into its own sub-directory
    rows = {variant.sync: train(info, device, variant, train_set, test_set) for variant in profiling.variants(args)}
    if rank == 0 and args.compare:
        profiling.print_comparison(rows, args, world_size)  # comparison.json and the table of all three
    dist.destroy_process_group()


def train(info, device, args, train_set, test_set):
    """Lesson 4's training run under the profiler; rank 0 returns the traces' communication summary."""
    rank, world_size = info.rank, info.world_size
    # Each rank draws its own random weights (seed + rank makes that visible)...
    model = build_model(args.model, args.seed + rank).to(device)
    if args.sync == "ddp":  # DDP: broadcasts rank 0's weights at wrap time, all_reduces buckets in backward
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    bucket_cap_mb=args.bucket_cap_mb)
    else:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)  # DDP: ...and then takes rank 0's, so all ranks start identical
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sync = {"per-param": average_gradients, "flat": average_gradients_flat, "ddp": already_averaged}[args.sync]

    # DDP: rank r gets every W-th index of the epoch's shuffled order; padded so all shards are equal
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    shards = [None] * world_size
    dist.all_gather_object(shards, list(sampler))  # DIST: epoch 0's shards, to show they are disjoint
    if args.loader == "dataloader":  # the loop to write for your own dataset
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    else:  # the same batches, each gathered from the in-memory tensors at once (data_tools/datasets.py)
        loader = batches(train_set, sampler, args.batch_size)
    profiling.check_first_epoch(args, len(loader))  # the profiled steps must all be training steps
    log_dir = profiling.cleared(args.log_dir, rank)  # TensorBoard would merge an earlier run's files with ours
    dist.barrier()  # DIST: nobody writes a trace before rank 0 has cleared the old ones

    def trace_ready(prof):
        # rank{r}.<timestamp>.pt.trace.json: the file TensorBoard's profiler plugin reads, one per rank
        tensorboard_trace_handler(str(log_dir), worker_name=f"rank{rank}")(prof)
        profiling.save_extras(prof, log_dir, rank, args)  # a copy for Perfetto, the costliest operators

    profiler = profile(
        activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else []),
        schedule=schedule(wait=args.wait, warmup=args.warmup, active=args.active, repeat=1),
        on_trace_ready=trace_ready,
        record_shapes=True,   # each operator's input shapes: the Operator view, and bytes per all_reduce
        profile_memory=True,  # allocations and frees: the Memory view
        with_stack=True)      # Python call stacks: the Module view, and a source line for every operator
    if rank == 0:  # one writer: the scalars describe the whole run, not one rank
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(log_dir))
    profiler.start()  # until profiler.stop(): the schedule decides which steps are recorded
    losses, step, start = [], 0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        epoch_start, epoch_samples = time.perf_counter(), 0
        for x, y in loader:
            with record_function("forward"):  # named spans: easy to find in the Trace view
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            with record_function("backward"):
                loss.backward()
            with record_function("gradient sync"):
                sync(model, world_size)  # DDP: every rank now holds the same averaged gradient
            optimizer.step()
            losses.append(loss.detach())
            step += 1
            profiler.step()  # ends ProfilerStep#<n>, counted from 0: wait, warmup, active, then nothing
            epoch_samples += world_size * len(y)
            if rank == 0:  # .item() waits for a GPU each step: fine here, costly in real runs
                writer.add_scalar("train/loss_rank0", loss.item(), step)
            if step == args.max_steps:
                break
        epoch_seconds = time.perf_counter() - epoch_start
        accuracy, test_loss, counted = evaluate(model, test_set, rank, world_size)
        if rank == 0:
            rank_print(rank, f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {accuracy:.4f} "
                             f"({counted} test images, each counted once)")
            profiling.epoch_scalars(writer, epoch, accuracy, test_loss, epoch_seconds, epoch_samples)
        if step == args.max_steps:
            break
    seconds = time.perf_counter() - start
    profiler.stop()
    rank_print(rank, f"{step} steps in {seconds:.1f} s (this rank's shard: {len(sampler)} samples per epoch)")

    losses = results.mean_over_ranks(losses)  # DIST: the loss of each global batch, averaged over ranks
    dist.barrier()  # DIST: every rank's trace is on disk before rank 0 reads them all
    if rank == 0:  # DIST: one process writes the outputs
        writer.close()
        communication = profiling.comm_summary(log_dir)  # what the traces say about gradient sync
        # metrics.json, model.pt, loss.png and the line that sums it up
        results.write(args, model, losses, seconds, accuracy, test_loss, len(sampler), sync=args.sync,
                      log_dir=str(log_dir), profiled_steps=profiling.profiled_steps(args),
                      communication=communication)
        write_json(args.run_dir / "shards.json", {"dataset_size": len(train_set), "epoch": 0, "shards": shards})
        profiling.print_communication(communication, args, world_size)  # the table of this --sync
    return communication if rank == 0 else None


def build_parser():
    p = cli.add_loader(cli.add_distributed(cli.parser(__doc__, "day1/5_mnist_manual_ddp_profile.py",
                                                      nproc_default=2)), "memory")
    return profiling.add_schedule_args(cli.add_sync(p, ddp=True))  # --sync, --compare; --log-dir, --wait, ...


if __name__ == "__main__":
    cli.main(lambda args: (require(args.dataset, args.data_dir), profiling.check_schedule(args),
                           launch(worker, args)), build_parser())
