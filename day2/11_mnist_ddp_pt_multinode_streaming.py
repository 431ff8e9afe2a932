"""Lesson 11: lesson 10's DDP, streaming the training set from a chunked HDF5 file instead of memory.

Once, on a login node or a laptop:   python data_tools/create_mnist_h5.py     # data/fashion-mnist-chunk1000.h5
Inside a Slurm allocation (salloc --nodes 2 --ntasks-per-node=4 ..., or an sbatch script):

    ./day2/multinode_setup_and_run.sh 11_mnist_ddp_pt_multinode_streaming.py --quick
    ./day2/multinode_setup_and_run.sh --launcher torchrun 11_mnist_ddp_pt_multinode_streaming.py --workers 2

On one machine:

    torchrun --standalone --nproc_per_node=4 day2/11_mnist_ddp_pt_multinode_streaming.py --quick

A dataset too large for memory is read from disk while training.  Read it sample by sample and every read
pays for a whole HDF5 chunk; read it in chunks and the shuffle can only move whole chunks.  So
(data_tools/h5stream.py):
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
Every epoch the lesson counts, across ranks, how often each sample was trained on, and reports it.
--source memory trains on the same chunks in the same order, taken from memory: the tests check that it
gives the same weights.  On Lustre/GPFS, export HDF5_USE_FILE_LOCKING=FALSE for other HDF5 tools (this
lesson reads without locks).  --batch-size is per rank.
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
from torch.utils.data import DataLoader

from course import cli
from course.evaluate import evaluate
from course.launch import backend_for, launch, require_launcher, setup_device
from course.models import build_model
from course.output import plot_curves, rank_print, save_weights, write_json
from course.profiling import add_profile_args, maybe_profile
from data_tools.datasets import DataError, default_data_dir, load_split, require
from data_tools.h5layout import create_command, default_h5_path, read_layout
from data_tools.h5stream import ChunkShardSampler, H5Chunks, H5TestSet, MemoryChunks, normalize, rebatch

LESSON = "day2/11_mnist_ddp_pt_multinode_streaming.py"


def worker(info, args):
    # info: rank, local rank, node and world size from srun's or torchrun's variables (lesson 9)
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)  # DDP: the LOCAL rank picks this node's GPU
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    host = socket.gethostname()
    placement = [None] * world_size
    dist.all_gather_object(placement, (info.node_rank, host, info.local_rank))  # who runs where
    nodes = len({node for node, _, _ in placement})
    if info.local_rank == 0:  # DDP: one process per node: the place for per-node work
        ranks = [r for r, (node, _, _) in enumerate(placement) if node == info.node_rank]
        rank_print(rank, f"local rank 0 of node {info.node_rank} ({host}), which runs global ranks {ranks}; "
                         f"my device {device}")
    layout = read_layout(args.h5_file)
    if args.source == "h5":
        chunks = H5Chunks(args.h5_file, "train", limit=args.train_samples or 0)  # opened on first read
    else:  # the same chunks from memory: the reference the tests compare the file against
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
    losses, epochs, order, done, wait, start = [], [], [], 0, 0.0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new chunk order each epoch, the same on every rank
        my_steps = -(-sampler.num_rank_samples() // args.batch_size)
        if args.max_steps:
            my_steps = min(my_steps, args.max_steps - done)
        steps = [None] * world_size
        dist.all_gather_object(steps, my_steps)  # ranks differ by up to a chunk's worth of steps
        seen = torch.zeros(chunks.num_samples, dtype=torch.int32, device=device)
        epoch_losses = torch.full((max(steps),), float("nan"), device=device)
        epoch_order = []
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
                seen.index_add_(0, index.to(device), torch.ones(len(index), dtype=torch.int32, device=device))
                if args.save_order:
                    epoch_order += index.tolist()
                ready = time.perf_counter()
        # DDP: join() copied the weights from a rank that ran to the end, but not the optimizer's momentum:
        # the ranks that stopped early missed the last steps.  Take it from the last such rank, as join() does.
        last = max(r for r in range(world_size) if steps[r] == max(steps))
        for p in model.parameters():
            dist.broadcast(optimizer.state[p]["momentum_buffer"], src=last)
        done += max(steps)
        losses.append(epoch_losses)
        order.append(epoch_order)

        dist.all_reduce(seen)  # DDP: how often each sample was trained on, summed over ranks
        once = int((seen == 1).sum())
        epochs.append({"epoch": epoch, "samples": chunks.num_samples, "trained": int(seen.sum()),
                       "seen_once": once, "seen_never": int((seen == 0).sum()), "seen_more": int((seen > 1).sum()),
                       "steps_per_rank": steps,
                       "chunks_per_rank": [len(range(r, len(chunks), world_size)) for r in range(world_size)]})
        accuracy, test_loss, counted = evaluate(model.module, test_set, rank, world_size)
        prof.epoch(epoch, accuracy, test_loss)
        if rank == 0:
            summary = ("each seen exactly once" if once == chunks.num_samples else
                       f"{once} seen once, {epochs[-1]['seen_never']} never, {epochs[-1]['seen_more']} more often")
            rank_print(rank, f"epoch {epoch}: {chunks.num_samples} training samples in {len(chunks)} chunks, "
                             f"{summary}; steps per rank {steps}; test loss {test_loss:.4f}, "
                             f"test accuracy {accuracy:.4f} ({counted} test images, each counted once)")
        if args.max_steps and done >= args.max_steps:
            break
    seconds = time.perf_counter() - start
    prof.close()
    rank_print(rank, f"{done} steps in {seconds:.1f} s, {wait:.1f} s of them waiting for data")

    # every replica must hold the same weights AND the same momentum (the join() caveat above)
    state = torch.cat([t.detach().reshape(-1) for p in model.parameters()
                       for t in (p, optimizer.state[p]["momentum_buffer"])])
    states = [torch.empty_like(state) for _ in range(world_size)]
    dist.all_gather(states, state)
    identical = all(torch.equal(states[0], s) for s in states)
    losses = torch.cat(losses)
    per_rank = [torch.empty_like(losses) for _ in range(world_size)]
    dist.all_gather(per_rank, losses)  # DDP: the loss of each step, averaged over the ranks that had a batch
    losses = torch.stack(per_rank).nanmean(0).tolist()
    waits, orders = [None] * world_size, [None] * world_size
    dist.all_gather_object(waits, round(wait, 3))
    if args.save_order:
        dist.all_gather_object(orders, order)
    if rank == 0:  # DDP: GLOBAL rank 0 alone writes the shared files (local rank 0 exists on every node)
        samples = sum(e["trained"] for e in epochs)
        run = args.run_dir
        write_json(run / "metrics.json", {
            "lesson": "11_mnist_ddp_pt_multinode_streaming", "dataset": layout.dataset, "model": args.model,
            "world_size": world_size, "nodes": nodes, "launcher": info.launcher, "written_by": [rank, host],
            "placement": [{"rank": r, "node": n, "host": h, "local_rank": lr}
                          for r, (n, h, lr) in enumerate(placement)],
            "source": args.source, "h5_file": str(args.h5_file), "chunk_samples": layout.chunk_samples,
            "workers": args.workers, "backend": dist.get_backend(), "batch_size": args.batch_size,
            "lr": args.lr, "epochs": len(epochs), "steps": done, "samples_seen": samples,
            "per_epoch": epochs, "replicas_identical": identical, "data_wait_seconds": waits,
            "train_seconds": seconds, "samples_per_second": samples / seconds,
            "test_accuracy": accuracy, "test_loss": test_loss, "loss_per_step": losses})
        if args.save_order:  # the sample order each rank trained on, per epoch: order[epoch][rank]
            write_json(run / "order.json", {"epochs": [[orders[r][e] for r in range(world_size)]
                                                        for e in range(len(epochs))]})
        save_weights(run / "model.pt", model)
        source = f"streamed from {args.h5_file.name}" if args.source == "h5" else "the same chunks from memory"
        plot_curves(run / "loss.png", {f"{world_size} ranks": (range(1, done + 1), losses)}, "step",
                    "training loss (mean over ranks)", f"{args.model}, {source}")
        print(f"{world_size} ranks on {nodes} node(s), {source} (chunks of {layout.chunk_samples}); "
              f"replicas identical: {identical}; test accuracy {accuracy:.4f}; outputs in {run}", flush=True)
    dist.destroy_process_group()


def check_data(args):
    """Fail fast, with the command that fixes it, before any rank starts."""
    data_dir = args.data_dir or default_data_dir()
    args.h5_file = args.h5_file or default_h5_path(args.dataset, data_dir)
    if not args.h5_file.exists():
        default = args.h5_file == default_h5_path(args.dataset, data_dir)
        command = create_command(args.dataset, output=None if default else args.h5_file)
        raise DataError(f"{args.h5_file} does not exist; create it with: {command}"
                        + (f" --data-dir {args.data_dir}" if args.data_dir else ""))
    layout = read_layout(args.h5_file)
    if layout.dataset != args.dataset:
        raise DataError(f"{args.h5_file} holds {layout.dataset}, not {args.dataset}; "
                        f"pass --dataset {layout.dataset}")
    if args.source == "memory":
        require(args.dataset, args.data_dir)


def build_parser():
    p = cli.add_distributed(cli.parser(__doc__, LESSON))
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0,
                   help="DDP's gradient bucket size in MB (the MLP's gradients are 0.4 MB: one bucket)")
    p.add_argument("--h5-file", type=Path, default=None,
                   help="the chunked file from data_tools/create_mnist_h5.py "
                        "(default: <data dir>/<dataset>-chunk1000.h5)")
    p.add_argument("--workers", type=int, default=1, choices=range(0, 17), metavar="N",
                   help="DataLoader worker processes per rank reading chunks ahead (0: read in the rank itself)")
    p.add_argument("--source", default="h5", choices=("h5", "memory"),
                   help="memory: the same chunks in the same order from the in-memory dataset (for comparison)")
    p.add_argument("--save-order", action="store_true",
                   help="also write order.json: the sample indices each rank trained on, per epoch")
    return add_profile_args(p)


if __name__ == "__main__":
    cli.main(lambda args: (require_launcher(LESSON, "--quick"), check_data(args), launch(worker, args)),
             build_parser())
