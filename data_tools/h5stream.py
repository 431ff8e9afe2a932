"""Streaming the chunked HDF5 file (data_tools/h5layout.py) across ranks: the chunk datasets lesson 11 reads.

Lesson 11 itself deals the chunks to the ranks (its ChunkShardSampler) and cuts them into batches (its
rebatch); this module reads them: H5Chunks from the file, MemoryChunks from memory, H5TestSet whole
(open_chunks picks the source for the lesson).

How an epoch is read, and why:
1. The unit of work is one chunk, not one sample.  HDF5 reads (and decompresses) whole chunks, so reading
   samples c*K .. c*K+K-1 costs one chunk, while K random single-sample reads would each pay for a chunk.
   Every read here starts on a chunk boundary and covers exactly one chunk (the last one may be shorter).
2. Chunk ids are shuffled with seed + epoch, the same permutation on every rank, and dealt round-robin:
   rank r of W reads chunks perm[r], perm[r+W], ...  Together the ranks read every chunk exactly once, so
   every sample is seen once per epoch, and nothing is padded.  Then the samples of each chunk are shuffled.
   The price: chunk counts may differ by one between ranks (lesson 11 uses DDP's join() for that).
3. The file is opened lazily, by the process that reads it.  An open h5py handle must not be inherited
   across fork() or pickled into DataLoader workers: each worker opens its own on its first read.
"""
import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from data_tools.datasets import DataError, load_split, spec
from data_tools.h5layout import H5LayoutError, add_h5_args, read_layout, require_h5  # noqa: F401 (lesson 11's)


# ----------------------------------------------------------------------------------------- order

