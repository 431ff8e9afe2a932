"""Lesson 6: torch's DistributedDataParallel does lesson 4's synchronization for us: the same result, less code.

    python day1/6_mnist_ddp_pt.py --nproc 2 --quick
    torchrun --nproc_per_node=4 day1/6_mnist_ddp_pt.py
    srun --ntasks=4 python day1/6_mnist_ddp_pt.py

Wrapping the model in DDP replaces lesson 4's two manual steps:
- at wrap time DDP broadcasts rank 0's parameters and buffers to every rank (no broadcast loop);
- during backward, hooks on the parameters put finished gradients into buckets (25 MB by default) and
  start an all_reduce for each full bucket while backward is still computing the rest, and many small
  tensors travel as a few large messages (lesson 4's --sync flat).
The result is the same training run as lesson 4: the same weights after the same steps.  What DDP gives
here is that result with less code to get wrong.  Its overlap of communication with backward pays off
when there are many buckets and a backward long enough to hide them (larger models, GPUs); the MLP's
0.4 MB of gradients fill a single bucket, which can only be sent when backward is done: on a 2-core VM a
step with lesson 4's flat all_reduce took 1.06x (MLP) and 0.98x (CNN) of DDP's, within the noise of about
10 % (benchmarks/README.md); lesson 5's --compare measures it in your run, from a few traced steps.
`device_ids` is passed only on GPUs; on the CPU DDP uses the model where it is.  --batch-size is per rank.
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from course.launching import cli
from course.launching.launch import backend_for, launch, setup_device
from course.measuring.profiling import add_profile_args, maybe_profile
from course.models import build_model
from course.training import results
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
    prof = maybe_profile(args, rank, device)  # --profile: lesson 5's traces and TensorBoard scalars
    losses, step, start = [], 0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP: gradients arrive averaged over ranks when backward returns
            optimizer.step()
            losses.append(loss.detach())
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
        # metrics.json, model.pt, loss.png and the line that sums it up
        results.write(args, model, losses, seconds, accuracy, test_loss, len(sampler))
    dist.destroy_process_group()


def build_parser():
    p = cli.add_loader(cli.add_distributed(cli.parser(__doc__, "day1/6_mnist_ddp_pt.py", nproc_default=2)))
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0,
                   help="DDP's gradient bucket size in MB (the MLP's gradients are 0.4 MB: one bucket)")
    return add_profile_args(p)


if __name__ == "__main__":
    cli.main(lambda args: (require(args.dataset, args.data_dir), launch(worker, args)), build_parser())
