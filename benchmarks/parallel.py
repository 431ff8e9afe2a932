"""Section parallel: lessons 18-20's model parallelism: what each rank holds, what the collectives reach.

Each rank builds the same ViT (width 128, depth 4, 4 heads; width 32, depth 2 with --smoke) and cuts it as
the lessons do (lesson 19's plan, course/measuring/parallel.py's counts):
- tensor parallel over T = 2 and 4 ranks (lesson 19): the bytes of the cut parameters on each rank against
  their whole size; the course's goal is exactly 1/T on every rank (bytes counted, not timed);
- on a 2 x 2 mesh (lesson 20, 4 ranks): FSDP2 x TP and HSDP, the bytes all ranks hold of the cut parameters
  against what their placements promise (the sum over the ranks of whole / pieces); goal: exactly 1x;
- the all_reduce's bus bandwidth at 16 MiB (1 MiB with --smoke) at 2 and 4 ranks, timed as lesson 18 times
  it (the slowest rank's seconds per call, best of the rounds; busbw = S / t x 2(n-1)/n): reported, no goal;
- the time of a training step under TP at 2 ranks against DDP at 2 ranks with the same global batch
  (reported: on a CPU TP sends 4 activations per block and step where DDP sends the gradients once);
- the pipeline's bubble (lesson 21) at p = 2 and 4 stages (one block each): GPipe with m = p micro-batches,
  1F1B with m = 2p, every stage given a simulated compute of 40 ms per micro-batch forward and 80 ms
  backward (course/measuring/parallel.py's StageBook, as lesson 21; 5 ms with --smoke): rank 0's measured waiting, 1 - the
  seconds its stage computed / the schedule's seconds, against (p - 1) / (m + p - 1); goal: within 15%.
On one CPU the ranks share the cores and gloo's collectives run over loopback: the bandwidth is this
machine's, not a network's.
"""
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import Row, best_of_each, load_lesson, max_over_ranks, spawn
from course.measuring import hardware, parallel
from course.models import ViT, build_stages


def _model(cfg, layout: str, world: int):
    """The ViT cut as a lesson cuts it: "tp" (lesson 19), "fsdp-tp" or "hsdp" (lesson 20, rows of 2), "ddp"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    plan = {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),  # lesson 19's plan
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
    torch.manual_seed(0)
    model = ViT(7, cfg["width"], cfg["depth"], cfg["heads"])
    if layout == "ddp":
        return DDP(model)
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for block in model.blocks:
            parallelize_module(block, mesh, plan)
        return model
    names = ("dp", "tp") if layout == "fsdp-tp" else ("replicate", "shard")
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=names)
    if layout == "fsdp-tp":
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
    shard_on = mesh["dp"] if layout == "fsdp-tp" else mesh
    for block in model.blocks:
        fully_shard(block, mesh=shard_on)
    fully_shard(model, mesh=shard_on)
    return model


def _everyone(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _bubble(rank: int, world: int, cfg: dict, schedule: str, m: int) -> dict:
    """Lesson 21's pipeline, one block per stage, `cfg["pp_steps"]` timed steps after one that learns the
    shapes: rank 0's compute seconds and the schedule's seconds."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    args = SimpleNamespace(patch=7, width=cfg["width"], depth=world, heads=cfg["heads"], schedule=schedule,
                           stage_ms=cfg["stage_ms"], microbatches=m)
    model, ids, n = build_stages(args, 0, rank, world, torch.device("cpu"))
    book = parallel.StageBook(torch.device("cpu"), args.stage_ms)  # lesson 21's book of the chunks
    pipe = PipelineStage(book.wrap(model[0], ids[0]), ids[0], n, torch.device("cpu"))
    clock = parallel.PipelineClock(book)
    steps = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](pipe, m, loss_fn=F.cross_entropy)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4 * m, 1, 28, 28, generator=g), torch.randint(0, 10, (4 * m,), generator=g)
    for step in range(cfg["pp_steps"] + 1):
        with clock.step(step + 1):
            steps.step(*([x] if rank == 0 else []), **({"target": y} if rank == world - 1 else {}))
        model.zero_grad()
    return {"busy": clock.busy, "seconds": clock.seconds}


