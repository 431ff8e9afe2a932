"""Lesson 16's checkpoint directories: published atomically, verified before use, resharded, exported.

What a checkpoint holds and how each rank saves and loads its shards (torch.distributed.checkpoint), and the
one collective by which every rank learns whether a checkpoint is intact, are lesson 16's idea and stay in
the lesson; this module is the file plumbing around it:
- a checkpoint is a directory, step-NNNNNNNNN/, written by every rank under a temporary name
  (.step-NNNNNNNNN.TOKEN.tmp/) with Writer, DCP's FileSystemWriter that also records the sha256 of each file
  it wrote: every rank hashes its own file, while its bytes are still in the page cache, in parallel with
  the other ranks (and, under dcp.async_save, in the saver's thread or process);
- publish() (rank 0, once every rank's files and DCP's .metadata are written) writes complete.json LAST (the
  run's settings, the position in training, every file's size and sha256, and the sha256 of its own content),
  flushes it to the disk and renames the directory into place: a crash before that leaves a temporary
  directory that no run ever loads; it then keeps the newest --keep complete checkpoints and removes damaged
  ones older than the new one;
- published(): the published checkpoints, newest first, whose complete.json is intact (its own digest) and
  lists files that are all there with their sizes (a file cut short by a full disk or a copy is caught);
  damaged or unfinished ones are reported and skipped.  share_intact(): one rank's share of a checkpoint's
  files (every W-th, by name) hashed and compared with complete.json; the lesson combines the ranks' verdicts;
- check(): before any rank starts: --resume needs a directory with a complete checkpoint of the same model
  and global batch (--resume if-any starts a new run when there is none yet: a job submitted again); a
  checkpoint already at --max-steps or --epochs leaves nothing to train (one line, exit 0); a run without
  --resume refuses a directory that already holds checkpoints.  It reads complete.json (its digest checked)
  and the files' sizes, not the files' bytes: hashing them is the ranks' work, shared, once they run (under
  torchrun every process runs check() itself, and would hash everything W times).  The one exception is a
  checkpoint at the end: its files are hashed before "nothing to train", since the ranks would skip it if
  damaged and train on from an older one;
- export(): the newest intact checkpoint's model (every file's digest checked, in the one process), loaded in
  one process (DCP reassembles every parameter from the shards of all ranks), written as one ordinary state
  dict that torch.load(weights_only=True) reads.
DCP's own files carry no checksum, and torch.load verifies none: bytes flipped in place (a failing disk, a
bad copy) load without a word where they fall in tensor data, and where they fall in a record's header
they end the run with a traceback from deep inside dcp.load (both seen here with 64 bytes flipped).  The
digest is SHA-256 (course/checkpoints/files.py says why: on this machine it costs about what a CRC does, and it
is collision resistant).
"""
import hashlib
import json
import os
import shutil
import time
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from course.checkpoints.files import fsync_dir, sha256_of, sidecar, write_digest

MARKER = "complete.json"
FORMAT = "16_distributed_checkpoint/2"  # /2: complete.json records every file's sha256 and its own
# A checkpoint belongs to one model: these must agree to load it (DCP reshards, it does not reshape)
MODEL = ("model", "patch", "width", "depth", "heads")
# and to one training run: the same global batches in the same order
RUN = ("dataset", "lr", "seed", "train_samples", "clip_grad_norm", "precision", "reduce_dtype")


def final_dirs(directory: Path) -> list:
    """Published checkpoints, newest (highest step) first."""
    return sorted((p for p in Path(directory).glob("step-*") if p.is_dir()), reverse=True)


def temporary(directory: Path, step: int, token: str) -> Path:
    """Where every rank writes the checkpoint of `step` (the same name on every rank: `token` is rank 0's)."""
    return Path(directory) / f".step-{step:09d}.{token}.tmp"


