"""Lesson 8: more ranks make a larger global batch: scale the learning rate with it, compare loss curves.

    python day1/8_mnist_ddp_pt_lr.py --nproc 4 --quick             # the 1-process reference first, then 4 ranks
    python day1/8_mnist_ddp_pt_lr.py --nproc 4 --quick --no-scale  # 4 ranks with the 1-process lr: they lag
    python day1/8_mnist_ddp_pt_lr.py --nproc 4 --warmup-steps 20   # ramp the lr up over the first 20 steps
    python day1/8_mnist_ddp_pt_lr.py --nproc 1                     # the reference alone
    torchrun --nproc_per_node=4 day1/8_mnist_ddp_pt_lr.py          # compares with a reference made before

With W ranks of batch b each, one step averages the gradients of W*b samples (the global batch), and an
epoch has W times fewer steps.  With the same learning rate a step moves the weights about as far as one
step on b samples did, so after the same number of samples the W-rank model has moved W times less and its
loss curve lags behind.  The linear scaling rule (Goyal et al. 2017, "Accurate, Large Minibatch SGD")
multiplies the learning rate by W: one step of lr*W on W*b samples then goes about as far as W steps of lr
on b samples, as long as the gradient changes little over those W steps.  In the first steps it changes
fast (and momentum needs ~10 steps, W times more samples, to build up), so every W lags there at first;
large-batch training ramps the lr up over those steps (--warmup-steps) and we compare the curves only after
them (--compare-after).  --lr is the base lr for the batch --batch-size per rank; the run uses lr * W
unless --no-scale.

The comparison: a W-rank run is compared with 1 process (lr, batch b) at equal samples seen.  Both curves
are smoothed with a moving mean over --smooth-samples samples; the largest and the mean gap after the first
--compare-after samples are printed and written to metrics.json, and once the run dir holds the same
comparison with the other lr (scaled, or --no-scale), the two are set side by side.  Measured with --quick
(2 cores, seeds 0-2), largest gap: 2 ranks 0.02-0.03 and 4 ranks 0.03-0.07 with scaling, 0.06 and
0.14-0.17 without (and always behind).  Started with plain python,
the lesson first runs the 1-process reference when run_dir has none for these settings
(run_dir/reference_ws1_*.csv); under torchrun or srun it says how to make one.  --quick here means 3 epochs
of 12 800 samples: after 1 epoch 4 ranks have taken only 50 steps, still the first steps.
The curves, the reference and the comparison are kept by course/training/curves.py.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import argparse
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
from course.launching.launch import backend_for, detect_launcher, launch, setup_device
from course.measuring.profiling import add_profile_args, maybe_profile
from course.models import build_model
from course.training import curves, results
from course.training.evaluate import evaluate
from course.training.output import rank_print
from data_tools.datasets import InMemoryMNIST, batches, require

QUICK_EPOCHS = 3  # --quick: 3 epochs of the 12 800 samples


def worker(info, args):
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
    require(args.dataset, args.data_dir)
    train_set = InMemoryMNIST(args.dataset, "train", args.data_dir, device, limit=args.train_samples or 0)
    test_set = InMemoryMNIST(args.dataset, "test", args.data_dir, device)

    model = build_model(args.model, args.seed + rank).to(device)
    # DDP: broadcasts rank 0's weights at wrap time, then all_reduces gradient buckets during backward
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)
    # DDP: the global batch is world_size * batch_size, so the linear scaling rule multiplies lr by world_size
    lr = args.lr if args.no_scale else args.lr * world_size
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if rank == 0:
        rule = "--no-scale: the 1-process lr" if args.no_scale else f"base lr {args.lr:g} x {world_size} ranks"
        warmup = f", warmed up from {args.lr:g} over {args.warmup_steps} steps" if args.warmup_steps else ""
        rank_print(rank, f"global batch {world_size} x {args.batch_size}: lr {lr:g} ({rule}){warmup}")

    # DDP: rank r gets every W-th index of the epoch's shuffled order; padded so all shards are equal
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    if args.loader == "dataloader":  # the loop to write for your own dataset
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    else:  # the same batches, each gathered from the in-memory tensors at once (data_tools/datasets.py)
        loader = batches(train_set, sampler, args.batch_size)
    prof = maybe_profile(args, rank, device)  # --profile: lesson 5's traces and TensorBoard scalars
    losses, seen, lrs, step, start = [], [], [], 0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        for x, y in loader:
            if args.warmup_steps:  # from the 1-process lr to the scaled one, a little more each step
                optimizer.param_groups[0]["lr"] = args.lr + (lr - args.lr) * min(1.0, step / args.warmup_steps)
            lrs.append(optimizer.param_groups[0]["lr"])
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP: gradients arrive averaged over ranks when backward returns
            optimizer.step()
            losses.append(loss.detach())
            # DDP: samples seen by all ranks together, the x axis that makes world sizes comparable
            seen.append((seen[-1] if seen else 0) + len(y) * world_size)
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
    rank_print(rank, f"{step} steps in {seconds:.1f} s (this rank's shard: {len(sampler)} samples per epoch)")

    losses = results.mean_over_ranks(losses)  # DIST: the loss of each global batch, averaged over ranks
    if rank == 0:  # DIST: one process writes the outputs
        curve = list(zip(seen, losses))
        comparison = curves.compare(curve, world_size, lr, args)  # this curve against 1 process's, at equal seen
        # metrics.json and model.pt; loss.png is this curve against 1 process's
        results.write(args, model, losses, seconds, accuracy, test_loss, len(sampler), samples=seen[-1],
                      line=False, plot=False, lr=lr, base_lr=args.lr, scaled=not args.no_scale,
                      warmup_steps=args.warmup_steps, samples_seen_per_step=seen, lr_per_step=lrs,
                      reference=str(curves.reference_path(args)) if comparison else None, deviation=comparison)
        curves.plot(args.run_dir / "loss.png", curve, world_size, lr, comparison is not None and world_size > 1, args)
        print(f"{world_size} ranks x batch {args.batch_size} = global batch {world_size * args.batch_size}, "
              f"lr {lr:g}; test accuracy {accuracy:.4f}; outputs in {args.run_dir}", flush=True)
    dist.destroy_process_group()


def run(args):
    if args.quick:  # 1 epoch is mostly the first steps, where every world size lags: see the docstring
        args.epochs = QUICK_EPOCHS
    require(args.dataset, args.data_dir)
    if detect_launcher(args) == "self" and args.nproc > 1 and not curves.has_reference(args, args.nproc):
        print(f"no 1-process reference covering {curves.samples_needed(args, args.nproc)} samples in "
              f"{args.run_dir}: running it first (1 rank, lr {args.lr:g}, batch {args.batch_size})", flush=True)
        reference_args = argparse.Namespace(**vars(args))
        if args.max_steps:  # the same samples in world-size times more steps of the per-rank batch
            reference_args.max_steps = args.max_steps * args.nproc
        launch(worker, reference_args, nproc=1)
    launch(worker, args)


def build_parser():
    p = cli.add_loader(cli.add_distributed(cli.parser(__doc__, "day1/8_mnist_ddp_pt_lr.py", nproc_default=2)))
    p.add_argument("--no-scale", action="store_true",
                   help="keep the base lr whatever the world size (to see the curve lag behind)")
    p.add_argument("--warmup-steps", type=cli.non_negative_int, default=0,
                   help="ramp the lr linearly from the base lr to the scaled lr over this many steps")
    p.add_argument("--smooth-samples", type=cli.positive_int, default=2560,
                   help="window of the moving mean of the loss, in samples seen")
    p.add_argument("--compare-after", type=cli.non_negative_int, default=12_800,
                   help="compare the curves only after this many samples (the first steps move fastest)")
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0,
                   help="DDP's gradient bucket size in MB (the MLP's gradients are 0.4 MB: one bucket)")
    return add_profile_args(p)


if __name__ == "__main__":
    cli.main(run, build_parser())
