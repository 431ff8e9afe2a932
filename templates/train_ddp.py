"""Data-parallel training (DDP): a template to copy beside your own code, with train_ddp.sh for Slurm.

Change three places, marked so in the code:
  CHANGE 1  the model: build_model
  CHANGE 2  the dataset: build_dataset (now a synthetic classification set made from a seed: runs offline)
  CHANGE 3  the loss and the metric: loss_fn, metric_fn
Needs torch only; --tensorboard also needs the tensorboard package.

    python train_ddp.py                          one process: the CPU, or one GPU
    python train_ddp.py --nproc 4                4 ranks on this machine, started by this file
    torchrun --standalone --nproc_per_node=4 train_ddp.py
    srun python train_ddp.py                     one task per rank, any number of nodes (see train_ddp.sh)

--batch-size is per rank: the global batch is ranks x --batch-size x --accum.  The run directory holds
checkpoints/ (ckpt-STEP.pt, each with its sha256 beside it), metrics.json and model.pt.  The same command
resumes from the newest intact checkpoint; SIGUSR1 or SIGTERM makes every rank stop after the same step,
write a checkpoint and exit 0 (train_ddp.sh then requeues the job).
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import signal

stop_requests = []  # the signals this rank got, read after every step: a handler may run inside a collective,
on_stop_signal = lambda signum, frame: stop_requests.append(signum)  # where no checkpoint can be written
signal.signal(signal.SIGUSR1, on_stop_signal)  # first thing: SIGUSR1's default action kills a rank still importing

import argparse
import contextlib
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def build_model(args):  # CHANGE 1: your model (no dropout while you check parity: see parity_check.py)
    return nn.Sequential(nn.Linear(args.features, args.hidden), nn.GELU(),
                         nn.Linear(args.hidden, args.hidden), nn.GELU(), nn.Linear(args.hidden, args.classes))


def build_dataset(args):  # CHANGE 2: your dataset; read files once, and never download from every rank at once
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(args.samples, args.features, generator=g)
    y = (x @ torch.randn(args.features, args.classes, generator=g)).argmax(1)
    return TensorDataset(x, y)


def loss_fn(output, target):  # CHANGE 3: your loss (a mean over the batch) ...
    return F.cross_entropy(output, target)


def metric_fn(output, target):  # ... and your metric (here: accuracy on the training batch)
    return (output.argmax(1) == target).float().mean()


def fail(message):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def env_int(name, default=None):
    value = os.environ.get(name, default)
    if value is None or not str(value).isdigit():
        fail(f"{name}={value!r}: expected a whole number (set by torchrun or srun; unset it to run alone)")
    return int(value)


def ranks(index, args):
    """(rank, local rank, world size, ranks on this node, launcher): torchrun, srun or this file's --nproc."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun (srun torchrun too)
        world = env_int("WORLD_SIZE")
        return env_int("RANK"), env_int("LOCAL_RANK"), world, env_int("LOCAL_WORLD_SIZE", world), "torchrun"
    if "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ:  # srun: a batch shell has no STEP
        if "MASTER_ADDR" not in os.environ:  # rank 0 runs on the step's first node; never a silent localhost
            nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
            try:
                out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                                     check=True, timeout=60).stdout
            except (OSError, subprocess.SubprocessError) as e:
                fail(f"cannot expand the node list {nodes!r} with scontrol ({e}): export MASTER_ADDR")
            os.environ["MASTER_ADDR"] = out.split()[0]
        os.environ.setdefault("MASTER_PORT", str(10000 + env_int("SLURM_JOB_ID") % 20000))  # a port per job
        return (env_int("SLURM_PROCID"), env_int("SLURM_LOCALID"), env_int("SLURM_STEP_NUM_TASKS"),
                int(os.environ.get("SLURM_STEP_TASKS_PER_NODE", "1").split("(")[0].split(",")[0]), "srun")
    return index, index, args.nproc, args.nproc, "self"


