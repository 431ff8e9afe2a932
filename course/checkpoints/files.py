"""Lesson 12's checkpoint files and bookkeeping: written atomically, rotated, the newest valid one found, the
directory locked; the position and records a checkpoint carries, and the run's closing report.

When a checkpoint is written (every --checkpoint-every steps and at the stop or end), that global rank 0 writes
it, that every rank loads the one rank 0 chose (map_location, weights_only=True), the signal flag and its
all_reduce, and the throw-away backward that rebuilds DDP's buckets are lesson 12's idea and stay in the lesson;
this module is the plumbing around it:
- prepare(): before init, reproducible kernels, the directory's lock and each rank's pid line;
- new_state(), after_step(), record_stop(), end_epoch(): the position (epoch, batch within it, step) and the
  records (loss per step, evaluations, stops, resumptions, seconds) that a checkpoint carries besides the
  weights, the optimizer and the RNG streams;
- save(): rank 0 builds the checkpoint (model, optimizer, the state above, every rank's RNG streams), writes
  it to a temporary file, flushes it to the disk, records its sha256 beside it (step-NNNNNNNNN.pt.sha256,
  in sha256sum's format: `sha256sum -c` checks it by hand) and renames both into place, the digest first
  (atomic: a crash while writing leaves the previous checkpoint, never half a new one, and never a
  checkpoint without its digest), then keeps the newest `keep`;
- restore(): every rank takes the weights, the optimizer, its own RNG streams and the state back;
- newest_valid(): the newest checkpoint whose bytes have the sha256 recorded when it was written, that
  loads (weights_only=True: a checkpoint is data, and weights_only refuses pickles that would run code) and
  is one of lesson 12's; damaged ones are reported and skipped.  The digest is needed because torch.load
  verifies no checksum: a file with 64 bytes flipped in the middle of its tensors loads without a word;
- check_same_run(): a checkpoint of other settings is refused, naming what differs;
- lock(): one run per checkpoint directory, so that two runs never mix their checkpoints;
- report(): rank 0's closing output: the stop and how to resume, or metrics.json, model.pt, loss.png and a line;
- add_args() and check_dir(): the lesson's options, and their checks before any rank starts.

The digest (sha256_of, also lesson 16's): SHA-256 from hashlib, measured on the course's 2-core machine
(AMD EPYC with the SHA extensions, Python 3.11, 16 MiB in memory): sha256 1.6 GB/s, sha1 1.7, zlib.crc32
2.1, blake2b 0.7, md5 0.65, sha3_256 0.4.  sha256 costs about as much as a CRC there, and unlike a CRC
it is collision resistant: no edit of a file keeps its digest, by accident or on purpose.  Without the CPU's
SHA instructions sha256 runs at about blake2b's speed; both stay far below the cost of writing the file
(benchmarks/README.md, section dcp: the digest against the save, goal at most 10 % of it).
"""
import fcntl
import hashlib
import os
import signal
import socket
import time
from pathlib import Path

FORMAT = "12_ddp_fault_tolerance/1"
# A checkpoint belongs to one training run: resuming with other values of these would be another run.
SAME_RUN = ("dataset", "model", "batch_size", "lr", "seed", "train_samples")
_held = []  # rank 0's lock on its checkpoint directory, held until the process ends (the kernel releases it)


def prepare(args, rank: int, launcher: str) -> Path:
    """Every rank, before init.  Reproducible kernels, so that a resumed run can equal the uninterrupted one
    (cuBLAS needs the setting; a GPU op without a deterministic version, e.g. the CNN's max-pool backward,
    warns instead of failing).  Rank 0 locks the checkpoint directory: a second run on it stops here, before
    any rank has joined.  Each rank prints its pid (to send it a signal by hand), its host, its launcher and
    how many times the job has been started again.  Returns the checkpoint directory."""
    import torch

    from course.training.output import rank_print

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    directory = args.checkpoint_dir or args.run_dir / "checkpoints"
    if rank == 0:
        _held.append(lock(directory))
    rank_print(rank, f"pid {os.getpid()} on {socket.gethostname()} ({launcher}, restart {restarts()})")
    return directory


