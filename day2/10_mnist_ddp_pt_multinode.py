"""Lesson 10: lesson 6's DDP across nodes: the local rank picks the GPU, global rank 0 writes the outputs.

Inside a Slurm allocation (salloc --nodes 2 --ntasks-per-node=2 ..., or an sbatch script):

    ./day2/multinode_setup_and_run.sh 10_mnist_ddp_pt_multinode.py --quick
    ./day2/multinode_setup_and_run.sh --launcher torchrun 10_mnist_ddp_pt_multinode.py

On one machine:

    torchrun --standalone --nproc_per_node=2 day2/10_mnist_ddp_pt_multinode.py --quick

The training is lesson 6's, unchanged: DDP neither knows nor cares which ranks share a node, and W ranks on
two nodes train exactly like W ranks on one (they end with the same weights).  What changes is who does what:
- the local rank (0 .. ranks per node - 1) picks the device, cuda:<local rank> on every node; with 4 GPUs a
  node, the global rank would ask node 1 (the second node) for GPUs 4..7, which it does not have;
- global rank 0, one process in the whole job, writes the shared outputs (metrics, weights, plot) to the
  shared filesystem; "local rank 0" is one process per node, and they would all write the same files;
- local rank 0 of each node is the one for per-node work (here a line per node; on a real cluster e.g.
  copying the data to the node's local disk once).
Ranks come from srun or torchrun, read as lesson 9 showed.  Started with plain python, it says how to launch.
--batch-size is per rank; the data comes through a DataLoader, as in lesson 6 (without --loader memory).
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import socket
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
from course.launching.launch import backend_for, launch, require_launcher, setup_device
from course.measuring.profiling import add_profile_args, maybe_profile
from course.models import build_model
from course.training import results
from course.training.evaluate import evaluate
from course.training.output import rank_print
from data_tools.datasets import InMemoryMNIST, require


def worker(info, args):
    # info: rank, local rank, node and world size from srun's or torchrun's variables (lesson 9)
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)  # DIST: the LOCAL rank picks this node's GPU
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
    host = socket.gethostname()
    placement = [None] * world_size
    dist.all_gather_object(placement, (info.node_rank, host, info.local_rank))  # DIST: who runs where
    nodes = len({node for node, _, _ in placement})
    if info.local_rank == 0:  # DIST: one process per node: the place for per-node work
        ranks = [r for r, (node, _, _) in enumerate(placement) if node == info.node_rank]
        rank_print(rank, f"local rank 0 of node {info.node_rank} ({host}), which runs global ranks {ranks}; "
                         f"my device {device}")
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
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)  # lesson 6's loop
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
    if rank == 0:  # DIST: GLOBAL rank 0 alone writes the shared files (local rank 0 exists on every node)
        # metrics.json (with who ran where), model.pt, loss.png and the line that sums it up
        results.write(args, model, losses, seconds, accuracy, test_loss, len(sampler),
                      ranks=f"{world_size} ranks on {nodes} node(s)", nodes=nodes, launcher=info.launcher,
                      written_by=[rank, host], placement=[{"rank": r, "node": n, "host": h, "local_rank": lr}
                                                         for r, (n, h, lr) in enumerate(placement)])
    dist.destroy_process_group()


def build_parser():
    p = cli.add_distributed(cli.parser(__doc__, "day2/10_mnist_ddp_pt_multinode.py"))
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0,
                   help="DDP's gradient bucket size in MB (the MLP's gradients are 0.4 MB: one bucket)")
    return add_profile_args(p)


if __name__ == "__main__":
    cli.main(lambda args: (require_launcher("day2/10_mnist_ddp_pt_multinode.py", "--quick"),
                           require(args.dataset, args.data_dir), launch(worker, args)), build_parser())