def setup_device(args, local_rank, local_world, launcher):
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        device = torch.device("cpu")
    else:
        visible = torch.cuda.device_count()
        if visible == 0:
            fail("--device cuda, but no GPU is visible")
        if local_rank >= visible and visible > 1:
            fail(f"local rank {local_rank} needs GPU {local_rank}, but this node shows {visible}: one rank per GPU")
        device = torch.device("cuda", local_rank if visible > 1 else 0)  # a task bound to one GPU sees only it
        torch.cuda.set_device(device)  # DIST: before init, so that NCCL and every tensor use this rank's GPU
    cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")  # srun: this task's CPUs; else the CPUs we may use, shared
    threads = int(cpus) if launcher == "srun" and cpus.isdigit() else len(os.sched_getaffinity(0)) // local_world
    omp = os.environ.get("OMP_NUM_THREADS")  # yours, if you set it
    if omp is not None and not (omp.isdigit() and int(omp) > 0):
        fail(f"OMP_NUM_THREADS={omp!r}: expected a number of threads > 0")
    torch.set_num_threads(int(omp) if omp else max(1, threads))
    return device


def save_checkpoint(directory, step, payload, keep=2):
    """Rank 0: to a temporary file, flushed to the disk, its digest beside it, then renamed into place."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt-{step:09d}.pt"
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    digest = directory / f".{path.name}.sha256.tmp"
    digest.write_text(hashlib.sha256(tmp.read_bytes()).hexdigest() + "\n")
    os.replace(digest, directory / f"{path.name}.sha256")
    os.replace(tmp, path)  # atomic: a crash leaves the previous checkpoint, never half of this one
    for old in sorted(directory.glob("ckpt-*.pt"))[:-keep]:
        old.unlink()
        (directory / f"{old.name}.sha256").unlink(missing_ok=True)
    return path


def newest_valid_checkpoint(directory):
    """torch.load checks no checksum: a file with bytes changed in place would load silently."""
    for path in sorted(directory.glob("ckpt-*.pt"), reverse=True):
        digest = directory / f"{path.name}.sha256"
        if digest.is_file() and digest.read_text().strip() == hashlib.sha256(path.read_bytes()).hexdigest():
            return path
        print(f"[rank 0] skipping {path}: it does not match {digest.name} (damaged or unfinished)", flush=True)
    return None


def worker(index, args):  # index: this rank's number when --nproc started it, else None
    rank, local_rank, world_size, local_world, launcher = ranks(index, args)
    device = setup_device(args, local_rank, local_world, launcher)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size,  # DIST: join; a missing rank ends it
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects now
    signal.signal(signal.SIGTERM, on_stop_signal)  # after init: until here SIGTERM simply ends the process
    print(f"[rank {rank}] pid {os.getpid()} on {socket.gethostname()}: {world_size} ranks ({launcher}), "
          f"{device}, {torch.get_num_threads()} threads", flush=True)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    random.seed(args.seed)
    dataset = build_dataset(args)
    per_step = args.batch_size * args.accum  # samples per rank per optimizer step
    # DDP: rank r gets every W-th index of the epoch's shuffled order (padded so that all shards are equal)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    steps_per_epoch = len(sampler) // per_step
    if steps_per_epoch == 0:
        fail(f"{len(dataset)} samples are fewer than one step needs ({world_size} ranks x {per_step})")
    model = build_model(args).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)  # DDP: broadcast, then hooks
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    state = {"step": 0, "epoch": 0, "batches_done": 0, "loss_per_step": [], "metric_per_step": []}

    directory = args.run_dir / "checkpoints"
    chosen = [newest_valid_checkpoint(directory) if rank == 0 and not args.fresh else None]
    dist.broadcast_object_list(chosen, src=0)  # DIST: rank 0 picks, every rank resumes from the same file
    if chosen[0] is not None:
        # DDP: one backward thrown away, so that resumed steps all_reduce in the buckets DDP rebuilds after the
        # first backward of every run: in the other order, sums over 3+ ranks round differently
        x, y = next(iter(DataLoader(dataset, batch_size=1)))
        loss_fn(model(x.to(device)), y.to(device)).backward()
        model.zero_grad(set_to_none=True)
        saved = torch.load(chosen[0], map_location=device, weights_only=True)  # DIST: onto this rank's device
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        state = saved["state"]
        if saved["world_size"] == world_size:  # DIST: my own random streams, as they were at the stop
            torch.set_rng_state(saved["rng"][rank]["torch"].cpu())
            random.setstate(saved["rng"][rank]["python"])
            if device.type == "cuda" and saved["rng"][rank]["cuda"] is not None:
                torch.cuda.set_rng_state(saved["rng"][rank]["cuda"].cpu(), device)
        if rank == 0:
            print(f"[rank 0] resuming from {chosen[0]}: step {state['step']}", flush=True)

    def checkpoint():
        rng, mine = [None] * world_size, {"torch": torch.get_rng_state(), "python": random.getstate(),
                                          "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
        dist.all_gather_object(rng, mine)  # DIST: every rank's random streams, for rank 0
        if rank == 0:  # DIST: one writer; every rank reads the same file back
            return save_checkpoint(directory, state["step"], {
                "model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "state": state,
                "scheduler": scheduler.state_dict(), "rng": rng, "world_size": world_size})

    writer = None
    if args.tensorboard and rank == 0:  # rank 0 alone writes scalars
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            fail("--tensorboard needs the tensorboard package: pip install tensorboard")
        writer = SummaryWriter(args.run_dir / "tensorboard")
    max_steps = min(args.max_steps or args.epochs * steps_per_epoch, args.epochs * steps_per_epoch)
    stopped = False
    for epoch in range(state["epoch"], args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        order = list(sampler)[state["batches_done"] * args.batch_size:]  # resumed mid-epoch: skip what was done
        batches = iter(DataLoader(dataset, batch_size=args.batch_size, sampler=order, num_workers=args.workers,
                                  pin_memory=device.type == "cuda",  # its own generator: making the iterator
                                  generator=torch.Generator().manual_seed(args.seed + epoch)))  # draws no
        # number from the random stream dropout uses, which a resumed run restores mid-epoch
        while state["batches_done"] < steps_per_epoch * args.accum and state["step"] < max_steps and not stopped:
            total, metric = torch.zeros((), device=device), torch.zeros((), device=device)
            for micro in range(args.accum):
                x, y = (t.to(device, non_blocking=True) for t in next(batches))
                last = micro == args.accum - 1
                with contextlib.nullcontext() if last else model.no_sync():  # DDP: all_reduce after the last only
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                        output = model(x)
                        loss = loss_fn(output.float(), y)
                    (loss / args.accum).backward()  # DDP: the last backward averages the gradients over ranks
                total, metric = total + loss.detach() / args.accum, metric + metric_fn(output, y).detach() / args.accum
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state["step"], state["batches_done"] = state["step"] + 1, state["batches_done"] + args.accum
            status = torch.stack([total, metric.float(), torch.tensor(float(len(stop_requests) > 0), device=device)])
            dist.all_reduce(status)  # DIST: loss and metric summed over ranks, and who was asked to stop
            state["loss_per_step"].append(status[0].item() / world_size)
            state["metric_per_step"].append(status[1].item() / world_size)
            stopped = status[2].item() > 0  # DIST: a rank got a signal: every rank stops after this same step
            if rank == 0 and (state["step"] % args.log_every == 0 or stopped):
                print(f"[rank 0] step {state['step']} loss {state['loss_per_step'][-1]:.6f} "
                      f"metric {state['metric_per_step'][-1]:.4f} lr {scheduler.get_last_lr()[0]:.3g}", flush=True)
                if writer:
                    writer.add_scalar("train/loss", state["loss_per_step"][-1], state["step"])
                    writer.add_scalar("train/metric", state["metric_per_step"][-1], state["step"])
            if state["step"] % args.checkpoint_every == 0 and not stopped and state["step"] < max_steps:
                checkpoint()
        if stopped or state["step"] >= max_steps:
            break
        state["epoch"], state["batches_done"] = epoch + 1, 0
    path = checkpoint()  # at a stop or at the end: the newest state is on the disk
    dist.barrier()  # DIST: nobody leaves before rank 0 has written it (srun would end the step early)
    if rank == 0:  # DIST: global rank 0 alone writes the shared files
        if stopped:
            print(f"[rank 0] stopped after step {state['step']} (signal); checkpoint {path}: "
                  f"run the same command again to resume", flush=True)
        else:
            torch.save(model.module.state_dict(), args.run_dir / "model.pt")
            (args.run_dir / "metrics.json").write_text(json.dumps({
                "steps": state["step"], "world_size": world_size, "launcher": launcher,
                "global_batch": world_size * per_step, "loss_per_step": state["loss_per_step"],
                "metric_per_step": state["metric_per_step"]}, indent=1))
            print(f"[rank 0] {state['step']} steps, {world_size} ranks x {per_step} = global batch "
                  f"{world_size * per_step}; final loss {state['loss_per_step'][-1]:.6f}; outputs in {args.run_dir}")
    if writer:
        writer.close()
    dist.destroy_process_group()  # DIST: leave the group


def parse_args():
    positive = lambda text: int(text) if text.isdigit() and int(text) > 0 else fail(f"expected a number > 0: {text!r}")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=positive, default=1, help="ranks to start on this machine (not under torchrun/srun)")
    p.add_argument("--run-dir", type=Path, default=Path("runs/train_ddp"), help="checkpoints and outputs")
    p.add_argument("--fresh", action="store_true", help="ignore existing checkpoints")
    p.add_argument("--epochs", type=positive, default=2)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: epochs)")
    p.add_argument("--batch-size", type=positive, default=32, help="samples per rank per micro-batch")
    p.add_argument("--accum", type=positive, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--warmup", type=positive, default=10, help="steps of linear learning-rate warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="forward in bfloat16 under autocast")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--checkpoint-every", type=positive, default=100, help="steps between checkpoints")
    p.add_argument("--log-every", type=positive, default=10)
    p.add_argument("--timeout", type=positive, default=300, help="seconds a rank waits for the others")
    p.add_argument("--tensorboard", action="store_true", help="rank 0 writes scalars to RUN_DIR/tensorboard")
    for option, default in ("--samples", 4096), ("--features", 32), ("--hidden", 64), ("--classes", 10):
        p.add_argument(option, type=positive, default=default)  # the placeholder dataset and model
    args = p.parse_args()
    try:
        (args.run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"cannot create --run-dir {args.run_dir}/checkpoints: {e.strerror}")
    if args.nproc > 1 and ("RANK" in os.environ or "SLURM_STEP_NUM_TASKS" in os.environ):
        fail("--nproc starts ranks itself: leave it out under torchrun or srun, which start them")
    if args.max_steps < 0 or args.workers < 0:
        fail("--max-steps and --workers must be >= 0")
    return args


if __name__ == "__main__":
    args = parse_args()
    if "RANK" in os.environ or "SLURM_STEP_NUM_TASKS" in os.environ:  # torchrun or srun started this rank
        worker(None, args)
        sys.exit(0)
    with socket.socket() as s:  # a free port, never a fixed one that another user's job may hold
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    if args.nproc == 1:
        worker(0, args)
        sys.exit(0)
    # the ranks are forked from a server process that has imported torch once: fast, and safe with CUDA
    mp.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])
    ranks_ = mp.start_processes(worker, args=(args,), nprocs=args.nproc, join=False, start_method="forkserver")
    for sig in (signal.SIGUSR1, signal.SIGTERM):  # pass a stop request on to every rank
        signal.signal(sig, lambda signum, _: [os.kill(p.pid, signum) for p in ranks_.processes if p.is_alive()])
    try:
        while not ranks_.join():
            pass
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:  # one failed: the others were ended
        print(f"error: rank {e.error_index} failed; the other ranks were stopped\n{e}", file=sys.stderr)
        sys.exit(1)