def restarts() -> int:
    """How many times this job has been started again: torchrun's restarts of its workers (--max-restarts)
    plus Slurm's requeues."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) + int(os.environ.get("SLURM_RESTART_COUNT", 0))


def new_state(args, world_size: int) -> dict:
    """A fresh run's state: the run's settings (which a resumed run must share), the position (epoch, batches
    done in it, step) and the records (mean loss of every step, evaluations, stops, the steps it resumed at,
    training seconds).  A checkpoint holds it, beside the weights, the optimizer and the RNG streams."""
    return {"format": FORMAT, "run": {k: getattr(args, k) for k in SAME_RUN} | {"world_size": world_size},
            "epoch": 0, "batches_done": 0, "step": 0, "loss_per_step": [], "evaluations": [], "stops": [],
            "resumed_at": [], "train_seconds": 0.0}


def steps(args, shard: int) -> tuple:
    """(batches per epoch, steps in all) for a rank's shard of `shard` samples: --max-steps, or every epoch."""
    per_epoch = -(-shard // args.batch_size)
    return per_epoch, args.max_steps or args.epochs * per_epoch


def after_step(state: dict, loss: float, rank: int, args, per_epoch: int) -> None:
    """Every rank, after a step: one batch further, its loss (the mean over ranks) recorded; rank 0 prints it
    every --log-every steps; then --step-sleep seconds, if given (time to send a signal by hand)."""
    from course.training.output import rank_print

    state["loss_per_step"].append(loss)
    state["step"] += 1
    state["batches_done"] += 1
    if rank == 0 and state["step"] % args.log_every == 0:
        rank_print(rank, f"step {state['step']} (epoch {state['epoch']}, batch {state['batches_done']}/{per_epoch}): "
                         f"loss {loss:.4f}")
    if args.step_sleep:
        time.sleep(args.step_sleep)


def record_stop(state: dict, stop_signal) -> dict:
    """Every rank, after the step at which the ranks agreed to stop: which signal reached which rank (one
    all_gather), kept in the state, so that its checkpoint and the final metrics.json have it.  Returns it."""
    import torch.distributed as dist

    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, signal.Signals(stop_signal).name if stop_signal else None)
    stopped = {"step": state["step"], "signals": {r: s for r, s in enumerate(got) if s}}
    state["stops"] = state["stops"] + [stopped]
    return stopped


def end_epoch(state: dict, epoch: int, accuracy: float, test_loss: float, per_epoch: int) -> None:
    """After an epoch's evaluation: recorded; the position moves to the next epoch if this one is complete
    (not when --max-steps ended it early)."""
    state["evaluations"] = state["evaluations"] + [
        {"epoch": epoch, "step": state["step"], "test_accuracy": accuracy, "test_loss": test_loss}]
    if state["batches_done"] >= per_epoch:
        state["epoch"], state["batches_done"] = epoch + 1, 0


def rng_state(device) -> dict:
    """This rank's random streams: the CPU generator's state and, on a GPU, that of its device."""
    import torch

    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None}


def files(directory: Path) -> list:
    """The checkpoints in `directory`, newest (highest step) first; temporary files are not among them."""
    return sorted(Path(directory).glob("step-*.pt"), reverse=True)


def save(directory: Path, state: dict, model, optimizer, rng: list, keep: int) -> Path:
    """Rank 0 only: the checkpoint (the state, the model's weights, the optimizer with its momentum buffers and
    every rank's RNG streams, `rng`, in rank order) written to a temporary file, flushed to the disk, renamed
    into place.  Says where it went and returns the path."""
    import torch

    from course.training.output import rank_print

    checkpoint = {**state, "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                  "optimizer": optimizer.state_dict(), "sampler_seed": state["run"]["seed"],
                  "rng": {"cpu": [r["cpu"] for r in rng],
                          "cuda": [r["cuda"] for r in rng] if rng[0]["cuda"] is not None else None}}
    final = directory / f"step-{state['step']:09d}.pt"
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on the disk before any name points to them
        # the digest of the bytes on the disk (read back from the page cache), in place before the file
        write_digest(sidecar(final), sha256_of(tmp), final.name)
        os.replace(tmp, final)    # atomic: readers see the previous checkpoints, or these and the new one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)  # and the rename itself survives a crash of the node
    for old in files(directory)[keep:]:  # the newest `keep`: one more in case the newest is damaged
        old.unlink(missing_ok=True)
        sidecar(old).unlink(missing_ok=True)
    for orphan in directory.glob("step-*.pt.sha256"):  # a save cut short between its two renames
        if not orphan.with_suffix("").exists():
            orphan.unlink(missing_ok=True)
    rank_print(0, f"checkpoint {final}")
    return final


