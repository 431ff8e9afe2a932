"""MNIST-format datasets: where they come from, how they are prepared once, how lessons load them.

A prepared data dir holds, per dataset, torchvision's layout (so torchvision can read it too):

    <data_dir>/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte
    <data_dir>/FashionMNIST/READY          (written last: the files below it were checked)

Preparation runs once (on a laptop or a login node), never on every rank: lessons only *load* and, when the
data is missing, stop with one line naming the command that prepares it.  Two preparations at once (two
jobs, two terminals) cannot corrupt the data dir: they take a file lock, build in a temporary directory and
rename it into place, which is atomic.
"""
import fcntl
import json
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_tools.idx import IMAGES_MAGIC, LABELS_MAGIC, IDXError, read_idx, write_idx

REPO_ROOT = Path(__file__).resolve().parents[1]
PREPARE_SCRIPT = "data_tools/prepare_data.py"


@dataclass(frozen=True)
class DatasetSpec:
    name: str            # the name on the command line
    folder: str          # torchvision's folder name under the data dir
    mean: float          # per-pixel mean and std of the training images, for normalization
    std: float
    system_copy: str     # where a Debian package puts the .gz files ("" if no package exists)
    classes: tuple


DATASETS = {
    "fashion-mnist": DatasetSpec(
        "fashion-mnist", "FashionMNIST", 0.2860, 0.3530, "/usr/share/datasets/fashion-mnist",
        ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")),
    "mnist": DatasetSpec(
        "mnist", "MNIST", 0.1307, 0.3081, "",
        tuple(str(d) for d in range(10))),
}
# Fashion-MNIST is the default because a machine without general internet access can still install it from
# Debian's registry (package dataset-fashion-mnist); MNIST's download mirrors are often unreachable from
# compute nodes.  Same format, same sizes, same code: `--dataset mnist` switches.
DEFAULT_DATASET = "fashion-mnist"

# split -> (images file, labels file, number of samples)
SPLITS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", 60_000),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 10_000),
}
FILES = [name for images, labels, _ in SPLITS.values() for name in (images, labels)]


class DataError(RuntimeError):
    """The dataset is missing or broken; the message says what to run."""


def default_data_dir() -> Path:
    """`$COURSE_DATA_DIR` if set (e.g. a scratch filesystem on a cluster), else `data/` in the repository."""
    return Path(os.environ.get("COURSE_DATA_DIR", REPO_ROOT / "data"))


def named(data_dir) -> str:
    """The data dir as a message names it: with "(COURSE_DATA_DIR)" when that variable chose it."""
    from_env = os.environ.get("COURSE_DATA_DIR")
    return f"{data_dir} (COURSE_DATA_DIR)" if from_env and Path(from_env) == Path(data_dir) else str(data_dir)


def spec(dataset: str) -> DatasetSpec:
    try:
        return DATASETS[dataset]
    except KeyError:
        raise DataError(f"unknown dataset {dataset!r}; choose one of: {', '.join(DATASETS)}") from None


def prepare_command(dataset: str, data_dir: Path) -> str:
    cmd = f"python {PREPARE_SCRIPT} --dataset {dataset}"
    if Path(data_dir).resolve() != default_data_dir().resolve():
        cmd += f" --data-dir {data_dir}"
    return cmd


def read_split(raw_dir, split: str):
    """Read and validate one split from a directory holding the IDX files (plain or .gz)."""
    images_name, labels_name, n = SPLITS[split]
    raw_dir = Path(raw_dir)

    def find(name):
        for candidate in (raw_dir / name, raw_dir / (name + ".gz")):
            if candidate.exists():
                return candidate
        raise IDXError(f"{raw_dir / name}: file not found")

    images = read_idx(find(images_name), IMAGES_MAGIC, (n, 28, 28))
    labels = read_idx(find(labels_name), LABELS_MAGIC, (n,))
    if labels.max() > 9:
        raise IDXError(f"{find(labels_name)}: label {labels.max()} out of range 0-9")
    return images, labels


def load_split(dataset: str, split: str, data_dir=None):
    """The split as (images uint8 [N, 28, 28], labels int64 [N]) torch tensors, from a prepared data dir."""
    import torch

    data_dir = Path(data_dir) if data_dir else default_data_dir()
    folder = data_dir / spec(dataset).folder
    if not (folder / "READY").exists():
        raise DataError(f"{dataset} is not prepared in {named(data_dir)}; run: {prepare_command(dataset, data_dir)}")
    try:
        images, labels = read_split(folder / "raw", split)
    except IDXError as e:
        raise DataError(f"{dataset} in {data_dir} is damaged ({e}); rebuild it with: "
                        f"{prepare_command(dataset, data_dir)} --force") from None
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))


