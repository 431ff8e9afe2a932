"""Lesson 12: lesson 10's DDP training survives time limits, preemption and crashed ranks: it checkpoints,
stops cleanly when asked, and resumes bit for bit where it stopped.

    python day2/12_ddp_fault_tolerance.py --nproc 2 --quick --step-sleep 0.05
        (in another terminal: kill -USR1 <a pid it printed>; then run the same command again: it resumes)
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=4 --max-restarts=3 \
        day2/12_ddp_fault_tolerance.py
    slurm/submit.sh 12_ddp_fault_tolerance --site cpu-only -- --epochs 20

Jobs end before training does: a time limit, preemption by a more important job, a crashed rank or node.
Four things make a run that can stop at any step and go on later as if nothing had happened:

1. A checkpoint every --checkpoint-every steps and at the end: the model, the optimizer (its momentum
   buffers are part of the training state), the position (epoch and batch within it), the sampler's seed
   and every rank's RNG state.  Global rank 0 writes it to a temporary file, flushes it to the disk and
   renames it: a crash while writing leaves the previous checkpoint, never half a new one.  Beside it goes
   its sha256 (step-NNNNNNNNN.pt.sha256, renamed into place first): torch.load checks no checksum, and a
   file with bytes flipped in place (a failing disk, a bad copy) would load without a word.  Rank 0 checks
   the digest before it chooses a checkpoint; every rank then loads the same file with map_location (its own
   device) and weights_only=True (a checkpoint is data: weights_only refuses pickles that would run code).
   The newest checkpoint that matches its digest and loads wins; a damaged one (truncated by a full disk, a
   copy cut short, bytes changed) is named in one line and skipped.
2. A clean stop on request.  SIGTERM (scancel, the end of the time limit, torchrun stopping its workers)
   and SIGUSR1 (what `sbatch --signal=B:USR1@120` sends 120 s before the limit) only set a flag: the
   handler runs between two Python bytecodes, maybe in the middle of a collective, where no checkpoint can
   be written.  After every step the flag is combined across ranks with an all_reduce, so all ranks stop
   after the same step, even when the signal reached only one of them.  Then a checkpoint, and exit 0.
3. Requeue and resume.  The launcher (slurm/12_ddp_fault_tolerance.sh, `--requeue`) traps SIGUSR1,
   passes it to the ranks, waits for the checkpoint and runs `scontrol requeue`: the job goes back to the
   queue and, when it starts again, the same command finds the newest checkpoint and resumes.
4. Restarts.  A rank that crashes cannot checkpoint.  Under `torchrun --max-restarts=N` the agent stops
   the other ranks and starts all of them again, N times at most; they resume from the newest checkpoint
   (and lose the steps since).  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives the restarted ranks a store of
   their own: in the one torchrun shares by default they can find the previous round's addresses and fail
   to connect (pytorch/pytorch#135712; 2 restarts of 3 failed here without it).  Under
   `srun --kill-on-bad-exit=1` a crash ends the job: a bug would only crash again; resubmit it by hand and
   it resumes.

torchrun and signals: torchrun passes SIGTERM, SIGINT, SIGHUP and SIGQUIT on to its workers, but by
default not SIGUSR1: the agent dies of it, and its workers (in sessions of their own) never see it and go
on, orphans, until something kills them without a checkpoint.  The launcher starts torchrun with
--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 (torch >= 2.9), so that it forwards SIGUSR1 and
gives its workers --shutdown-timeout seconds (30 by default) to finish.
Started with --nproc, the parent passes SIGTERM and SIGUSR1 on to its ranks (course/launching/supervise.py).

Resumed, the run is the run that was never interrupted, bit for bit (measured on the CPU and on one H100 GPU): same
data order, same weights, same losses.  That needs deterministic kernels (use_deterministic_algorithms),
the same threads per rank and, from 3 ranks on, the same gradient buckets.  DDP all_reduces the first
backward after the wrap in provisional buckets (parameter order), then rebuilds them in the order the
gradients arrived.  A number's place in its bucket sets the order in which the ranks' values are added:
with 2 ranks a + b = b + a, with 4 another order rounds differently (4 ranks resumed without the rebuild
ended with weights ~1e-8 off).  The uninterrupted run trains in rebuilt buckets, so a resumed run rebuilds
them first, with one backward pass that it throws away.  The weights are loaded after the wrap, on every
rank from the same file: the replicas agree without a broadcast.  The checkpoint directory is locked by the
run using it: a second run on the same --run-dir stops with a message instead of mixing its checkpoints with
the first one's.  --bucket-cap-mb and --profile as in lesson 10.
course/checkpoints/files.py holds the plumbing: what goes into a checkpoint and back out (save, restore), the files
(atomic write, their digests, rotation, the newest valid one, the lock), the position and records a checkpoint carries (step,
losses, evaluations, stops) and the closing report.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/
from course.launching.requires import require  # noqa: E402
require(__file__)  # before torch: a torch or package this lesson lacks is one line, not an ImportError

stop_signal = None  # set by on_stop_signal, read by the training loop after every step


def on_stop_signal(signum, frame):
    global stop_signal
    stop_signal = signum  # only a flag: we may be inside a collective here; the loop stops at a safe point


signal.signal(signal.SIGUSR1, on_stop_signal)  # from the start: by default SIGUSR1 kills a rank still importing

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from course.checkpoints import files as checkpoints
from course.launching import cli
from course.launching.launch import backend_for, launch, setup_device
from course.measuring.profiling import add_profile_args, maybe_profile
from course.models import build_model
from course.training.evaluate import evaluate
from course.training.output import rank_print
from data_tools.datasets import InMemoryMNIST, batches, require


def worker(info, args):
    # info: rank, local rank, node and world size from srun's or torchrun's variables (lesson 9)
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)  # DIST: the LOCAL rank picks this node's GPU
    directory = checkpoints.prepare(args, rank, info.launcher)  # deterministic kernels, the dir's lock, pids
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
    signal.signal(signal.SIGTERM, on_stop_signal)  # after init: until here SIGTERM simply ends the process
    require(args.dataset, args.data_dir)
    train_set = InMemoryMNIST(args.dataset, "train", args.data_dir, device, limit=args.train_samples or 0)
    test_set = InMemoryMNIST(args.dataset, "test", args.data_dir, device)

    model = build_model(args.model, args.seed + rank).to(device)
    # DDP: broadcasts rank 0's weights at wrap time, then all_reduces gradient buckets during backward
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    state = checkpoints.new_state(args, world_size)  # the position (step 0) and the run's records so far
    chosen = [checkpoints.newest_valid(directory, fresh=args.fresh) if rank == 0 else None]  # DIST: rank 0 picks
    dist.broadcast_object_list(chosen, src=0)  # DIST: and tells the others: every rank resumes from the same one
    if chosen[0] is not None:
        saved = torch.load(chosen[0], map_location=device, weights_only=True)  # DIST: onto this rank's device
        state = checkpoints.restore(chosen[0], saved, model.module, optimizer, rank, state)  # the same on all ranks
        # DDP: one backward, thrown away, so that resumed steps reduce in rebuilt buckets (see "bit for bit" above)
        F.cross_entropy(model(train_set.images[:1]), train_set.labels[:1]).backward()  # the next zero_grad drops it

    def checkpoint():
        """Every rank calls it (the RNG states are gathered); rank 0 writes."""
        rng = [None] * world_size
        dist.all_gather_object(rng, checkpoints.rng_state(device))  # DIST: each rank's streams, for rank 0
        if rank == 0:  # to a temporary file, flushed to the disk and renamed: a crash leaves the previous one
            return checkpoints.save(directory, state, model.module, optimizer, rng, args.keep)

    # DDP: rank r gets every W-th index of the epoch's shuffled order; padded so all shards are equal
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    per_epoch, max_steps = checkpoints.steps(args, len(sampler))  # batches per epoch, steps in all
    prof = maybe_profile(args, rank, device)  # --profile: lesson 5's traces and TensorBoard scalars
    stopped, start = None, time.perf_counter()
    for epoch in range(state["epoch"], args.epochs):
        if state["step"] >= max_steps:
            break
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        # Resumed mid-epoch: the same shuffle (set_epoch), less the batches already trained on
        loader = batches(train_set, list(sampler)[state["batches_done"] * args.batch_size:], args.batch_size)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP: gradients arrive averaged over ranks when backward returns
            optimizer.step()
            status = torch.stack([loss.detach().float(), torch.tensor(float(stop_signal is not None), device=device)])
            dist.all_reduce(status)  # DIST: one all_reduce a step: the loss and the stop requests, summed over ranks
            checkpoints.after_step(state, (status[0] / world_size).item(), rank, args, per_epoch)
            prof.step(loss, world_size * len(y))
            if status[1] > 0:  # DIST: a rank was asked to stop: ALL stop after this step; gathers who got what
                stopped = checkpoints.record_stop(state, stop_signal)
            elif state["step"] % args.checkpoint_every == 0 and state["step"] < max_steps:  # the last: below
                checkpoint()
            if stopped is not None or state["step"] >= max_steps:
                break
        if stopped is not None:
            break
        accuracy, test_loss, counted = evaluate(model.module, test_set, rank, world_size)
        prof.epoch(epoch, accuracy, test_loss)
        if rank == 0:
            rank_print(rank, f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {accuracy:.4f} "
                             f"({counted} test images, each counted once)")
        checkpoints.end_epoch(state, epoch, accuracy, test_loss, per_epoch)  # the next epoch, if this one is done
    seconds = time.perf_counter() - start
    prof.close()
    state["train_seconds"] += seconds
    path = checkpoint()  # at the stop or at the end: the newest state is always on the disk
    dist.barrier()  # DIST: nobody leaves before rank 0 has written it (srun would stop the job early)
    if rank == 0:  # DIST: GLOBAL rank 0 alone writes the shared files (local rank 0 exists on every node)
        checkpoints.report(args, model, state, stopped, path, len(sampler), info.launcher)  # stopped: exit 0 too
    dist.destroy_process_group()


def build_parser():
    p = checkpoints.add_args(cli.add_distributed(cli.parser(__doc__, "day2/12_ddp_fault_tolerance.py", nproc_default=2)))
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0,
                   help="DDP's gradient bucket size in MB (the MLP's gradients are 0.4 MB: one bucket)")
    return add_profile_args(p)


if __name__ == "__main__":
    cli.main(lambda args: (checkpoints.check_dir(args),
                           require(args.dataset, args.data_dir), launch(worker, args)), build_parser())
