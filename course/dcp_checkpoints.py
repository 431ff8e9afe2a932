"""Lesson 16's checkpoint directories: published atomically, checked before use, resharded, exported.

What a checkpoint holds and how each rank saves and loads its shards (torch.distributed.checkpoint) is
lesson 16's idea and stays in the lesson; this module is the file plumbing around it:
- a checkpoint is a directory, step-NNNNNNNNN/, written by every rank under a temporary name
  (.step-NNNNNNNNN.TOKEN.tmp/); publish() (rank 0, once every rank's files and DCP's .metadata are written)
  writes complete.json LAST (the run's settings, the position in training, every file's size), flushes it
  to the disk and renames the directory into place: a crash before that leaves a temporary directory that
  no run ever loads; it then keeps the newest --keep complete checkpoints and removes damaged ones older
  than the new one;
- newest(): the newest published checkpoint whose complete.json lists files that are all there with their
  sizes (a file cut short by a full disk or a copy is caught); damaged or unfinished ones are reported and
  skipped;
- check(): before any rank starts: --resume needs a directory with a complete checkpoint of the same model
  and global batch (--resume if-any starts a new run when there is none yet: a job submitted again); a
  checkpoint already at --max-steps or --epochs leaves nothing to train (one line, exit 0); a run without
  --resume refuses a directory that already holds checkpoints;
- export(): the newest checkpoint's model, loaded in one process (DCP reassembles every parameter from the
  shards of all ranks), written as one ordinary state dict that torch.load(weights_only=True) reads.
"""
import json
import os
import shutil
import warnings
from pathlib import Path

from course.checkpoints import fsync_dir

MARKER = "complete.json"
FORMAT = "16_distributed_checkpoint/1"
# A checkpoint belongs to one model: these must agree to load it (DCP reshards, it does not reshape)
MODEL = ("model", "patch", "width", "depth", "heads")
# and to one training run: the same global batches in the same order
RUN = ("dataset", "lr", "seed", "train_samples", "clip_grad_norm", "precision")


def final_dirs(directory: Path) -> list:
    """Published checkpoints, newest (highest step) first."""
    return sorted((p for p in Path(directory).glob("step-*") if p.is_dir()), reverse=True)


def temporary(directory: Path, step: int, token: str) -> Path:
    """Where every rank writes the checkpoint of `step` (the same name on every rank: `token` is rank 0's)."""
    return Path(directory) / f".step-{step:09d}.{token}.tmp"


def settings(args, world_size: int) -> dict:
    """What complete.json records about the run: the model, the run, the global batch, the world size."""
    return {"model_args": {k: getattr(args, k) for k in MODEL}, "run": {k: getattr(args, k) for k in RUN},
            "global_batch_size": world_size * args.batch_size, "world_size": world_size}


