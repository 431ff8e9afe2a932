"""One lesson file, every launcher: who started us, which rank we are, where rank 0 listens.

    python lesson.py --nproc 4          we start the 4 workers ourselves (torch.multiprocessing)
    torchrun --nproc_per_node=4 ...     torchrun set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT
    srun python lesson.py               Slurm set SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, the node list
    srun torchrun ...                   torchrun's variables win (one agent per node, as day 2 teaches)

Every launcher ends in the same place: `worker(info, args)` runs once per rank with MASTER_ADDR and
MASTER_PORT in the environment, ready for `dist.init_process_group(...)`, which each lesson calls itself.
Lesson 0 explains processes and ranks; lesson 9 reads the Slurm variables by hand.
"""
import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from course.cli import CourseError
from data_tools.datasets import DataError

# A SIGTERM (kill, scancel, a time limit) or SIGUSR1 (sbatch --signal) sent to `python lesson.py --nproc N`
# reaches only the parent: it passes them on to its ranks, as torchrun does with SIGTERM (lesson 12).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Seconds a self-launched rank may take to exit once its work is done (see _end_within)
EXIT_GRACE_S = int(os.environ.get("COURSE_EXIT_GRACE", "60"))


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


def how_to_launch(lesson: str, lesson_args: str = "") -> str:
    """What to type to start a multi-node lesson (day 2), which never spawns its own workers: one line."""
    name, args = Path(lesson).name, f" {lesson_args}" if lesson_args else ""
    where = "no launcher started it"
    if "SLURM_JOB_ID" in os.environ:  # a batch script's shell or salloc's shell: a job, but not an srun step
        where = f"you are inside Slurm job {os.environ['SLURM_JOB_ID']} but not in a job step"
    return (f"this multi-node lesson does not start its own processes ({where}): in a Slurm allocation "
            f"(salloc --nodes 2 --ntasks-per-node=4) run ./day2/multinode_setup_and_run.sh {name}{args}; "
            f"on one machine run torchrun --standalone --nproc_per_node=4 {lesson}{args}")


def require_launcher(lesson: str, lesson_args: str = "") -> None:
    """Multi-node lessons need torchrun or srun: plain `python lesson.py` stops with how_to_launch()."""
    if detect_launcher() == "self":
        raise CourseError(how_to_launch(lesson, lesson_args))


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
        # As the TCPStore does: a port left in TIME_WAIT by the previous job step (srun after srun in one
        # job, same job id, same port) is free to listen on; only a live listener counts as in use.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            raise CourseError(f"port {port} on {addr} is already in use (another job or user?); "
                              f"choose another with MASTER_PORT=<free port>") from None


def _check_master_addr_is_here(addr: str) -> None:
    """Rank 0 hosts the store at MASTER_ADDR: an address of another machine would only fail after --timeout."""
    try:
        ip = socket.gethostbyname(addr)
        with socket.socket() as s:
            s.bind((ip, 0))
    except OSError as e:
        raise CourseError(f"rank 0 runs on {socket.gethostname()}, but MASTER_ADDR={addr} is not an address of "
                          f"this host ({e.strerror or e}); unset MASTER_ADDR (the first node of the job is "
                          f"taken) or set it to rank 0's hostname") from None


