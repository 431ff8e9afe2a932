"""Section 1: the input pipeline, in samples/s over a shuffled epoch of the training set.

- the lessons' path: InMemoryMNIST (the split as one normalized float tensor) + batches(RandomSampler);
- the original workshop's per-sample path: torchvision's dataset, ToTensor on every sample (PIL image ->
  float tensor), DataLoader collating 64 samples per batch, with 0 and 2 worker processes;
- the memory-copy limit: the bytes an epoch of batches moves (each sample's image and label read once and
  written once into its batch, plus the index) divided by the copy bandwidth of this machine, measured here
  as one large tensor copy with all threads.
"""
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, Subset

from benchmarks.common import Row, best_of_each
from data_tools.datasets import InMemoryMNIST, batches, default_data_dir, sampler_order, spec

BATCH = 64  # the lessons' default


def lessons_epoch(ds, batch_size=BATCH, sync=None, sampler=RandomSampler) -> int:
    n = 0
    for x, y in batches(ds, sampler(ds), batch_size):
        n += len(y)
    if sync:
        sync()
    return n


def dataloader_epoch(ds, batch_size=BATCH) -> int:
    """The same batches through a DataLoader over a BatchSampler (the usual way to batch a sampler): one
    list of Python ints and one DataLoader step per batch."""
    from torch.utils.data import BatchSampler

    n = 0
    for x, y in DataLoader(ds, sampler=BatchSampler(RandomSampler(ds), batch_size, False), batch_size=None):
        n += len(y)
    return n


def per_sample_loader(dataset: str, data_dir, workers: int, limit: int = 0, batch_size=BATCH):
    """The original workshop's input path: per-sample PIL -> ToTensor, collated by a DataLoader."""
    import torchvision
    from torchvision.transforms import ToTensor

    tv = getattr(torchvision.datasets, spec(dataset).folder)(root=str(data_dir), train=True, download=False,
                                                             transform=ToTensor())
    if limit:
        tv = Subset(tv, range(limit))
    return DataLoader(tv, batch_size=batch_size, shuffle=True, num_workers=workers)


def per_sample_rate(loader, max_samples: int, device=None) -> float:
    """samples/s over the first max_samples of a shuffled epoch, worker start-up included."""
    start, n = time.perf_counter(), 0
    for x, y in loader:
        if device is not None:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        n += len(y)
        if n >= max_samples:
            break
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def copy_limit(ds, copy_seconds: float):
    """(seconds for the bytes an epoch of batches moves at this machine's copy bandwidth, GB/s), from the
    time of one copy of the whole image tensor (all threads)."""
    src = ds.images
    bandwidth = 2 * src.nbytes / copy_seconds  # bytes read + bytes written per second
    n = len(ds)
    moved = 2 * n * (src[0].nbytes + ds.labels[0].nbytes) + n * 8  # read + write every sample, read the index
    return moved / bandwidth, bandwidth / 1e9