def _widths(cfg) -> dict:
    """Lesson 18's exercise 3 in one process and one thread (a rank's share of this machine's 2 cores): the
    ViT at width 32 and 64 (depth 2, 4 heads, batch 64, SGD with momentum), the FLOPs of one training step
    counted as the lesson counts them (FlopCounterMode with its CPU attention formulas), then the steps of
    both timed in interleaved rounds (common.best_of_each), so that the machine's load hits both alike:
    {width: (FLOPs a step, best seconds a step)}."""
    from torch.utils.flop_counter import FlopCounterMode

    cpu_attention = load_lesson("day4/18_hardware_limits.py").CPU_ATTENTION
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)
    steps, flops = {}, {}
    for width in (32, 64):
        torch.manual_seed(0)
        model = ViT(7, width, 2, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(model=model, optimizer=optimizer):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        with FlopCounterMode(display=False, custom_mapping=cpu_attention) as counting:
            step()  # also the warm-up
        flops[width] = counting.get_total_flops()
        steps[width] = lambda step=step: [step() for _ in range(cfg["steps"])]
    best = best_of_each(steps, cfg["rounds"] + 2)
    torch.set_num_threads(threads)
    return {width: (flops[width], best[width] / cfg["steps"]) for width in steps}


def _worker(rank, world, cfg):
    result = {"held": {}}
    layouts = ["tp"] + (["fsdp-tp", "hsdp"] if world == 4 else [])
    for layout in layouts:
        result["held"][layout] = _everyone(parallel.cut_bytes(_model(cfg, layout, world)))
    # the all_reduce's bandwidth, as lesson 18 times it (course/measuring/hardware.py), best of the rounds
    tensor = torch.ones(cfg["mib"] * 2 ** 20 // 4)
    result["all_reduce_seconds"] = min(hardware.timed(lambda: dist.all_reduce(tensor), cfg["calls"], tensor.device)[0]
                                       for _ in range(cfg["rounds"]))
    result["bytes"] = tensor.numel() * 4
    if world == 2:  # TP's step against DDP's, the same global batch
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(cfg["batch"], 1, 28, 28, generator=g), torch.randint(0, 10, (cfg["batch"],), generator=g)
        half = slice(rank * cfg["batch"] // 2, (rank + 1) * cfg["batch"] // 2)
        variants = {"tp": (_model(cfg, "tp", world), x, y), "ddp": (_model(cfg, "ddp", world), x[half], y[half])}
        optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, (m, _, _) in variants.items()}
        steps = {k: float("inf") for k in variants}
        for round_ in range(cfg["rounds"] + 1):  # round 0 warms up
            for k, (model, xb, yb) in variants.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(cfg["steps"]):
                    loss = F.cross_entropy(model(xb), yb)
                    optimizers[k].zero_grad()
                    loss.backward()
                    optimizers[k].step()
                seconds = max_over_ranks(time.perf_counter() - start) / cfg["steps"]
                steps[k] = min(steps[k], seconds) if round_ else steps[k]
        result["step_seconds"] = steps
    result["bubble"] = {f"{schedule} {m}": _bubble(rank, world, cfg, schedule, m)
                        for schedule, m in (("gpipe", world), ("1f1b", 2 * world))}
    return result


def run(ctx):
    cfg = {"width": ctx.pick(32, 128, 128), "depth": ctx.pick(2, 4, 8), "heads": 4, "batch": ctx.pick(16, 64, 64),
           "mib": ctx.pick(1, 16, 64), "calls": ctx.pick(1, 5, 10), "rounds": ctx.pick(1, 3, 5),
           "steps": ctx.pick(1, 3, 5), "stage_ms": ctx.pick(5, 40, 40), "pp_steps": ctx.pick(1, 3, 5)}
    model = f"vit w{cfg['width']} d{cfg['depth']}"
    rows = []
    (f32, s32), (f64, s64) = _widths(cfg).values()
    rows.append(Row("parallel", "vit d2, batch 64, one thread: GFLOP/s a training step reached at width 64 "
                    "(lesson 18, exercise 3)", f64 / s64 / 1e9, "GFLOP/s", (f64 / s64) / (f32 / s32),
                    "width 32 (> 1: the wider model uses the core better)",
                    note=f"{f64 / f32:.2f}x the FLOPs a step in {s64 / s32:.2f}x the time ({s64 * 1e3:.1f} against "
                         f"{s32 * 1e3:.1f} ms); best of {cfg['rounds'] + 2} interleaved rounds of {cfg['steps']} "
                         f"steps").check(">=", 1.0))
    for world in (2, 4):
        r = spawn(_worker, world, cfg)
        for layout, everyone in r["held"].items():
            whole = everyone[0]["cut_whole"]
            if layout == "tp":
                fullest = max(e["cut"] for e in everyone)
                rows.append(Row("parallel", f"{model}, {world} ranks: cut parameter bytes on the fullest rank, tensor "
                                f"parallel (lesson 19)", fullest / 2 ** 20, "MB", fullest / whole,
                                "the cut layers' whole size", note=f"every rank: {sorted({e['cut'] for e in everyone})} "
                                f"bytes of {whole}").check("==", round(1 / world, 6)))
            else:
                held, promised = sum(e["cut"] for e in everyone), world * everyone[0]["cut_share"]
                rows.append(Row("parallel", f"{model}, 2 x 2 mesh: cut parameter bytes on all ranks, {layout} "
                                f"(lesson 20)", held / 2 ** 20, "MB", held / promised, "what the placements promise",
                                note=f"ranks hold {min(e['cut'] for e in everyone) / whole:.4f}-"
                                     f"{max(e['cut'] for e in everyone) / whole:.4f} of the parameters "
                                     f"(uneven where a first dimension does not divide)").check("==", 1.0))
        busbw = r["bytes"] / r["all_reduce_seconds"] * 2 * (world - 1) / world / 1e9
        rows.append(Row("parallel", f"all_reduce of {cfg['mib']} MiB, {world} ranks (gloo): bus bandwidth", busbw,
                        "GB/s", note=f"{r['all_reduce_seconds'] * 1e3:.2f} ms per call, best of {cfg['rounds']} "
                                     f"rounds of {cfg['calls']}; lesson 18's definition"))
        if "step_seconds" in r:
            s = r["step_seconds"]
            rows.append(Row("parallel", f"{model}, 2 ranks: train step, tensor parallel, batch {cfg['batch']} on "
                            f"both", s["tp"] * 1e3, "ms/step", s["tp"] / s["ddp"],
                            f"DDP, {cfg['batch'] // 2} per rank (> 1: slower)",
                            note=f"DDP {s['ddp'] * 1e3:.1f} ms; best of {cfg['rounds']} rounds of {cfg['steps']} "
                                 f"steps, 1 thread per rank"))
        for key, b in r["bubble"].items():
            schedule, m = key.split()
            measured, formula = 1 - b["busy"] / b["seconds"], (world - 1) / (int(m) + world - 1)
            rows.append(Row("parallel", f"pipeline bubble, p = {world} stages, m = {m}, {schedule}, "
                            f"{cfg['stage_ms']} ms per stage forward (lesson 21)", measured, "of the step",
                            measured / formula, f"(p - 1) / (m + p - 1) = {formula:.3f}",
                            note=f"rank 0 computed {b['busy'] / cfg['pp_steps'] * 1e3:.0f} of "
                                 f"{b['seconds'] / cfg['pp_steps'] * 1e3:.0f} ms a step; mean of "
                                 f"{cfg['pp_steps']} steps").check("within", 0.15))
    return rows