def _lesson11():
    """Lesson 11's module, loaded once (its file name starts with a digit, so it is loaded from its path)."""
    import importlib.util
    import sys

    name = "lesson11_streaming"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "day2" / "11_mnist_ddp_pt_multinode_streaming.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def __getattr__(name):
    """ChunkShardSampler and rebatch are lesson 11's idea and live in the lesson; they are offered here too,
    for the benchmarks and tests that stream the file as the lesson does."""
    if name in ("ChunkShardSampler", "rebatch"):
        return getattr(_lesson11(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def chunk_seed(seed: int, epoch: int, chunk: int) -> int:
    """The seed that shuffles the samples of `chunk` in `epoch`: the same in every process."""
    digest = hashlib.sha256(f"{seed},{epoch},{chunk}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def chunk_bounds(chunk: int, chunk_samples: int, num_samples: int) -> tuple:
    """(start, stop) of `chunk`'s samples; the last chunk may be shorter (never padded)."""
    start = chunk * chunk_samples
    return start, min(start + chunk_samples, num_samples)


def chunk_permutation(n: int, shuffle_seed) -> torch.Tensor:
    if shuffle_seed is None:
        return torch.arange(n)
    g = torch.Generator()
    g.manual_seed(shuffle_seed)
    return torch.randperm(n, generator=g)


# ----------------------------------------------------------------------------------------- reading

class H5Chunks(torch.utils.data.Dataset):
    """Item (chunk, shuffle_seed) -> (indices, images uint8 [n,28,28], labels int64 [n]), shuffled within.

    One h5py read per chunk of images, aligned to the file's chunks; the labels are read once.  `limit` keeps
    the first samples only (--train-samples); the last chunk is then cut short, never padded.
    """

    def __init__(self, path, split: str, limit: int = 0):
        self.layout = read_layout(path)  # opened, checked and closed here, before any worker exists
        self.path, self.split = Path(path), split
        self.chunk_samples = self.layout.chunk_samples
        self.num_samples = min(limit, self.layout.sizes[split]) if limit else self.layout.sizes[split]
        self._images = self._labels = self._file = self._pid = None

    def __getstate__(self):  # a DataLoader worker started by spawn/forkserver gets no open handle
        return {**self.__dict__, "_file": None, "_images": None, "_labels": None, "_pid": None}

    def _open(self):
        """This split's images dataset and all its labels, opened by this process on its first read.

        - The images dataset is looked up once, not per chunk (a lookup by name costs about as much as
          reading a small chunk), and the file is opened without HDF5's chunk cache: every chunk is read
          once per epoch, so a cache would only add a copy of each chunk.
        - The labels are one byte per sample (60 kB for the training set): read whole, once, into memory,
          instead of one more small read per chunk.
        """
        import h5py

        if self._file is None or self._pid != os.getpid():  # first read in this process (or after a fork)
            self._file = h5py.File(self.path, "r", locking=False, rdcc_nbytes=0)
            self._images = self._file[f"{self.split}/images"]
            try:
                labels = self._file[f"{self.split}/labels"][:self.num_samples]
            except OSError as e:
                raise self._damaged(f"the labels of {self.split} are", e) from None
            self._labels = torch.from_numpy(labels.astype(np.int64))
            self._pid = os.getpid()
        return self._images, self._labels

    def _damaged(self, what: str, e: OSError) -> H5LayoutError:
        """The error for data h5py could not read back (with --checksum: a checksum that does not match);
        `what` ends in its verb: "chunk 3 of train is"."""
        return H5LayoutError(self.path, f"{what} damaged or unreadable: {e}", self.layout.dataset,
                             self.chunk_samples, self.layout.checksum)

    def __len__(self):
        return -(-self.num_samples // self.chunk_samples)

    def __getitem__(self, task):
        chunk, shuffle_seed = task
        start, stop = chunk_bounds(chunk, self.chunk_samples, self.num_samples)
        if not 0 <= start < stop:
            raise IndexError(f"chunk {chunk} out of range (0..{len(self) - 1})")
        images, labels = self._open()
        try:
            images = images[start:stop]  # one read of exactly one HDF5 chunk
        except OSError as e:  # e.g. a chunk whose checksum (--checksum) does not match: the file was damaged
            raise self._damaged(f"chunk {chunk} of {self.split} is", e) from None
        order = chunk_permutation(stop - start, shuffle_seed)  # shuffled within the chunk: one gather each
        return (torch.arange(start, stop)[order], torch.from_numpy(images).index_select(0, order),
                labels[start:stop].index_select(0, order))


class MemoryChunks(torch.utils.data.Dataset):
    """The same items as H5Chunks, cut from uint8 tensors already in memory (load_split's arrays)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, chunk_samples: int, limit: int = 0):
        n = min(limit, len(labels)) if limit else len(labels)
        self.images, self.labels = images[:n], labels[:n]
        self.chunk_samples, self.num_samples = chunk_samples, n

    def __len__(self):
        return -(-self.num_samples // self.chunk_samples)

    def __getitem__(self, task):
        chunk, shuffle_seed = task
        start, stop = chunk_bounds(chunk, self.chunk_samples, self.num_samples)
        index = torch.arange(start, stop)[chunk_permutation(stop - start, shuffle_seed)]
        return index, self.images.index_select(0, index), self.labels.index_select(0, index)


def normalize(images: torch.Tensor, dataset: str) -> torch.Tensor:
    """uint8 [B,28,28] -> float [B,1,28,28]: the same arithmetic as InMemoryMNIST, so both give equal bits."""
    s = spec(dataset)
    x = images.to(torch.float32, copy=True)  # the one new tensor; the rest is in place
    return x.div_(255).sub_(s.mean).div_(s.std).unsqueeze(1)


class H5TestSet:
    """A split read whole from the file into memory (the test set is small), shaped like InMemoryMNIST."""

    def __init__(self, path, split: str, device="cpu"):
        import h5py

        layout = read_layout(path)
        with h5py.File(path, "r", locking=False) as f:
            images = torch.from_numpy(f[f"{split}/images"][:])
            labels = torch.from_numpy(f[f"{split}/labels"][:].astype(np.int64))
        self.images = normalize(images, layout.dataset).to(device)
        self.labels = labels.to(device)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        if isinstance(index, list):
            index = torch.as_tensor(index, device=self.labels.device)
        return self.images[index], self.labels[index]


def open_chunks(args, world_size: int, device):
    """Lesson 11's data: (the training chunks, the test set read whole, the file's layout).  The chunks come
    from the file (--source h5; opened on the first read, by the process that reads) or, the same chunks in
    the same order, from memory (--source memory).  Fewer chunks than ranks is one line: a rank without a
    chunk would have nothing to train on."""
    layout = read_layout(args.h5_file)
    if args.source == "h5":
        chunks = H5Chunks(args.h5_file, "train", limit=args.train_samples or 0)
    else:
        images, labels = load_split(layout.dataset, "train", args.data_dir)
        chunks = MemoryChunks(images, labels, layout.chunk_samples, limit=args.train_samples or 0)
    if len(chunks) < world_size:
        raise DataError(f"{chunks.num_samples} samples in chunks of {layout.chunk_samples} are only "
                        f"{len(chunks)} chunks for {world_size} ranks; use more --train-samples or a file "
                        f"with smaller chunks (data_tools/create_mnist_h5.py --chunk-samples N)")
    return chunks, H5TestSet(args.h5_file, "test", device), layout
