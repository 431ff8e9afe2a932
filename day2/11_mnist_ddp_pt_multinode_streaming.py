"""Lesson 11: lesson 10's DDP, streaming the training set from a chunked HDF5 file instead of memory.

Once, on a login node or a laptop:   python data_tools/create_mnist_h5.py     # data/fashion-mnist-chunk1000.h5
Inside a Slurm allocation (salloc --nodes 2 --ntasks-per-node=4 ..., or an sbatch script):

    ./day2/multinode_setup_and_run.sh 11_mnist_ddp_pt_multinode_streaming.py --quick
    ./day2/multinode_setup_and_run.sh --launcher torchrun 11_mnist_ddp_pt_multinode_streaming.py --workers 2

On one machine:

    torchrun --standalone --nproc_per_node=4 day2/11_mnist_ddp_pt_multinode_streaming.py --quick

A dataset too large for memory is read from disk while training.  Read it sample by sample and every read
pays for a whole HDF5 chunk; read it in chunks and the shuffle can only move whole chunks.  So (below:
ChunkShardSampler, the DataLoader over whole chunks, rebatch; data_tools/h5stream.py reads the file):
- the chunk is the unit: each epoch the chunk ids are shuffled with seed + epoch (the same order on every
  rank) and dealt round-robin, rank r reading chunks r, r+W, ...; one aligned read per chunk; the samples
  of a chunk are then shuffled.  The ranks together read every chunk once: each sample once per epoch;
- the file is opened lazily by whichever process reads (a DataLoader worker, --workers), never inherited
  through fork or pickled;
- no padding: DistributedSampler repeats samples so that ranks get equal shares, and a padding sample with a
  made-up label would be trained on.  Here chunk counts may differ by one between ranks, so ranks run out
  of batches at different steps.  DDP's join() lets the ranks that are done keep answering the others'
  gradient all_reduces (with zeros) until all are done; then it copies the final weights from a rank that
  ran to the end.  join() does not know about the optimizer: the momentum of a rank that stopped early
  missed the last steps, so after each epoch we copy it from a rank that ran to the end as well.
  (The alternative, dropping the remainder so all ranks take equal steps, would skip samples every epoch.)
  Each rank prints the steps it took part in and, in brackets, those on its own batches (the rest it
  shadowed under join()).
Every epoch the lesson counts, across ranks, how often each sample was trained on, and reports it
(course/coverage.py).  --source memory trains on the same chunks in the same order, taken from memory:
it gives the same weights as the file.  On Lustre/GPFS, export HDF5_USE_FILE_LOCKING=FALSE for other HDF5 tools (this
lesson reads without locks).  --batch-size is per rank.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler

from course import cli, coverage, replicas, results
from course.evaluate import evaluate
from course.launch import backend_for, launch, require_launcher, setup_device
from course.models import build_model
from course.output import rank_print, write_json
from course.profiling import add_profile_args, maybe_profile
from data_tools.datasets import load_split
from data_tools.h5layout import add_h5_args, read_layout, require_h5
from data_tools.h5stream import H5Chunks, H5TestSet, MemoryChunks, chunk_seed, normalize

LESSON = "day2/11_mnist_ddp_pt_multinode_streaming.py"


class ChunkShardSampler(Sampler):
    """This rank's chunks for one epoch, as (chunk id, shuffle seed) tasks for a chunk dataset (H5Chunks).

    All chunks are permuted with seed + epoch (identical on every rank, like DistributedSampler) and rank r
    takes every W-th one.  The shuffle seed of a chunk depends only on (seed, epoch, chunk), so the order of
    samples is a pure function of the arguments: the same whichever rank or DataLoader worker reads it.
    """

    def __init__(self, num_samples: int, chunk_samples: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True):
        if num_samples < 1 or chunk_samples < 1:
            raise ValueError("num_samples and chunk_samples must be positive")
        self.num_samples, self.chunk_samples = num_samples, chunk_samples
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.num_chunks = -(-num_samples // chunk_samples)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def chunk_order(self) -> list:
        """The epoch's order of all chunks (before they are dealt to ranks)."""
        if not self.shuffle:
            return list(range(self.num_chunks))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)  # DDP: the same permutation on every rank
        return torch.randperm(self.num_chunks, generator=g).tolist()

    def my_chunks(self) -> list:
        return self.chunk_order()[self.rank::self.world_size]  # DDP: dealt round-robin: each chunk to one rank

    def chunk_size(self, chunk: int) -> int:
        return min(self.chunk_samples, self.num_samples - chunk * self.chunk_samples)

    def num_rank_samples(self) -> int:
        """Samples this rank gets this epoch (ranks differ by up to one chunk)."""
        return sum(self.chunk_size(c) for c in self.my_chunks())

    def __iter__(self):
        for chunk in self.my_chunks():
            yield chunk, (chunk_seed(self.seed, self.epoch, chunk) if self.shuffle else None)

    def __len__(self):
        return len(range(self.rank, self.num_chunks, self.world_size))


