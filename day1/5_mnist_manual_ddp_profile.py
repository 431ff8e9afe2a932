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
"""
import argparse
import math
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler
from torch.utils.data.distributed import DistributedSampler

from course import cli
from course.evaluate import evaluate
from course.launch import backend_for, launch, setup_device
from course.models import build_model
from course.output import plot_curves, rank_print, save_weights, write_json
from course.profiling import clear_previous, comm_summary, comm_table, view_hint, writable_log_dir
from data_tools.datasets import InMemoryMNIST, batches, require

SYNCS = ("per-param", "flat", "ddp")


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
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    require(args.dataset, args.data_dir)
    train_set = InMemoryMNIST(args.dataset, "train", args.data_dir, device, limit=args.train_samples or 0)
    test_set = InMemoryMNIST(args.dataset, "test", args.data_dir, device)
    if not args.compare:
        train(info, device, args, train_set, test_set)
    else:  # the same ranks train three times, from the same start, each variant into its own sub-directory
        rows = {}
        for sync in SYNCS:
            variant = argparse.Namespace(**{**vars(args), "sync": sync, "log_dir": args.log_dir / sync,
                                            "run_dir": args.run_dir / sync})
            rows[sync] = train(info, device, variant, train_set, test_set)
        if rank == 0:
            write_json(args.run_dir / "comparison.json", rows)
            print(f"\ngradient sync, {world_size} ranks, {args.model}, batch {args.batch_size} per rank: mean "
                  f"over ranks and {args.active} profiled steps (comm time includes waiting for the slowest "
                  f"rank)\n{comm_table(rows)}", flush=True)
            print(view_hint(args.log_dir, traces="*/chrome_trace/rank*.json"), flush=True)
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
    sync = {"per-param": average_gradients, "flat": average_gradients_flat,
            "ddp": already_averaged}[args.sync]

    # DDP: rank r gets every W-th index of the epoch's shuffled order; padded so all shards are equal
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    shards = [None] * world_size
    dist.all_gather_object(shards, list(sampler))  # epoch 0's shards, to show (and test) they are disjoint

    profiled = args.wait + args.warmup + args.active
    first_epoch_steps = min(math.ceil(len(sampler) / args.batch_size), args.max_steps or math.inf)
    if first_epoch_steps < profiled:  # the profiled window must be training steps only, not evaluation
        raise cli.CourseError(f"the profiler schedule needs {profiled} training steps (--wait {args.wait} "
                              f"--warmup {args.warmup} --active {args.active}) but the first epoch has "
                              f"{first_epoch_steps}; raise --max-steps/--train-samples or lower --active")
    log_dir = args.log_dir
    if rank == 0:
        log_dir.mkdir(parents=True, exist_ok=True)
        clear_previous(log_dir)  # TensorBoard would merge an earlier run's files in this dir with ours
    dist.barrier()  # DDP: nobody writes a trace before rank 0 has cleared the old ones

    def trace_ready(prof):
        # rank{r}.<timestamp>.pt.trace.json: the file TensorBoard's profiler plugin reads, one per rank
        tensorboard_trace_handler(str(log_dir), worker_name=f"rank{rank}")(prof)
        # it is a Chrome trace: copied under a fixed name, for https://ui.perfetto.dev or chrome://tracing
        (log_dir / "chrome_trace").mkdir(exist_ok=True)
        trace = max(log_dir.glob(f"rank{rank}.*.pt.trace.json"), key=lambda path: path.stat().st_mtime)
        shutil.copyfile(trace, log_dir / "chrome_trace" / f"rank{rank}.json")
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        (log_dir / f"rank{rank}.key_averages.txt").write_text(table + "\n")
        if rank == 0:
            print(f"[rank 0] --sync {args.sync}: the costliest operators of {args.active} profiled steps "
                  f"(prof.key_averages(); every rank's table is in {log_dir}/rank*.key_averages.txt)\n"
                  f"{table}", flush=True)

    profiler = profile(
        activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else []),
        schedule=schedule(wait=args.wait, warmup=args.warmup, active=args.active, repeat=1),
        on_trace_ready=trace_ready,
        record_shapes=True,   # each operator's input shapes: the Operator view, and bytes per all_reduce
        profile_memory=True,  # allocations and frees: the Memory view
        with_stack=True)      # Python call stacks: the Module view, and a source line for every operator
    writer = None
    if rank == 0:  # one writer: the scalars describe the whole run, not one rank
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(log_dir))

    losses, step, start = [], 0, time.perf_counter()
    with profiler:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
            epoch_start, epoch_samples = time.perf_counter(), 0
            for x, y in batches(train_set, sampler, args.batch_size):
                with record_function("forward"):  # named spans: easy to find in the Trace view
                    loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                with record_function("backward"):
                    loss.backward()
                with record_function("gradient sync"):
                    sync(model, world_size)  # DDP: every rank now holds the same averaged gradient
                optimizer.step()
                profiler.step()  # ends ProfilerStep#<n>, counted from 0: wait, warmup, active, then nothing
                losses.append(loss.detach())
                step += 1
                epoch_samples += world_size * len(y)
                if writer is not None:  # .item() waits for a GPU each step: fine here, costly in real runs
                    writer.add_scalar("train/loss_rank0", loss.item(), step)
                if step == args.max_steps:
                    break
            train_seconds = time.perf_counter() - epoch_start
            unwrapped = model.module if args.sync == "ddp" else model
            accuracy, test_loss, counted = evaluate(unwrapped, test_set, rank, world_size)
            if rank == 0:
                rank_print(rank, f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {accuracy:.4f} "
                                 f"({counted} test images, each counted once)")
                writer.add_scalar("test/accuracy", accuracy, epoch)
                writer.add_scalar("test/loss", test_loss, epoch)
                writer.add_scalar("perf/epoch_seconds", train_seconds, epoch)
                writer.add_scalar("perf/samples_per_second", epoch_samples / train_seconds, epoch)
            if step == args.max_steps:
                break
    seconds = time.perf_counter() - start
    rank_print(rank, f"{step} steps on {len(sampler)} samples per epoch in {seconds:.1f} s")

    losses = torch.stack(losses)
    dist.all_reduce(losses)  # DDP: the loss of each global batch, averaged over ranks (one call at the end)
    losses = (losses / world_size).tolist()
    dist.barrier()  # DDP: every rank's trace is on disk before rank 0 reads them all
    if rank == 0:
        writer.close()
        communication = comm_summary(log_dir)
        global_batch = world_size * args.batch_size
        samples = min(step * global_batch, args.epochs * world_size * len(sampler))
        run = args.run_dir
        write_json(run / "metrics.json", {
            "lesson": "5_mnist_manual_ddp_profile", "dataset": args.dataset, "model": args.model,
            "sync": args.sync, "world_size": world_size, "backend": dist.get_backend(),
            "batch_size": args.batch_size, "global_batch_size": global_batch, "lr": args.lr,
            "epochs": args.epochs, "steps": step, "samples_seen": samples, "train_seconds": seconds,
            "samples_per_second": samples / seconds, "test_accuracy": accuracy, "test_loss": test_loss,
            "loss_per_step": losses, "log_dir": str(log_dir),
            "profiled_steps": list(range(args.wait + args.warmup + 1, profiled + 1)),
            "communication": communication})
        write_json(run / "shards.json", {"dataset_size": len(train_set), "epoch": 0, "shards": shards})
        save_weights(run / "model.pt", model)
        plot_curves(run / "loss.png", {f"{world_size} ranks": (range(1, step + 1), losses)}, "step",
                    "training loss (mean over ranks)", f"{args.model}, global batch {global_batch}")
        print(f"{world_size} ranks x batch {args.batch_size} = global batch {global_batch}; test accuracy "
              f"{accuracy:.4f}; outputs in {run}\n"
              f"gradient sync in the profiled steps (mean over {world_size} ranks, from the traces):\n"
              f"{comm_table({args.sync: communication})}\n{view_hint(log_dir)}", flush=True)
    return communication if rank == 0 else None


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


def build_parser():
    p = cli.add_distributed(cli.parser(__doc__, "day1/5_mnist_manual_ddp_profile.py", nproc_default=2))
    p.add_argument("--sync", default="per-param", choices=SYNCS,
                   help="per-param: one all_reduce per parameter tensor; flat: one for all gradients; "
                        "ddp: torch DDP's bucketed all_reduce during backward (lesson 6)")
    p.add_argument("--compare", action="store_true",
                   help="train with all three --sync variants, one after the other, each into "
                        "LOG_DIR/<sync>, and print them side by side")
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0,
                   help="--sync ddp: gradient bucket size in MB (the MLP's 0.4 MB fit in one bucket)")
    p.add_argument("--log-dir", type=Path, default=Path("log_ddp"),
                   help="where every rank writes its trace and rank 0 its TensorBoard scalars")
    p.add_argument("--wait", type=non_negative_int, default=1, help="profiler schedule: steps skipped")
    p.add_argument("--warmup", type=non_negative_int, default=1,
                   help="profiler schedule: then steps traced and discarded")
    p.add_argument("--active", type=cli.positive_int, default=3,
                   help="profiler schedule: then steps recorded")
    return p


def main(args):
    require(args.dataset, args.data_dir)
    profiled = args.wait + args.warmup + args.active
    if args.max_steps is not None and args.max_steps < profiled:
        raise cli.CourseError(f"--max-steps {args.max_steps} ends training before the profiler has "
                              f"recorded: its schedule needs {profiled} steps (--wait {args.wait} "
                              f"--warmup {args.warmup} --active {args.active})")
    writable_log_dir(args.log_dir)
    launch(worker, args)


if __name__ == "__main__":
    cli.main(main, build_parser())
