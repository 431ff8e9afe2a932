"""Section fsdp: lesson 15's FSDP2 against lesson 13's DDP, at 2 and 4 ranks: bytes per rank and step time.

Each rank builds the same ViT (lesson 15's default size: width 128, depth 4, 4 heads) three times: wrapped in
DDP, and sharded with fully_shard per block and on the root as lesson 15 does, with reshard_after_forward
True (ZeRO-3) and False (ZeRO-2).  All three train on the same batches with SGD + momentum, in fp32.
- bytes per rank: parameters, gradients and momentum as the rank holds them (course/measuring/memory.py counts a
  DTensor by its local shard), on the fullest rank, against DDP's replica; the course's goal is at most
  1.1 / W of DDP's.  DDP's own gradient buckets (another copy of the gradients) are not counted.
- parameter bytes held from forward to backward: what the ranks keep gathered between the two passes.
- step time: the best of rounds that interleave the three variants (each round: a barrier, k steps, a
  barrier, the slowest rank's time), ratios against DDP's (> 1: slower).  On one CPU the ranks share the
  cores and gloo's collectives run over loopback.  Per step FSDP2 sends an all_gather per block in forward,
  again in backward under ZeRO-3, and a reduce_scatter: 1.5x the bytes of DDP's all_reduce under ZeRO-3, as
  many under ZeRO-2, in more and smaller messages (one per block instead of DDP's 25 MB buckets).
"""
import itertools
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from benchmarks.common import Row, max_over_ranks, spawn
from course.measuring import memory
from course.models import ViT
from data_tools.datasets import InMemoryMNIST, batches

VARIANTS = ("DDP", "FSDP2, reshard after forward (ZeRO-3)", "FSDP2, keep until backward (ZeRO-2)")


def build(variant: str, world: int, cfg: dict):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = ViT(7, cfg["width"], cfg["depth"], cfg["heads"])
    if variant == "DDP":
        model = DDP(model)
    else:
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward="ZeRO-3" in variant)
        fully_shard(model, mesh=mesh)
    after_forward = memory.watch_after_forward(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), after_forward


def _worker(rank, world, cfg):
    ds = InMemoryMNIST(cfg["dataset"], "train", cfg["data_dir"], limit=cfg["limit"])
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    data = list(itertools.islice(batches(ds, sampler, cfg["batch"]), cfg["distinct_batches"]))
    variants = {name: build(name, world, cfg) for name in VARIANTS}

    def steps(model, optimizer, k):
        for x, y in itertools.islice(itertools.cycle(data), k):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    for model, optimizer, _ in variants.values():
        steps(model, optimizer, cfg["warmup"])
    best = {name: float("inf") for name in VARIANTS}
    for _ in range(cfg["rounds"]):
        for name, (model, optimizer, _) in variants.items():
            dist.barrier()
            start = time.perf_counter()
            steps(model, optimizer, cfg["steps"])
            dist.barrier()
            best[name] = min(best[name], max_over_ranks(time.perf_counter() - start) / cfg["steps"])
    held = {}
    for name, (model, optimizer, after_forward) in variants.items():
        mine = dict(memory.held(model, optimizer), after_forward=after_forward["peak"])
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        held[name] = {k: max(r[k] for r in everyone) for k in mine}
    return {"step": best, "held": held}


def run(ctx):
    cfg = {"dataset": ctx.dataset, "data_dir": str(ctx.data_dir) if ctx.data_dir else None,
           "limit": ctx.pick(1024, 0, 0), "batch": 32, "threads": 1, "distinct_batches": ctx.pick(4, 20, 50),
           "width": ctx.pick(32, 128, 128), "depth": ctx.pick(2, 4, 8), "heads": ctx.pick(2, 4, 4),
           "warmup": ctx.pick(1, 3, 5), "steps": ctx.pick(1, 5, 10), "rounds": ctx.pick(1, 5, 10)}
    model = f"vit w{cfg['width']} d{cfg['depth']}"
    rows = []
    for world in (2, 4):
        r = spawn(_worker, world, cfg)
        ddp = r["held"]["DDP"]
        tag = f"{model}, {world} ranks:"
        for name in VARIANTS[1:]:
            held = r["held"][name]
            row = Row("fsdp", f"{tag} parameters + gradients + momentum per rank, {name}", held["total"] / 2 ** 20,
                      "MB", held["total"] / ddp["total"], "DDP's replica (fullest rank)",
                      note="gradient buckets not counted" if "ZeRO-3" in name else "")
            rows.append(row.check("<=", round(1.1 / world, 3)) if "ZeRO-3" in name else row)
        for name in VARIANTS:
            held = r["held"][name]
            rows.append(Row("fsdp", f"{tag} parameters held from forward to backward, {name}",
                            held["after_forward"] / 2 ** 20, "MB",
                            *((held["after_forward"] / ddp["after_forward"], "DDP") if name != "DDP" else ())))
        for name in VARIANTS:
            ms = r["step"][name] * 1e3
            rows.append(Row("fsdp", f"{tag} train step, {name}", ms, "ms/step",
                            *((r["step"][name] / r["step"]["DDP"], "DDP (> 1: slower)") if name != "DDP" else ()),
                            note=f"batch {cfg['batch']} per rank, 1 thread per rank, best of {cfg['rounds']} "
                                 f"rounds of {cfg['steps']} steps" if name == "DDP" else ""))
    return rows
