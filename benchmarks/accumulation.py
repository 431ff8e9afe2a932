"""Section accumulation: lesson 14's gradient accumulation at 2 ranks, and its activation checkpointing.

- accumulation: DDP over 2 ranks (gloo, one thread a rank), the default ViT (width 64, depth 4), micro-batches
  of 32 per rank, K = 1, 2 and 4 micro-batches per optimizer step, the first K-1 forward and backward under
  `no_sync()` (lesson 14's loop, fp32).  The all_reduce bytes are counted by lesson 14's communication hook
  (course/measuring/accumulation.py); per sample of the global batch W x K x 32 the course's goal is exactly 1/K of
  K = 1's.  Time per sample: the best of rounds that interleave the three (each round: a barrier, the
  steps, a barrier, the slowest rank's time), against K = 1's: every sample still costs its forward and
  backward, only the all_reduces get fewer.
- checkpointing: one process, the ViT (width 64) at depth 4 and 8, batch 64: the bytes autograd keeps for
  backward during one forward pass (saved-tensor hooks, course/measuring/accumulation.py; the block inputs that
  checkpoint keeps are counted), with every block under `torch.utils.checkpoint(..., use_reentrant=False)`
  against without (goal at most 0.5x), and the train step's time (goal at most 1.4x: the recompute is
  about one more forward pass per backward, ~1.3x in theory; timed with one CPU thread, best of rounds that
  interleave the two).  What a step holds at its peak, with and without checkpointing, is section memory's
  (course/measuring/memory.py's StepPeak, on the CPU and with CUDA), the one peak lesson 14 reports.
"""
import contextlib
import functools
import itertools
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data.distributed import DistributedSampler

from benchmarks.common import Row, best_of_each, max_over_ranks, spawn
from course.measuring.accumulation import Meter
from course.models import ViT
from data_tools.datasets import InMemoryMNIST, batches

KS = (1, 2, 4)
MICRO_BATCH = 32


def checkpointed_vit(width: int, depth: int, device, checkpointed: bool):
    """Lesson 14's ViT (seed 0) and its SGD optimizer, each block under activation checkpointing if asked."""
    torch.manual_seed(0)
    model = ViT(7, width, depth, 4 if width % 4 == 0 else 2).to(device)
    if checkpointed:  # as lesson 14 does it
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _accumulation_worker(rank, world, cfg):
    ds = InMemoryMNIST(cfg["dataset"], "train", cfg["data_dir"], limit=cfg["limit"])
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    data = list(itertools.islice(batches(ds, sampler, MICRO_BATCH), cfg["distinct_batches"]))
    variants = {}
    for k in KS:
        torch.manual_seed(0)
        model = DDP(ViT(7, cfg["width"], cfg["depth"], cfg["heads"]))
        variants[k] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                       Meter(model, torch.device("cpu"), checkpointed=False))

    def steps(k, n):
        model, optimizer, meter = variants[k]
        micro = itertools.cycle(data)
        for _ in range(n):
            optimizer.zero_grad()
            for i in range(k):  # lesson 14's inner loop
                x, y = next(micro)
                with model.no_sync() if i < k - 1 else contextlib.nullcontext():
                    (F.cross_entropy(model(x), y) / k).backward()
            optimizer.step()
            meter.step()

    for k in KS:
        steps(k, cfg["warmup"])
    best = {k: float("inf") for k in KS}
    for _ in range(cfg["rounds"]):
        for k in KS:
            dist.barrier()
            start = time.perf_counter()
            steps(k, cfg["steps"])
            dist.barrier()
            best[k] = min(best[k], max_over_ranks(time.perf_counter() - start) / cfg["steps"])
    counted = {}
    for k, (_, _, meter) in variants.items():
        n = len(meter.times)
        counted[k] = meter.summary(n, world * k * MICRO_BATCH)
    return {"step": best, "counted": counted}