def require(dataset: str, data_dir=None) -> None:
    """Fail fast (before any process is started) if the dataset is not prepared, or visibly damaged."""
    data_dir = Path(data_dir) if data_dir else default_data_dir()
    folder = data_dir / spec(dataset).folder
    if not (folder / "READY").exists():
        raise DataError(f"{dataset} is not prepared in {named(data_dir)}; run: {prepare_command(dataset, data_dir)}")
    # Headers and sizes only (a few bytes per file): a truncated or foreign file is one message here, in the
    # launching process, rather than one per rank; load_split() still validates everything it reads.
    for images, labels, n in SPLITS.values():
        for name, magic, shape in ((images, IMAGES_MAGIC, (n, 28, 28)), (labels, LABELS_MAGIC, (n,))):
            problem = _idx_header_problem(folder / "raw" / name, magic, shape)
            if problem:
                raise DataError(f"{dataset} in {data_dir} is damaged ({folder / 'raw' / name}: {problem}); "
                                f"rebuild it with: {prepare_command(dataset, data_dir)} --force")


def _idx_header_problem(path: Path, magic: int, shape: tuple):
    """What is wrong with an (uncompressed) IDX file's header and size, or None."""
    import struct

    header_size = 4 + 4 * len(shape)
    try:
        with open(path, "rb") as f:
            header = f.read(header_size)
        size = path.stat().st_size
    except FileNotFoundError:
        return "file not found"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if len(header) < 4 or struct.unpack(">I", header[:4])[0] != magic:
        found = f"0x{struct.unpack('>I', header[:4])[0]:08x}" if len(header) >= 4 else "none"
        return f"magic number {found}, expected 0x{magic:08x} (wrong file, or not an IDX file)"
    if len(header) < header_size or struct.unpack(f">{len(shape)}I", header[4:]) != tuple(shape):
        return f"shape is not {tuple(shape)}"
    expected = header_size + int(np.prod(shape))
    if size != expected:
        return f"{'truncated' if size < expected else 'has trailing bytes'}: {size} bytes, expected {expected}"
    return None


# ----------------------------------------------------------------------------------------- preparation

def _lock(data_dir: Path, folder: str):
    """The preparation's lock file, held: a second preparation waits here, then finds READY."""
    data_dir.mkdir(parents=True, exist_ok=True)
    lock = open(data_dir / f".{folder}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def _candidate_dirs(source: Path, folder: str):
    """A user-named source may be the raw dir itself, a torchvision root, or a dataset folder."""
    return [source, source / "raw", source / folder / "raw", source / folder]


def _from_directory(source: Path, folder: str, dest_raw: Path) -> str:
    errors = []
    for candidate in _candidate_dirs(source, folder):
        if not candidate.is_dir():
            continue
        try:
            splits = {split: read_split(candidate, split) for split in SPLITS}
        except IDXError as e:
            errors.append(str(e))
            continue
        for split, (images, labels) in splits.items():
            images_name, labels_name, _ = SPLITS[split]
            write_idx(dest_raw / images_name, images)
            write_idx(dest_raw / labels_name, labels)
        return str(candidate)
    detail = errors[0] if errors else "no IDX files found there"
    raise DataError(f"{source} does not hold a usable dataset: {detail}")


def _download(spec_: DatasetSpec, dest_root: Path, timeout: float) -> str:
    """torchvision's mirrors, with a short timeout so an offline node fails in seconds, not minutes."""
    import torchvision

    cls = {"fashion-mnist": torchvision.datasets.FashionMNIST, "mnist": torchvision.datasets.MNIST}[spec_.name]
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout)
    try:
        for train in (True, False):
            cls(root=str(dest_root), train=train, download=True)
    except Exception as e:  # URLError, timeouts, checksum failures: all mean "not from here"
        raise DataError(f"could not download {spec_.name} ({type(e).__name__}: {e}). Offline? "
                        + ("Install Debian's copy: apt-get install dataset-fashion-mnist, or "
                           if spec_.system_copy else "")
                        + f"copy the four IDX files from elsewhere and run: python {PREPARE_SCRIPT} "
                          f"--dataset {spec_.name} --source DIR") from None
    finally:
        socket.setdefaulttimeout(old)
    return "torchvision download"


