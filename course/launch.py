"""One lesson file, every launcher: who started us, which rank we are, where rank 0 listens.

    python lesson.py --nproc 4          we spawn the 4 workers ourselves (torch.multiprocessing)
    torchrun --nproc_per_node=4 ...     torchrun set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT
    srun python lesson.py               Slurm set SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, the node list
    srun torchrun ...                   torchrun's variables win (one agent per node, as day 2 teaches)

Every launcher ends in the same place: `worker(info, args)` runs once per rank with MASTER_ADDR and
MASTER_PORT in the environment, ready for `dist.init_process_group(...)`, which each lesson calls itself.
Lesson 0 explains processes and ranks; lesson 9 reads the Slurm variables by hand.
"""
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import torch

from course.cli import CourseError


@dataclass(frozen=True)
class RankInfo:
    rank: int              # global rank, 0 .. world_size-1
    local_rank: int        # rank on this node: picks the GPU
    world_size: int
    local_world_size: int  # ranks on this node: divides the CPU cores
    node_rank: int
    launcher: str          # "self", "torchrun" or "srun"


def detect_launcher() -> str:
    if all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return "torchrun"
    # SLURM_STEP_NUM_TASKS exists only inside an srun step, not in a batch script's own shell, where a
    # plain `python lesson.py` must spawn its workers itself instead of waiting for peers that never come.
    if "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ:
        return "srun"
    return "self"


def free_port() -> int:
    """A port nobody uses right now on this machine: never a fixed one two users could both pick."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_master_addr() -> str:
    """The first host of the step's node list; rank 0 runs there.  Never a silent localhost."""
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise CourseError("SLURM_JOB_NODELIST is not set; set MASTER_ADDR to the first node's hostname")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise CourseError(f"cannot expand the Slurm node list {nodelist!r} with scontrol ({e}); "
                          "set MASTER_ADDR to the first node's hostname") from None
    return out.split()[0]


def slurm_master_port() -> int:
    """Derived from the job id: all ranks compute the same port, two jobs on one node differ."""
    return 10_000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20_000


def _check_port_free(addr: str, port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            raise CourseError(f"port {port} on {addr} is already in use (another job or user?); "
                              f"choose another with MASTER_PORT=<free port>") from None


def _srun_info() -> RankInfo:
    env = os.environ
    rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
    local_rank = int(env.get("SLURM_LOCALID", 0))
    # "2(x2),1" style: take this node's count from SLURM_STEP_TASKS_PER_NODE, else assume uniform
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_NTASKS_PER_NODE", "1"))
    local_world = int(per_node.split("(")[0].split(",")[0])
    os.environ.setdefault("MASTER_ADDR", slurm_master_addr())
    os.environ.setdefault("MASTER_PORT", str(slurm_master_port()))
    if rank == 0:
        _check_port_free(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return RankInfo(rank, local_rank, world, local_world, int(env.get("SLURM_NODEID", 0)), "srun")


def _torchrun_info() -> RankInfo:
    env = os.environ
    return RankInfo(int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]),
                    int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])), int(env.get("GROUP_RANK", 0)),
                    "torchrun")


def _run(worker, info: RankInfo, args):
    if "OMP_NUM_THREADS" not in os.environ:
        # ranks on one node share its cores; oversubscribing them makes every rank slower
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_world_size))
    try:
        return worker(info, args)
    except CourseError as e:
        print(f"[rank {info.rank}] error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def _spawned(index: int, worker, nproc: int, args):
    _run(worker, RankInfo(index, index, nproc, nproc, 0, "self"), args)


def launch(worker, args, nproc: int = None) -> None:
    """Run `worker(info, args)` in every rank, however this process was started."""
    launcher = detect_launcher()
    if launcher == "torchrun":
        _run(worker, _torchrun_info(), args)
    elif launcher == "srun":
        _run(worker, _srun_info(), args)
    else:
        nproc = args.nproc if nproc is None else nproc
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
        if nproc == 1:
            _run(worker, RankInfo(0, 0, 1, 1, 0, "self"), args)
            return
        try:
            torch.multiprocessing.spawn(_spawned, args=(worker, nproc, args), nprocs=nproc, join=True)
        except torch.multiprocessing.ProcessExitedException as e:
            # mp.spawn has already terminated the other ranks: one failed rank ends the job
            raise CourseError(f"rank {e.error_index} exited with code {e.exit_code}; "
                              "the other ranks were stopped") from None
        except torch.multiprocessing.ProcessRaisedException as e:
            last = str(e).strip().splitlines()[-1]
            print(str(e), file=sys.stderr)
            raise CourseError(f"rank {e.error_index} failed: {last}; the other ranks were stopped") from None


def setup_device(device: str, local_rank: int) -> torch.device:
    """cuda:<local_rank> on a GPU node (set as the current device before init), else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise CourseError("--device cuda was asked for but no GPU is visible; use --device cpu")
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise CourseError(f"local rank {local_rank} needs GPU {local_rank} but this node has {n} visible; "
                              f"launch at most {n} ranks per node, or use --device cpu")
        torch.cuda.set_device(local_rank)  # before init: NCCL binds each rank to its own GPU
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device, backend: str = "auto") -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise CourseError("the nccl backend needs GPUs; use --backend gloo (or auto) on the CPU")
    return backend
