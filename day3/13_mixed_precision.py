"""Lesson 13: mixed precision under DDP: autocast computes in 16 bits, GradScaler keeps fp16's gradients alive.

    python day3/13_mixed_precision.py --nproc 2 --quick --precision bf16
    torchrun --nproc_per_node=4 day3/13_mixed_precision.py --precision fp16
    srun --ntasks=4 python day3/13_mixed_precision.py --precision bf16
    python day3/13_mixed_precision.py --nproc 2 --quick --precision fp32 --compile

Lesson 6's DDP loop, with day 3's model (a small Vision Transformer, course/models.py) and three changes:
- `torch.autocast(device, dtype)` runs the forward pass's matrix products in bf16 or fp16 (half the bytes,
  tensor cores on GPUs) and keeps precision-sensitive ops (layer norms, the loss; on GPUs softmax too) in
  fp32.  The weights, their gradients and the optimizer stay fp32: DDP all_reduces fp32 gradients, as before.
- fp16 keeps 10 mantissa bits but only 5 exponent bits: numbers below ~6e-8 become 0, above 65504 inf.  Small
  gradients would vanish, so GradScaler multiplies the loss by a large scale before backward and divides the
  gradients by it before the step.  bf16 has fp32's exponent range (8 bits, 7 mantissa bits): no scaler.
- `scaler.unscale_(optimizer)` before `clip_grad_norm_`: clipping must see the true gradients, not the
  scaled ones (scaled, their norm is ~65536x too large and every step would be clipped to almost nothing).
A step whose gradients hold inf or NaN is skipped and the scale halved.  GradScaler looks only at this
rank's gradients, yet every rank skips the same step: DDP has already all_reduced the gradients, and an inf
on one rank makes the sum inf on all of them (--overflow-at injects one on one rank to watch it).
On a CPU without bf16 instructions (no avx512_bf16/AMX in lscpu's flags) 16-bit matrix products are
emulated and slower than fp32; on GPUs they are faster; on CPUs with those instructions, measure: a small
model can still lose to autocast's casts.  --batch-size is per rank.
Every rank measures the memory of its step 3 (course/measuring/memory.py): what it holds as the forward begins, and
the most during the step; lessons 14 and 15 show what checkpointing and sharding take off it.
--compile: torch.compile of the DDP-wrapped model.  Compiled after wrapping, dynamo cuts the graph at DDP's
bucket boundaries, so each bucket's all_reduce still starts while the rest of backward runs (compiling the
bare model before wrapping gives one graph whose gradients all arrive at its end).  The first forward and
backward compile: tens of seconds on a CPU, then cached in /tmp/torchinductor_$USER.  course/training/precision.py's
warm_up runs them once before training (the gradients are thrown away), so the step times are training's
alone; an epoch's shorter last batch compiles once more.  TORCH_LOGS=ddp_graphs prints the pieces when the
gradients fill more than one bucket (--bucket-cap-mb, at least DDP's first bucket of 1 MB).
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import math
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
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from course.launching import cli
from course.launching.launch import backend_for, launch, setup_device
from course.measuring import memory
from course.measuring.profiling import add_profile_args, maybe_profile
from course.models import add_vit_args, check_vit_args, model_from_args
from course.training import precision, replicas
from course.training.evaluate import evaluate
from course.training.output import plot_curves, rank_print, save_weights, write_json
from course.training.precision import DTYPES, check_precision
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

    model = model_from_args(args, args.seed + rank).to(device)
    # DDP: broadcasts rank 0's weights at wrap time, then all_reduces gradient buckets during backward
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dtype = DTYPES[args.precision]
    if args.compile:  # after DDP wraps it: dynamo splits the graph at DDP's buckets, whose all_reduces overlap
        model = torch.compile(model)  # compiles on its first forward and backward: warm_up runs them, untimed
        precision.warm_up(model, train_set, args, dtype)  # rank 0 says how long compiling took
    peak = memory.StepPeak(model, optimizer, device)  # step 3's bytes: held as it begins, most during it
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")  # fp16 only; off, it passes through

    # DDP: rank r gets every W-th index of the epoch's shuffled order; padded so all shards are equal
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    if args.loader == "dataloader":  # the loop to write for your own dataset
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    else:  # the same batches, each gathered from the in-memory tensors at once (data_tools/datasets.py)
        loader = batches(train_set, sampler, args.batch_size)
    prof = maybe_profile(args, rank, device)  # --profile: lesson 5's traces and TensorBoard scalars
    losses, norms, skipped, step, start = [], [], [], 0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        for x, y in loader:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = F.cross_entropy(model(x), y)  # the logits are 16-bit, the loss fp32
            optimizer.zero_grad()
            overflow = math.inf if (step + 1, rank) == (args.overflow_at, args.overflow_rank) else 1.0
            scaler.scale(loss * overflow).backward()  # DDP: the (scaled) gradients, averaged over ranks
            scaler.unscale_(optimizer)  # the true gradients, so that clipping sees their real norm
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            scale = scaler.get_scale()
            scaler.step(optimizer)  # skipped if unscale_ found inf/NaN in this rank's (= every rank's) grads
            scaler.update()  # halves the scale after a skipped step, doubles it after 2000 good ones
            if scaler.get_scale() < scale:
                skipped.append(step + 1)
                rank_print(rank, f"step {step + 1} skipped (inf/NaN gradients; own loss {loss.item() * overflow:.3g}); "
                                 f"loss scale {scale:g} -> {scaler.get_scale():g}")
            losses.append(loss.detach())
            norms.append(norm.detach())
            step += 1
            prof.step(loss, world_size * len(y))
            if step == args.max_steps:
                break
        accuracy, test_loss, counted = evaluate(model.module, test_set, rank, world_size)
        prof.epoch(epoch, accuracy, test_loss)
        if rank == 0:
            rank_print(rank, f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {accuracy:.4f} "
                             f"({counted} test images, each counted once)")
        if step == args.max_steps:
            break
    seconds = time.perf_counter() - start
    prof.close()
    rank_print(rank, f"{step} steps in {seconds:.1f} s (this rank's shard: {len(sampler)} samples per epoch), "
                     f"{len(skipped)} skipped {skipped}; {peak}")

    identical = replicas.identical_on_all_ranks(model.parameters())  # DIST: all_gathers every rank's weights
    losses = torch.stack(losses)
    dist.all_reduce(losses)  # DIST: the loss of each global batch, averaged over ranks (one call at the end)
    losses = (losses / world_size).tolist()
    if rank == 0:  # DIST: one process writes the outputs
        global_batch = world_size * args.batch_size
        samples = min(step * global_batch, args.epochs * world_size * len(sampler))
        run = args.run_dir
        write_json(run / "metrics.json", {
            "lesson": "13_mixed_precision", "dataset": args.dataset, "model": args.model,
            "precision": args.precision, "world_size": world_size, "backend": dist.get_backend(),
            "batch_size": args.batch_size, "global_batch_size": global_batch, "lr": args.lr,
            "epochs": args.epochs, "steps": step, "skipped_steps": skipped, "identical_weights": identical,
            "samples_seen": samples, "train_seconds": seconds, "samples_per_second": samples / seconds,
            "test_accuracy": accuracy, "test_loss": test_loss, "loss_per_step": losses,
            "grad_norm_per_step": torch.stack(norms).tolist(), "memory": peak.result()})
        save_weights(run / "model.pt", model)
        plot_curves(run / "loss.png", {f"{args.precision}, {world_size} ranks": (range(1, step + 1), losses)},
                    "step", "training loss (mean over ranks)", f"{args.model}, global batch {global_batch}")
        print(f"{world_size} ranks x batch {args.batch_size} = global batch {global_batch}, {args.precision}: "
              f"test accuracy {accuracy:.4f}; skipped steps {skipped}; weights identical on all ranks: "
              f"{identical}; outputs in {run}", flush=True)
    dist.destroy_process_group()


def build_parser():
    p = cli.add_loader(cli.add_distributed(cli.parser(__doc__, "day3/13_mixed_precision.py", nproc_default=2)))
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0,
                   help="DDP's gradient bucket size in MB")
    p.add_argument("--precision", default="bf16", choices=sorted(DTYPES),
                   help="the dtype of autocast's matrix products; fp16 adds GradScaler")
    p.add_argument("--clip-grad-norm", type=cli.positive_float, default=1.0,
                   help="clip the gradients' total norm to this")
    p.add_argument("--overflow-at", type=cli.positive_int, default=None, metavar="STEP",
                   help="multiply one rank's loss by inf at this step, to watch every rank skip it (fp16)")
    p.add_argument("--overflow-rank", type=cli.non_negative_int, default=1, help="the rank of --overflow-at")
    p.add_argument("--compile", action="store_true", help="torch.compile the DDP model (compiled before training)")
    return add_profile_args(add_vit_args(p))


if __name__ == "__main__":
    cli.main(lambda args: (require(args.dataset, args.data_dir), check_vit_args(args), check_precision(args),
                           launch(worker, args)), build_parser())