def _wait_for_rank0(rank: int, timeout) -> None:
    """Connect to rank 0's store at MASTER_ADDR:MASTER_PORT until it answers or `timeout` seconds pass.

    init_process_group does the same, but an unreachable address costs it up to twice its timeout, and it
    fails with a traceback; this fails within the timeout, with one line that says what to check.
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    deadline = time.monotonic() + (timeout or 300)
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(left, 5))).close()
            return
        except OSError as e:  # refused (rank 0 not listening yet), unreachable, unknown name, timed out
            last = e.strerror or str(e) or type(e).__name__
        if left <= 0:
            raise CourseError(f"rank {rank} could not reach rank 0 at MASTER_ADDR={addr} MASTER_PORT={port} within "
                              f"--timeout {timeout or 300:g} s ({last}); MASTER_ADDR must be rank 0's host, "
                              f"reachable from this node (check the name, a firewall, GLOO_SOCKET_IFNAME/"
                              f"NCCL_SOCKET_IFNAME), and rank 0 must have started") from None
        time.sleep(min(0.2, max(left, 0)))


def _srun_info() -> RankInfo:
    env = os.environ
    rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
    local_rank = int(env.get("SLURM_LOCALID", 0))
    # "2(x2),1" style: take this node's count from SLURM_STEP_TASKS_PER_NODE, else assume uniform
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_NTASKS_PER_NODE", "1"))
    local_world = int(per_node.split("(")[0].split(",")[0])
    if "MASTER_ADDR" not in os.environ:  # not setdefault(): that would ask scontrol even when it is set
        os.environ["MASTER_ADDR"] = slurm_master_addr()
    os.environ.setdefault("MASTER_PORT", str(slurm_master_port()))
    if rank == 0:
        _check_master_addr_is_here(os.environ["MASTER_ADDR"])
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
    before_init_process_group()
    try:
        if info.launcher != "self" and info.rank != 0 and info.world_size > 1:
            _wait_for_rank0(info.rank, getattr(args, "timeout", None))
        return worker(info, args)
    except (CourseError, DataError) as e:
        print(f"[rank {info.rank}] error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except RuntimeError as e:  # gloo/NCCL/store failures: one line, not pages of C++ traceback
        if not _communication_error(e):
            raise
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        if torch.distributed.is_initialized():
            what = ("communication with the other ranks failed; another rank probably crashed or was killed "
                    "(see its messages)")
        else:
            what = (f"the process group could not be set up with rank 0 at {os.environ.get('MASTER_ADDR')}:"
                    f"{os.environ.get('MASTER_PORT')} within --timeout; check MASTER_ADDR/MASTER_PORT and that "
                    f"every rank was started with the same world size")
        print(f"[rank {info.rank}] error: {what} ({type(e).__name__}: {first})", file=sys.stderr, flush=True)
        sys.exit(1)


def before_init_process_group() -> None:
    """In a rank that will train: import torch._dynamo now, before its init_process_group.

    torch.optim imports torch._dynamo on an optimizer's first use (1.5-2.5 s).  Imported *after*
    init_process_group, torch 2.14 keeps the default process group alive past destroy_process_group: gloo's
    threads then still run while the interpreter shuts down, and a rank that has finished can abort there
    ("terminate called without an active exception": lesson 5, 2 of 50 runs in a stress loop under load).
    Imported before, it costs nothing extra, and the group ends where the lesson ends it (tests/test_faults.py
    checks that no gloo thread is left).  A process that has not imported course.models trains nothing
    (lessons 0, 1 and 9) and does not pay for the import.
    """
    if "course.models" in sys.modules:
        importlib.import_module("torch._dynamo")


def _communication_error(e: RuntimeError) -> bool:
    """torch.distributed's own errors, and the plain RuntimeErrors gloo and NCCL raise from a collective."""
    text = str(e)
    return isinstance(e, torch.distributed.DistError) or any(
        marker in text for marker in ("gloo/transport", "Gloo connectFullMesh", "ProcessGroupNCCL", "NCCL error"))


def _spawned(index: int, worker, nproc: int, args, environ: dict):
    # A rank forked from the fork server has the environment the server started with; this launch's own
    # (MASTER_PORT is new for every launch, e.g. in lesson 7's sweep) is the one that counts.
    os.environ.clear()
    os.environ.update(environ)
    try:
        _run(worker, RankInfo(index, index, nproc, nproc, 0, "self"), args)
    finally:
        _end_within(EXIT_GRACE_S)


