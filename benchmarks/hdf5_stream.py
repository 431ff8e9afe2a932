"""Section 2: streaming the training set from a chunked HDF5 file (lesson 11's loader) vs memory.

One file per chunk size (100 / 1000 / 6400 samples) and compression (none / gzip / lzf), written with
data_tools' own writer (h5layout.write_h5).  An epoch streams every chunk once through lesson 11's input
pipeline (data_tools/h5stream.py: ChunkShardSampler -> H5Chunks in a DataLoader -> rebatch into batches of 64
-> normalize each batch), 1 rank, 0 workers.
- warm: the file's pages are in the OS page cache (it was just read);
- cold: its pages were dropped before every epoch with posix_fadvise(POSIX_FADV_DONTNEED) (the raw read
  speed row shows the drop worked: a cold read goes to the disk; on a VM the host may still cache it);
- from memory: lesson 11's --source memory, the same chunks through the same pipeline without the file (the
  reference of the goals: what reading the file costs), and the in-memory path of lessons 2-10
  (InMemoryMNIST + batches, the normalized float set in memory; what streaming costs in all);
- the naive loader: one h5py read per sample in shuffled order.  HDF5 reads whole chunks (and decompresses
  them, and verifies their checksum if they have one), so each 784-byte sample read pays for its whole
  chunk: that is why lesson 11 reads chunk-aligned and shuffles chunks, then samples within a chunk;
- a checksum per chunk (create_mnist_h5.py --checksum): the same uncompressed file at chunk 1000 with one.
"""
import math
import os
import shutil
import time

import torch
from torch.utils.data import DataLoader

from benchmarks.common import Row, best_of
from benchmarks.input_pipeline import lessons_epoch
from data_tools import h5layout, h5stream
from data_tools.datasets import InMemoryMNIST, load_split

BATCH = 64


