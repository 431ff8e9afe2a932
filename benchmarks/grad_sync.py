"""Section 3: gradient synchronization per training step at world size 2 (gloo, 1 thread per rank).

Every variant runs the same step as lesson 4 (forward, backward, synchronize, SGD with momentum) on the same
batches; only the synchronization differs:
- none: compute only, the floor every variant pays;
- lesson 4's teaching version: one all_reduce per parameter tensor (day1/4_mnist_manual_ddp.py, imported);
- lesson 4's --sync flat: all gradients in one buffer, one all_reduce;
- torch DDP with gradient buckets of 1, 25 (its default) and 100 MB.
The reference for the cost of communication is gloo's all_reduce of the same number of bytes, alone.
Variants are measured in many short interleaved rounds (each round runs every variant once).  The time
shown is each variant's best round (on a shared machine, the rounds nothing disturbed); the ratio to DDP is
the median over the rounds of the two variants' times in the same round, so that a disturbance that hits
one round hits both sides of the ratio.
"""
import itertools
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from benchmarks.common import Row, load_lesson, max_over_ranks, spawn
from course.models import build_model
from data_tools.datasets import InMemoryMNIST, batches

NONE = "no sync (compute only)"
PER_PARAM = "per-parameter all_reduce (lesson 4)"
FLAT = "flat all_reduce (lesson 4 --sync flat)"
DDP_DEFAULT = "torch DDP, 25 MB buckets (default)"
DDP_BUCKETS = {1: "torch DDP, 1 MB buckets", 25: DDP_DEFAULT, 100: "torch DDP, 100 MB buckets"}


def _worker(rank, world, cfg):
    lesson4 = load_lesson("day1/4_mnist_manual_ddp.py")
    ds = InMemoryMNIST(cfg["dataset"], "train", cfg["data_dir"], limit=cfg["limit"])
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    data = list(itertools.islice(batches(ds, sampler, cfg["batch"]), cfg["distinct_batches"]))
    results = {}
    for model_name in cfg["models"]:
        variants = {}
        plain = build_model(model_name, 0)
        for name, sync in ((NONE, None), (PER_PARAM, lesson4.average_gradients),
                           (FLAT, lesson4.average_gradients_flat)):
            model = build_model(model_name, 0)
            variants[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), sync)
        for mb, name in DDP_BUCKETS.items():
            model = DDP(build_model(model_name, 0), bucket_cap_mb=mb)
            variants[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), None)

        def steps(model, optimizer, sync, k):
            for x, y in itertools.islice(itertools.cycle(data), k):
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                if sync:
                    sync(model, world)
                optimizer.step()

        rounds = {name: [] for name in variants}
        for model, optimizer, sync in variants.values():
            steps(model, optimizer, sync, cfg["warmup"])  # DDP rebuilds its buckets after the first steps
        for _ in range(cfg["rounds"]):
            for name, (model, optimizer, sync) in variants.items():
                steps(model, optimizer, sync, 2)  # this variant's tensors back in the caches
                dist.barrier()
                start = time.perf_counter()
                steps(model, optimizer, sync, cfg["steps"][model_name])
                dist.barrier()
                seconds = max_over_ranks(time.perf_counter() - start)
                rounds[name].append(seconds / cfg["steps"][model_name])

        # gloo alone, the same bytes as the gradients: what any synchronization must at least pay
        numel = sum(p.numel() for p in plain.parameters())
        buf = torch.zeros(numel)
        reps = cfg["steps"]["mlp"]
        allreduce = float("inf")
        for _ in range(cfg["rounds"]):
            for _ in range(cfg["warmup"]):
                dist.all_reduce(buf)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(buf)
            dist.barrier()
            allreduce = min(allreduce, max_over_ranks(time.perf_counter() - start) / reps)
        results[model_name] = {"step": {name: min(r) for name, r in rounds.items()}, "allreduce": allreduce,
                               "vs_ddp": {name: statistics.median(a / b for a, b in zip(r, rounds[DDP_DEFAULT]))
                                          for name, r in rounds.items()}, "bytes": numel * 4,
                               "tensors": len(list(plain.parameters()))}
    return results


def run(ctx):
    cfg = {"dataset": ctx.dataset, "data_dir": str(ctx.data_dir) if ctx.data_dir else None,
           "limit": ctx.pick(2048, 0, 0), "batch": 64, "models": ["mlp", "cnn"], "threads": 1,
           "distinct_batches": ctx.pick(4, 50, 100), "warmup": ctx.pick(1, 10, 20),
           "steps": {"mlp": ctx.pick(3, 30, 60), "cnn": ctx.pick(3, 10, 20)}, "rounds": ctx.pick(1, 15, 30)}
    results = spawn(_worker, 2, cfg)
    rows = []
    how = (f"best of {cfg['rounds']} interleaved rounds of {cfg['steps']['mlp']} (mlp) / {cfg['steps']['cnn']} "
           f"(cnn) steps, batch 64 per rank; ratio: median over the rounds of the same round's DDP time")
    for model_name, r in results.items():
        step = {k: v * 1e3 for k, v in r["step"].items()}
        tag = f"{model_name}, 2 ranks:"
        for name, ms in step.items():
            row = Row("sync", f"{tag} step with {name}", ms, "ms/step", r["vs_ddp"][name], DDP_DEFAULT,
                      note=how if name == NONE else "")
            if name == FLAT and model_name == "mlp":
                row.check("<=", 1.15)
            rows.append(row)
        ar = r["allreduce"] * 1e3
        rows.append(Row("sync", f"{tag} gloo all_reduce of {r['bytes'] / 1e3:.0f} kB alone", ar, "ms/call",
                        note=f"{r['bytes'] / r['allreduce'] / 1e6:.0f} MB/s; the gradients' bytes "
                             f"({r['tensors']} tensors)"))
        for name in (PER_PARAM, FLAT, DDP_DEFAULT):
            overhead = step[name] - step[NONE]
            rows.append(Row("sync", f"{tag} sync cost of {name} (step - compute only)", overhead, "ms/step",
                            overhead / ar, "gloo all_reduce of the same bytes",
                            note=f"{overhead / step[name] * 100:.0f}% of the step"
                                 + (" (DDP overlaps it with backward)" if name == DDP_DEFAULT else "")))
    return rows
