"""Lesson 12's checkpoint files: written atomically, rotated, the newest valid one found, the directory locked.

What a checkpoint holds, when it is written and how a run resumes from it is lesson 12's idea and stays in
the lesson; this module is the file plumbing around it:
- save(): rank 0 writes to a temporary file, flushes it to the disk and renames it into place (atomic:
  a crash while writing leaves the previous checkpoint, never half a new one), then keeps the newest `keep`;
- newest_valid(): the newest checkpoint that loads (weights_only=True: a checkpoint is data, and
  weights_only refuses pickles that would run code) and is one of lesson 12's; torn ones are reported;
- check_same_run(): a checkpoint of other settings is refused, naming what differs;
- lock(): one run per checkpoint directory, so that two runs never mix their checkpoints;
- add_args() and check_dir(): the lesson's options, and their checks before any rank starts.
"""
import fcntl
import os
import socket
from pathlib import Path

FORMAT = "12_ddp_fault_tolerance/1"


def files(directory: Path) -> list:
    """The checkpoints in `directory`, newest (highest step) first; temporary files are not among them."""
    return sorted(Path(directory).glob("step-*.pt"), reverse=True)


def save(directory: Path, step: int, state: dict, keep: int) -> Path:
    """Rank 0 only: write to a temporary file, flush it to the disk, rename it into place."""
    import torch

    final = directory / f"step-{step:09d}.pt"
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on the disk before any name points to them
        os.replace(tmp, final)    # atomic: readers see the previous checkpoints, or these and the new one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)  # and the rename itself survives a crash of the node
    for old in files(directory)[keep:]:  # the newest `keep`: one more in case the newest is damaged
        old.unlink(missing_ok=True)
    return final


def fsync_dir(directory: Path) -> None:
    """Flush a directory's entries (names created or renamed in it) to the disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def newest_valid(directory: Path, rank: int = 0, fresh: bool = False):
    """Rank 0: the newest checkpoint that loads and is complete, or None.  Damaged ones are skipped.
    `fresh` (--fresh): delete every checkpoint first, and start over."""
    import torch

    from course.output import rank_print

    if fresh:
        for old in files(directory):
            old.unlink()
    for path in files(directory):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or state.get("format") != FORMAT:
                raise ValueError("not a checkpoint of this lesson")
            return path
        except Exception as e:  # truncated zip, garbage, a foreign pickle: all mean "do not resume from it"
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            rank_print(rank, f"skipping checkpoint {path} (torn or invalid: {reason[:120]})")
    return None


def check_same_run(saved: dict, run: dict, directory: Path) -> None:
    """A checkpoint of another run (other settings) is refused, in one line naming what differs."""
    if saved["run"] != run:
        from course.cli import CourseError

        differ = ", ".join(f"{k} {saved['run'].get(k)} -> {v}" for k, v in run.items() if saved["run"].get(k) != v)
        raise CourseError(f"the checkpoints in {directory} are of another run ({differ}); resume with "
                          f"the same settings, or start over with --fresh or another --run-dir")


def lock(directory: Path):
    """Rank 0: hold an exclusive lock on the checkpoint dir while training, or stop with a message."""
    from course.cli import CourseError

    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel when this process ends
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise CourseError(f"{directory} is used by another run ({holder}); wait for it to end, or give this "
                          f"run its own --run-dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return handle


def add_args(p):
    """Lesson 12's options: when and where checkpoints are written, how many are kept, starting over, and
    its demo aids (the loss every N steps, a sleep after each step to send a signal by hand)."""
    from course.cli import positive_int

    p.add_argument("--checkpoint-every", type=positive_int, default=100, metavar="STEPS",
                   help="write a checkpoint every this many steps (and always at a stop and at the end)")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="where the checkpoints go (default: RUN_DIR/checkpoints); a run resumes from the newest")
    p.add_argument("--keep", type=positive_int, default=2, help="checkpoints kept (the newest ones)")
    p.add_argument("--fresh", action="store_true",
                   help="delete the checkpoints of earlier runs and start over (never in a requeued job script)")
    p.add_argument("--log-every", type=positive_int, default=50, metavar="STEPS",
                   help="rank 0 prints the loss every this many steps")
    p.add_argument("--step-sleep", type=float, default=0.0, metavar="SECONDS",
                   help="sleep after each step, to have time to send a signal by hand (a demo aid; 0: full speed)")
    return p


def check_dir(args) -> None:
    """Before any rank starts: --step-sleep is not negative and --checkpoint-dir can be written."""
    from course.cli import CourseError

    if args.step_sleep < 0:
        raise CourseError(f"--step-sleep {args.step_sleep:g}: must be 0 or more seconds")
    if args.checkpoint_dir is not None:
        try:
            args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            if not os.access(args.checkpoint_dir, os.W_OK):
                raise PermissionError("not writable")
        except OSError as e:
            raise CourseError(f"checkpoint dir {args.checkpoint_dir} cannot be written "
                              f"({e.strerror or e}); choose another with --checkpoint-dir") from None
