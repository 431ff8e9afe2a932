"""The chunked HDF5 copy of MNIST/Fashion-MNIST that lesson 11 streams: its layout, writing, checking.

Format "course-mnist-h5" version 1, written by data_tools/create_mnist_h5.py:

    /                attrs: format, version, dataset, chunk_samples, source_sha256
    /train/images    uint8 [60000, 28, 28]   stored in HDF5 chunks of [K, 28, 28]
    /train/labels    uint8 [60000]           stored in HDF5 chunks of [K]
    /test/images     uint8 [10000, 28, 28]   same chunking
    /test/labels     uint8 [10000]

With --checksum every chunk also carries a fletcher32 checksum, which HDF5 verifies on every read: a
damaged chunk then fails instead of feeding garbage, for up to a third of warm streaming speed (the
benchmark's hdf5 section measures both).  Without it (the default, as in h5py) a damaged byte goes unseen.
The file is written under a temporary name and renamed into place: readers see no file, the old one or the
complete new one, never half a file, and so can read without HDF5's file locks (locking=False), which fail
on some parallel filesystems (Lustre/GPFS: "unable to lock file"; for other HDF5 tools there, export
HDF5_USE_FILE_LOCKING=FALSE).  No torch here: creating the file on a login node should not import it.
"""
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_tools.datasets import DataError

FORMAT, VERSION = "course-mnist-h5", 1
CREATE_SCRIPT = "data_tools/create_mnist_h5.py"
DEFAULT_CHUNK_SAMPLES = 1000
SPLIT_SIZES = {"train": 60_000, "test": 10_000}


def default_h5_path(dataset: str, data_dir, chunk_samples: int = DEFAULT_CHUNK_SAMPLES) -> Path:
    return Path(data_dir) / f"{dataset}-chunk{chunk_samples}.h5"


def create_command(dataset: str, chunk_samples: int = DEFAULT_CHUNK_SAMPLES, output=None,
                   checksum: bool = False) -> str:
    cmd = f"python {CREATE_SCRIPT} --dataset {dataset}"
    if chunk_samples != DEFAULT_CHUNK_SAMPLES:
        cmd += f" --chunk-samples {chunk_samples}"
    if checksum:
        cmd += " --checksum"
    if output is not None:
        cmd += f" --output {output}"
    return cmd


