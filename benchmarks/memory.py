"""Section memory: the peak memory of a training step, measured (course/measuring/memory.py's StepPeak), where lessons
14 and 15 claim to save memory.

- checkpointing (lesson 14): one process, the ViT at width 64, depth 4 and 8, batch 64, SGD with momentum:
  the most bytes the third step holds above what was held when its forward began, with every block under
  `torch.utils.checkpoint(..., use_reentrant=False)` against without; the course's goal is at most 0.5x.
  On the CPU: live tensor storages (a TorchDispatchMode); with CUDA also the same rows from
  torch.cuda.max_memory_allocated minus torch.cuda.memory_allocated when the step began.
- sharding (lesson 15 against lesson 13): the ViT at width 256, depth 8 (25 MB of fp32 parameters), batch 2
  per rank, so that parameters, gradients, momentum and DDP's gradient buckets, not activations, make up
  the memory: DDP and FSDP2 (reshard after forward, as lesson 15 shards: per block, then the root) at 2 and
  4 ranks (gloo, 1 thread a rank); each rank measures its own third step, and the row takes the fullest
  rank's peak (held when the step began + the most above it).  Goals: FSDP2 at most 0.6x DDP's at 2 ranks,
  at most 0.35x at 4.  FSDP2's peak is its shards plus what a step gathers (a block's whole parameters and
  all_gather's output buffer, a block's whole gradients before their reduce_scatter, the root's parameters
  kept from forward to backward), so it approaches 1/W of DDP's only when the model has many blocks.
"""
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

from benchmarks.accumulation import checkpointed_vit
from benchmarks.common import Row, spawn
from benchmarks.fsdp import build
from course.measuring.memory import MB, StepPeak
from data_tools.datasets import InMemoryMNIST, batches

STEPS = 3  # StepPeak measures the third


def _checkpointing(ctx, depth: int, width: int, device: torch.device) -> dict:
    ds = InMemoryMNIST(ctx.dataset, "train", ctx.data_dir, device, limit=ctx.pick(16, 64, 64))
    x, y = ds.images, ds.labels
    out = {}
    for checkpointed in (False, True):
        model, optimizer = checkpointed_vit(width, depth, device, checkpointed)
        peak = StepPeak(model, optimizer, device)
        for _ in range(STEPS):  # lesson 14's order: zero_grad, forward, backward, step
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        out[checkpointed] = peak.result()
    return {"measured": out, "batch": len(y)}


def _sharding_worker(rank, world, cfg):
    ds = InMemoryMNIST(cfg["dataset"], "train", cfg["data_dir"], limit=cfg["limit"])
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    data = list(itertools.islice(batches(ds, sampler, cfg["batch"]), STEPS))
    measured = {}
    for name in ("DDP", "FSDP2, reshard after forward (ZeRO-3)"):
        model, optimizer, _ = build(name, world, cfg)
        peak = StepPeak(model, optimizer, torch.device("cpu"))
        for x, y in data:  # lesson 13's and 15's order: forward, zero_grad, backward, step
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        everyone = [None] * world
        dist.all_gather_object(everyone, peak.result())
        measured[name] = max(everyone, key=lambda r: r["peak_bytes"])
        del model, optimizer, peak
    return measured


def run(ctx) -> list:
    rows = []
    width = ctx.pick(32, 64, 64)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if ctx.cuda else [])
    for device in devices:
        where = "CPU, live tensors" if device.type == "cpu" else f"{torch.cuda.get_device_name()}, CUDA allocator"
        for depth in ctx.pick((2,), (4, 8), (4, 8)):
            m = _checkpointing(ctx, depth, width, device)
            plain, ckpt = m["measured"][False], m["measured"][True]
            rows.append(Row("memory", f"vit w{width} d{depth}, batch {m['batch']}, {where}: step's peak above what "
                                      f"was held before it, checkpointed", ckpt["peak_above_bytes"] / MB, "MB",
                            ckpt["peak_above_bytes"] / plain["peak_above_bytes"], "not checkpointed",
                            note=f"{plain['peak_above_bytes'] / MB:.2f} MB without; held before: "
                                 f"{plain['held_before_bytes'] / MB:.2f} MB").check("<=", 0.5))
    cfg = {"dataset": ctx.dataset, "data_dir": str(ctx.data_dir) if ctx.data_dir else None,
           "limit": ctx.pick(256, 1024, 1024), "batch": 2, "threads": 1,
           "width": ctx.pick(32, 256, 256), "depth": ctx.pick(2, 8, 8), "heads": ctx.pick(2, 4, 4)}
    model = f"vit w{cfg['width']} d{cfg['depth']}, batch {cfg['batch']} per rank"
    for world, goal in ((2, 0.6), (4, 0.35)):
        r = spawn(_sharding_worker, world, cfg)
        ddp, fsdp = r["DDP"], r["FSDP2, reshard after forward (ZeRO-3)"]
        rows.append(Row("memory", f"{model}, {world} ranks: step's peak per rank, DDP", ddp["peak_bytes"] / MB, "MB",
                        note=f"held before the step {ddp['held_before_bytes'] / MB:.2f} MB, at most "
                             f"{ddp['peak_above_bytes'] / MB:.2f} MB more; fullest rank, live tensors"))
        rows.append(Row("memory", f"{model}, {world} ranks: step's peak per rank, FSDP2 (ZeRO-3)",
                        fsdp["peak_bytes"] / MB, "MB", fsdp["peak_bytes"] / ddp["peak_bytes"], "DDP (fullest rank)",
                        note=f"held before the step {fsdp['held_before_bytes'] / MB:.2f} MB, at most "
                             f"{fsdp['peak_above_bytes'] / MB:.2f} MB more").check("<=", goal))
    return rows
