"""Which device each rank computes on, and which backend connects the ranks: nccl on GPUs, gloo on the CPU.

One GPU per rank, chosen by the local rank and made the current device before init_process_group; more ranks
than GPUs is one clear line, not a hang.  course/launch.py finds the ranks and calls these; course/ports.py
chooses where rank 0 listens; course/supervise.py starts and watches the ranks of `--nproc N`.
"""
import os

import torch

from course.cli import CourseError


def setup_device(device: str, local_rank: int) -> torch.device:
    """cuda:<local_rank> on a GPU node (set as the current device before init), else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise CourseError("--device cuda was asked for but no GPU is visible; use --device cpu")
        n = torch.cuda.device_count()
        if n == 1 and local_rank > 0 and os.environ.get("SLURM_GPUS_PER_TASK"):
            # srun --gpus-per-task=1 binds each task to its own GPU, which the task sees as cuda:0
            local_rank = 0
        elif local_rank >= n:
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


def check_enough_gpus(args, nproc: int) -> None:
    """Before starting `nproc` ranks: the errors setup_device/backend_for would raise in every rank, as one line."""
    device, backend = getattr(args, "device", None), getattr(args, "backend", "auto")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # --device auto gives each rank a GPU of its own whenever CUDA sees one (setup_device above)
    wants_gpu = device == "cuda" or backend == "nccl" or (device == "auto" and gpus > 0)
    if wants_gpu and nproc > gpus:
        what = "--backend nccl" if backend == "nccl" else "--device cuda" if device == "cuda" else \
            "--device auto (CUDA is visible)"
        fix = f"use --nproc {gpus}, or --backend gloo --device cpu for {nproc} ranks on the CPU" if gpus else \
            "use --backend gloo --device cpu"
        raise CourseError(f"{what} with {nproc} ranks needs {nproc} GPUs (one per rank), this machine has "
                          f"{gpus}; {fix}")


def share_cpu_cores(ranks_on_node: int) -> None:
    """Ranks on one node share its cores; oversubscribing them makes every rank slower.  OMP_NUM_THREADS wins."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_node))