def _checkpointing(ctx, depth: int, device: torch.device) -> dict:
    ds = InMemoryMNIST(ctx.dataset, "train", ctx.data_dir, device, limit=ctx.pick(16, 64, 64))
    x, y = ds.images, ds.labels
    width = ctx.pick(32, 64, 64)
    out, fns = {}, {}
    for checkpointed in (False, True):
        model, optimizer = checkpointed_vit(width, depth, device, checkpointed)
        meter = Meter(model, device, checkpointed)

        def step(model=model, optimizer=optimizer, meter=meter):
            with meter.forward():
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        for _ in range(ctx.pick(1, 2, 3)):  # warm-up; the first call also counts the bytes
            step()
        out[checkpointed] = meter.summary(1, len(y))
        fns[checkpointed] = step
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a process whose threads wait for each other is what a busy machine
    try:                      # slows most, and the ratio is the point
        times = best_of_each(fns, ctx.pick(1, 20, 40), sync)
    finally:
        torch.set_num_threads(threads)
    return {"counted": out, "step": times, "batch": len(y), "width": width}


def run(ctx) -> list:
    cfg = {"dataset": ctx.dataset, "data_dir": str(ctx.data_dir) if ctx.data_dir else None,
           "limit": ctx.pick(1024, 0, 0), "threads": 1, "distinct_batches": ctx.pick(4, 16, 32),
           "width": ctx.pick(32, 64, 64), "depth": ctx.pick(2, 4, 4), "heads": ctx.pick(2, 4, 4),
           "warmup": 1, "steps": ctx.pick(1, 3, 5), "rounds": ctx.pick(1, 6, 10)}
    r = spawn(_accumulation_worker, 2, cfg)
    rows = []
    tag = f"vit w{cfg['width']} d{cfg['depth']}, 2 ranks, micro-batch {MICRO_BATCH}"
    one = r["counted"]["1"]
    for k in KS:
        c = r["counted"][str(k)]
        row = Row("accumulation", f"{tag}, K = {k}: all_reduce bytes per sample", c["allreduce_bytes_per_sample"],
                  "B/sample", *((c["allreduce_bytes_per_sample"] / one["allreduce_bytes_per_sample"], "K = 1")
                                if k > 1 else ()),
                  note=f"{c['allreduce_rounds_per_step']:g} round(s) of {c['allreduce_calls_per_step']:g} "
                       f"bucket(s) per step, {c['allreduce_bytes_per_step'] / 1024:.1f} KB")
        rows.append(row.check("<=", 1 / k) if k > 1 else row)
    for k in KS:
        per_sample = r["step"][str(k)] / (2 * k * MICRO_BATCH)
        rows.append(Row("accumulation", f"{tag}, K = {k}: train time per sample", per_sample * 1e6, "us/sample",
                        *((per_sample / (r["step"]["1"] / (2 * MICRO_BATCH)), "K = 1 (> 1: slower)")
                          if k > 1 else ()),
                        note=f"best of {cfg['rounds']} rounds of {cfg['steps']} steps, 1 thread per rank"
                        if k == 1 else ""))
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if ctx.cuda else [])
    for device in devices:
        where = "CPU" if device.type == "cpu" else torch.cuda.get_device_name()
        threads = "1 thread; " if device.type == "cpu" else ""
        for depth in ctx.pick((2,), (4, 8), (4, 8)):
            m = _checkpointing(ctx, depth, device)
            plain, ckpt = m["counted"][False], m["counted"][True]
            name = f"vit w{m['width']} d{depth}, batch {m['batch']}, {where}"
            rows.append(Row("accumulation", f"{name}: kept for backward, checkpointed",
                            ckpt["saved_for_backward_bytes"] / 2 ** 20, "MB",
                            ckpt["saved_for_backward_bytes"] / plain["saved_for_backward_bytes"],
                            "not checkpointed", note=f"{plain['saved_for_backward_bytes'] / 2 ** 20:.2f} MB "
                                                     "without; one forward pass").check("<=", 0.5))
            rows.append(Row("accumulation", f"{name}: train step, checkpointed", m["step"][True] * 1e3, "ms/step",
                            m["step"][True] / m["step"][False], "not checkpointed (> 1: slower)",
                            note=f"{threads}{m['step'][False] * 1e3:.1f} ms without").check("<=", 1.4))
    return rows
