"""Lesson 14: gradient accumulation (K micro-batches, one all_reduce) and activation checkpointing.

    python day3/14_accumulation_checkpointing.py --nproc 2 --quick --accumulate 4 --checkpoint-activations
    torchrun --nproc_per_node=4 day3/14_accumulation_checkpointing.py --accumulate 2
    srun --ntasks=4 python day3/14_accumulation_checkpointing.py --accumulate 2 --checkpoint-activations

Lesson 13's loop (mixed precision stays as it was), with two ways to train what does not fit:
- `--accumulate K`: each optimizer step takes K micro-batches of --batch-size b per rank, one after the
  other, and adds up their gradients in `.grad` before one step: the global batch per step is W x K x b, with
  the memory of a batch of b.  The loss of each micro-batch is divided by K, so that the sum of K gradients
  is the gradient of the mean over all K x b samples, as one batch of K x b would give.
- The first K-1 micro-batches run forward AND backward inside `model.no_sync()`: DDP then sends nothing and
  only accumulates.  The last one runs outside it and DDP all_reduces the summed gradients, bucket by bucket,
  once: one round of all_reduce per optimizer step, not K, and 1/K of the bytes per sample.  (no_sync must
  cover the forward pass too: DDP decides in forward whether the coming backward will synchronize.)
- `--checkpoint-activations`: each transformer block runs under
  `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`.  Autograd then keeps only the block's
  input instead of every intermediate tensor (attention, MLP, norms), and backward runs the block's forward
  again to get them back: less memory for about a third more compute.  Written here as a wrapper of each
  block's forward, so that the model's code (course/models.py) and its saved weights stay the same.
  The recomputed forward is the same arithmetic: the gradients come out the same.
- What each saves is counted while training (course/measuring/accumulation.py) and written into metrics.json: the
  all_reduce calls and bytes of every optimizer step (a DDP communication hook that counts each bucket, then
  all_reduces it as DDP would), and the bytes autograd keeps for backward during one micro-batch's forward
  (saved-tensor hooks).
- What the step really holds is measured on every rank (course/measuring/memory.py, as in lessons 13 and 15): during
  step 3, from its first forward to `optimizer.step()`, the bytes held when it began and the most above
  that; checkpointing can shrink only the part above (the replica is held before the step and stays).  On
  a GPU torch.cuda.max_memory_allocated minus what was allocated as the step began (the run's whole peak
  would include the dataset held on the GPU); on the CPU the live tensors.
Accumulation costs time: K micro-batches take about K times one's compute.  --batch-size is per rank and per
micro-batch.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import contextlib
import math
import sys
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/
from course.launching.requires import require  # noqa: E402
require(__file__)  # before torch: a torch or package this lesson lacks is one line, not an ImportError

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from course.launching import cli
from course.launching.launch import backend_for, launch, setup_device
from course.measuring import accumulation, memory
from course.measuring.profiling import add_profile_args, maybe_profile
from course.models import add_vit_args, check_vit_args, model_from_args
from course.training import replicas
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
    if args.checkpoint_activations:  # each block keeps only its input; backward runs its forward again
        for block in model.blocks:  # block(x) now runs checkpoint(block's forward, x, use_reentrant=False)
            block.forward = partial(checkpoint, block.forward, use_reentrant=False)
    # DDP: broadcasts rank 0's weights at wrap time, then all_reduces gradient buckets during backward
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)
    meter = accumulation.Meter(model, device, args.checkpoint_activations)  # counts what is sent and kept
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dtype = DTYPES[args.precision]
    peak = memory.StepPeak(model, optimizer, device)  # step 3's bytes: held as it begins, most during it
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")  # fp16 only; off, it passes through

    # DDP: rank r gets every W-th index of the epoch's shuffled order; padded so all shards are equal
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    if args.loader == "dataloader":  # the loop to write for your own dataset
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    else:  # the same batches, each gathered from the in-memory tensors at once (data_tools/datasets.py)
        loader = batches(train_set, sampler, args.batch_size)
    prof = maybe_profile(args, rank, device)  # --profile: lesson 5's traces and TensorBoard scalars
    k = args.accumulate
    losses, norms, skipped, step, samples, start = [], [], [], 0, 0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        for micro_batches in zip(*[iter(loader)] * k):  # k consecutive batches (a shorter rest is left out)
            optimizer.zero_grad()
            overflow = math.inf if (step + 1, rank) == (args.overflow_at, args.overflow_rank) else 1.0
            loss = 0.0
            for i, (x, y) in enumerate(micro_batches):
                # DDP: no_sync for the first k-1: forward and backward only add to .grad, nothing is sent
                with model.no_sync() if i < k - 1 else contextlib.nullcontext():
                    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32), meter.forward():
                        micro_loss = F.cross_entropy(model(x), y) / k  # the sum of k is the mean over k*b
                    scaler.scale(micro_loss * overflow).backward()  # DDP: the last all_reduces the sum, once
                loss += micro_loss.detach()
            scaler.unscale_(optimizer)  # the true gradients, so that clipping sees their real norm
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            scale = scaler.get_scale()
            scaler.step(optimizer)  # skipped if unscale_ found inf/NaN in this rank's (= every rank's) grads
            scaler.update()  # halves the scale after a skipped step, doubles it after 2000 good ones
            if scaler.get_scale() < scale:
                skipped.append(step + 1)
                rank_print(rank, f"step {step + 1} skipped (inf/NaN gradients; own loss {loss.item() * overflow:.3g}); "
                                 f"loss scale {scale:g} -> {scaler.get_scale():g}")
            losses.append(loss)
            norms.append(norm.detach())
            step += 1
            meter.step()  # the time of each optimizer step, for the summary
            seen = world_size * sum(len(y) for _, y in micro_batches)  # the global batch, W x k x b
            samples += seen
            prof.step(loss, seen)
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
        global_batch = world_size * k * args.batch_size
        saves = meter.summary(step, global_batch)  # this rank's counts: every rank sends and keeps the same
        run = args.run_dir
        write_json(run / "metrics.json", {
            "lesson": "14_accumulation_checkpointing", "dataset": args.dataset, "model": args.model,
            "precision": args.precision, "world_size": world_size, "backend": dist.get_backend(),
            "batch_size": args.batch_size, "accumulate": k, "global_batch_size": global_batch, "lr": args.lr,
            "checkpoint_activations": args.checkpoint_activations, **saves,
            "epochs": args.epochs, "steps": step, "skipped_steps": skipped, "identical_weights": identical,
            "samples_seen": samples, "train_seconds": seconds, "samples_per_second": samples / seconds,
            "test_accuracy": accuracy, "test_loss": test_loss, "loss_per_step": losses,
            "grad_norm_per_step": torch.stack(norms).tolist(), "memory": peak.result()})
        save_weights(run / "model.pt", model)
        plot_curves(run / "loss.png", {f"{args.precision}, {world_size} ranks": (range(1, step + 1), losses)},
                    "step", "training loss (mean over ranks)", f"{args.model}, global batch {global_batch}")
        print(accumulation.describe(saves, k, args.checkpoint_activations), flush=True)
        print(f"{world_size} ranks x {k} micro-batches x batch {args.batch_size} = global batch {global_batch}, "
              f"{args.precision}: "
              f"test accuracy {accuracy:.4f}; skipped steps {skipped}; weights identical on all ranks: "
              f"{identical}; outputs in {run}", flush=True)
    dist.destroy_process_group()


def build_parser():
    p = cli.add_loader(cli.add_distributed(cli.parser(__doc__, "day3/14_accumulation_checkpointing.py", nproc_default=2)))
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0,
                   help="DDP's gradient bucket size in MB")
    p.add_argument("--precision", default="bf16", choices=sorted(DTYPES),
                   help="the dtype of autocast's matrix products; fp16 adds GradScaler")
    p.add_argument("--clip-grad-norm", type=cli.positive_float, default=1.0,
                   help="clip the gradients' total norm to this")
    p.add_argument("--overflow-at", type=cli.positive_int, default=None, metavar="STEP",
                   help="multiply one rank's loss by inf at this step, to watch every rank skip it (fp16)")
    p.add_argument("--overflow-rank", type=cli.non_negative_int, default=1, help="the rank of --overflow-at")
    p.add_argument("--accumulate", type=cli.positive_int, default=1, metavar="K",
                   help="micro-batches of --batch-size per optimizer step; one all_reduce after the last")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="run each transformer block under torch.utils.checkpoint (recomputed in backward)")
    return add_profile_args(add_vit_args(p))


if __name__ == "__main__":
    cli.main(lambda args: (require(args.dataset, args.data_dir), check_vit_args(args), check_precision(args),
                           accumulation.check_args(args), launch(worker, args)), build_parser())