def source_sha256(splits: dict) -> str:
    """A fingerprint of the source arrays: a file made from other data (or another dataset) differs."""
    h = hashlib.sha256()
    for split in sorted(splits):
        images, labels = splits[split]
        h.update(split.encode())
        h.update(np.ascontiguousarray(images, dtype=np.uint8).tobytes())
        h.update(np.ascontiguousarray(labels, dtype=np.uint8).tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------- layout

@dataclass(frozen=True)
class Layout:
    path: Path
    dataset: str
    chunk_samples: int
    compression: str           # "none", "gzip", "lzf"
    sizes: dict                # split -> number of samples
    source_sha256: str
    checksum: bool = False     # a fletcher32 checksum per chunk, verified on every read

    def chunks(self, split: str) -> int:
        return -(-self.sizes[split] // self.chunk_samples)

    def describe(self) -> str:
        k = self.chunk_samples
        lines = [f"{self.path}: {self.dataset}, {FORMAT} v{VERSION}, chunks of {k} samples, "
                 f"compression {self.compression}, "
                 + ("a fletcher32 checksum per chunk" if self.checksum else "no checksums")]
        for split, n in self.sizes.items():
            last = n - (self.chunks(split) - 1) * k
            tail = "" if last == k else f" (the last one {last})"
            lines.append(f"  {split}/images uint8 {(n, 28, 28)} chunk {(k, 28, 28)}; {split}/labels uint8 "
                         f"({n},) chunk ({k},): {self.chunks(split)} chunks{tail}")
        return "\n".join(lines)


class H5LayoutError(DataError):
    """The file is missing, unreadable or not in this layout; `why` says which, without the fix."""

    def __init__(self, path, why: str, dataset=None, chunk_samples=None, checksum=False):
        self.path, self.why = path, why
        fix = create_command(dataset or "<dataset>", chunk_samples or DEFAULT_CHUNK_SAMPLES, path, checksum)
        fix += " --force"
        super().__init__(f"{path} is not a usable {FORMAT} file ({why}); recreate it with: {fix}")


def read_layout(path) -> Layout:
    """Open `path`, check every part of the layout, close it.  Any problem is one DataError line."""
    import h5py

    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} does not exist")  # callers say how to create it
    try:
        f = h5py.File(path, "r", locking=False)
    except OSError as e:  # truncated, not HDF5 at all, unreadable
        raise H5LayoutError(path, f"cannot open it: {str(e).split('(', 1)[-1].rstrip(')') or e}") from None
    with f:
        attrs = dict(f.attrs)
        if attrs.get("format") != FORMAT:
            raise H5LayoutError(path, f"format attribute {attrs.get('format')!r}, expected {FORMAT!r}")
        if attrs.get("version") != VERSION:
            raise H5LayoutError(path, f"format version {attrs.get('version')!r}, this code reads {VERSION}")
        dataset, k = str(attrs.get("dataset")), int(attrs.get("chunk_samples", 0))
        compression, checksums = set(), set()
        sizes = {}
        for split, expected in SPLIT_SIZES.items():
            for name, tail in (("images", (28, 28)), ("labels", ())):
                key = f"{split}/{name}"
                d = f.get(key)
                if not isinstance(d, h5py.Dataset):
                    raise H5LayoutError(path, f"no dataset {key}", dataset, k)
                if d.dtype != np.uint8 or d.shape != (expected, *tail):
                    raise H5LayoutError(path, f"{key} is {d.dtype} {d.shape}, expected uint8 {(expected, *tail)}",
                                  dataset, k)
                if d.chunks != (k, *tail):
                    raise H5LayoutError(path, f"{key} has HDF5 chunks {d.chunks}, expected {(k, *tail)}",
                                        dataset, k)
                compression.add(d.compression or "none")
                checksums.add(bool(d.fletcher32))
            sizes[split] = expected
        return Layout(path, dataset, k, "/".join(sorted(compression)), sizes, str(attrs.get("source_sha256")),
                      checksums == {True})


def write_h5(path, splits: dict, dataset: str, chunk_samples: int, compression: str = "none",
             checksum: bool = False) -> Layout:
    """Write splits {name: (images uint8 [N,28,28], labels [N])} to `path` atomically (temp file + rename);
    `checksum`: a fletcher32 checksum per chunk."""
    import h5py

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with h5py.File(tmp, "w", locking=False) as f:
            f.attrs.update(format=FORMAT, version=VERSION, dataset=dataset, chunk_samples=chunk_samples,
                           source_sha256=source_sha256(splits))
            # fletcher32: a checksum per chunk, so that a damaged chunk is an error on read, not silent garbage
            opts = {"fletcher32": checksum, **({} if compression == "none" else {"compression": compression})}
            for split, (images, labels) in splits.items():
                f.create_dataset(f"{split}/images", data=np.asarray(images, dtype=np.uint8),
                                 chunks=(chunk_samples, 28, 28), **opts)
                f.create_dataset(f"{split}/labels", data=np.asarray(labels, dtype=np.uint8),
                                 chunks=(chunk_samples,), **opts)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)  # atomic: a reader sees no file, the old file, or the complete new one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return read_layout(path)


def add_h5_args(p):
    """Lesson 11's options: the chunked file, the DataLoader workers reading it, memory as the same chunks'
    other source, and --save-order.  require_h5() checks them before any rank starts."""
    p.add_argument("--h5-file", type=Path, default=None,
                   help="the chunked file from data_tools/create_mnist_h5.py "
                        "(default: <data dir>/<dataset>-chunk1000.h5)")
    p.add_argument("--workers", type=int, default=1, choices=range(0, 17), metavar="N",
                   help="DataLoader worker processes per rank reading chunks ahead (0: read in the rank itself)")
    p.add_argument("--source", default="h5", choices=("h5", "memory"),
                   help="memory: the same chunks in the same order from the in-memory dataset (for comparison)")
    p.add_argument("--save-order", action="store_true",
                   help="also write order.json: the sample indices each rank trained on, per epoch")
    return p


def require_h5(args) -> None:
    """Lesson 11, before any rank starts: the file exists and holds --dataset (else one line with the command
    that fixes it); with --source memory the in-memory dataset is prepared too.  Sets args.h5_file."""
    from data_tools.datasets import DataError, default_data_dir, named, require

    data_dir = args.data_dir or default_data_dir()
    args.h5_file = args.h5_file or default_h5_path(args.dataset, data_dir)
    if not args.h5_file.exists():
        default = args.h5_file == default_h5_path(args.dataset, data_dir)
        command = create_command(args.dataset, output=None if default else args.h5_file)
        where = f" (in {named(data_dir)})" if default and not args.data_dir else ""
        raise DataError(f"{args.h5_file} does not exist{where}; create it with: {command}"
                        + (f" --data-dir {args.data_dir}" if args.data_dir else ""))
    layout = read_layout(args.h5_file)
    if layout.dataset != args.dataset:
        raise DataError(f"{args.h5_file} holds {layout.dataset}, not {args.dataset}; "
                        f"pass --dataset {layout.dataset}")
    if args.source == "memory":
        require(args.dataset, args.data_dir)