def prepare(dataset: str, data_dir=None, source=None, force: bool = False,
            download_timeout: float = 15.0, log=print) -> Path:
    """Make `dataset` ready in `data_dir`; return its folder.  Idempotent and safe to run concurrently.

    Sources, in order: `source` (a directory the user names), an already prepared data dir, the system
    copy from a Debian package, torchvision's download.
    """
    s = spec(dataset)
    data_dir = Path(data_dir) if data_dir else default_data_dir()
    final = data_dir / s.folder
    # Already prepared: checked and used without writing anything, not even the lock file, so that a data
    # dir a trainer prepared once serves a class read-only.  READY appears only with the complete folder (an
    # atomic rename below), so a reader that sees it never sees half a preparation.
    if (final / "READY").exists() and not force and source is None:
        return _already_prepared(dataset, data_dir, final, log)
    try:
        lock = _lock(data_dir, s.folder)
    except OSError as e:
        raise DataError(f"{dataset} is not prepared in {named(data_dir)}, and it cannot be prepared there "
                        f"({e.strerror or e}: {e.filename or data_dir}); ask whoever prepared the shared data to "
                        f"run: {prepare_command(dataset, data_dir)}, or set COURSE_DATA_DIR to a directory of "
                        f"your own") from None
    with lock:  # closing it releases the lock
        if final.exists() and not force and source is None:
            if (final / "READY").exists():  # prepared by another process while this one waited for the lock
                return _already_prepared(dataset, data_dir, final, log)
            raise DataError(f"{final} exists but was not prepared by this tool (no READY file); "
                            f"rebuild it with: {prepare_command(dataset, data_dir)} --force")

        tmp = Path(tempfile.mkdtemp(prefix=f".{s.folder}-", dir=data_dir))
        try:
            raw = tmp / s.folder / "raw"
            raw.mkdir(parents=True)
            if source is not None:
                origin = _from_directory(Path(source), s.folder, raw)
            elif s.system_copy and Path(s.system_copy).is_dir():
                origin = _from_directory(Path(s.system_copy), s.folder, raw)
            else:
                origin = _download(s, tmp, download_timeout)
                for gz in raw.glob("*.gz"):
                    gz.unlink()
            for split in SPLITS:  # validate what we are about to publish, whatever its origin
                read_split(raw, split)
            (tmp / s.folder / "READY").write_text(json.dumps({"dataset": dataset, "source": origin}) + "\n")
            if final.exists():
                shutil.rmtree(final)  # only reached with force or source: the user asked for a rebuild
            os.rename(tmp / s.folder, final)  # atomic: readers see the old folder or the complete new one
        except IDXError as e:
            raise DataError(str(e)) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"{dataset}: prepared in {final} (from {origin})")
    return final


def _already_prepared(dataset: str, data_dir: Path, final: Path, log) -> Path:
    """A prepared folder, every split read and validated (reading only)."""
    try:
        for split in SPLITS:
            read_split(final / "raw", split)
    except IDXError as e:
        raise DataError(f"{final} is damaged ({e}); rebuild it with: "
                        f"{prepare_command(dataset, data_dir)} --force") from None
    log(f"{dataset}: already prepared in {final}")
    return final


# ----------------------------------------------------------------------------------------- in memory

class InMemoryMNIST:
    """A whole split held as one normalized float tensor [N, 1, 28, 28] (and labels), on CPU or a GPU.

    The dataset is 47 MB as uint8 and 188 MB as float32: it fits in memory (and on any GPU), so the hot
    path is one tensor index per batch instead of N per-sample PIL -> ToTensor conversions.  Index it with a
    list of indices to get a whole batch at once; `batches()` below is the fast way through an epoch.
    """

    def __init__(self, dataset: str, split: str, data_dir=None, device="cpu", limit: int = 0):
        import torch

        images, labels = load_split(dataset, split, data_dir)
        if limit:
            images, labels = images[:limit], labels[:limit]
        s = spec(dataset)
        self.images = ((images.float().div_(255) - s.mean) / s.std).unsqueeze(1).to(device)
        self.labels = labels.to(device)
        self._torch = torch

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        if isinstance(index, list):  # a whole batch from a BatchSampler
            index = self._torch.as_tensor(index, device=self.labels.device)
        return self.images[index], self.labels[index]


