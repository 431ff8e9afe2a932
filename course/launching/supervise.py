"""Supervising ranks: what torchrun and srun do for the ranks they start, done here for `--nproc N`.

The ranks are forked from this process, or from a fork server where that is not safe (start_method);
SIGTERM and SIGUSR1 sent to the launching process are passed on to them; when one rank fails the others are
stopped and one line says which rank and why; a rank that has done its work but does not exit is ended.
Inside every rank, however it was started, a failure the user can act on ends it with one line instead of a
traceback (failures_as_one_line), so its launcher ends the job.
Beside it in course/launching/: launch.py finds the ranks and starts them; devices.py picks each rank's device
and backend; ports.py chooses where rank 0 listens.
"""
import gc
import importlib
import os
import signal
import sys
import time
from contextlib import contextmanager

import torch

from course.launching.cli import CourseError
from data_tools.datasets import DataError

# A SIGTERM (kill, scancel, a time limit) or SIGUSR1 (sbatch --signal) sent to `python lesson.py --nproc N`
# reaches only the parent: it passes them on to its ranks, as torchrun does with SIGTERM (lesson 12).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Seconds a self-launched rank may take to exit once its work is done (see _end_within)
EXIT_GRACE_S = int(os.environ.get("COURSE_EXIT_GRACE", "60"))


def run_ranks(rank_main, nproc: int, rank_args: tuple) -> None:
    """Start `rank_main(index, *rank_args)` in `nproc` processes and wait for them all; one failure ends all.

    Every rank gets this process's environment as it is now (see _rank), and ends within EXIT_GRACE_S of its
    work being done.  A failed rank is a CourseError naming it.
    """
    ranks = torch.multiprocessing.start_processes(_rank, args=(rank_main, rank_args, dict(os.environ)),
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


def _rank(index: int, rank_main, rank_args: tuple, environ: dict):
    # A rank forked from the fork server has the environment the server started with; this launch's own
    # (MASTER_PORT is new for every launch, e.g. in lesson 7's sweep) is the one that counts.  (Forked from
    # this process, it has that already.)
    os.environ.clear()
    os.environ.update(environ)
    try:
        rank_main(index, *rank_args)
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


def _signal_all(pids, signum) -> None:
    for i, pid in enumerate(pids):
        if signum == signal.SIGUSR1 and i:
            # A rank that prints its stacks on SIGUSR1 (faulthandler, lesson 17) writes them in many small
            # pieces: ranks signalled at the same moment interleave them character by character in the
            # shared terminal.  A quarter of a second apart, each rank's stacks come out whole.
            time.sleep(0.25)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # that rank has already ended
            pass


def start_method(packages=("course", "data_tools")) -> str:
    """How the ranks are started: forked from this process where that is safe, else from a fork server.

    "fork" (Linux, no GPU visible, no thread started here since torch was imported): every rank is a copy
    of this process, which has imported torch, torch._dynamo and the lesson already, ready in milliseconds.
    Where a GPU is visible, CUDA's state may not be copied into a child, and a process whose OpenMP threads
    have run cannot be forked either (the child's first parallel region then waits for threads it does not
    have, for ever: measured with torch 2.14.1).  Those get "forkserver": a fresh Python process (nothing of
    this one is copied) imports torch and the course's modules once, and every rank is a fork of it (about
    4 CPU-seconds more per launch than "fork", once).  Without either (Windows) "spawn": every rank imports
    torch itself, about 2 s of CPU each (benchmarks/bench.py, section startup).  COURSE_START_METHOD picks
    one of the three; "fork" where it is not safe is one line.  `packages`: whose modules, imported here,
    the fork server imports too.
    """
    import multiprocessing

    available = multiprocessing.get_all_start_methods()
    why_not_fork = _why_not_fork()
    default = "fork" if why_not_fork is None else "forkserver" if "forkserver" in available else "spawn"
    method = os.environ.get("COURSE_START_METHOD") or default
    if method not in ("fork", "forkserver", "spawn") or method not in available:
        raise CourseError(f"COURSE_START_METHOD={method} is not a way to start ranks here; use "
                          f"{' or '.join(m for m in ('fork', 'forkserver', 'spawn') if m in available)}, "
                          f"or unset it")
    if method == "fork" and why_not_fork is not None:
        raise CourseError(f"COURSE_START_METHOD=fork: this process cannot be forked safely ({why_not_fork}); "
                          f"use forkserver, or unset it")
    if method == "spawn":
        return method
    if method == "fork":
        before_init_process_group()  # torch._dynamo, once here instead of once per rank
        return method
    # torch and the course's modules this lesson uses; each rank still runs the lesson file itself (Python
    # 3.11's fork server does not preload __main__), which then finds them imported.
    ours = sorted(name for name in sys.modules if name.split(".")[0] in packages)
    preload = ["course.launching.gc_paused", "torch", "torch.distributed", *ours]
    if "course.models" in sys.modules:  # a lesson that trains: see before_init_process_group
        preload.append("torch._dynamo")
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    return "forkserver"


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


# The threads this process had when torch had just been imported (one of torch's own besides the main one)
_THREADS_AT_IMPORT = _thread_count()


def _why_not_fork():
    """None where forking this process for the ranks is safe, else why not (for one line)."""
    if not sys.platform.startswith("linux"):
        return "only on Linux"  # macOS's system libraries are not safe to use in a forked child
    if torch.cuda.is_available():
        return "a GPU is visible"
    threads = _thread_count()
    if threads < 0 or threads > _THREADS_AT_IMPORT:
        return f"it has started {threads - _THREADS_AT_IMPORT} thread(s) since torch was imported"
    return None


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
        with _without_gc():
            importlib.import_module("torch._dynamo")


@contextmanager
def _without_gc():
    """Python's cyclic garbage collector off while a large package is imported: importing torch._dynamo then
    takes about 0.3 CPU-seconds less (of 1.6 on a 2-core machine), in every rank torchrun or srun starts.
    (The fork server, which imports everything before its first rank, has it off throughout: gc_paused.py.)"""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def failures_as_one_line(rank: int):
    """A failure the user can act on, or a broken connection to the other ranks, ends this rank with one line
    on stderr and exit code 1, not pages of (C++) traceback; anything else is a bug and keeps its traceback."""
    try:
        yield
    except (CourseError, DataError) as e:
        _say(f"[rank {rank}] error: {e}")
        sys.exit(1)
    except RuntimeError as e:  # gloo/NCCL/store failures
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
        _say(f"[rank {rank}] error: {what} ({type(e).__name__}: {first})")
        sys.exit(1)


def _communication_error(e: RuntimeError) -> bool:
    """torch.distributed's own errors, and the plain RuntimeErrors gloo and NCCL raise from a collective."""
    text = str(e)
    return isinstance(e, torch.distributed.DistError) or any(
        marker in text for marker in ("gloo/transport", "Gloo connectFullMesh", "ProcessGroupNCCL", "NCCL error"))


def _say(line: str) -> None:
    """One line on stderr in one write.  print() writes the text and its newline separately, and stderr is not
    buffered: two ranks failing at the same moment then end up on one line ("...rank_[rank 0] error: ...")."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
