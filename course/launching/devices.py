"""Which device each rank computes on, and which backend connects the ranks: nccl on GPUs, gloo on the CPU.

One GPU per rank, made the current device before init_process_group; more ranks than GPUs is one clear line,
not a hang.  Which GPU is decided from what the rank sees, not from one Slurm variable:
- ranks that share one view of the node's GPUs take cuda:<local rank>.  That is every rank that torchrun or
  `--nproc N` started (children of one process, one CUDA_VISIBLE_DEVICES), and srun tasks that see all the
  GPUs Slurm gave the step on this node (SLURM_GPUS_ON_NODE), or that Slurm gave no GPUs to at all;
- an srun task that sees fewer GPUs than the step has on its node was bound to them (--gpus-per-task,
  --gpu-bind=single:1 or map_gpu, a site's default binding): its GPUs are numbered from cuda:0, and it takes
  cuda:<local rank % visible>, which is cuda:0 when it sees one.  That is safe only while the tasks' sets
  cannot overlap: when the node's tasks x the GPUs each sees exceed the step's GPUs on the node
  (--gpu-bind=closest, or SLURM_GPU_BIND=closest as a site default, gives each task all the GPUs of its
  socket, and srun deals the tasks out to the sockets in turn), two tasks would take the same GPU and NCCL
  refuses it; no task can tell from what it sees which GPU is its own, so every task stops with one line
  naming --gpus-per-task=1 or --gpu-bind=single:1.
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
        on_node = os.environ.get("SLURM_GPUS_ON_NODE", "")
        if on_node.isdigit() and local_world_size * visible > int(on_node):  # the tasks' GPU sets overlap
            raise CourseError(overlapping_gpus(local_world_size, visible, int(on_node)))
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


def overlapping_gpus(tasks: int, visible: int, on_node: int) -> str:
    """Every task of the node says this: Slurm bound each to GPUs that other tasks were bound to as well."""
    site = os.environ.get("SLURM_GPU_BIND", "")
    how = f"SLURM_GPU_BIND={site} here" if site else "--gpu-bind=closest, or a site default in SLURM_GPU_BIND"
    return (f"{tasks} Slurm tasks on this node each see {visible} GPU(s) of the {on_node} the step has here, so "
            f"some tasks were bound to the same GPUs ({how}: each task gets all the GPUs of its socket); no task "
            f"can tell which of them is its own, and NCCL needs a GPU of its own for every rank: ask Slurm for a "
            f"GPU per task (srun --gpus-per-task=1, or --gpu-bind=single:1), or use --device cpu")


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


def mesh_timeouts(dims, seconds: float) -> dict:
    """init_device_mesh's `backend_override` that gives the process groups of every mesh dimension in `dims` the
    lesson's --timeout.  init_device_mesh takes no timeout: the groups it creates for a dimension (new_group, or
    split_group when the default group is bound to a GPU) would otherwise wait torch's default, 30 minutes with
    gloo and 10 with NCCL (torch 2.14.1), not --timeout.  It passes each dimension's options' `_timeout` to those
    groups; NCCL takes only its own options class.  One options object per dimension, of the default group's
    backend (init_process_group first)."""
    import torch.distributed as dist
    from datetime import timedelta

    def options():
        if dist.get_backend() == "nccl":
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = timedelta(seconds=seconds)
            return nccl
        return dist.distributed_c10d.C10DBackend.Options(dist.get_backend(), timedelta(seconds=seconds))

    return {dim: options() for dim in dims}


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


def usable_cpus() -> int:
    """The CPUs this process may run on, not the machine's: its affinity set (taskset, a Slurm task's binding,
    a container's cpuset), and no more than Slurm gave a task (SLURM_CPUS_PER_TASK, --cpus-per-task) when set."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity sets outside Linux
        cpus = os.cpu_count() or 1
    per_task = os.environ.get("SLURM_CPUS_PER_TASK", "").strip()  # checked before any rank: environment.py
    return min(cpus, int(per_task)) if per_task.isdigit() and int(per_task) > 0 else cpus


def share_cpu_cores(ranks_on_node: int, launcher: str = "self") -> None:
    """Ranks share the CPUs they may use; oversubscribing them makes every rank slower.  OMP_NUM_THREADS wins.
    The ranks of `--nproc N` and of torchrun share their process's CPUs (usable_cpus() // ranks); an srun task
    given --cpus-per-task has its own SLURM_CPUS_PER_TASK, and without it is counted as sharing what it sees."""
    if "OMP_NUM_THREADS" not in os.environ:
        own = launcher == "srun" and os.environ.get("SLURM_CPUS_PER_TASK", "").strip().isdigit()
        torch.set_num_threads(max(1, usable_cpus() if own else usable_cpus() // ranks_on_node))
