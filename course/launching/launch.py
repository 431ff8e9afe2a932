"""One lesson file, every launcher: who started us, which rank we are, where rank 0 listens.

    python lesson.py --nproc 4          we start the 4 workers ourselves (torch.multiprocessing)
    torchrun --nproc_per_node=4 ...     torchrun set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT
    srun python lesson.py               Slurm set SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, the node list
    srun torchrun ...                   torchrun's variables win (one agent per node, as day 2 teaches)

An explicit `--nproc N` inside a one-task srun step (`srun --ntasks=1 ... --pty bash` on a compute node, the
way to JupyterLab there; any `srun -n1`) starts N ranks itself: that step's task is one shell or notebook, not a
rank.  In a step of several tasks srun has started the ranks already; an --nproc that disagrees with their number
is one line (each task would otherwise start N ranks of its own, N x tasks processes fighting over the GPUs and
the outputs).  A lesson started from the shell of such a step (a plain `srun --pty bash` in an allocation of
several tasks) is one line too: the other tasks' shells have ended, their ranks would never come.

Every launcher ends in the same place: `worker(info, args)` runs once per rank with MASTER_ADDR and
MASTER_PORT in the environment, ready for `dist.init_process_group(...)`, which each lesson calls itself.
Lesson 0 explains processes and ranks; lesson 9 reads the Slurm variables by hand.

Beside this file in course/launching/: environment.py (which launcher started us, its variables checked),
devices.py (each rank's device and backend: set_device, nccl or gloo, more ranks than GPUs), ports.py (which
MASTER_PORT, and the checks on MASTER_ADDR and MASTER_PORT), supervise.py (starting, watching and ending the
ranks of --nproc N; a failing rank as one line).
"""
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from course.launching.cli import CourseError
# detect_launcher and world_size (environment.py) are imported from here by lessons and modules alike
from course.launching.environment import check_launch_environment, detect_launcher, nproc_asked, world_size  # noqa: F401
# backend_for, setup_device, gpu_index and mesh_timeouts are imported from here by the lessons: one import line
# for the launch model
from course.launching.devices import backend_for, check_enough_gpus, gpu_index, mesh_timeouts, setup_device, \
    share_cpu_cores, tasks_on_this_node, use_layout  # noqa: F401
from course.launching.ports import check_master_addr_is_here, check_port_is_free, free_port, slurm_master_port, \
    wait_for_rank0
from course.launching.supervise import before_init_process_group, failures_as_one_line, run_ranks


@dataclass(frozen=True)
class RankInfo:
    rank: int              # global rank, 0 .. world_size-1
    local_rank: int        # rank on this node: picks the GPU
    world_size: int
    local_world_size: int  # ranks on this node: divides the CPU cores
    node_rank: int
    launcher: str          # "self", "torchrun" or "srun"


def how_to_launch(lesson: str, lesson_args: str = "") -> str:
    """What to type to start a multi-node lesson (day 2), which never spawns its own workers: one line."""
    name, args = Path(lesson).name, f" {lesson_args}" if lesson_args else ""
    where = "no launcher started it"
    if "SLURM_JOB_ID" in os.environ:  # a batch script's shell or salloc's shell: a job, but not an srun step
        where = f"you are inside Slurm job {os.environ['SLURM_JOB_ID']} but not in a job step"
    return (f"this multi-node lesson does not start its own processes ({where}): in a Slurm allocation "
            f"(salloc --nodes 2 --ntasks-per-node=2) run ./day2/multinode_setup_and_run.sh {name}{args}; "
            f"on one machine run torchrun --standalone --nproc_per_node=2 {lesson}{args}")


def require_launcher(lesson: str, lesson_args: str = "") -> None:
    """Multi-node lessons need torchrun or srun: plain `python lesson.py` stops with how_to_launch()."""
    if detect_launcher() == "self":
        raise CourseError(how_to_launch(lesson, lesson_args))


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


def _srun_info() -> RankInfo:
    env = os.environ
    rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
    local_rank, local_world = int(env.get("SLURM_LOCALID", 0)), tasks_on_this_node()
    if "MASTER_ADDR" not in os.environ:  # not setdefault(): that would ask scontrol even when it is set
        os.environ["MASTER_ADDR"] = slurm_master_addr()
    os.environ.setdefault("MASTER_PORT", str(slurm_master_port()))
    if rank == 0:
        check_master_addr_is_here(os.environ["MASTER_ADDR"])
        check_port_is_free(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return RankInfo(rank, local_rank, world, local_world, int(env.get("SLURM_NODEID", 0)), "srun")


def _torchrun_info() -> RankInfo:
    env = os.environ
    return RankInfo(int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]),
                    int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])), int(env.get("GROUP_RANK", 0)),
                    "torchrun")


def _run(worker, info: RankInfo, args):
    """One rank, however it was started: its share of the cores, then the lesson's worker."""
    share_cpu_cores(info.local_world_size, info.launcher)
    before_init_process_group()
    use_layout(info.local_world_size, info.launcher)  # for setup_device, which the lesson calls with its local rank
    try:
        with failures_as_one_line(info.rank):
            if info.launcher != "self" and info.rank != 0 and info.world_size > 1:
                wait_for_rank0(info.rank, getattr(args, "timeout", None))
            return worker(info, args)
    finally:
        use_layout(None, None)


def _self_launched_rank(index: int, worker, nproc: int, args):
    _run(worker, RankInfo(index, index, nproc, nproc, 0, "self"), args)


def launch(worker, args, nproc: int = None) -> None:
    """Run `worker(info, args)` in every rank, however this process was started."""
    launcher = detect_launcher(args)
    if launcher == "torchrun":
        _run(worker, _torchrun_info(), args)
    elif launcher == "srun":
        _run(worker, _srun_info(), args)
    else:
        nproc = args.nproc if nproc is None else nproc
        check_enough_gpus(args, nproc)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
        if nproc == 1:
            _run(worker, RankInfo(0, 0, 1, 1, 0, "self"), args)
        else:
            run_ranks(_self_launched_rank, nproc, (worker, nproc, args))  # forked, watched: supervise.py
