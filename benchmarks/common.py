"""What every section shares: a result row, timing helpers, spawning ranks, and the table/CSV/plot writers.

Every comparison is a ratio of two numbers measured in the same run, on the same machine, minutes apart.
Times are the best of several repeats: on a shared or noisy machine the minimum is the estimate least
disturbed by other processes (every side of a ratio is treated the same way).
"""
import importlib.util
import io
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from pathlib import Path

import torch

from course.launching.devices import usable_cpus
from course.launching.ports import free_port
from course.launching.supervise import before_init_process_group, start_method

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("input", "hdf5", "sync", "train", "startup", "precision", "accumulation", "fsdp", "dcp", "memory",
            "parallel", "gpt")


@dataclass
class Row:
    section: str
    name: str            # what was measured
    value: float
    unit: str
    ratio: float = None  # value / (the reference's value), or the reverse for times: see `vs`
    vs: str = ""         # what the ratio compares against
    goal: str = ""       # the course's goal for this ratio (or value), e.g. ">= 30"
    status: str = ""     # "met", "not met", or "" when the row has no goal
    note: str = ""

    def check(self, op: str, threshold: float, on: str = "ratio") -> "Row":
        x = self.ratio if on == "ratio" else self.value
        ok = x is not None and math.isfinite(x) and (x >= threshold if op == ">=" else x <= threshold if op == "<="
                                                     else abs(x - 1) <= threshold if op == "within"
                                                     else abs(x - threshold) <= 1e-9 * max(1.0, abs(threshold)))
        self.goal = (f"{on} within {threshold:.0%} of 1" if op == "within" else
                     f"{on} {op} {threshold:g}" + (f" {self.unit}" if on == "value" else ""))
        self.status = "met" if ok else "not met"
        return self


COLUMNS = [f.name for f in fields(Row)]


@dataclass
class Context:
    dataset: str
    data_dir: Path
    out: Path
    smoke: bool          # tiny sizes: exercises every code path in seconds, the numbers mean nothing
    large: bool          # bigger sizes, full epochs, more repeats
    cuda: bool           # also measure the GPU rows

    def pick(self, smoke, default, large):
        return smoke if self.smoke else large if self.large else default


def best_of(fn, repeats: int, sync=None) -> float:
    """The shortest of `repeats` timed calls of fn(), in seconds."""
    return best_of_each({"fn": fn}, repeats, sync)["fn"]


