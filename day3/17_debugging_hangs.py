"""Lesson 17: debugging a hung or mismatched job: make each rank say where it is stuck and what the others did.

    python day3/17_debugging_hangs.py --nproc 2 --quick --bug skip
    torchrun --nproc_per_node=2 day3/17_debugging_hangs.py --quick --bug uneven
    srun --ntasks=2 python day3/17_debugging_hangs.py --quick --bug shape

Lesson 6's DDP loop with three mistakes learners make, one at a time (--bug; none: the healthy run):
- skip: a rank skips a collective.  Rank 0 writes a checkpoint every --save-every steps and every rank then
  waits in a barrier, so that no rank reads a half-written file; with the barrier indented under
  `if rank == 0`, rank 0 waits in it while the other ranks go on into the next step's gradient all_reduce.
- uneven: ranks with different numbers of batches.  The last rank's shard holds one batch more (a data set
  split by hand into files of different sizes, without DistributedSampler's padding): the other ranks finish
  the epoch and wait in the barrier before the evaluation, the last one waits in DDP's all_reduce of its
  backward.
- shape: ranks all_reduce tensors of different sizes (the last rank sends one number more in the loss that
  is logged every step).
The repros run on the CPU with gloo, also on a GPU node (one line says so at the start).  gloo pairs the n-th
collective of every rank whatever it is: a barrier against an all_reduce waits until --timeout and raises in
the main thread of both ranks.  All_reduces of different sizes may abort the process that receives more bytes
than it expects ("Received data size doesn't match expected size", seen with 4 against 5 numbers) or, as with
--bug shape's 2 against 3, complete on one rank with wrong numbers: that rank goes on and waits in its next
collective while the other still waits in the all_reduce.  NCCL pairs collectives without checking type or
size either, and, checked in torch 2.14.1's ProcessGroupNCCL, its timeout is kept by a watchdog thread: by
default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) that thread logs "Watchdog caught collective operation timeout:
WorkNCCL(SeqNum=..., OpType=..., NumelIn=...)", dumps the flight recorder (TORCH_NCCL_DUMP_ON_TIMEOUT, on by
default) and takes the whole process down from its own thread, so no rank gets an exception to report (with
TORCH_NCCL_BLOCKING_WAIT=1 there is no watchdog: a collective's wait() raises in the thread that waits, where
something waits).  A healthy run on GPUs uses NCCL, and a real hang of it leaves its dumps where this
lesson's analyzer command reads them.
The tools, in the worker and in failed_collective:
- the timeout (init_process_group's `timeout`, --timeout, 10 s here): without it a rank waits 30 minutes
  (gloo) or 10 (NCCL) before anything happens (torch.distributed.constants).  With it each gloo rank raises
  in the collective it waited in, and failed_collective ends the rank with one line: the collective, its
  sequence number, shapes and the lesson line that issued it, how long the rank waited, and the last
  collective every other rank had entered (read from the rendezvous store, which outlives gloo's
  connections): "rank 0 waited 10.0 s in barrier #16 (...) and stopped: timed out ...; rank 1 last entered
  all_reduce #16 (shape [101770], ...)": the gradient bucket of DDP's backward against a barrier.  The
  launcher of --nproc, torchrun and srun --kill-on-bad-exit then end the job.
- the flight recorder (TORCH_FR_BUFFER_SIZE): the last collectives of each rank with the Python stack that
  issued them.  gloo's are recorded (state "scheduled" only); the automatic dump on a timeout is NCCL's
  watchdog's (to TORCH_FR_DUMP_TEMP_FILE + rank: set to RUN_DIR/flight_recorder/rank_ here); on gloo each
  failed rank writes RUN_DIR/flight_recorder/rank_R itself, and the analyzer names the culprit:
      python -m torch.distributed.flight_recorder.fr_trace RUN_DIR/flight_recorder -p rank_
  ("Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH ...").  The gloo dump is fixed up first: torch
  2.14.1's analyzer stops with KeyError on a gloo dump as it comes (course/measuring/debugging.py).
- a stack dump of every rank while it hangs: faulthandler prints every thread's Python stack on SIGUSR1
  (`kill -USR1` the launcher of --nproc: it passes the signal on to every rank; under torchrun, each rank's
  PID; under Slurm, `scancel --signal=USR1 JOBID`); `py-spy dump --pid PID` needs nothing in the script but
  ptrace rights (root, kernel.yama.ptrace_scope=0, or docker --cap-add SYS_PTRACE); --debug-server PORT
  starts torch.distributed.debug's server (experimental in torch 2.14.1; needs Jinja2): rank 0 serves
  http://HOST:PORT/stacks (every rank's Python stacks), /fr_trace_json (every rank's flight recorder) and
  /pyspy_dump (py-spy on every rank, if py-spy is on the ranks' PATH).
- TORCH_DISTRIBUTED_DEBUG=DETAIL: before each collective the ranks compare its fingerprint (type, sequence
  number, shapes, dtypes), on gloo and on NCCL (torch wraps both in a checking process group); a mismatch
  raises at once on every rank, naming both sides ("Rank 0 is running collective: ...TensorShape=[4]...,
  but Rank 1 is running collective: ...TensorShape=[5]..."; when the two differ in type the other side is
  shown garbled, as an internal REDUCE or GATHER).  In torch 2.14.1 on the CPU, DistributedDataParallel's
  constructor crashes under DETAIL (SIGSEGV in its logger, even for one Linear layer; INFO works), so this
  lesson cannot run under it: try it on plain collectives (the notebook's exercise 3).  It costs an extra
  collective per collective: for debugging only.
Every repro ends with a non-zero exit within --timeout, plus up to 3 s while a failed rank waits for the
others' last collectives, plus the time to start and train up to the bug: 15-20 s in all with --timeout 3 on
a 2-core machine shared with other jobs.  slurm/17_debugging_hangs.sh runs the healthy lesson, then --bug
skip, and succeeds only if the repro fails that way.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import faulthandler
import os
import signal
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
from torch.distributed.debug import start_debug_server
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from course.launching import cli
from course.launching.launch import backend_for, launch, setup_device
from course.measuring import debugging
from course.measuring.profiling import add_profile_args, maybe_profile
from course.models import build_model
from course.training import results
from course.training.evaluate import evaluate
from course.training.output import rank_print
from data_tools.datasets import InMemoryMNIST, batches, require


def worker(info, args):
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)
    # DIST: the flight recorder keeps each rank's last collectives with the Python stack that issued each (read
    # when the process group is made; 2000 is torch 2.14's default), and NCCL's watchdog writes it to
    # RUN_DIR/flight_recorder/rank_R when a collective times out (gloo has no watchdog: see failed_collective)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", debugging.dump_prefix(args.run_dir))
    faulthandler.enable(all_threads=True)  # a rank that crashes (gloo's abort, a segfault) prints its stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 PID: every thread's stack, now
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout),  # DIST: how long a rank waits in a collective
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
    if args.debug_server:  # DIST: a web page on rank 0 with every rank's stacks and flight recorder
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))  # what it reads (torchrun sets them)
        debugging.ends_with_this_process()  # its page's process, forked from rank 0, must not outlive it
        start_debug_server(port=args.debug_server, start_method="fork")
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
    args.run_dir.mkdir(parents=True, exist_ok=True)
    prof = maybe_profile(args, rank, device)  # --profile: lesson 5's traces and TensorBoard scalars
    losses, step, start = [], 0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        shard = list(sampler)  # DDP: this rank's indices; DistributedSampler pads them so all shards are equal
        if args.bug == "uneven" and rank == world_size - 1:
            shard += shard[:args.batch_size]  # BUG uneven: one batch more than the other ranks
        if args.loader == "dataloader":
            loader = DataLoader(train_set, batch_size=args.batch_size, sampler=shard)
        else:
            loader = batches(train_set, shard, args.batch_size)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP: gradients arrive averaged over ranks when backward returns
            optimizer.step()
            stats = torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
            if args.bug == "shape" and rank == world_size - 1:
                stats = torch.cat([stats, stats[:1]])  # BUG shape: this rank sends one number more
            dist.all_reduce(stats)  # DIST: the loss over the global batch, for the log
            losses.append(stats[0] / stats[1])
            step += 1
            prof.step(loss, world_size * len(y))
            if step % args.save_every == 0:
                if rank == 0:  # one rank writes the checkpoint
                    torch.save(model.module.state_dict(), args.run_dir / "checkpoint.pt")
                if rank == 0 or args.bug != "skip":  # BUG skip: the barrier indented under `if rank == 0`
                    dist.barrier()  # DIST: no rank goes on before the checkpoint is written
            if step == args.max_steps:
                break
        dist.barrier()  # DIST: every rank has finished its epoch before the evaluation
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

    losses = [loss.item() for loss in losses]  # already averaged over the global batch
    if rank == 0:  # DIST: one process writes the outputs
        # metrics.json, model.pt, loss.png and the line that sums it up
        results.write(args, model, losses, seconds, accuracy, test_loss, len(sampler))
    dist.destroy_process_group()


def failed_collective(info, args):
    """The worker; a collective that times out or fails ends this rank with one line: where it waited, and
    what the other ranks did (course/measuring/debugging.py formats it), and its flight recorder dumped for the
    analyzer."""
    started = time.time()
    try:
        return worker(info, args)
    except RuntimeError as error:  # DIST: the timeout (or gloo) raised in the collective this rank waited in
        if isinstance(error, cli.CourseError) or not dist.is_initialized():  # DIST: failed before joining
            raise
        record = torch._C._distributed_c10d._dump_fr_trace()  # DIST: this rank's flight recorder (a pickle)
        dump = debugging.write_dump(record, args.run_dir, info.rank)  # RUN_DIR/flight_recorder/rank_R
        raise cli.CourseError(debugging.one_line(error, record, info.rank, args, dump, started)) from None


def build_parser():
    p = cli.add_loader(cli.add_distributed(cli.parser(__doc__, "day3/17_debugging_hangs.py", nproc_default=2)))
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0,
                   help="DDP's gradient bucket size in MB (the MLP's gradients are 0.4 MB: one bucket)")
    p.add_argument("--bug", default="none", choices=debugging.BUGS,
                   help="skip: rank 0 alone enters a barrier; uneven: the last rank has one batch more; "
                        "shape: the last rank all_reduces one number more; none: the healthy run")
    p.add_argument("--save-every", type=cli.positive_int, default=5, help="a checkpoint every N steps")
    p.add_argument("--debug-server", type=debugging.port, default=None, metavar="PORT",
                   help="serve every rank's stacks and flight recorder on http://RANK0_HOST:PORT "
                        "(torch.distributed.debug; torch's default port is 25999)")
    p.set_defaults(timeout=10.0)  # seconds a rank waits in a collective: short, so that a hang ends soon
    return add_profile_args(p)


if __name__ == "__main__":
    cli.main(lambda args: (debugging.check_args(args), require(args.dataset, args.data_dir),
                           launch(failed_collective, args)), build_parser())