def publish(tmp: Path, info: dict, keep: int) -> Path:
    """Rank 0, after every rank's dcp.save/async_save finished: marker last, fsync, rename, rotate."""
    tmp = Path(tmp)
    if not (tmp / ".metadata").is_file():
        raise RuntimeError(f"{tmp} has no .metadata: DCP did not finish writing it")
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    marker = tmp / MARKER
    with open(marker, "w") as f:
        json.dump({"format": FORMAT, **info, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())  # DCP's own files were fsynced by each rank (FileSystemWriter, sync_files=True)
    fsync_dir(tmp)
    final = tmp.parent / tmp.name.split(".")[1]  # .step-000000006.TOKEN.tmp -> step-000000006
    if final.exists():  # a damaged one of an earlier run at the same step (newest() skipped it)
        shutil.rmtree(final)
    os.replace(tmp, final)  # atomic: readers see the previous checkpoints, or these and the new one
    fsync_dir(final.parent)
    # the newest `keep` complete ones (one more in case the newest is damaged later); a damaged one older
    # than this one can never be loaded again
    complete = [d for d in final_dirs(final.parent) if damage(d) is None]
    for old in final_dirs(final.parent):
        if old in complete[keep:] or (old not in complete and old.name < final.name):
            shutil.rmtree(old, ignore_errors=True)
    return final


def damage(path: Path):
    """Why the checkpoint directory `path` must not be loaded, or None if it is complete."""
    try:
        info = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        return f"no {MARKER}: never finished"
    except (OSError, ValueError) as e:
        return f"{MARKER} unreadable ({e})"
    if info.get("format") != FORMAT:
        return "not a checkpoint of lesson 16"
    for name, size in info["files"].items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
    return None


def newest(directory: Path, say=print):
    """The newest complete checkpoint (path, complete.json's content) or (None, None); says what it skips."""
    directory = Path(directory)
    for tmp in sorted(directory.glob(".step-*.tmp")):
        say(f"skipping unfinished checkpoint {tmp} (never published: a save was cut short)")
    for path in final_dirs(directory):
        reason = damage(path)
        if reason is None:
            return path, json.loads((path / MARKER).read_text())
        say(f"skipping checkpoint {path} (torn or invalid: {reason})")
    return None, None


def remove_unfinished(directory: Path) -> None:
    """Rank 0 at the start: the temporary directories of saves that never finished."""
    for tmp in Path(directory).glob(".step-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def check(args, world_size: int) -> None:
    """Before any rank starts: the checkpoint directory agrees with --resume, the model and the batch."""
    from course.cli import CourseError

    directory, asked = args.checkpoint_dir, args.resume
    if args.resume == "if-any" and newest(directory, say=lambda *_: None)[0] is None:
        args.resume = None  # nothing to resume yet: a new run (unfinished saves are removed as for one)
    if args.resume:
        if not directory.is_dir():
            raise CourseError(f"--resume: the checkpoint dir {directory} does not exist; give the --checkpoint-dir "
                              f"of the run to resume, or leave out --resume to start a new run")
        _, info = newest(directory, say=lambda *_: None)
        if info is None:
            raise CourseError(f"--resume: {directory} holds no complete checkpoint; start a new run without "
                              f"--resume (and another --checkpoint-dir)")
        mine = settings(args, world_size)
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
        if info["epoch"] >= args.epochs or (args.max_steps and info["step"] >= args.max_steps):
            end = (f"--max-steps {args.max_steps}" if args.max_steps and info["step"] >= args.max_steps
                   else f"--epochs {args.epochs}")
            if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0:  # once, also under torchrun
                print(f"nothing to train: the newest checkpoint in {directory} is at step {info['step']} (epoch "
                      f"{info['epoch']}) and this run ends at {end}; raise it to train on, or --export the "
                      f"checkpoint", flush=True)
            raise SystemExit(0)
        g = info["global_batch_size"]
        if mine["global_batch_size"] != g:
            fix = (f"resume at {world_size} ranks with --batch-size {g // world_size}" if g % world_size == 0 else
                   f"{g} does not divide among {world_size} ranks: resume at a world size that divides {g}")
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


def export(directory: Path, out: Path) -> Path:
    """One process, no process group: the newest checkpoint's model as one ordinary torch.save file.

    dcp.load(no_dist=True) reads the shards of every rank that saved and assembles whole tensors into the
    plain model's state dict (the same as torch.distributed.checkpoint.format_utils.dcp_to_torch_save, which
    converts everything, optimizer included)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from course.cli import CourseError
    from course.models import ViT, build_model
    from course.output import save_weights

    if not Path(directory).is_dir():
        raise CourseError(f"--export: the checkpoint dir {directory} does not exist; give it with --checkpoint-dir")
    path, info = newest(directory)
    if path is None:
        raise CourseError(f"--export: {directory} holds no complete checkpoint to export")
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
    """The checkpoint being written: every rank waits for its own part (wait()); rank 0 then publishes it.

    A synchronous save is finished when dcp.save returns; an asynchronous one when its future is done,
    which on rank 0 (DCP's coordinator, which writes .metadata after every rank reported its files) means
    on every rank.  The time the training loop spends in a save, waiting included, is its stall."""

    def __init__(self, rank: int, keep: int):
        self.rank, self.keep, self.pending, self.published, self.stalls = rank, keep, None, [], []

    def started(self, future, tmp: Path, info: dict) -> None:
        self.pending = (future, tmp, info)

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
            final = publish(tmp, info, self.keep)
            self.published.append(str(final))
            print(f"[rank 0] checkpoint {final} (step {info['step']})", flush=True)


def add_args(p):
    """Lesson 16's checkpoint flags."""
    from course.cli import positive_int

    p.add_argument("--checkpoint-every", type=positive_int, default=100, metavar="STEPS",
                   help="save a checkpoint every this many steps (and always at the end)")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="where the checkpoints go (default: RUN_DIR/checkpoints)")
    p.add_argument("--keep", type=positive_int, default=2, help="checkpoints kept (the newest ones)")
    p.add_argument("--resume", nargs="?", const="yes", default=None, choices=("yes", "if-any"),
                   help="go on from the newest complete checkpoint in --checkpoint-dir, at any world size; "
                        "--resume if-any: start a new run when there is none yet (a job submitted again)")
    p.add_argument("--async-save", action="store_true",
                   help="dcp.async_save: write checkpoints in a background thread while training goes on")
    p.add_argument("--export", type=Path, default=None, metavar="PATH",
                   help="write the newest checkpoint's model to PATH as one ordinary file (one process), then stop")
    return p


def report(stalls: list, asynchronous: bool) -> None:
    """Rank 0: how long the training loop waited for its saves."""
    kind = "async_save (a thread writes)" if asynchronous else "save (the loop writes)"
    mean = sum(stalls) / len(stalls) if stalls else 0.0
    print(f"checkpoints: {len(stalls)} with dcp.{kind}; the training loop waited {mean * 1000:.1f} ms per save "
          f"(most {max(stalls, default=0) * 1000:.1f} ms)", flush=True)
