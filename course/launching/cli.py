"""The command line every lesson shares, and its checks: bad input is one line and a non-zero exit."""
import argparse
import os
import sys
from pathlib import Path

from data_tools.datasets import DATASETS, DEFAULT_DATASET, DataError

MODELS = ("mlp", "cnn")
QUICK_TRAIN_SAMPLES = 12_800


class CourseError(RuntimeError):
    """A problem the user can fix; printed as one line, never as a traceback."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message; we print one line that says what to do
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _whole_number(text: str, least: int, says: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} must be {says}")
    return value


def positive_int(text: str) -> int:
    return _whole_number(text, 1, "at least 1")


def non_negative_int(text: str) -> int:
    """A whole number of steps or samples, 0 allowed (0 steps of warmup: none)."""
    return _whole_number(text, 0, "0 or more")


def _number(text: str, zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 0 if zero else value > 0):
        raise argparse.ArgumentTypeError(f"{value} must be {'0 or more' if zero else 'greater than 0'}")
    return value


def positive_float(text: str) -> float:
    return _number(text, zero=False)


def non_negative_float(text: str) -> float:
    """A time that may be 0 (0 ms of simulated compute: none)."""
    return _number(text, zero=True)


class NprocGiven(argparse.Action):
    """--nproc N typed on the command line: also kept as `nproc_given`, for course/launching/environment.py,
    where an explicit --nproc inside a one-task srun step starts N ranks while the default leaves the step's task
    one rank."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        if values is not None:  # a positional with nargs="?" (lesson 7's world size) is called with its default
            namespace.nproc_given = values


def parser(doc: str, lesson: str, *, data=True, outputs=True, nproc_default=None,
           batch_help="per rank") -> Parser:
    """The shared options.  `doc` is the lesson's docstring (its first paragraph is the description)."""
    p = Parser(prog=f"python {lesson}", description=doc.strip().split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.set_defaults(lesson=Path(lesson).stem)  # the name metrics.json gives the run (course/training/results.py)
    if nproc_default is not None:
        p.add_argument("--nproc", type=positive_int, default=nproc_default, action=NprocGiven,
                       help="processes to spawn when started with plain python, also in a one-task srun step "
                            "such as srun --ntasks=1 --pty bash (ignored under torchrun; under srun with several tasks "
                            "they are the ranks)")
    if data:
        p.add_argument("--dataset", default=DEFAULT_DATASET, choices=sorted(DATASETS), help="which dataset")
        p.add_argument("--data-dir", type=Path, default=None,
                       help="prepared data dir (default: $COURSE_DATA_DIR or data/ in the repository)")
        p.add_argument("--model", default="mlp", choices=MODELS,
                       help="mlp: 784-128-10 as in the original workshop; cnn: the FashionMNIST guide's CNN")
        p.add_argument("--epochs", type=positive_int, default=2)
        p.add_argument("--batch-size", type=positive_int, default=64, help=f"samples per step, {batch_help}")
        p.add_argument("--lr", type=positive_float, default=0.01, help="SGD learning rate (momentum 0.9)")
        p.add_argument("--seed", type=int, default=0, help="one seed for weights and shuffling")
        p.add_argument("--train-samples", type=positive_int, default=None,
                       help="train on the first N samples only (default: all 60000)")
        p.add_argument("--max-steps", type=positive_int, default=None, help="stop after this many steps")
        p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                       help="auto: one GPU per rank when CUDA is available, else the CPU")
        p.add_argument("--quick", action="store_true",
                       help=f"laptop/test mode: 1 epoch on {QUICK_TRAIN_SAMPLES} samples "
                            "(still the whole test set)")
    if outputs:
        p.add_argument("--run-dir", type=Path, default=Path("runs") / Path(lesson).stem,
                       help="where rank 0 writes metrics, plots and weights")
    return p


def add_distributed(p: Parser) -> Parser:
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="auto: nccl on GPUs, gloo on the CPU")
    p.add_argument("--timeout", type=positive_float, default=120.0,
                   help="seconds a rank waits for the others (process group init and collectives)")
    return p


def add_loader(p: Parser, default: str = "dataloader") -> Parser:
    p.add_argument("--loader", default=default, choices=("dataloader", "memory"),
                   help="dataloader: a DataLoader over the DistributedSampler, the loop for any dataset; "
                        "memory: the same batches in the same order, gathered from the in-memory tensors "
                        "(faster)")
    return p


def add_sync(p: Parser, ddp: bool = False) -> Parser:
    """--sync, how lessons 4 and 5 average the gradients; with `ddp` (lesson 5) also torch DDP's way, and
    --compare and --bucket-cap-mb."""
    p.add_argument("--sync", default="per-param", choices=("per-param", "flat", "ddp")[:3 if ddp else 2],
                   help="per-param: one all_reduce per parameter tensor; flat: one for all gradients"
                        + ("; ddp: torch DDP's bucketed all_reduce during backward (lesson 6)" if ddp else ""))
    if ddp:
        p.add_argument("--compare", action="store_true",
                       help="train with all three --sync variants, one after the other, each into "
                            "LOG_DIR/<sync>, and print them side by side")
        p.add_argument("--bucket-cap-mb", type=positive_float, default=25.0,
                       help="--sync ddp: gradient bucket size in MB (the MLP's 0.4 MB fit in one bucket)")
    return p


def parse(p: Parser, argv=None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if getattr(args, "quick", False) and hasattr(args, "train_samples"):  # the image lessons' (data=True) --quick
        args.epochs = 1
        args.train_samples = args.train_samples or QUICK_TRAIN_SAMPLES
    if getattr(args, "train_samples", None):
        from data_tools.datasets import SPLITS

        available = SPLITS["train"][2]
        if args.train_samples > available:
            p.exit(2, f"{p.prog}: error: --train-samples {args.train_samples}: the training set of {args.dataset} "
                      f"has {available} samples; give at most {available}, or leave it out for all of them\n")
    log_dir = getattr(args, "log_dir", None)  # lessons 5 and test-profile always profile; others with --profile
    if log_dir is not None and (getattr(args, "profile", True) or getattr(args, "watch_hardware", False)):
        problem = unwritable(log_dir)
        if problem:
            p.exit(1, f"{p.prog}: error: log dir {log_dir} cannot be written ({problem}); "
                      f"choose another with --log-dir\n")
    run_dir = getattr(args, "run_dir", None)
    if run_dir is not None:
        problem = unwritable(run_dir)
        if problem:
            p.exit(2, f"{p.prog}: error: run dir {run_dir} cannot be written ({problem}); "
                      f"choose another with --run-dir\n")
    return args


def unwritable(directory: Path):
    """Why `directory` could not be created or written, or None; checked without creating it, so that a run
    that stops on bad input (no data, a wrong option) leaves no empty run dir behind (the writers create it).
    Its nearest existing parent is tried for real with a uniquely named probe directory, made and removed at
    once: only trying tells, for root or on a read-only mount, and a unique name cannot disturb the other
    ranks, which check the same run dir at the same moment."""
    import tempfile

    directory = Path(directory).absolute()
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return "it is a file" if existing == directory else f"{existing} is a file"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=existing))
    except OSError as e:
        return e.strerror or str(e)
    return None


def main(run, p: Parser, argv=None) -> None:
    """Parse, run, and turn the errors a user can fix into one line and exit code 1."""
    args = parse(p, argv)
    try:
        run(args)
    except (CourseError, DataError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        sys.exit(1)
