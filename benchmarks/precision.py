"""Section precision: the ViT's training step in fp32, bf16 and fp16 (lesson 13's step), in one process.

The step is lesson 13's without DDP: autocast around the forward pass, GradScaler around backward (fp16
only), unscale_, clip_grad_norm_, SGD step.  The precision changes the compute, not the communication (the
gradients DDP all_reduces stay fp32), so one process with the benchmark's threads measures what it changes.
Default ViT (width 64, depth 4, 4 heads, 16 tokens), batch 64 of real images; times are the best of rounds
that interleave the three precisions (common.best_of_each), ratios against fp32 (> 1: slower than fp32).
A CPU computes 16-bit matrix products natively only with avx512_bf16 / amx_bf16 (lscpu's flags); without
them the inputs are converted and the products are slower than fp32.  The flags found are in the rows'
notes.  With CUDA the same rows on one GPU.
Lesson 13's --compile: the fp32 step with the model under torch.compile against the same step eager, both
after warm-up (the first compiled call compiles forward and backward: its seconds are a row of their own).
--smoke compiles with backend "eager" (dynamo's capture only, seconds instead of a minute): its numbers say
nothing about inductor.
"""
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import Row, best_of_each
from course.models import ViT
from course.training.precision import DTYPES
from data_tools.datasets import InMemoryMNIST

BATCH = 64


def cpu_flags() -> str:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "CPU flags unknown"
    found = [f for f in ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16") if f in flags]
    return "CPU has " + (", ".join(found) if found else "no avx512_bf16/amx_bf16/avx512_fp16/amx_fp16")


def step_fn(precision: str, device: torch.device, x, y, compile_backend: str = None):
    """One training step of lesson 13 at this precision, as a function of no arguments (the model under
    torch.compile with `compile_backend`, if given)."""
    torch.manual_seed(0)
    model = ViT().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if compile_backend:
        model = torch.compile(model, backend=compile_backend)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    dtype = DTYPES[precision]

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()

    return step


def measure(ctx, device: torch.device, x, y) -> dict:
    steps = {p: step_fn(p, device, x, y) for p in DTYPES}
    for step in steps.values():  # warm-up: first-call allocations, oneDNN/cuBLAS kernel choice
        for _ in range(ctx.pick(1, 2, 3)):
            step()
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    repeats = ctx.pick(1, 5, 15)
    return best_of_each(steps, repeats, sync)


def compiled_vs_eager(ctx, device: torch.device, x, y) -> tuple:
    """(compile seconds, {"eager": s, "compiled": s}) for lesson 13's fp32 step."""
    steps = {"eager": step_fn("fp32", device, x, y),
             "compiled": step_fn("fp32", device, x, y, "eager" if ctx.smoke else "inductor")}
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    start = time.perf_counter()
    steps["compiled"]()  # compiles the forward and the backward
    if sync:
        sync()
    compile_seconds = time.perf_counter() - start
    for step in steps.values():
        for _ in range(ctx.pick(1, 2, 3)):
            step()
    return compile_seconds, best_of_each(steps, ctx.pick(1, 5, 15), sync)


def run(ctx) -> list:
    rows = []
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if ctx.cuda else [])
    for device in devices:
        batch = InMemoryMNIST(ctx.dataset, "train", ctx.data_dir, device, limit=BATCH)  # one batch, read once
        best = measure(ctx, device, batch.images, batch.labels)
        where = f"{torch.get_num_threads()} CPU threads" if device.type == "cpu" else torch.cuda.get_device_name()
        note = cpu_flags() if device.type == "cpu" else f"bf16 supported: {torch.cuda.is_bf16_supported()}"
        for p, seconds in best.items():
            rows.append(Row("precision", f"vit, batch {BATCH}, {where}: train step in {p}"
                            + (" (GradScaler)" if p == "fp16" else ""), seconds * 1e3, "ms/step",
                            *((seconds / best["fp32"], "the same step in fp32 (> 1: slower)") if p != "fp32" else ()),
                            note=note))
        compile_seconds, best = compiled_vs_eager(ctx, device, batch.images, batch.labels)
        backend = "backend eager (--smoke)" if ctx.smoke else "inductor"
        rows.append(Row("precision", f"vit, batch {BATCH}, {where}: torch.compile ({backend}), the first step",
                        compile_seconds, "s", note="compiling forward and backward; cached afterwards"))
        rows.append(Row("precision", f"vit, batch {BATCH}, {where}: train step in fp32, compiled ({backend})",
                        best["compiled"] * 1e3, "ms/step", best["compiled"] / best["eager"],
                        "the same step eager, after warm-up (< 1: faster)", note=note))
    return rows