def rebatch(chunks, batch_size: int):
    """Cut a stream of (indices, images, labels) chunks into batches of `batch_size`; the last may be short.

    A batch may span two chunks; nothing is dropped or repeated.  Batches are views of their chunk; only a
    batch that spans two chunks is copied (fewer than batch_size samples from each side).
    """
    left = None  # what the previous chunks left over, fewer than batch_size samples
    for chunk in chunks:
        n, start = len(chunk[0]), 0
        if left is not None:  # complete the batch the previous chunks began
            start = min(batch_size - len(left[0]), n)
            left = tuple(torch.cat((a, t[:start])) for a, t in zip(left, chunk))
            if len(left[0]) < batch_size:
                continue
            yield left
            left = None
        stop = start + (n - start) // batch_size * batch_size
        for i in range(start, stop, batch_size):
            yield tuple(t[i:i + batch_size] for t in chunk)
        if stop < n:
            left = tuple(t[stop:] for t in chunk)
    if left is not None:
        yield left


def worker(info, args):
    # info: rank, local rank, node and world size from srun's or torchrun's variables (lesson 9)
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)  # DIST: the LOCAL rank picks this node's GPU
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout))
    host = socket.gethostname()
    placement = [None] * world_size
    dist.all_gather_object(placement, (info.node_rank, host, info.local_rank))  # DIST: who runs where
    nodes = len({node for node, _, _ in placement})
    if info.local_rank == 0:  # DIST: one process per node: the place for per-node work
        ranks = [r for r, (node, _, _) in enumerate(placement) if node == info.node_rank]
        rank_print(rank, f"local rank 0 of node {info.node_rank} ({host}), which runs global ranks {ranks}; "
                         f"my device {device}")
    layout = read_layout(args.h5_file)
    if args.source == "h5":
        chunks = H5Chunks(args.h5_file, "train", limit=args.train_samples or 0)  # opened on first read
    else:  # the same chunks from memory, to compare the file with
        images, labels = load_split(layout.dataset, "train", args.data_dir)
        chunks = MemoryChunks(images, labels, layout.chunk_samples, limit=args.train_samples or 0)
    test_set = H5TestSet(args.h5_file, "test", device)
    if len(chunks) < world_size:  # a rank without a single chunk would have nothing to train on
        raise cli.CourseError(f"{chunks.num_samples} samples in chunks of {layout.chunk_samples} are only "
                              f"{len(chunks)} chunks for {world_size} ranks; use more --train-samples or a file "
                              f"with smaller chunks (data_tools/create_mnist_h5.py --chunk-samples N)")

    model = build_model(args.model, args.seed + rank).to(device)
    # DDP: broadcasts rank 0's weights at wrap time, then all_reduces gradient buckets during backward
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # DDP: this rank's chunks of each epoch, instead of DistributedSampler's samples
    sampler = ChunkShardSampler(chunks.num_samples, layout.chunk_samples, rank, world_size, seed=args.seed)
    # batch_size=None: the DataLoader hands over whole chunks (one read each); rebatch() cuts them into batches
    loader = DataLoader(chunks, sampler=sampler, batch_size=None, num_workers=args.workers,
                        persistent_workers=args.workers > 0, pin_memory=device.type == "cuda")
    prof = maybe_profile(args, rank, device)  # --profile: lesson 5's traces and TensorBoard scalars
    counts = coverage.Coverage(chunks.num_samples, device, args.save_order)  # each sample once per epoch?
    losses, done, own, wait, start = [], 0, 0, 0.0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new chunk order each epoch, the same on every rank
        my_steps = -(-sampler.num_rank_samples() // args.batch_size)
        if args.max_steps:
            my_steps = min(my_steps, args.max_steps - done)
        steps = [None] * world_size
        dist.all_gather_object(steps, my_steps)  # DIST: ranks differ by up to a chunk's worth of steps
        counts.start_epoch()
        epoch_losses = torch.full((max(steps),), float("nan"), device=device)
        ready = time.perf_counter()
        with model.join():  # DDP: a rank out of batches shadows the others' all_reduces until all are done
            for i, (index, images, y) in enumerate(rebatch(loader, args.batch_size)):
                if i == my_steps:
                    break
                wait += time.perf_counter() - ready  # time this rank waited for data
                x = normalize(images.to(device, non_blocking=True), layout.dataset)
                y = y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()  # DDP: gradients arrive averaged over ranks when backward returns
                optimizer.step()
                epoch_losses[i] = loss.detach()
                prof.step(loss, world_size * len(y))
                counts.add(index)  # which samples this rank trained on
                ready = time.perf_counter()
        # DDP: join() copied the weights from a rank that ran to the end, but not the optimizer's momentum:
        # the ranks that stopped early missed the last steps.  Take it from the last such rank, as join() does.
        last = max(r for r in range(world_size) if steps[r] == max(steps))
        for p in model.parameters():
            dist.broadcast(optimizer.state[p]["momentum_buffer"], src=last)  # DDP: the same momentum everywhere
        done, own = done + max(steps), own + steps[rank]  # own: steps on this rank's batches, not shadowed
        losses.append(epoch_losses)
        summary = counts.end_epoch(epoch, steps, len(chunks), world_size)  # DIST: counts summed over ranks
        accuracy, test_loss, counted = evaluate(model.module, test_set, rank, world_size)
        prof.epoch(epoch, accuracy, test_loss)
        if rank == 0:
            rank_print(rank, f"epoch {epoch}: {chunks.num_samples} training samples in {len(chunks)} chunks, "
                             f"{summary}; steps per rank {steps}; test loss {test_loss:.4f}, "
                             f"test accuracy {accuracy:.4f} ({counted} test images, each counted once)")
        if args.max_steps and done >= args.max_steps:
            break
    seconds = time.perf_counter() - start
    prof.close()
    rank_print(rank, f"{done} steps ({own} on its own batches) in {seconds:.1f} s, {wait:.1f} s waiting for data")

    # every replica must hold the same weights AND the same momentum (the join() caveat above)
    identical = replicas.identical_on_all_ranks(  # DIST: an all_gather of every rank's weights and momentum
        t for p in model.parameters() for t in (p, optimizer.state[p]["momentum_buffer"]))
    losses = torch.cat(losses)
    per_rank = [torch.empty_like(losses) for _ in range(world_size)]
    dist.all_gather(per_rank, losses)  # DIST: the loss of each step, averaged over the ranks that had a batch
    losses = torch.stack(per_rank).nanmean(0).tolist()
    waits = [None] * world_size
    dist.all_gather_object(waits, round(wait, 3))  # DIST: how long each rank waited for data
    orders = counts.all_orders(world_size) if args.save_order else None
    if rank == 0:  # DIST: GLOBAL rank 0 alone writes the shared files (local rank 0 exists on every node)
        source = f"streamed from {args.h5_file.name}" if args.source == "h5" else "the same chunks from memory"
        # metrics.json (with who ran where and each epoch's coverage), model.pt, loss.png
        results.write(args, model, losses, seconds, accuracy, test_loss, 0, line=False,
                      title=f"{args.model}, {source}", samples=sum(e["trained"] for e in counts.epochs),
                      nodes=nodes, launcher=info.launcher,
                      written_by=[rank, host], placement=[{"rank": r, "node": n, "host": h, "local_rank": lr}
                                                         for r, (n, h, lr) in enumerate(placement)],
                      dataset=layout.dataset, source=args.source, h5_file=str(args.h5_file),
                      chunk_samples=layout.chunk_samples, workers=args.workers, epochs=len(counts.epochs),
                      per_epoch=counts.epochs, replicas_identical=identical, data_wait_seconds=waits)
        if args.save_order:  # the sample order each rank trained on, per epoch: order[epoch][rank]
            write_json(args.run_dir / "order.json", {"epochs": orders})
        print(f"{world_size} ranks on {nodes} node(s), {source} (chunks of {layout.chunk_samples}); replicas "
              f"identical: {identical}; test accuracy {accuracy:.4f}; outputs in {args.run_dir}", flush=True)
    dist.destroy_process_group()


def build_parser():
    p = cli.add_distributed(cli.parser(__doc__, LESSON))
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0,
                   help="DDP's gradient bucket size in MB (the MLP's gradients are 0.4 MB: one bucket)")
    return add_profile_args(add_h5_args(p))  # --h5-file, --workers, --source, --save-order; --profile


if __name__ == "__main__":
    cli.main(lambda args: (require_launcher(LESSON, "--quick"), require_h5(args), launch(worker, args)),
             build_parser())