def best_of_each(fns: dict, repeats: int, sync=None) -> dict:
    """{name: shortest time} of several functions timed in interleaved rounds, so that a slow spell of the
    machine hits all of them alike instead of one."""
    best = {name: math.inf for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if sync:
                sync()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def load_lesson(relative_path: str):
    """Import a lesson file (its name starts with a digit, so `import` cannot): the benchmark measures
    the lessons' own functions, not copies of them."""
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(f"lesson_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _spawned(rank, fn, world, port, cfg, result_path):
    import torch.distributed as dist

    torch.set_num_threads(cfg.get("threads") or max(1, usable_cpus() // world))  # the CPUs this process may use
    if world > 1:
        before_init_process_group()  # the workers train, as the lessons' ranks do
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        result = fn(rank, world, cfg)
        if rank == 0:
            Path(result_path).write_text(json.dumps(result))
    finally:
        if world > 1:
            dist.destroy_process_group()


def spawn(fn, world: int, cfg: dict):
    """Run fn(rank, world, cfg) in `world` fresh processes (gloo process group when world > 1, 127.0.0.1,
    a free port) and return what rank 0 returned (JSON-serializable).  The processes are started as the
    lessons' ranks are: forked from a fork server that has imported torch and the benchmark's modules once."""
    method = start_method(packages=("benchmarks", "course", "data_tools"))
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        result_path = Path(tmp) / "result.json"
        torch.multiprocessing.start_processes(_spawned, args=(fn, world, free_port(), cfg, str(result_path)),
                                              nprocs=world, join=True, start_method=method)
        return json.loads(result_path.read_text())


def max_over_ranks(seconds: float) -> float:
    """A step is as slow as its slowest rank."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# ----------------------------------------------------------------------------------------- reports

def fmt(x, digits=3) -> str:
    if x is None:
        return ""
    if isinstance(x, str):
        return x
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    mag = math.floor(math.log10(abs(x)))
    if mag >= 6:
        return f"{x:.3g}"
    return f"{x:,.{max(0, digits - 1 - mag)}f}"


def table(rows, markdown=False) -> str:
    head = ["section", "measurement", "value", "unit", "ratio", "vs", "goal", "status"]
    body = [[r.section, r.name, fmt(r.value), r.unit, f"{fmt(r.ratio)}x" if r.ratio is not None else "",
             r.vs, r.goal, r.status] for r in rows]
    if markdown:  # the notes too: the terminal is too narrow for them, the CSV has them
        head.append("note")
        body = [line + [r.note] for line, r in zip(body, rows)]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in line) + " |" for line in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(line[i]) for line in body)) if body else len(h) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in body]
    return "\n".join(out)


def write_reports(out: Path, rows, meta: dict) -> dict:
    """bench.csv (one row per measurement), bench.json (rows + machine), bench.md (the table), bench.png."""
    from course.training.output import _atomic_write, write_csv, write_json

    csv_rows = [{k: ("" if v is None else v) for k, v in asdict(r).items()} for r in rows]
    paths = {"csv": write_csv(out / "bench.csv", csv_rows, COLUMNS),
             "json": write_json(out / "bench.json", {"meta": meta, "rows": [asdict(r) for r in rows]})}
    md = f"{meta_line(meta)}\n\n{table(rows, markdown=True)}\n"
    paths["md"] = _atomic_write(out / "bench.md", lambda f: f.write(md.encode()))
    paths["png"] = plot(out / "bench.png", rows, meta)
    return paths


def meta_line(meta: dict) -> str:
    return (f"Measured {meta['date']} on {meta['machine']} with `{meta['command']}` "
            f"(torch {meta['torch']}, {meta['threads']} threads{', ' + meta['gpu'] if meta.get('gpu') else ''}).")


def plot(path: Path, rows, meta: dict) -> Path:
    """One panel per section: a bar per ratio (log scale), coloured by its goal: green met, red not met."""
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt
    from course.training.output import _atomic_write

    sections = [s for s in SECTIONS if any(r.section == s and r.ratio is not None for r in rows)]
    heights = [max(1, sum(1 for r in rows if r.section == s and r.ratio is not None)) for s in sections] or [1]
    fig, axes = plt.subplots(len(heights), 1, figsize=(14, 1.2 + 0.3 * sum(heights) + 0.6 * len(heights)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False, layout="constrained")
    for ax, section in zip(axes[:, 0], sections):
        mine = [r for r in rows if r.section == section and r.ratio is not None]
        labels = [f"{r.name}  (vs {r.vs})" if r.vs else r.name for r in mine]
        labels = [label if len(label) <= 95 else label[:92] + "..." for label in labels]
        ratios = [r.ratio if r.ratio and math.isfinite(r.ratio) and r.ratio > 0 else float("nan") for r in mine]
        colors = ["tab:green" if r.status == "met" else "tab:red" if r.status == "not met" else "tab:gray"
                  for r in mine]
        y = range(len(mine))
        ax.barh(y, ratios, color=colors)
        ax.set_yticks(list(y), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.axvline(1.0, color="black", linewidth=0.8)
        for yi, r in zip(y, ratios):
            if math.isfinite(r):
                ax.text(r, yi, f" {fmt(r)}x", va="center", fontsize=7)
        ax.set_title(section, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ratio (log scale; green: goal met, red: goal not met, grey: no goal)")
    fig.suptitle(meta_line(meta), fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return _atomic_write(path, lambda f: f.write(buf.getvalue()))
