"""Lesson 11: lesson 10's DDP, streaming the training set from a chunked HDF5 file instead of memory.

Once, on a login node or a laptop:   python data_tools/create_mnist_h5.py     # data/fashion-mnist-chunk1000.h5
Inside a Slurm allocation (salloc --nodes 2 --ntasks-per-node=2 ..., or an sbatch script):

    ./day2/multinode_setup_and_run.sh 11_mnist_ddp_pt_multinode_streaming.py --quick
    ./day2/multinode_setup_and_run.sh --launcher torchrun 11_mnist_ddp_pt_multinode_streaming.py --workers 2

On one machine:

    torchrun --standalone --nproc_per_node=2 day2/11_mnist_ddp_pt_multinode_streaming.py --quick

A dataset too large for memory is read from disk while training.  Read it sample by sample and every read
pays for a whole HDF5 chunk; read it in chunks and the shuffle can only move whole chunks.  So (below:
ChunkShardSampler, the DataLoader over whole chunks, rebatch; data_tools/h5stream.py reads the file):
- the chunk is the unit: each epoch the chunk ids are shuffled with seed + epoch (the same order on every
  rank) and dealt round-robin, rank r reading the chunks at positions r, r+W, ... of that list; one aligned
  read per chunk; the samples of a chunk are then shuffled.  The ranks together read every chunk once: each
  sample once per epoch;
- the file is opened lazily by whichever process reads (a DataLoader worker, --workers), never inherited
  through fork or pickled;
- no padding: DistributedSampler repeats samples so that ranks get equal shares, and a padding sample with a
  made-up label would be trained on.  Here chunk counts may differ by one between ranks (and the last chunk
  may be short), so ranks run out of batches at different steps.  DDP's join() lets the ranks that are done
  keep answering the others' gradient all_reduces (with zeros) until all are done; then it copies the final
  weights from a rank that ran to the end.  join() does not know about the optimizer: the momentum of a rank
  that stopped early missed the last steps, so after each epoch we copy it from a rank that ran to the end as
  well.  (The alternative, dropping the remainder so all ranks take equal steps, would skip samples every
  epoch.)  Each rank prints the steps it took part in and, in brackets, those on its own batches (the rest it
  shadowed under join()).
The bookkeeping is course/training/coverage.py's: every rank's steps in an epoch (from the samples in its chunks),
how often each sample was trained on, counted across ranks and reported every epoch, each step's loss
averaged over the ranks that had a batch, the time each rank waited for data, and at the end whether every
replica holds the same weights and momentum.  --source memory trains on the same chunks in the same order,
taken from memory: it gives the same weights as the file.  On Lustre/GPFS, export
HDF5_USE_FILE_LOCKING=FALSE for other HDF5 tools (this lesson reads without locks).  --batch-size is per rank.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import socket
import sys
import time
from datetime import timedelta
from itertools import islice
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/
from course.launching.requires import require  # noqa: E402
require(__file__)  # before torch: a torch or package this lesson lacks is one line, not an ImportError

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from course.launching import cli
from course.launching.launch import backend_for, launch, require_launcher, setup_device
from course.measuring.profiling import add_profile_args, maybe_profile
from course.models import build_model
from course.training import coverage, results
from course.training.evaluate import evaluate
from course.training.output import rank_print
from data_tools.h5stream import add_h5_args, chunk_seed, normalize, open_chunks, require_h5  # reading the file

class ChunkShardSampler(torch.utils.data.Sampler):
    """This rank's chunks for one epoch, as (chunk id, shuffle seed) tasks for a chunk dataset (H5Chunks).

    All chunks are permuted with seed + epoch (identical on every rank, like DistributedSampler) and rank r
    takes every W-th one.  The shuffle seed of a chunk depends only on (seed, epoch, chunk), so the order of
    samples is a pure function of the arguments: the same whichever rank or DataLoader worker reads it.
    """

    def __init__(self, num_chunks: int, rank: int, world_size: int, seed: int = 0):
        self.num_chunks, self.rank, self.world_size, self.seed, self.epoch = num_chunks, rank, world_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def my_chunks(self) -> list:
        g = torch.Generator().manual_seed(self.seed + self.epoch)  # DDP: the same permutation on every rank
        return torch.randperm(self.num_chunks, generator=g).tolist()[self.rank::self.world_size]  # DDP: round-robin

    def __iter__(self):
        return iter([(chunk, chunk_seed(self.seed, self.epoch, chunk)) for chunk in self.my_chunks()])

    def __len__(self):
        return len(self.my_chunks())


def rebatch(chunks, batch_size: int):
    """Cut a stream of (indices, images, labels) chunks into batches of `batch_size`; the last may be short.
    A batch may span two chunks; nothing is dropped or repeated."""
    left = ()  # the last samples of the chunks so far (at most batch_size): the next batch starts with them
    for chunk in chunks:
        chunk = tuple(torch.cat(pair) for pair in zip(left, chunk)) if left else chunk
        *full, left = zip(*(t.split(batch_size) for t in chunk))  # batches of batch_size, views of the chunk
        yield from full
    if left:
        yield left


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
    chunks, test_set, layout = open_chunks(args, world_size, device)

    model = build_model(args.model, args.seed + rank).to(device)
    # DDP: broadcasts rank 0's weights at wrap time, then all_reduces gradient buckets during backward
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    sampler = ChunkShardSampler(len(chunks), rank, world_size, seed=args.seed)  # DDP: this rank's chunks
    loader = DataLoader(chunks, sampler=sampler, batch_size=None,  # None: whole chunks, one read each (rebatch below)
                        num_workers=args.workers, persistent_workers=args.workers > 0, pin_memory=device.type == "cuda")
    prof = maybe_profile(args, rank, device)  # --profile: lesson 5's traces and TensorBoard scalars
    record, start = coverage.Coverage(chunks.num_samples, device, args.save_order), time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        steps = record.start_epoch(sampler.my_chunks(), chunks, args)  # DIST: every rank's steps: uneven
        with model.join():  # DDP: a rank out of batches shadows the others' all_reduces until all are done
            for index, images, y in record.timed(islice(rebatch(loader, args.batch_size), steps[rank])):
                x, y = normalize(images.to(device, non_blocking=True), layout.dataset), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()  # DDP: gradients arrive averaged over ranks when backward returns
                optimizer.step()
                prof.step(loss, world_size * len(y))
                record.add(index, loss)  # which samples this rank trained on, and its loss
        last = max(r for r in range(world_size) if steps[r] == max(steps))  # DDP: join() copies its weights,
        for p in model.parameters():  # DDP: not the momentum, which the ranks that stopped early did not update
            dist.broadcast(optimizer.state[p]["momentum_buffer"], src=last)  # DDP: the same momentum everywhere
        record.end_epoch(epoch, len(chunks))  # DIST: counts summed over ranks: each sample once?
        accuracy, test_loss, counted = evaluate(model.module, test_set, rank, world_size)
        prof.epoch(epoch, accuracy, test_loss)
        if rank == 0:
            rank_print(rank, f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {accuracy:.4f} "
                             f"({counted} test images, each counted once)")
        if args.max_steps and record.steps >= args.max_steps:
            break
    seconds = time.perf_counter() - start
    prof.close()
    losses, identical = record.gather(model, optimizer)  # DIST: mean losses; same weights AND momentum everywhere?
    rank_print(rank, f"{record.steps} steps ({record.own_steps} on its own batches) in {seconds:.1f} s, "
                     f"{record.wait:.1f} s waiting for data; replicas identical: {identical}")
    if rank == 0:  # DIST: GLOBAL rank 0 alone writes the shared files (local rank 0 exists on every node)
        # metrics.json (with who ran where), model.pt, loss.png and the line that sums it up
        results.write(args, model, losses, seconds, accuracy, test_loss, len(sampler),
                      ranks=f"{world_size} ranks on {nodes} node(s)", nodes=nodes, launcher=info.launcher,
                      written_by=[rank, host], placement=[{"rank": r, "node": n, "host": h, "local_rank": lr}
                                                         for r, (n, h, lr) in enumerate(placement)],
                      **record.outputs(args, layout, identical))  # each epoch's coverage; order.json
    dist.destroy_process_group()


def build_parser():
    p = cli.add_distributed(cli.parser(__doc__, "day2/11_mnist_ddp_pt_multinode_streaming.py"))
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0,
                   help="DDP's gradient bucket size in MB (the MLP's gradients are 0.4 MB: one bucket)")
    return add_profile_args(add_h5_args(p))  # --h5-file, --workers, --source, --save-order; --profile


if __name__ == "__main__":
    cli.main(lambda args: (require_launcher("day2/11_mnist_ddp_pt_multinode_streaming.py", "--quick"),
                           require_h5(args), launch(worker, args)), build_parser())