def restore(path: Path, saved: dict, model, optimizer, rank: int, state: dict) -> dict:
    """Every rank, from the checkpoint rank 0 chose, loaded onto this rank's device: a checkpoint of another
    run is refused; then the weights (the same on every rank), the optimizer's state (the momentum), this
    rank's own RNG streams.  Returns the saved state with this resumption added; rank 0 says where it goes on."""
    import torch

    from course.training.output import rank_print

    check_same_run(saved, state["run"], Path(path).parent)  # the same settings, or one line saying which differ
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"]["cpu"][rank].cpu())  # each rank its own random stream
    if next(model.parameters()).device.type == "cuda" and saved["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state(saved["rng"]["cuda"][rank].cpu())
    state = {k: saved[k] for k in state}
    state["resumed_at"] = state["resumed_at"] + [state["step"]]
    if rank == 0:
        rank_print(rank, f"resuming from {path}: step {state['step']}, epoch {state['epoch']}, "
                         f"batch {state['batches_done']} of the epoch")
    return state


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB pieces (hashlib releases the GIL while it hashes)."""
    digest, buffer = hashlib.sha256(), bytearray(1 << 20)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def sidecar(path: Path) -> Path:
    """Where the digest of `path` is kept: beside it, with .sha256 added to its name."""
    return Path(path).with_name(Path(path).name + ".sha256")


def write_digest(where: Path, digest: str, name: str) -> None:
    """`where` holds `digest` of the file `name`, in sha256sum's format; written to a temporary name, flushed
    and renamed, so that it is whole or absent."""
    tmp = where.with_name(f".{where.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(f"{digest}  {name}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, where)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def digest_damage(path: Path):
    """Why the bytes of `path` are not the ones its sidecar recorded when it was written, or None."""
    try:
        recorded = sidecar(path).read_text().split()[0]
    except (OSError, IndexError):
        return f"no readable {sidecar(path).name}: its digest was never written"
    if sha256_of(path) != recorded:
        return f"its sha256 differs from the one in {sidecar(path).name}: the file changed after it was written"
    return None


def fsync_dir(directory: Path) -> None:
    """Flush a directory's entries (names created or renamed in it) to the disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def newest_valid(directory: Path, rank: int = 0, fresh: bool = False):
    """Rank 0: the newest checkpoint whose bytes match their digest, that loads and is lesson 12's, or None.
    Damaged ones are skipped, each with one line naming it.
    `fresh` (--fresh): delete every checkpoint first, and start over."""
    import torch

    from course.training.output import rank_print

    if fresh:
        for old in files(directory):
            old.unlink()
        for old in directory.glob("step-*.pt.sha256"):
            old.unlink()
    for path in files(directory):
        try:
            damaged = digest_damage(path)  # before torch.load, which would load flipped bytes without a word
            if damaged:
                raise ValueError(damaged)
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
        from course.launching.cli import CourseError

        differ = ", ".join(f"{k} {saved['run'].get(k)} -> {v}" for k, v in run.items() if saved["run"].get(k) != v)
        raise CourseError(f"the checkpoints in {directory} are of another run ({differ}); resume with "
                          f"the same settings, or start over with --fresh or another --run-dir")


def lock(directory: Path):
    """Rank 0: hold an exclusive lock on the checkpoint dir while training, or stop with a message."""
    from course.launching.cli import CourseError

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


def report(args, model, state: dict, stopped, path: Path, shard: int, launcher: str) -> None:
    """Rank 0, once the last checkpoint is on the disk.  Stopped (`stopped`: record_stop's record): one line,
    after which step, which signal reached which rank, the checkpoint, how to go on; the run then ends with
    exit code 0, as a stop on request is no failure.  Done: metrics.json (with the evaluations, stops,
    resumptions and restarts), model.pt and loss.png (course/training/results.py), and one line."""
    from course.training import results
    from course.training.output import rank_print

    if stopped is not None:
        got = ", ".join(f"{name} to rank {r}" for r, name in stopped["signals"].items())
        rank_print(0, f"stopped after step {stopped['step']} of {steps(args, shard)[1]} ({got}); checkpoint {path}; "
                      f"run the same command again to resume")
        return
    last = state["evaluations"][-1] if state["evaluations"] else {"test_accuracy": None, "test_loss": None}
    resumed = state["resumed_at"] or "none"
    global_batch = state["run"]["world_size"] * args.batch_size
    results.write(args, model, state["loss_per_step"], state["train_seconds"], last["test_accuracy"],
                  last["test_loss"], shard, line=False, launcher=launcher,
                  title=f"{args.model}, global batch {global_batch}, resumed at steps {resumed}",
                  evaluations=state["evaluations"], stops=state["stops"], resumed_at=state["resumed_at"],
                  restarts=restarts(), checkpoint=str(path))
    print(f"{state['step']} steps, {len(state['stops'])} stop(s), resumed at steps {resumed}; "
          f"test accuracy {last['test_accuracy']:.4f}; outputs in {args.run_dir}", flush=True)


def add_args(p):
    """Lesson 12's options: when and where checkpoints are written, how many are kept, starting over, and
    its demo aids (the loss every N steps, a sleep after each step to send a signal by hand)."""
    from course.launching.cli import positive_int

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
    from course.launching.cli import CourseError

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