def batches(dataset, sampler, batch_size: int, drop_last: bool = False):
    """Whole batches (images, labels) of an InMemoryMNIST, in the order the sampler gives.

    The sampler's order (RandomSampler, DistributedSampler, a list of indices) becomes one index tensor per
    pass (sampler_order below), on the dataset's device.  The labels of the pass are gathered at once; each
    batch is then one index_select of the images and a slice of those labels.  A DataLoader over a
    BatchSampler gives the same batches, bit for bit, 3-5x slower: a list of Python ints and a DataLoader
    step per batch (benchmarks/bench.py, section input).  As with a DataLoader, call `sampler.set_epoch(e)`
    before the loop.
    """
    return _Batches(dataset, sampler, batch_size, drop_last)


class _Batches:
    def __init__(self, dataset, sampler, batch_size: int, drop_last: bool):
        self.dataset, self.sampler, self.batch_size, self.drop_last = dataset, sampler, batch_size, drop_last

    def __len__(self):
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        images, labels = self.dataset.images, self.dataset.labels
        order = sampler_order(self.sampler)
        if self.drop_last:
            order = order[:len(order) - len(order) % self.batch_size]
        if not len(order):
            return
        order = order.to(labels.device)
        # The labels of the whole pass in one gather (8 bytes a sample): one index_select per batch fewer.
        pass_labels = labels.index_select(0, order)
        for index, batch_labels in zip(order.split(self.batch_size), pass_labels.split(self.batch_size)):
            yield images.index_select(0, index), batch_labels


def sampler_order(sampler):
    """The indices one pass over `sampler` yields, as an int64 tensor, exactly as iterating it would.

    torch's own samplers (SequentialSampler, RandomSampler without replacement, DistributedSampler) are
    computed here as tensors with the same generator calls as their __iter__ (torch 2.x): their __iter__
    turns a tensor into 60 000 Python ints, which an epoch would then read back one by one, a quarter of its
    time.  Anything else (a list, a range, a custom sampler, a subclass) is iterated.
    """
    import torch
    from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

    kind = type(sampler)
    if kind is SequentialSampler:
        return torch.arange(len(sampler.data_source))
    if kind is RandomSampler and not sampler.replacement:
        n, wanted = len(sampler.data_source), sampler.num_samples
        generator = sampler.generator
        if generator is None:  # what RandomSampler does: a fresh generator seeded from the global one
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            generator = torch.Generator()
            generator.manual_seed(seed)
        parts = [torch.randperm(n, generator=generator) for _ in range(wanted // n)]
        parts.append(torch.randperm(n, generator=generator)[:wanted % n])
        return torch.cat(parts) if len(parts) > 1 else parts[0]
    if kind is DistributedSampler:
        n = len(sampler.dataset)
        if sampler.shuffle:  # the same permutation on every rank: seed + epoch
            g = torch.Generator()
            g.manual_seed(sampler.seed + sampler.epoch)
            indices = torch.randperm(n, generator=g)
        else:
            indices = torch.arange(n)
        if sampler.total_size > n:  # pad with the first indices again (repeated if need be)
            padding = sampler.total_size - n
            indices = torch.cat([indices, indices.repeat(-(-padding // n))[:padding]])
        # every num_replicas-th from this rank's, up to total_size (drop_last: the tail is cut here)
        return indices[sampler.rank:sampler.total_size:sampler.num_replicas].clone()
    return torch.from_numpy(np.fromiter(sampler, dtype=np.int64))


def main_prepare(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog=PREPARE_SCRIPT,
        description="Prepare MNIST or Fashion-MNIST once into a data dir (run on a laptop or a login node, "
                    "not on every rank).")
    p.add_argument("--dataset", default=DEFAULT_DATASET, choices=sorted(DATASETS),
                   help=f"which dataset (default: {DEFAULT_DATASET})")
    p.add_argument("--data-dir", type=Path, default=None,
                   help=f"where to put it (default: $COURSE_DATA_DIR or {default_data_dir()})")
    p.add_argument("--source", type=Path, default=None,
                   help="a directory that already holds the four IDX files (.gz or plain)")
    p.add_argument("--force", action="store_true", help="rebuild even if the data dir looks prepared")
    p.add_argument("--download-timeout", type=float, default=15.0, metavar="S",
                   help="seconds before a download attempt gives up (default: 15)")
    args = p.parse_args(argv)
    try:
        prepare(args.dataset, args.data_dir, args.source, args.force, args.download_timeout)
    except (DataError, OSError) as e:
        print(f"{PREPARE_SCRIPT}: error: {e}", file=sys.stderr)
        return 1
    return 0