def _end_within(seconds: int) -> None:
    """This process has done its work and only has to exit: if that takes longer than `seconds`, the kernel
    ends it (SIGALRM's default action works wherever the process is stuck, even in C++ code after Python has
    shut down) and the launcher says so.  Seen once on a 16-core node (torch 2.11): a rank of lesson 7's sweep
    had printed its results and then never exited; it was 1 run in 10 and did not happen again in 30 more.
    Without this, the job would wait for that rank for ever."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, seconds))


def launch(worker, args, nproc: int = None) -> None:
    """Run `worker(info, args)` in every rank, however this process was started."""
    launcher = detect_launcher()
    if launcher == "torchrun":
        _run(worker, _torchrun_info(), args)
    elif launcher == "srun":
        _run(worker, _srun_info(), args)
    else:
        nproc = args.nproc if nproc is None else nproc
        _check_gpus(args, nproc)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
        if nproc == 1:
            _run(worker, RankInfo(0, 0, 1, 1, 0, "self"), args)
            return
        ranks = torch.multiprocessing.start_processes(_spawned, args=(worker, nproc, args, dict(os.environ)),
                                                      nprocs=nproc, join=False, start_method=start_method())
        previous = {sig: signal.signal(sig, lambda signum, _: _signal_all(ranks.pids(), signum))
                    for sig in FORWARDED_SIGNALS}
        try:
            while not ranks.join():
                pass
        except torch.multiprocessing.ProcessExitedException as e:
            # join() has already terminated the other ranks: one failed rank ends the job
            index, code = e.error_index, e.exit_code
            for i, process in enumerate(ranks.processes):
                if code > 0 and process.exitcode is not None and process.exitcode < 0 \
                        and process.exitcode != -signal.SIGTERM:
                    index, code = i, process.exitcode  # killed (SIGKILL, OOM...): the others failed because of it
                    break
            if code == -signal.SIGALRM:
                raise CourseError(f"rank {index} finished its work but had not exited {EXIT_GRACE_S} s later "
                                  f"(stuck while shutting down), so it was ended; the other ranks were stopped"
                                  ) from None
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            raise CourseError(f"rank {index} {how}; the other ranks were stopped") from None
        except torch.multiprocessing.ProcessRaisedException as e:
            last = str(e).strip().splitlines()[-1]
            print(str(e), file=sys.stderr)
            raise CourseError(f"rank {e.error_index} failed: {last}; the other ranks were stopped") from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def start_method(packages=("course", "data_tools")) -> str:
    """How the ranks are started: forked from a fork server where the platform has one (Linux, macOS).

    The fork server is a fresh Python process (nothing of this one is copied: no CUDA, no threads).  It
    imports torch and the course's modules once, and every rank is then a fork of it, ready in milliseconds;
    with "spawn" every rank imports torch again itself, about 2 s of CPU each (benchmarks/bench.py,
    section startup).  One server serves every launch of this process (lesson 7's sweep).
    COURSE_START_METHOD=spawn starts every rank as a fresh interpreter instead.  `packages`: whose modules,
    imported here, the server imports too.
    """
    import multiprocessing

    available = multiprocessing.get_all_start_methods()
    method = os.environ.get("COURSE_START_METHOD") or ("forkserver" if "forkserver" in available else "spawn")
    if method not in ("forkserver", "spawn") or method not in available:
        raise CourseError(f"COURSE_START_METHOD={method} is not a way to start ranks here; use "
                          f"{' or '.join(m for m in ('forkserver', 'spawn') if m in available)}, or unset it")
    if method == "spawn":
        return method
    # torch and the course's modules this lesson uses; each rank still runs the lesson file itself (Python
    # 3.11's fork server does not preload __main__), which then finds them imported.
    ours = sorted(name for name in sys.modules if name.split(".")[0] in packages)
    preload = ["torch", "torch.distributed", *ours]
    if "course.models" in sys.modules:  # a lesson that trains: see before_init_process_group
        preload.append("torch._dynamo")
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    return "forkserver"


def _check_gpus(args, nproc: int) -> None:
    """Before spawning: the errors setup_device/backend_for would raise in every rank, as one line."""
    device, backend = getattr(args, "device", None), getattr(args, "backend", "auto")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # --device auto gives each rank a GPU of its own whenever CUDA sees one (setup_device below)
    wants_gpu = device == "cuda" or backend == "nccl" or (device == "auto" and gpus > 0)
    if wants_gpu and nproc > gpus:
        what = "--backend nccl" if backend == "nccl" else "--device cuda" if device == "cuda" else \
            "--device auto (CUDA is visible)"
        fix = f"use --nproc {gpus}, or --backend gloo --device cpu for {nproc} ranks on the CPU" if gpus else \
            "use --backend gloo --device cpu"
        raise CourseError(f"{what} with {nproc} ranks needs {nproc} GPUs (one per rank), this machine has "
                          f"{gpus}; {fix}")


def _signal_all(pids, signum) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # that rank has already ended
            pass


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