# Lesson 11's input pipeline, as its training loop builds it (day2/11_mnist_ddp_pt_multinode_streaming.py
# has no function for it to import): keep the two in step.
def stream_epoch(chunks, dataset: str, epoch: int = 0, batch_size: int = BATCH) -> int:
    sampler = h5stream.ChunkShardSampler(len(chunks), rank=0, world_size=1, seed=0)
    sampler.set_epoch(epoch)
    loader = DataLoader(chunks, sampler=sampler, batch_size=None, num_workers=0)
    n = 0
    for index, images, labels in h5stream.rebatch(loader, batch_size):
        h5stream.normalize(images, dataset)  # timed: the pipeline normalizes every batch
        n += len(labels)
    return n


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def drop_from_page_cache(path) -> None:
    """Make the next read of `path` come from the disk: drop its (clean) pages from the OS page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_read_seconds(path) -> float:
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 22):
            pass
    return time.perf_counter() - start


def naive_rate(path, samples: int, max_seconds: float = 10.0) -> tuple:
    """(samples/s, samples read) of one h5py read per sample (image and label) in a shuffled order; stops
    after max_seconds (a compressed file with large chunks reads a few samples per second)."""
    import h5py

    order = torch.randperm(h5layout.SPLIT_SIZES["train"], generator=torch.Generator().manual_seed(0))[:samples]
    with h5py.File(path, "r", locking=False) as f:
        images, labels = f["train/images"], f["train/labels"]
        start = time.perf_counter()
        for n, i in enumerate(order.tolist(), 1):
            images[i], labels[i]
            if time.perf_counter() - start > max_seconds:
                break
        return n / (time.perf_counter() - start), n


def run(ctx):
    limit = ctx.pick(2048, 0, 0)
    chunk_sizes = ctx.pick([1000], [100, 1000, 6400], [100, 1000, 6400])
    compressions = ctx.pick(["none", "lzf"], ["none", "gzip", "lzf"], ["none", "gzip", "lzf"])
    rounds = ctx.pick(1, 5, 7)
    naive_samples = ctx.pick(64, 1000, 6000)
    workdir = ctx.out / "h5-files"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    try:
        loaded = {split: load_split(ctx.dataset, split, ctx.data_dir) for split in h5layout.SPLIT_SIZES}
        splits = {split: tuple(t.numpy() for t in pair) for split, pair in loaded.items()}
        ds = InMemoryMNIST(ctx.dataset, "train", ctx.data_dir, limit=limit)
        n = len(ds)
        lessons = n / best_of(lambda: lessons_epoch(ds, BATCH), max(rounds, 3))
        rows = [Row("hdf5", "in-memory path of lessons 2-10: InMemoryMNIST + batches", lessons, "samples/s",
                    note=f"shuffled epoch, batch {BATCH}")]
        train_images, train_labels = loaded["train"]
        paths = {}
        for k in chunk_sizes:
            # lesson 11 --source memory: the same chunks, order, rebatch and normalize, without the file
            memory_chunks = h5stream.MemoryChunks(train_images, train_labels, k, limit)
            stream_epoch(memory_chunks, ctx.dataset)
            memory_row = Row("hdf5", f"chunk {k}: lesson 11's pipeline from memory (--source memory)", 0.0,
                             "samples/s", None, "in-memory path of lessons 2-10",
                             note="the reference of this chunk size's files, measured between their epochs")
            rows.append(memory_row)
            memory_seconds, measured = math.inf, []
            # as create_mnist_h5.py writes them by default: no checksums; at chunk 1000 one more file made
            # with --checksum, to show what verifying a checksum per chunk costs
            variants = [(c, False) for c in compressions] + ([("none", True)] if k == 1000 else [])
            for compression, checksum in variants:
                variant = compression + (", checksum" if checksum else "")
                path = workdir / f"{ctx.dataset}-chunk{k}-{compression}{'-checksum' if checksum else ''}.h5"
                h5layout.write_h5(path, splits, ctx.dataset, k, compression, checksum)
                paths[(k, variant)] = path
                chunks = h5stream.H5Chunks(path, "train", limit)
                stream_epoch(chunks, ctx.dataset)  # warm: the page cache holds the file now
                warm = cold = math.inf
                for _ in range(rounds):  # interleaved: a slow spell of the machine hits all three alike
                    memory_seconds = min(memory_seconds, timed(lambda: stream_epoch(memory_chunks, ctx.dataset)))
                    warm = min(warm, timed(lambda: stream_epoch(chunks, ctx.dataset)))
                    drop_from_page_cache(path)
                    cold = min(cold, timed(lambda: stream_epoch(h5stream.H5Chunks(path, "train", limit),
                                                                ctx.dataset)))
                measured.append((variant, checksum, path, n / warm, n / cold))
            memory = n / memory_seconds
            memory_row.value, memory_row.ratio = memory, memory / lessons
            memory_name = f"lesson 11 from memory, chunk {k}"
            for variant, checksum, path, warm, cold in measured:
                tag = f"chunk {k}, {variant}:"
                rows.append(Row("hdf5", f"{tag} file size", path.stat().st_size / 1e6, "MB",
                                note="both splits, uint8, " + ("a fletcher32 checksum per chunk (--checksum)"
                                                               if checksum else "no checksums (the default)")))
                warm_row = Row("hdf5", f"{tag} streaming, warm", warm, "samples/s", warm / memory, memory_name,
                               note=f"file in the page cache; best of {rounds}")
                cold_row = Row("hdf5", f"{tag} streaming, cold", cold, "samples/s", cold / memory, memory_name,
                               note=f"page cache dropped (posix_fadvise) before each epoch; best of {rounds}")
                rows += [warm_row, cold_row]
                if (k, variant) == (1000, "none"):
                    warm_row.check(">=", 0.7)
                    cold_row.check(">=", 0.3)
                    rows.append(Row("hdf5", f"{tag} streaming, warm, vs lessons 2-10", warm, "samples/s",
                                    warm / lessons, "in-memory path of lessons 2-10"))

        probe = paths.get((1000, "none")) or next(iter(paths.values()))
        drop_from_page_cache(probe)
        cold_read = raw_read_seconds(probe)
        warm_read = min(raw_read_seconds(probe) for _ in range(3))
        size = probe.stat().st_size / 1e6
        rows.append(Row("hdf5", f"raw read of {probe.name}, cold", size / cold_read, "MB/s",
                        (size / cold_read) / (size / warm_read), "warm read",
                        note="proof that cold reads come from the disk"))
        rows.append(Row("hdf5", f"raw read of {probe.name}, warm", size / warm_read, "MB/s"))
        for (k, variant), path in paths.items():
            if k != 1000 and not ctx.large:
                continue
            rate, read = naive_rate(path, naive_samples)
            ref = next((r for r in rows if r.name == f"chunk {k}, {variant}: streaming, warm"), None)
            rows.append(Row("hdf5", f"naive loader, one read per sample: chunk {k}, {variant}, warm", rate,
                            "samples/s", rate / ref.value, f"chunk-aligned streaming (chunk {k}, {variant})",
                            note=f"each 784-byte read pays for a {k * 784 / 1e3:.0f} kB chunk; "
                                 f"{read:,} samples timed"))
        return rows
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
