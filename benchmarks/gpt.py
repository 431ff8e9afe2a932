"""Section gpt: lesson 22 run as a learner runs it, one process against FSDP2, and the Hugging Face export.

- tokens/s per rank and MFU: `python day5/22_gpt_pretraining.py` on the CPU, one process with the global batch
  (--nproc 1) and FSDP2 over 2 ranks with half the rows each (--nproc 2): the same tokens a step, read from
  each run's metrics.json (the lesson times every step but the first; MFU against a matmul it times, as on
  any CPU).  On one machine the two ranks share its cores and send their collectives over loopback: a ratio
  below 1 is the price of sharding where nothing needs it; on GPUs each rank has its own device.
- memory: what rank 0 held as step 3 began (parameters, gradients, AdamW's two moments), FSDP2's
  against the one process's; the course's goal is at most 1.1 / W of it.
- memory against the estimate: the peak of step 3 that each run measured on rank 0 against the estimate
  (course/fit.py) that the lesson printed before its ranks started; the course's goal is within 5%.
- the export (lessons 22 and 23): a larger GPT's whole state dict (a few MB) written as a Hugging Face directory by
  course/checkpoints/hf.py's save_whole (model.safetensors, config.json and SHA256SUMS, moved into place whole)
  against torch.save of the same tensors, and the SHA-256 of model.safetensors against that save: what the
  digest that every later load checks costs.  Best of a few repeats, page cache.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import REPO, Row, best_of

LESSON = REPO / "day5" / "22_gpt_pretraining.py"


def lesson_run(args: list, out: Path, timeout: float = 900) -> dict:
    """The lesson, started as a learner starts it; its metrics.json."""
    cmd = [sys.executable, str(LESSON), *args, "--device", "cpu", "--run-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return json.loads((out / "metrics.json").read_text())


def export_rows(ctx, sizes: dict, seq: int) -> list:
    from course.checkpoints import hf
    from course.gpt import GPT, GPT_DEFAULTS

    torch.manual_seed(0)
    full = dict(GPT_DEFAULTS, **sizes)  # as lesson 22's gpt_sizes: the vocabulary and the rest from course/gpt.py
    state = GPT(**full).state_dict()
    mb = sum(v.numel() * v.element_size() for v in state.values()) / 2 ** 20
    repeats = ctx.pick(1, 3, 5)
    with tempfile.TemporaryDirectory(prefix="bench-gpt-", dir=ctx.out) as tmp:
        tmp = Path(tmp)
        export = best_of(lambda: hf.save_whole(tmp / "hf", state, full, seq), repeats)
        plain = best_of(lambda: torch.save(state, tmp / "model.pt"), repeats)
        digest = best_of(lambda: hf.sha256(tmp / "hf" / "model.safetensors"), repeats)
        assert hf.verify_digests(tmp / "hf")  # what a later load checks: the export is intact
    tag = f"gpt w{sizes['width']} d{sizes['depth']}, {mb:.1f} MB:"
    note = f"fp32, best of {repeats}, page cache"
    return [
        Row("gpt", f"{tag} export, Hugging Face directory (safetensors, config.json, SHA256SUMS)", mb / export,
            "MB/s", plain / export, "torch.save of the same tensors (> 1: faster)", note=note),
        Row("gpt", f"{tag} torch.save of the same tensors", mb / plain, "MB/s", note=note),
        Row("gpt", f"{tag} sha256 of model.safetensors", digest * 1e3, "ms", digest / export,
            "the whole export (its own digest included)", note=note),
    ]


def run(ctx):
    small = dict(width=32, depth=2, heads=4, hidden=64)
    sizes = ctx.pick(small, dict(width=64, depth=2, heads=4, hidden=172), dict(width=256, depth=4, heads=8, hidden=688))
    seq, steps, rows_per_step = ctx.pick(32, 64, 128), ctx.pick(4, 40, 100), 16
    common = ["--max-steps", str(steps), "--seq-len", str(seq), "--eval-rows", str(rows_per_step),
              "--sample-tokens", "0", "--seed", "0", *(f"--{k}={v}" for k, v in sizes.items())]
    with tempfile.TemporaryDirectory(prefix="bench-gpt-", dir=ctx.out) as tmp:
        one = lesson_run([*common, "--nproc", "1", "--batch-size", str(rows_per_step)], Path(tmp) / "one")
        fsdp = lesson_run([*common, "--nproc", "2", "--batch-size", str(rows_per_step // 2)], Path(tmp) / "fsdp")
    tag = f"gpt w{sizes['width']} d{sizes['depth']}, {rows_per_step} rows of {seq} tokens a step:"
    note = f"{one['parameters']:,} parameters, {steps} steps (the first untimed), CPU, gloo"
    held = {k: m["memory"]["held_before_bytes"] for k, m in (("one", one), ("fsdp", fsdp))}
    rows = [
        Row("gpt", f"{tag} tokens/s per rank, one process (lesson 22 --nproc 1)", one["tokens_per_second_per_rank"],
            "tokens/s", note=note),
        Row("gpt", f"{tag} tokens/s per rank, FSDP2 over 2 ranks (lesson 22 --nproc 2)",
            fsdp["tokens_per_second_per_rank"], "tokens/s",
            fsdp["tokens_per_second_per_rank"] / one["tokens_per_second_per_rank"],
            "one process (< 1: slower per rank)", note="the 2 ranks share this machine's cores"),
        Row("gpt", f"{tag} MFU, one process", one["mfu"], "", note=f"6 x non-embedding parameters + 12 x depth x "
            f"width x seq FLOPs a token (torchtitan), over {one['peak_flops_from']}"),
        Row("gpt", f"{tag} MFU, FSDP2 over 2 ranks", fsdp["mfu"], "", fsdp["mfu"] / one["mfu"], "one process",
            note="each run against the matmul peak it timed itself (2 ranks time it at once, sharing the cores)"),
        Row("gpt", f"{tag} held as step 3 began per rank, FSDP2 over 2 ranks", held["fsdp"] / 2 ** 20, "MB",
            held["fsdp"] / held["one"], "one process (the model whole)",
            note="parameters, gradients, AdamW's two moments; rank 0").check("<=", 1.1 / 2),
        *(Row("gpt", f"{tag} step 3's peak on rank 0, {what}: measured against course/fit.py's estimate",
              m["memory"]["peak_bytes"] / 2 ** 20, "MB", m["memory"]["peak_bytes"] / m["memory_estimate"]["peak_bytes"],
              "the estimate the lesson printed before its ranks started",
              note=f"estimated {m['memory_estimate']['peak_bytes']:,} bytes, measured {m['memory']['peak_bytes']:,} "
                   f"(live tensors on the CPU)").check("within", 0.05)
          for what, m in (("one process", one), ("FSDP2 over 2 ranks", fsdp))),
    ]
    bigger = ctx.pick(small, dict(width=256, depth=4, heads=8, hidden=688), dict(width=512, depth=8, heads=8, hidden=1376))
    return rows + export_rows(ctx, bigger, seq)  # a few MB: a save long enough to time
