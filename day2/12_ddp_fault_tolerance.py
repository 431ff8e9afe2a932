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
   renames it: a crash while writing leaves the previous checkpoint, never half a new one.  Every rank
   loads the same file with map_location (its own device) and weights_only=True (a checkpoint is data:
   weights_only refuses pickles that would run code).  The newest checkpoint that loads wins; a torn one
   (truncated by a full disk, a copy cut short) is reported and skipped.
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
Started with --nproc, the parent passes SIGTERM and SIGUSR1 on to its ranks (course/supervise.py).

Resumed, the run is the run that was never interrupted, bit for bit (measured on the CPU and on one H100 GPU): same
data order, same weights, same losses.  That needs deterministic kernels (use_deterministic_algorithms),
the same threads per rank and, from 3 ranks on, the same gradient buckets.  DDP all_reduces the first
backward after the wrap in provisional buckets (parameter order), then rebuilds them in the order the
gradients arrived.  A number's place in its bucket sets the order in which the ranks' values are added:
with 2 ranks a + b = b + a, with 4 another order rounds differently (4 ranks resumed without the rebuild
ended with weights ~1e-8 off).  The uninterrupted run trains in rebuilt buckets, so a resumed run rebuilds
them first, with one backward pass that it throws away.  The checkpoint directory is locked by the run
using it: a second run on the same --run-dir stops with a message instead of mixing its checkpoints with
the first one's.
The checkpoint files (atomic write, rotation, the newest valid one, the lock) are course/checkpoints.py's.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/

stop_signal = None  # set by on_stop_signal, read by the training loop after every step


def on_stop_signal(signum, frame):
    global stop_signal
    stop_signal = signum  # only a flag: we may be inside a collective here; the loop stops at a safe point


# SIGUSR1 means "the time limit is near": handled from the first moment, since its default action would kill
# a rank that is still importing torch.  SIGTERM is handled once training can be saved (see worker).
signal.signal(signal.SIGUSR1, on_stop_signal)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from course import checkpoints, cli, results
from course.evaluate import evaluate
from course.launch import backend_for, launch, setup_device
from course.models import build_model
from course.output import rank_print
from data_tools.datasets import InMemoryMNIST, batches, require

# A checkpoint belongs to one training run: resuming with other values of these would be another run.
SAME_RUN = ("dataset", "model", "batch_size", "lr", "seed", "train_samples")

# ----------------------------------------------------------------------------------------------- training