def settings(args, world_size: int, keys=(MODEL, RUN), replicas=None) -> dict:
    """What complete.json records about the run: the model, the run, the global batch, the world size.
    keys: the flags that name the model and the run (lesson 16's by default); replicas: the data-parallel
    replicas a global batch is split among (all the ranks unless a mesh has a tensor-parallel dimension)."""
    value = lambda k: str(getattr(args, k)) if isinstance(getattr(args, k), Path) else getattr(args, k)  # noqa: E731
    return {"model_args": {k: value(k) for k in keys[0]}, "run": {k: value(k) for k in keys[1]},
            "global_batch_size": (replicas or world_size) * args.batch_size, "world_size": world_size}


_staged_seconds = {}  # checkpoint directory -> how long async_save's copy took (Writer.stage), until read


def copy_seconds(tmp: Path) -> float:
    """How long dcp.async_save's copy to CPU memory took for the save into `tmp` (Writer.stage timed it);
    0 for a plain dcp.save, which stages nothing.  Read once."""
    return _staged_seconds.pop(str(tmp), 0.0)


class Writer(FileSystemWriter):
    """DCP's FileSystemWriter, which also writes, beside every file it wrote, that file's sha256 (FILE.sha256).

    write_data runs on every rank inside dcp.save (under dcp.async_save: in its thread or process), so each
    rank hashes its own file, all ranks at once.  DCP gathers the ranks' write results to rank 0, which then
    writes .metadata, only after every rank's write_data has returned: once rank 0's save is done, every
    rank's digest is on the disk, and publish() moves them into complete.json.  Being a FileSystemWriter,
    it is also what dcp.async_save stages with (FileSystemWriter is a BlockingAsyncStager: a copy to CPU
    memory before async_save returns)."""

    def stage(self, state_dict):
        """FileSystemWriter's stage() (the copy dcp.async_save makes before it returns, in the calling process),
        timed: Saves reports it."""
        begun = time.perf_counter()
        staged = super().stage(state_dict)
        _staged_seconds[str(self.path)] = time.perf_counter() - begun
        return staged

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)  # a future that is already done: the file is written
        for name in sorted({result.storage_data.relative_path for result in written.value()}):
            write_digest(sidecar(Path(self.path) / name), sha256_of(Path(self.path) / name), name)
        return written


