"""Lesson 1: lesson 0's all_reduce on GPUs: NCCL, one rank per GPU, set_device before init.

    python day1/1_torch_dist_gpu.py                          # one process per visible GPU
    python day1/1_torch_dist_gpu.py --nproc 2
    torchrun --nproc_per_node=4 day1/1_torch_dist_gpu.py
    srun --ntasks-per-node=4 --gpus-per-node=4 python day1/1_torch_dist_gpu.py

NCCL moves GPU memory between GPUs directly (NVLink, PCIe, InfiniBand) without a detour through the CPU.
Each rank owns one GPU: `torch.cuda.set_device(local_rank)` must come before init_process_group, or every
rank would create its context on GPU 0; `device_id=` hands the same GPU to init_process_group, so that NCCL
connects there at init (a wrong device shows at once, not at the first collective) and barrier() knows its
device (None on the CPU: torch refuses a CPU device_id).  NCCL cannot put two ranks on one GPU, so there can
be at most as many ranks per node as GPUs.  A rank that Slurm gave a GPU of its own (srun --gpus-per-task=1,
--gpu-bind=single:1) sees only that one, as cuda:0; course/launching/devices.py's gpu_index tells the two cases apart
from what the rank sees.  On a machine without CUDA this script says so and runs lesson 0's gloo path.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/
from course.launching.requires import require  # noqa: E402
require(__file__)  # before torch: a torch or package this lesson lacks is one line, not an ImportError

import torch
import torch.distributed as dist

from course.launching import cli
from course.launching.launch import detect_launcher, gpu_index, launch
from course.training.output import rank_print


def worker(info, args):
    if args.backend == "nccl":
        # cuda:<local rank>, or cuda:0 in a task Slurm gave one GPU; one line if ranks outnumber the GPUs
        gpu = gpu_index(info.local_rank, info.local_world_size, info.launcher)
        torch.cuda.set_device(gpu)  # DIST: before init, so NCCL binds this rank to its own GPU
        device = torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, rank=info.rank, world_size=info.world_size,  # DIST: join the group
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
    value = torch.tensor([float(info.rank + 1)], device=device)  # NCCL reduces tensors in GPU memory
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rank_print(info.rank, f"of {info.world_size} on {device} ({where}): my value is {value.item():g}")
    dist.all_reduce(value, op=dist.ReduceOp.SUM)  # DIST: lesson 0's collective, now between GPUs
    rank_print(info.rank, f"all_reduce(SUM) = {value.item():g}, mean = {value.item() / info.world_size:g}")
    dist.destroy_process_group()


def run(args):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.backend == "auto":
        if gpus == 0:
            print("No CUDA GPU is visible: running the same all_reduce with gloo on the CPU "
                  "(use a GPU node to see NCCL).", flush=True)
        args.backend = "nccl" if gpus else "gloo"
    if args.backend == "nccl":
        if gpus == 0:
            raise cli.CourseError("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo")
        if detect_launcher(args) == "self" and args.nproc > gpus:  # fail before spawning anything
            raise cli.CourseError(f"{args.nproc} NCCL ranks on a node with {gpus} GPU(s): NCCL needs one GPU "
                                  f"per rank; use --nproc {gpus} (or --backend gloo)")
    launch(worker, args)


if __name__ == "__main__":
    p = cli.parser(__doc__, "day1/1_torch_dist_gpu.py", data=False, outputs=False,
                   nproc_default=max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 2)
    p.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"),
                   help="auto: nccl when CUDA GPUs are visible, else gloo on the CPU")
    p.add_argument("--timeout", type=cli.positive_float, default=120.0,
                   help="seconds a rank waits for the others")
    cli.main(run, p)
