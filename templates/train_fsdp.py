"""Sharded training (FSDP2): a template to copy beside your own code, with train_fsdp.sh for Slurm.

Each rank holds 1/W of the parameters, gradients and optimizer state: for a model too large for one GPU
under DDP (train_ddp.py).  Change three places, marked so in the code:
  CHANGE 1  the model: model_parts, the parts it is made of (stem, blocks, head) in the order they are made
  CHANGE 2  the dataset: build_dataset (now a synthetic classification set made from a seed: runs offline)
  CHANGE 3  the loss and the metric: loss_fn, metric_fn
Needs torch only.

    python train_fsdp.py --nproc 4 --batch-size 16   4 ranks on this machine, started by this file
    python train_fsdp.py --nproc 2 --batch-size 32   resumes that run on 2 ranks: the same global batch
    torchrun --standalone --nproc_per_node=4 train_fsdp.py     or: srun python train_fsdp.py (train_fsdp.sh)

Built on the meta device (shapes, no memory), sharded block by block, then given memory for this rank's rows
only, filled with one process's initial weights (the same --seed): every rank makes the parts again on the CPU,
one at a time, in order, and keeps its rows.  Checkpoints (torch.distributed.checkpoint): every rank writes its
own file, rank 0 adds complete.json (the position, every file's sha256) and renames the directory into place;
a run resumes from the newest intact one at any world size with the same global batch.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import signal

stop_requests = []  # the signals this rank got, read after every step: a handler may run inside a collective,
on_stop_signal = lambda signum, frame: stop_requests.append(signum)  # where no checkpoint can be written
signal.signal(signal.SIGUSR1, on_stop_signal)  # first thing: SIGUSR1's default action kills a rank still importing

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def model_parts(args):  # CHANGE 1: your model's parts, made in order: a stem, the blocks, a head
    yield nn.Linear(args.features, args.width)
    for _ in range(args.depth):
        yield Block(args.width)
    yield nn.Sequential(nn.LayerNorm(args.width), nn.Linear(args.width, args.classes))


class Net(nn.Module):
    def __init__(self, parts, checkpointing=False):
        super().__init__()
        self.stem, *blocks, self.head = parts
        self.blocks, self.checkpointing = nn.ModuleList(blocks), checkpointing

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:  # recomputed in backward: less memory kept, the same gradients
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return self.head(x)


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
    """(rank, local rank, world size, ranks on this node, launcher): torchrun, srun or --nproc (as train_ddp.py)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        world = env_int("WORLD_SIZE")
        return env_int("RANK"), env_int("LOCAL_RANK"), world, env_int("LOCAL_WORLD_SIZE", world), "torchrun"
    if "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ:  # srun
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
        if visible == 0 or (local_rank >= visible > 1):
            fail(f"local rank {local_rank} needs a GPU of its own, but this node shows {visible}")
        device = torch.device("cuda", local_rank if visible > 1 else 0)  # a task bound to one GPU sees only it
        torch.cuda.set_device(device)  # DIST: before init, so that NCCL and every tensor use this rank's GPU
    cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")  # srun: this task's CPUs; else the CPUs we may use, shared
    threads = int(cpus) if launcher == "srun" and cpus.isdigit() else len(os.sched_getaffinity(0)) // local_world
    omp = os.environ.get("OMP_NUM_THREADS")  # yours, if you set it
    if omp is not None and not (omp.isdigit() and int(omp) > 0):
        fail(f"OMP_NUM_THREADS={omp!r}: expected a number of threads > 0")
    torch.set_num_threads(int(omp) if omp else max(1, threads))
    return device


@torch.no_grad()
def init_shards(model, args):
    """One process's initial weights: each part made whole on the CPU, in order, under --seed; my rows kept."""
    torch.manual_seed(args.seed)
    for whole, sharded in zip(model_parts(args), [model.stem, *model.blocks, model.head]):
        targets = dict(sharded.named_parameters()) | dict(sharded.named_buffers())
        for name, tensor in whole.state_dict().items():
            target = targets[name]
            if isinstance(target, DTensor):  # DIST: my rows, cut as fully_shard cut them; nothing is sent
                mine = distribute_tensor(tensor.to(target.device), target.device_mesh, target.placements,
                                         src_data_rank=None)
                target, tensor = target.to_local(), mine.to_local()
            target.copy_(tensor)


sha256 = lambda path: hashlib.sha256(path.read_bytes()).hexdigest()  # noqa: E731  (torch.load checks none)


def newest_intact(directory):
    """Rank 0: the newest step-N directory whose complete.json lists files that all match their sha256."""
    for path in sorted(directory.glob("step-*"), reverse=True):
        try:
            info = json.loads((path / "complete.json").read_text())
            if all(sha256(path / name) == digest for name, digest in info["files"].items()):
                return str(path), info
        except (OSError, ValueError, KeyError):
            pass
        print(f"[rank 0] skipping {path}: unfinished or damaged (complete.json missing or a sha256 differs)")
    return None, None