def run(ctx):
    data_dir = ctx.data_dir or default_data_dir()
    limit = ctx.pick(1024, 0, 0)
    repeats = ctx.pick(1, 7, 15)
    per_sample_max = ctx.pick(256, 12_800, 60_000)
    rows = []
    ds = InMemoryMNIST(ctx.dataset, "train", data_dir, limit=limit)
    n = len(ds)
    src, dst = ds.images, torch.empty_like(ds.images)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    lessons_epoch(ds)  # warm-up
    t = best_of_each({"lessons": lambda: lessons_epoch(ds), "lessons512": lambda: lessons_epoch(ds, 512),
                      "sequential": lambda: lessons_epoch(ds, sampler=SequentialSampler),
                      "order": lambda: sampler_order(RandomSampler(ds)),
                      "ints": lambda: np.fromiter(RandomSampler(ds), dtype=np.int64),
                      "dataloader": lambda: dataloader_epoch(ds),
                      "copy": lambda: dst.copy_(src)}, repeats)
    t_lessons, t_large, t_order = t["lessons"], t["lessons512"], t["order"]
    lessons = n / t_lessons
    t_limit, gbps = copy_limit(ds, t["copy"])
    limit_rate = n / t_limit
    del dst

    rates = {}
    per_sample_repeats = ctx.pick(1, 2, 1)
    for workers in (0, 2):
        loader = per_sample_loader(ctx.dataset, data_dir, workers, limit)
        rates[workers] = max(per_sample_rate(loader, per_sample_max) for _ in range(per_sample_repeats))
    span = "one epoch" if per_sample_max >= n else f"the first {per_sample_max:,} samples of an epoch"
    span += f", best of {per_sample_repeats}" if per_sample_repeats > 1 else ""
    base = "per-sample torchvision + ToTensor, DataLoader"
    rows.append(Row("input", f"{base}, 0 workers", rates[0], "samples/s",
                    note=f"{span}, batch {BATCH}, shuffled"))
    rows.append(Row("input", f"{base}, 2 workers", rates[2], "samples/s", rates[2] / rates[0],
                    "per-sample, 0 workers", note=f"{span}, worker start included"))
    rows.append(Row("input", "lessons' path: InMemoryMNIST + batches(RandomSampler)", lessons, "samples/s",
                    lessons / rates[0], "per-sample, 0 workers",
                    note=f"best of {repeats} shuffled epochs of {n:,}, batch {BATCH}").check(">=", 30))
    rows.append(Row("input", "memory-copy limit for the bytes an epoch moves", limit_rate, "samples/s",
                    note=f"copy bandwidth {gbps:.1f} GB/s (read+write), {torch.get_num_threads()} threads"))
    rows.append(Row("input", "lessons' path vs the memory-copy limit", lessons, "samples/s",
                    lessons / limit_rate, "memory-copy limit",
                    note=f"epoch {t_lessons * 1e3:.1f} ms vs {t_limit * 1e3:.1f} ms at copy bandwidth"
                    ).check(">=", 0.5))
    rows.append(Row("input", "  the same path in the dataset's order (SequentialSampler)", n / t["sequential"],
                    "samples/s", t_lessons / t["sequential"], "the lessons' path",
                    note="the same batch sizes, rows side by side: what shuffling costs the gather"))
    rows.append(Row("input", "  of which: the RandomSampler's order as an index tensor",
                    t_order * 1e3, "ms/epoch", t_order / t_lessons, "the lessons' epoch",
                    note="sampler_order(): one torch.randperm, the same draws as iterating the sampler"))
    rows.append(Row("input", "  the same order read by iterating the sampler (Python ints)",
                    t["ints"] * 1e3, "ms/epoch", t["ints"] / t_lessons, "the lessons' epoch",
                    note="what the order would cost if batches() iterated torch's samplers"))
    rows.append(Row("input", "the same batches through a DataLoader over a BatchSampler", n / t["dataloader"],
                    "samples/s", t_lessons / t["dataloader"], "the lessons' path",
                    note="the same bits; a DataLoader step and a list of Python ints per batch"))
    rows.append(Row("input", "lessons' path at batch 512 vs the memory-copy limit", n / t_large, "samples/s",
                    t_limit / t_large, "memory-copy limit",
                    note="8x fewer batches: less per-batch Python, the same bytes"))
    if ctx.cuda:
        rows += run_gpu(ctx, data_dir, limit, repeats, per_sample_max)
    return rows


def run_gpu(ctx, data_dir, limit, repeats, per_sample_max, device=None):
    """The same comparison with the data on one GPU (per-sample batches are copied to it)."""
    device = device or torch.device("cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    ds = InMemoryMNIST(ctx.dataset, "train", data_dir, device=device, limit=limit)
    src, dst = ds.images, torch.empty_like(ds.images)
    dst.copy_(src)
    lessons_epoch(ds, sync=sync)
    times = best_of_each({"lessons": lambda: lessons_epoch(ds), "copy": lambda: dst.copy_(src)}, repeats, sync)
    t = times["lessons"]
    t_limit, gbps = copy_limit(ds, times["copy"])
    rate = per_sample_rate(per_sample_loader(ctx.dataset, data_dir, 2, limit), per_sample_max, device)
    tag = f"[{device.type}]"
    return [
        Row("input", f"{tag} per-sample path, 2 workers, batches copied to the GPU", rate, "samples/s"),
        Row("input", f"{tag} lessons' path, data resident on the GPU", len(ds) / t, "samples/s",
            len(ds) / t / rate, "per-sample, 2 workers, on the GPU"),
        Row("input", f"{tag} lessons' path vs the GPU memory-copy limit", len(ds) / t, "samples/s",
            t_limit / t, "GPU memory-copy limit", note=f"device copy bandwidth {gbps:.0f} GB/s"),
    ]