def worker(info, args):
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)
    # Reproducible kernels, so that a resumed run can equal the uninterrupted one (cuBLAS needs the setting;
    # a GPU op without a deterministic version, e.g. the CNN's max-pool backward, warns instead of failing)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    directory = args.checkpoint_dir or args.run_dir / "checkpoints"
    lock = checkpoints.lock(directory) if rank == 0 else None  # before init: a second run stops right here
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout))
    signal.signal(signal.SIGTERM, on_stop_signal)  # after init: until here SIGTERM simply ends the process
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) + int(os.environ.get("SLURM_RESTART_COUNT", 0))
    rank_print(rank, f"pid {os.getpid()} on {socket.gethostname()} ({info.launcher}, restart {restarts})")
    require(args.dataset, args.data_dir)
    train_set = InMemoryMNIST(args.dataset, "train", args.data_dir, device, limit=args.train_samples or 0)
    test_set = InMemoryMNIST(args.dataset, "test", args.data_dir, device)

    model = build_model(args.model, args.seed + rank).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    run = {k: getattr(args, k) for k in SAME_RUN} | {"world_size": world_size}
    state = {"epoch": 0, "batches_done": 0, "step": 0, "loss_per_step": [], "evaluations": [], "stops": [],
             "resumed_at": [], "train_seconds": 0.0}

    # DIST: rank 0 picks the checkpoint and tells the others: every rank must resume from the same one
    chosen = [None]
    if rank == 0:
        # --fresh deletes them all first; a torn or foreign file is reported and skipped
        chosen = [checkpoints.newest_valid(directory, fresh=args.fresh)]
    dist.broadcast_object_list(chosen, src=0)  # DIST: every rank learns rank 0's choice
    if chosen[0] is not None:
        saved = torch.load(chosen[0], map_location=device, weights_only=True)  # DIST: onto this rank's device
        checkpoints.check_same_run(saved, run, directory)  # the same settings, or one line saying which differ
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"]["cpu"][rank].cpu())  # each rank its own random stream
        if device.type == "cuda" and saved["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(saved["rng"]["cuda"][rank].cpu())
        state = {k: saved[k] for k in state}
        state["resumed_at"] = state["resumed_at"] + [state["step"]]
        if rank == 0:
            rank_print(rank, f"resuming from {chosen[0]}: step {state['step']}, epoch {state['epoch']}, "
                             f"batch {state['batches_done']} of the epoch")
    # DDP: wraps after loading: the broadcast at wrap time then copies weights every rank already has
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if chosen[0] is not None:
        # DDP: one backward, thrown away, so that the resumed steps reduce in DDP's rebuilt buckets as the
        # uninterrupted run's do (see "bit for bit" above: from 3 ranks on, the buckets decide the rounding)
        F.cross_entropy(model(train_set.images[:1]), train_set.labels[:1]).backward()  # on every rank
        optimizer.zero_grad()  # nothing of it reaches the weights or the momentum

    def checkpoint():
        """Every rank calls it (the RNG states are gathered); rank 0 writes."""
        rng = [None] * world_size
        dist.all_gather_object(rng, {"cpu": torch.get_rng_state(),  # DIST: each rank's stream, for rank 0
                                     "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None})
        if rank == 0:
            # written to a temporary file, flushed to the disk and renamed: a crash leaves the previous one
            path = checkpoints.save(directory, state["step"], {
                "format": checkpoints.FORMAT, "run": run, **state,
                "model": {k: v.detach().cpu() for k, v in model.module.state_dict().items()},
                "optimizer": optimizer.state_dict(), "sampler_seed": args.seed,
                "rng": {"cpu": [r["cpu"] for r in rng],
                        "cuda": [r["cuda"] for r in rng] if device.type == "cuda" else None}}, args.keep)
            return path

    # DDP: rank r gets every W-th index of the epoch's shuffled order; padded so all shards are equal
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    per_epoch = -(-len(sampler) // args.batch_size)
    max_steps = args.max_steps or args.epochs * per_epoch
    segment_start, stopped = time.perf_counter(), None
    while state["epoch"] < args.epochs and state["step"] < max_steps and stopped is None:
        epoch = state["epoch"]
        sampler.set_epoch(epoch)  # DDP: the epoch's shuffle, the same on every rank and in every restart
        # Resuming mid-epoch: skip the batches this epoch has already trained on
        order = list(sampler)[state["batches_done"] * args.batch_size:]
        for x, y in batches(train_set, order, args.batch_size):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP: gradients arrive averaged over ranks when backward returns
            optimizer.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            # DIST: one all_reduce per step carries the loss (summed) and the stop requests (counted), so that
            # every rank sees the same decision after the same step, whichever rank got the signal
            status = torch.stack([loss.detach().float(), torch.tensor(float(stop_signal is not None), device=device)])
            dist.all_reduce(status)  # DIST: summed over ranks, the same on every rank
            state["loss_per_step"].append((status[0] / world_size).item())
            state["step"] += 1
            state["batches_done"] += 1
            asked = int(status[1].item())
            if rank == 0 and state["step"] % args.log_every == 0:
                rank_print(rank, f"step {state['step']} (epoch {epoch}, batch {state['batches_done']}/{per_epoch}): "
                                 f"loss {state['loss_per_step'][-1]:.4f}")
            if asked:  # DIST: every rank is here, after the same step: who got which signal, for the record
                got = [None] * world_size  # DIST: which signal reached which rank
                dist.all_gather_object(got, signal.Signals(stop_signal).name if stop_signal else None)
                stopped = {"step": state["step"], "signals": {r: s for r, s in enumerate(got) if s}}
                state["stops"] = state["stops"] + [stopped]
                break
            if state["step"] % args.checkpoint_every == 0:
                path = checkpoint()
                if rank == 0:
                    rank_print(rank, f"checkpoint {path}")
            if state["step"] >= max_steps:
                break
        if stopped is None:  # the epoch is done (or max_steps reached): evaluate, then on to the next one
            accuracy, test_loss, counted = evaluate(model.module, test_set, rank, world_size)
            state["evaluations"] = state["evaluations"] + [
                {"epoch": epoch, "step": state["step"], "test_accuracy": accuracy, "test_loss": test_loss}]
            if rank == 0:
                rank_print(rank, f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {accuracy:.4f} "
                                 f"({counted} test images, each counted once)")
            if state["batches_done"] >= per_epoch:
                state["epoch"], state["batches_done"] = epoch + 1, 0
    state["train_seconds"] += time.perf_counter() - segment_start
    path = checkpoint()  # at the stop or at the end: the newest state is always on the disk
    dist.barrier()  # DIST: nobody leaves before rank 0 has written it (srun would stop the job early)
    if stopped is not None:
        if rank == 0:
            got = ", ".join(f"{name} to rank {r}" for r, name in stopped["signals"].items())
            rank_print(rank, f"stopped after step {stopped['step']} of {max_steps} ({got}); checkpoint {path}; "
                             f"run the same command again to resume")
        dist.destroy_process_group()
        return

    if rank == 0:  # DIST: global rank 0 alone writes the shared files
        last = state["evaluations"][-1] if state["evaluations"] else {"test_accuracy": None, "test_loss": None}
        resumed = state["resumed_at"] or "none"
        # metrics.json (with the stops, resumptions and restarts), model.pt, loss.png
        results.write(args, model, state["loss_per_step"], state["train_seconds"], last["test_accuracy"],
                      last["test_loss"], len(sampler), line=False, launcher=info.launcher,
                      title=f"{args.model}, global batch {world_size * args.batch_size}, resumed at steps {resumed}",
                      evaluations=state["evaluations"], stops=state["stops"], resumed_at=state["resumed_at"],
                      restarts=restarts, checkpoint=str(path))
        print(f"{state['step']} steps, {len(state['stops'])} stop(s), resumed at steps {resumed}; "
              f"test accuracy {last['test_accuracy']:.4f}; outputs in {args.run_dir}", flush=True)
    dist.destroy_process_group()
    if lock is not None:
        lock.close()


def build_parser():
    p = cli.add_distributed(cli.parser(__doc__, "day2/12_ddp_fault_tolerance.py", nproc_default=2))
    return checkpoints.add_args(p)  # --checkpoint-every, --checkpoint-dir, --keep, --fresh, --log-every, ...


if __name__ == "__main__":
    cli.main(lambda args: (checkpoints.check_dir(args), require(args.dataset, args.data_dir), launch(worker, args)),
             build_parser())