def worker(index, args):  # index: this rank's number when --nproc started it, else None
    rank, local_rank, world_size, local_world, launcher = ranks(index, args)
    device = setup_device(args, local_rank, local_world, launcher)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size,  # DIST: join; a missing rank ends it
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects now
    signal.signal(signal.SIGTERM, on_stop_signal)  # after init: until here SIGTERM simply ends the process
    print(f"[rank {rank}] pid {os.getpid()} on {socket.gethostname()}: {world_size} ranks, {device}", flush=True)
    dataset = build_dataset(args)
    per_step = args.batch_size * args.accum  # samples per rank per optimizer step
    global_batch = world_size * per_step
    # DDP: rank r gets every W-th index of the epoch's shuffled order: a step's samples are the same for any W
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    steps_per_epoch = len(dataset) // global_batch
    if steps_per_epoch == 0:
        fail(f"{len(dataset)} samples are fewer than one step needs ({world_size} ranks x {per_step})")

    with torch.device("meta"):  # DIST: shapes only, no memory: no rank ever holds the whole model
        model = Net(list(model_parts(args)), checkpointing=args.checkpoint_activations)
    mesh = init_device_mesh(device.type, (world_size,))  # DIST: the ranks that share the model
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.bf16 else None, reduce_dtype=torch.float32)
    for block in model.blocks:  # one unit per block: gathered just before it runs, freed after
        if args.compile:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=policy)  # DIST: this block's parameters sharded on dim 0
    fully_shard(model, mesh=mesh, mp_policy=policy)  # DIST: the root: stem and head, and the hooks
    model.to_empty(device=device)  # DIST: memory for this rank's shards only
    init_shards(model, args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    # the position and the losses so far; not the random streams (this model draws none: train_ddp.py saves them)
    state = {"step": 0, "epoch": 0, "steps_in_epoch": 0, "loss_per_step": [], "metric_per_step": []}

    directory = args.run_dir / "checkpoints"
    chosen = [newest_intact(directory) if rank == 0 and not args.fresh else (None, None)]
    dist.broadcast_object_list(chosen, src=0)  # DIST: rank 0 picks, every rank loads the same checkpoint
    path, info = chosen[0]
    if path is not None:
        if info["global_batch"] != global_batch:
            fail(f"{path} was trained with global batch {info['global_batch']}: use --batch-size "
                 f"{info['global_batch'] // (world_size * args.accum)} on {world_size} ranks")
        model_sd, optim_sd = get_state_dict(model, optimizer)  # DIST: this rank's shards, keyed by name
        dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)  # DIST: my rows, saved by any W
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)  # DIST: in place
        scheduler.load_state_dict(info["scheduler"])
        state = info["state"]
        if rank == 0:
            print(f"[rank 0] resuming from {path}: step {state['step']} (saved by {info['world_size']} ranks)")

    def save():
        final = directory / f"step-{state['step']:09d}"
        tmp = directory / f".{final.name}.tmp"
        if final.exists():  # resumed at the end: nothing new to save
            return final
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed writer's leftovers
        dist.barrier()  # DIST: the old leftovers are gone before anyone writes
        model_sd, optim_sd = get_state_dict(model, optimizer)  # DIST: this rank's shards
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)  # DIST: every rank its own file
        if rank == 0:  # DIST: rank 0 publishes: the digests, then one rename; a crash leaves the previous one
            files = {p.name: sha256(p) for p in sorted(tmp.iterdir())}
            (tmp / "complete.json").write_text(json.dumps({
                "state": state, "scheduler": scheduler.state_dict(), "global_batch": global_batch,
                "world_size": world_size, "files": files}))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in sorted(directory.glob("step-*"))[:-2]:
                shutil.rmtree(old)
        dist.barrier()  # DIST: nobody goes on (or leaves) before the checkpoint is in place
        return final

    max_steps = min(args.max_steps or args.epochs * steps_per_epoch, args.epochs * steps_per_epoch)
    stopped = False
    for epoch in range(state["epoch"], args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        order = list(sampler)[state["steps_in_epoch"] * per_step:]  # resumed mid-epoch: skip what was done
        batches = iter(DataLoader(dataset, batch_size=args.batch_size, sampler=order, num_workers=args.workers,
                                  pin_memory=device.type == "cuda"))
        while state["steps_in_epoch"] < steps_per_epoch and state["step"] < max_steps and not stopped:
            total, metric = torch.zeros((), device=device), torch.zeros((), device=device)
            for micro in range(args.accum):
                x, y = (t.to(device, non_blocking=True) for t in next(batches))
                # DIST: the gradients of all but the last micro-batch stay unreduced, summed locally
                model.set_requires_gradient_sync(micro == args.accum - 1)
                output = model(x)  # DIST: each block all_gathered just before it runs
                loss = loss_fn(output.float(), y)
                (loss / args.accum).backward()  # DDP: the last backward reduce_scatters: my rows' average
                total, metric = total + loss.detach() / args.accum, metric + metric_fn(output, y).detach() / args.accum
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # DIST: the norm over all shards
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state["step"], state["steps_in_epoch"] = state["step"] + 1, state["steps_in_epoch"] + 1
            status = torch.stack([total, metric.float(), torch.tensor(float(len(stop_requests) > 0), device=device)])
            dist.all_reduce(status)  # DIST: loss and metric summed over ranks, and who was asked to stop
            state["loss_per_step"].append(status[0].item() / world_size)
            state["metric_per_step"].append(status[1].item() / world_size)
            stopped = status[2].item() > 0  # DIST: a rank got a signal: every rank stops after this same step
            if rank == 0 and (state["step"] % args.log_every == 0 or stopped):
                print(f"[rank 0] step {state['step']} loss {state['loss_per_step'][-1]:.6f} "
                      f"metric {state['metric_per_step'][-1]:.4f}", flush=True)
            if state["step"] % args.checkpoint_every == 0 and not stopped and state["step"] < max_steps:
                save()
        if stopped or state["step"] >= max_steps:
            break
        state["epoch"], state["steps_in_epoch"] = epoch + 1, 0
    path = save()
    # DIST: the whole weights for model.pt, gathered one tensor at a time onto rank 0's CPU
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0 and stopped:
        print(f"[rank 0] stopped after step {state['step']} (signal); checkpoint {path}: run again to resume")
    elif rank == 0:
        torch.save(full, args.run_dir / "model.pt")
        (args.run_dir / "metrics.json").write_text(json.dumps({
            "steps": state["step"], "world_size": world_size, "global_batch": global_batch,
            "loss_per_step": state["loss_per_step"], "metric_per_step": state["metric_per_step"]}, indent=1))
        print(f"[rank 0] {state['step']} steps, {world_size} ranks x {per_step} = global batch {global_batch}; "
              f"final loss {state['loss_per_step'][-1]:.6f}; outputs in {args.run_dir}", flush=True)
    dist.destroy_process_group()  # DIST: leave the group


def parse_args():
    positive = lambda text: int(text) if text.isdigit() and int(text) > 0 else fail(f"expected a number > 0: {text!r}")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=positive, default=1, help="ranks to start on this machine (not under torchrun/srun)")
    p.add_argument("--run-dir", type=Path, default=Path("runs/train_fsdp"), help="checkpoints and outputs")
    p.add_argument("--fresh", action="store_true", help="ignore existing checkpoints")
    p.add_argument("--epochs", type=positive, default=2)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: epochs)")
    p.add_argument("--batch-size", type=positive, default=32, help="samples per rank per micro-batch")
    p.add_argument("--accum", type=positive, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--warmup", type=positive, default=10, help="steps of linear learning-rate warm-up")
    p.add_argument("--clip", type=float, default=0.0, help="clip the gradients' norm to this (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="gather parameters and compute in bfloat16")
    p.add_argument("--checkpoint-activations", action="store_true", help="recompute each block in backward")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (needs a C++ compiler on CPU)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--checkpoint-every", type=positive, default=100, help="steps between checkpoints")
    p.add_argument("--log-every", type=positive, default=10)
    p.add_argument("--timeout", type=positive, default=300, help="seconds a rank waits for the others")
    for option, default in ("--samples", 4096), ("--features", 32), ("--width", 64), ("--depth", 4), \
                           ("--classes", 10):
        p.add_argument(option, type=positive, default=default)  # the placeholder dataset and model
    args = p.parse_args()
    try:
        (args.run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"cannot create --run-dir {args.run_dir}/checkpoints: {e.strerror}")
    if args.nproc > 1 and ("RANK" in os.environ or "SLURM_STEP_NUM_TASKS" in os.environ):
        fail("--nproc starts ranks itself: leave it out under torchrun or srun, which start them")
    if args.max_steps < 0 or args.workers < 0 or args.clip < 0:
        fail("--max-steps, --workers and --clip must be >= 0")
    return args


if __name__ == "__main__":  # as in train_ddp.py
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
    mp.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch._dynamo"])
    ranks_ = mp.start_processes(worker, args=(args,), nprocs=args.nproc, join=False, start_method="forkserver")
    for sig in (signal.SIGUSR1, signal.SIGTERM):  # pass a stop request on to every rank
        signal.signal(sig, lambda signum, _: [os.kill(p.pid, signum) for p in ranks_.processes if p.is_alive()])
    try:
        while not ranks_.join():
            pass
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:  # one failed: the others were ended
        print(f"error: rank {e.error_index} failed; the other ranks were stopped\n{e}", file=sys.stderr)
        sys.exit(1)
