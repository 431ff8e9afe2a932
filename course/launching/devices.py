"""Which device each rank computes on, and which backend connects the ranks: nccl on GPUs, gloo on the CPU.

One GPU per rank, made the current device before init_process_group; more ranks than GPUs is one clear line,
not a hang.  Which GPU is decided from what the rank sees, not from one Slurm variable:
- ranks that share one view of the node's GPUs take cuda:<local rank>.  That is every rank that torchrun or
  `--nproc N` started (children of one process, one CUDA_VISIBLE_DEVICES), and srun tasks that see all the
  GPUs Slurm gave the step on this node (SLURM_GPUS_ON_NODE), or that Slurm gave no GPUs to at all;
- an srun task that sees fewer GPUs than the step has on its node was bound to them (--gpus-per-task,
  --gpu-bind=single:1 or map_gpu, a site's default binding): its GPUs are numbered from cuda:0, and it takes
  cuda:<local rank % visible>, which is cuda:0 when it sees one.
course/launching/launch.py finds the ranks and calls these; course/launching/ports.py chooses where rank 0 listens;
course/launching/supervise.py starts and watches the ranks of `--nproc N`.
"""
import os

import torch

from course.launching.cli import CourseError

# (local_world_size, launcher) of the rank this process runs, while course/launching/launch.py runs it: setup_device's
# callers pass only the local rank.  A process that no launch() started (lesson 2, lesson 9) reads its
# launcher's variables instead (layout_from_environment).
_layout = None


def use_layout(local_world_size, launcher) -> None:
    global _layout
    _layout = None if local_world_size is None else (local_world_size, launcher)


def tasks_on_this_node() -> int:
    """The srun step's tasks on this node: SLURM_STEP_TASKS_PER_NODE ("2(x3),1": 2 on each of the first
    three nodes, 1 on the fourth) at this node's index in the step, SLURM_NODEID."""
    counts = []
    for part in os.environ.get("SLURM_STEP_TASKS_PER_NODE", os.environ.get("SLURM_TASKS_PER_NODE", "1")).split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    node = int(os.environ.get("SLURM_NODEID", 0))
    return counts[node] if node < len(counts) else counts[-1]


def layout_from_environment():
    """(local_world_size, launcher) from the launcher's variables, for a rank that no launch() started."""
    from course.launching.environment import detect_launcher

    launcher = detect_launcher()
    if launcher == "torchrun":
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])), launcher
    if launcher == "srun":
        return tasks_on_this_node(), launcher
    return 1, launcher


def bound_by_slurm(visible: int) -> bool:
    """Whether Slurm showed this srun task only part of the step's GPUs on its node: it bound the task to
    them.  Without SLURM_GPUS_ON_NODE (no GPUs through Slurm's gres, or an old Slurm), a CUDA_VISIBLE_DEVICES
    that someone set (a site's wrapper) counts as a binding, none as a view every task shares."""
    on_node = os.environ.get("SLURM_GPUS_ON_NODE", "")
    if on_node.isdigit():
        return visible < int(on_node)
    return bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


def gpu_index(local_rank: int, local_world_size: int, launcher: str) -> int:
    """The index of this rank's GPU among those it sees; one line if the node's ranks outnumber its GPUs.
    Reads only the device count: nothing is allocated, no GPU is made current."""
    visible = torch.cuda.device_count()
    if launcher == "srun" and bound_by_slurm(visible):
        return local_rank % visible
    if local_world_size > visible:  # every rank of the node says so, none is left waiting for the others
        raise CourseError(too_many_ranks(local_world_size, visible, launcher))
    return local_rank


def too_many_ranks(ranks: int, visible: int, launcher: str) -> str:
    what = {"srun": "Slurm tasks", "torchrun": "torchrun ranks", "self": "ranks"}.get(launcher, "ranks")
    line = (f"{ranks} {what} on this node share {visible} visible GPU(s); NCCL needs a GPU of its own for every "
            f"rank: ")
    if launcher == "srun":
        return line + (f"ask Slurm for a GPU per task (srun --gpus-per-task=1, or --gpu-bind=single:1), start "
                       f"{visible} tasks per node at most, or use --device cpu")
    if launcher == "torchrun" and "SLURM_STEP_ID" in os.environ:
        return line + (f"give the torchrun task all the node's GPUs (srun --gpus-per-task={ranks}, or "
                       f"--gpus-per-node), start {visible} ranks per node at most, or use --device cpu")
    return line + f"start {visible} ranks per node at most, or use --device cpu"


def setup_device(device: str, local_rank: int) -> torch.device:
    """This rank's GPU (gpu_index), set as the current device before init, on a GPU node; else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise CourseError("--device cuda was asked for but no GPU is visible; use --device cpu")
        index = gpu_index(local_rank, *(_layout or layout_from_environment()))
        torch.cuda.set_device(index)  # before init: NCCL binds each rank to its own GPU
        return torch.device("cuda", index)
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