def canonical_digest(content: dict) -> str:
    """The sha256 of complete.json's content written in one canonical way (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def publish(tmp: Path, info: dict, keep: int, damaged=()) -> Path:
    """Rank 0, after every rank's dcp.save/async_save finished: the ranks' digests and .metadata's into the
    marker, marker last, fsync, rename, rotate.  `damaged`: published checkpoints found damaged at the start
    (never counted among the `keep`)."""
    tmp = Path(tmp)
    if not (tmp / ".metadata").is_file():
        raise RuntimeError(f"{tmp} has no .metadata: DCP did not finish writing it")
    files = {}
    for p in sorted(tmp.iterdir()):
        if p.is_file() and p.suffix != ".sha256":
            if p.suffix == ".distcp" and not sidecar(p).is_file():
                raise RuntimeError(f"{p} has no {sidecar(p).name}: it was not written by the course's Writer")
            digest = sidecar(p).read_text().split()[0] if sidecar(p).is_file() else sha256_of(p)  # .metadata
            files[p.name] = {"bytes": p.stat().st_size, "sha256": digest}
    content = {"format": FORMAT, **info, "files": files}
    marker = tmp / MARKER
    with open(marker, "w") as f:
        json.dump({**content, "sha256": canonical_digest(content)}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())  # DCP's own files were fsynced by each rank (FileSystemWriter, sync_files=True)
    for digest in tmp.glob("*.sha256"):  # complete.json holds them now
        digest.unlink()
    fsync_dir(tmp)
    final = tmp.parent / tmp.name.split(".")[1]  # .step-000000006.TOKEN.tmp -> step-000000006
    if final.exists():  # a damaged one of an earlier run at the same step (skipped at the start)
        shutil.rmtree(final)
    os.replace(tmp, final)  # atomic: readers see the previous checkpoints, or these and the new one
    fsync_dir(final.parent)
    # the newest `keep` complete ones (one more in case the newest is damaged later); a damaged one older
    # than this one can never be loaded again
    complete = [d for d in final_dirs(final.parent) if d == final or (str(d) not in damaged and damage(d) is None)]
    for old in final_dirs(final.parent):
        if old in complete[keep:] or (old not in complete and old.name < final.name):
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_marker(path: Path):
    """(complete.json's content, None) if it is intact, else (None, why not)."""
    try:
        info = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        return None, f"no {MARKER}: never finished"
    except (OSError, ValueError) as e:
        return None, f"{MARKER} unreadable ({e})"
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        return None, "not a checkpoint of lesson 16 (or of an earlier version of it)"
    recorded = info.pop("sha256", None)
    if recorded != canonical_digest(info):
        return None, f"{MARKER}: its content differs from the sha256 it records"
    return info, None


def damage(path: Path):
    """Why the checkpoint directory `path` must not be loaded, or None if it is complete: complete.json
    intact, every file it lists there with its size (the files' bytes: share_intact)."""
    info, reason = read_marker(path)
    if reason:
        return reason
    for name, recorded in info["files"].items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != recorded["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, {recorded['bytes']} were written"
    return None


def published(directory: Path, say=print) -> list:
    """The complete checkpoints, newest first, as (path, complete.json's content); says what it skips."""
    directory, found = Path(directory), []
    for tmp in sorted(directory.glob(".step-*.tmp")):
        say(f"skipping unfinished checkpoint {tmp} (never published: a save was cut short)")
    for path in final_dirs(directory):
        reason = damage(path)
        if reason is None:
            found.append((path, read_marker(path)[0]))
        else:
            say(f"skipping checkpoint {path} (torn or invalid: {reason})")
    return found


def newest(directory: Path, say=print):
    """The newest complete checkpoint (path, complete.json's content) or (None, None); says what it skips."""
    found = published(directory, say)
    return found[0] if found else (None, None)


def share_intact(path: Path, info: dict, rank: int, world_size: int, say=None) -> bool:
    """Rank `rank` of `world_size`: its share of the checkpoint's files (every world_size-th, by name) hashed
    and compared with complete.json's digests.  A file that differs is named in one line."""
    from course.training.output import rank_print

    for name in sorted(info["files"])[rank::world_size]:
        if sha256_of(Path(path) / name) != info["files"][name]["sha256"]:
            (say or (lambda m: rank_print(rank, m)))(
                f"skipping checkpoint {path} (torn or invalid: {name}: its sha256 differs from the one in "
                f"{MARKER}: the file changed after it was written)")
            return False
    return True


def require_intact(chosen: list, resume, directory: Path, rank: int) -> None:
    """Every rank, after the verdicts: --resume and no checkpoint intact ends the run, rank 0 saying so."""
    if resume and chosen[0] is None:
        if rank == 0:
            from course.launching.cli import CourseError

            raise CourseError(f"--resume: no checkpoint in {Path(directory)} is intact (each is named above); "
                              f"remove the damaged ones, or start a new run with another --checkpoint-dir")
        raise SystemExit(1)


def newest_intact(directory: Path, resume, rank: int, world_size: int, device) -> list:
    """Every rank: lesson 16's choice of the checkpoint to resume from, for a lesson that composes it (22).

    Rank 0 lists the published checkpoints (with --resume) and names this run's temporary directories; every
    rank hashes its share of each one's files, newest first, and one all_reduce (MIN) of the verdicts tells
    every rank before any rank loads.  Returns [path or None, rank 0's token, [(path, complete.json), ...]]
    for Saves; --resume and none intact: one line, the end (require_intact)."""
    from course.training.output import rank_print

    chosen = [None, None, []]
    if rank == 0:
        chosen = [None, str(os.getpid()), published(directory, lambda m: rank_print(0, m)) if resume else []]
        remove_unfinished(directory)
    dist.broadcast_object_list(chosen, src=0)
    for path, saved in chosen[2]:
        intact = torch.tensor(float(share_intact(path, saved, rank, world_size)), device=device)
        dist.all_reduce(intact, op=dist.ReduceOp.MIN)
        if intact.item():
            chosen[0] = path
            break
    require_intact(chosen, resume, directory, rank)
    return chosen


def remove_unfinished(directory: Path) -> None:
    """Rank 0 at the start: the temporary directories of saves that never finished."""
    for tmp in Path(directory).glob(".step-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def check(args, world_size: int, keys=(MODEL, RUN), replicas=None) -> None:
    """Before any rank starts: the checkpoint directory agrees with --resume, the model and the batch
    (keys and replicas: as for settings)."""
    from course.launching.cli import CourseError

    args.checkpoint_dir = args.checkpoint_dir or args.run_dir / "checkpoints"
    directory, asked = args.checkpoint_dir, args.resume
    if args.resume == "if-any" and newest(directory, say=lambda *_: None)[0] is None:
        args.resume = None  # nothing to resume yet: a new run (unfinished saves are removed as for one)
    if args.resume:
        if not directory.is_dir():
            raise CourseError(f"--resume: the checkpoint dir {directory} does not exist; give the --checkpoint-dir "
                              f"of the run to resume, or leave out --resume to start a new run")
        path, info = newest(directory, say=lambda *_: None)
        if info is None:
            raise CourseError(f"--resume: {directory} holds no complete checkpoint; start a new run without "
                              f"--resume (and another --checkpoint-dir)")
        mine = settings(args, world_size, keys, replicas)
        differ = [f"--{k.replace('_', '-')} {info['model_args'].get(k)} -> {v}"
                  for k, v in mine["model_args"].items() if info["model_args"].get(k) != v]
        if differ:
            raise CourseError(f"the checkpoint in {directory} is of another model ({', '.join(differ)}); resume "
                              f"with the model flags it was saved with")
        differ = [f"--{k.replace('_', '-')} {info['run'].get(k)} -> {v}"
                  for k, v in mine["run"].items() if info["run"].get(k) != v]
        if differ:
            raise CourseError(f"the checkpoint in {directory} is of another run ({', '.join(differ)}); resume "
                              f"with the settings it was saved with")
        epochs = getattr(args, "epochs", None)  # lesson 22 counts steps only
        at_end = (epochs and info["epoch"] >= epochs) or (args.max_steps and info["step"] >= args.max_steps)
        # at the end, its files are hashed here (and every process does it): a damaged one would not be the
        # end, the ranks will skip it and train on from an older one
        if at_end and share_intact(path, info, 0, 1, say=lambda *_: None):
            end = (f"--max-steps {args.max_steps}" if args.max_steps and info["step"] >= args.max_steps
                   else f"--epochs {args.epochs}")
            if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0:  # once, also under torchrun
                print(f"nothing to train: the newest checkpoint in {directory} is at step {info['step']} (epoch "
                      f"{info['epoch']}) and this run ends at {end}; raise it to train on"
                      f"{', or --export the checkpoint' if hasattr(args, 'export') else ''}", flush=True)
            raise SystemExit(0)
        g = info["global_batch_size"]
        if mine["global_batch_size"] != g:
            n = replicas or world_size
            fix = (f"resume at {world_size} ranks with --batch-size {g // n}" if g % n == 0 else
                   f"{g} does not divide among {n} replicas: resume at a world size that divides {g}")
            raise CourseError(f"the checkpoint in {directory} was trained with global batch {g} "
                              f"({info['world_size']} ranks), this run's is {mine['global_batch_size']}; {fix}")
    elif directory.is_dir() and (final_dirs(directory) or (asked is None and any(directory.glob(".step-*.tmp")))):
        fix = "none of them is complete: remove them" if asked == "if-any" else "add --resume to go on from the newest"
        raise CourseError(f"{directory} already holds checkpoints; {fix}, or choose another --checkpoint-dir")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK):
            raise PermissionError("not writable")
    except OSError as e:
        raise CourseError(f"checkpoint dir {directory} cannot be written ({e.strerror or e}); choose another "
                          f"with --checkpoint-dir") from None


def export(args) -> Path:
    """One process, no process group: the newest intact checkpoint's model as one ordinary torch.save file.

    Every file of the checkpoint is hashed here (one process: all the shares); a damaged checkpoint is
    named and skipped, as at a resume.  dcp.load(no_dist=True) reads the shards of every rank that saved and
    assembles whole tensors into the plain model's state dict (the same as
    torch.distributed.checkpoint.format_utils.dcp_to_torch_save, which converts everything, optimizer
    included)."""
    import torch.distributed.checkpoint as dcp

    from course.launching.cli import CourseError, unwritable
    from course.models import ViT, build_model
    from course.training.output import save_weights

    directory, out = Path(args.checkpoint_dir or args.run_dir / "checkpoints"), Path(args.export)
    problem = "it is a directory" if out.is_dir() else unwritable(out.parent)  # before the checkpoint is read
    if problem:
        problem = f"{out.parent} is a file" if problem == "it is a file" else problem
        raise CourseError(f"--export {out} cannot be written ({problem}); give a file in a directory you can "
                          f"write, e.g. --export model.pt")
    if not directory.is_dir():
        raise CourseError(f"--export: the checkpoint dir {directory} does not exist; give it with --checkpoint-dir")
    path, info = next(((p, i) for p, i in published(directory) if share_intact(p, i, 0, 1, say=print)), (None, None))
    if path is None:
        raise CourseError(f"--export: {directory} holds no intact checkpoint to export")
    m = info["model_args"]
    model = ViT(m["patch"], m["width"], m["depth"], m["heads"]) if m["model"] == "vit" else build_model(m["model"], 0)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)  # whole tensors from all ranks' shards, in one process
    save_weights(out, state["model"])
    size = sum(v.numel() * v.element_size() for v in state["model"].values())
    print(f"exported the model of {path.name} (saved by {info['world_size']} ranks) to {out}: {size / 2 ** 20:.3f} "
          f"MB; load it with torch.load(path, weights_only=True) into {m['model']} "
          f"(patch {m['patch']}, width {m['width']}, depth {m['depth']}, heads {m['heads']})", flush=True)
    return Path(out)


class Saves:
    """The checkpoint being written: every rank waits for its own part; rank 0 then publishes it.

    A synchronous save is finished when dcp.save returns.  dcp.async_save (torch 2.14.1,
    state_dict_saver.async_save) stages, i.e. copies this rank's state to CPU memory, before it returns, and
    runs dcp.save, its planning collectives included, in its executor (a thread, or with
    AsyncCheckpointerType.PROCESS a process of its own per rank, started at the first save); its future is
    done when that save is, which on every rank comes after rank 0 has written .metadata.  The time the
    training loop spends in a save is its stall: waiting for the previous save, then get_state_dict and the
    save call (for async_save: the copy, which Writer.stage times, and the hand-over to the executor)."""

    def __init__(self, rank: int, keep: int, chosen: list):
        self.rank, self.keep, self.pending, self.published = rank, keep, None, []
        self.stalls, self.calls, self.copies, self.waits, self.begun, self.waited = [], [], [], [], 0.0, 0.0
        # the published checkpoints newer than the one resumed from were all skipped at the start as damaged
        self.damaged = {str(p) for p, _ in chosen[2] if chosen[0] is None or p.name > Path(chosen[0]).name}

    def begin(self) -> None:
        """Every rank, as a save begins: the clock starts; a save still running is waited for (and published)."""
        self.begun = time.perf_counter()
        self.wait()
        self.waited = time.perf_counter()

    def started(self, result, tmp: Path, info: dict) -> None:
        """Every rank, once dcp.save (its Metadata) or dcp.async_save (a Future) has returned."""
        self.calls.append(time.perf_counter() - self.waited)
        self.copies.append(copy_seconds(tmp))
        self.pending = (result if isinstance(result, Future) else None, tmp, info)
        if self.pending[0] is None:
            self.wait()  # rank 0: every rank has written: complete.json, then the rename
        self.waits.append(self.waited - self.begun)
        self.stalls.append(time.perf_counter() - self.begun)

    def poll(self) -> None:
        """Rank 0, after a step: publish the asynchronous save if it is done (never waits)."""
        if self.rank == 0 and self.pending is not None and (self.pending[0] is None or self.pending[0].done()):
            self.wait()

    def wait(self) -> None:
        """Every rank before the next save and at the end: this rank's part written; rank 0 publishes."""
        if self.pending is None:
            return
        future, tmp, info = self.pending
        self.pending = None
        if future is not None:
            future.result()  # raises here if the background save failed
        if self.rank == 0:
            final = publish(tmp, info, self.keep, self.damaged)
            self.damaged.discard(str(final))
            self.published.append(str(final))
            print(f"[rank 0] checkpoint {final} (step {info['step']})", flush=True)

    def metrics(self) -> dict:
        """What metrics.json records about the saves, in seconds per save."""
        return {"checkpoints": self.published, "save_stall_seconds": self.stalls,
                "save_call_seconds": self.calls, "save_copy_seconds": self.copies, "save_wait_seconds": self.waits}

    def report(self, executor) -> None:
        """Rank 0: how long the training loop waited for its saves, and for what."""
        ms = lambda xs: f"{1000 * sum(xs) / max(len(xs), 1):.1f} ms"  # noqa: E731
        if not executor:
            print(f"checkpoints: {len(self.stalls)} with dcp.save (the loop writes); the training loop waited "
                  f"{ms(self.stalls)} per save (most {1000 * max(self.stalls, default=0):.1f} ms)", flush=True)
            return
        print(f"checkpoints: {len(self.stalls)} with dcp.async_save (a {executor} writes); the training loop "
              f"waited {ms(self.stalls)} per save (most {1000 * max(self.stalls, default=0):.1f} ms): "
              f"{ms(self.copies)} in async_save's copy to CPU memory, "
              f"{ms([c - s for c, s in zip(self.calls, self.copies)])} in the rest of get_state_dict and the "
              f"async_save call, {ms(self.waits)} for the previous save to finish", flush=True)


def add_args(p, every=100, extras=True):
    """Lesson 16's checkpoint flags (extras: --async-save and --export too); every: --checkpoint-every's
    default (None: only at a stop signal, and at the end when given)."""
    from course.launching.cli import positive_int

    p.add_argument("--checkpoint-every", type=positive_int, default=every, metavar="STEPS",
                   help="save a checkpoint every this many steps (and always at the end)" if every else
                        "save a checkpoint every this many steps, and at the end (default: only at a stop "
                        "signal, SIGUSR1 or SIGTERM)")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="where the checkpoints go (default: RUN_DIR/checkpoints)")
    p.add_argument("--keep", type=positive_int, default=2, help="checkpoints kept (the newest ones)")
    p.add_argument("--resume", nargs="?", const="yes", default=None, choices=("yes", "if-any"),
                   help="go on from the newest intact checkpoint in --checkpoint-dir, at any world size; "
                        "--resume if-any: start a new run when there is none yet (a job submitted again)")
    if not extras:
        return p
    p.add_argument("--async-save", nargs="?", const="thread", default=None, choices=("thread", "process"),
                   help="dcp.async_save: copy the state to CPU memory, then write it while training goes on, in "
                        "a background thread (the default) or a background process per rank")
    p.add_argument("--export", type=Path, default=None, metavar="PATH",
                   help="write the newest intact checkpoint's model to PATH as one ordinary file (one process), "
                        "then stop")
    return p
