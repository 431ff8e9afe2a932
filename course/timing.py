"""Lesson 7's bookkeeping: the table of timing runs (CSV, markdown, plot) and the explanation of one run.

Lesson 7 measures (compute and communication per step, samples/s); this module records each run as one row
of run_dir/timings.csv, keeps the latest run of each world size per configuration in scaling.csv,
scaling.md and scaling.png, and says with the run's own numbers whether more ranks paid off.

Noise: the steps of a run are cut into NOISE_BLOCKS blocks of consecutive steps; half the range of the
blocks' speeds, relative to the run's speed, is the run's noise.  A speed-up (the ratio of two runs) carries
both runs' noises, added in quadrature, and a verdict says "pay off" or "do not pay off" only when 1.0 lies
outside speed-up +- noise.
"""
import csv
import fcntl
import math
import os
import socket
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from course.output import write_csv

COLUMNS = ["date", "host", "world_size", "threads_per_rank", "model", "batch_per_rank", "device", "backend",
           "epochs", "samples", "train_seconds", "samples_per_second", "step_ms", "compute_ms", "comm_ms",
           "comm_share", "allreduce_ms", "load", "noise"]
NOISE_BLOCKS = 5
LESSON = "day1/7_mnist_ddp_pt_timing.py"


def noise(step_seconds: list) -> float:
    """Half the range of the speeds of NOISE_BLOCKS blocks of consecutive steps, relative to their mean."""
    n = len(step_seconds) // NOISE_BLOCKS
    if n == 0:
        return 0.0
    speeds = [n / sum(step_seconds[i * n:(i + 1) * n]) for i in range(NOISE_BLOCKS)]
    return (max(speeds) - min(speeds)) / 2 / (sum(speeds) / len(speeds))


def add_world_size(p):
    """Lesson 7's world size: a positional argument, as in the original workshop, or --nproc."""
    import argparse

    from course.cli import positive_int

    p.add_argument("world_size", nargs="?", type=positive_int, default=None,
                   help="processes to spawn, as in the original workshop's `python 7_mnist_ddp_pt_timing.py "
                        "4`: the same as --nproc")
    p.add_argument("--nproc", type=positive_int, default=argparse.SUPPRESS,
                   help="processes to spawn when started with plain python (ignored under torchrun/srun, "
                        "which choose the world size) (default: 2)")
    return p


def world_size_asked(args, parser):
    """The world size asked for on the command line (None if none); a positional and a --nproc that disagree
    are an error, and so is --sweep under a launcher that chose the world size."""
    from course.launch import detect_launcher

    launcher = detect_launcher()
    if args.sweep and launcher != "self":
        parser.error(f"--sweep starts its own workers; under {launcher} run one world size per call "
                     f"(each call adds a row to the table)")
    nproc = getattr(args, "nproc", None)
    if args.world_size and nproc and args.world_size != nproc:
        parser.error(f"world size {args.world_size} and --nproc {nproc} disagree; give one of them")
    return args.world_size or nproc


def time_allreduce(numel: int, steps: int, device) -> float:
    """The fastest of at least 30 all_reduces of a buffer as large as all the gradients, in ms: the wire cost
    alone.  The fastest, not the median: one all_reduce after a barrier also pays for the rank that left the
    barrier last and for threads that waited for a busy core; the fastest comes closest to the transfer."""
    import torch
    import torch.distributed as dist

    def wait():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    buffer, times = torch.zeros(numel, device=device), []
    for _ in range(max(steps, 30) + 3):
        dist.barrier()
        wait()
        start = time.perf_counter()
        dist.all_reduce(buffer)  # what DDP's gradient buckets add up to, in one message
        wait()
        times.append((time.perf_counter() - start) * 1000)
    return min(times[3:])


def row(args, world_size: int, device, epochs: int, samples: int, step_seconds: list, compute_ms: float,
        comm_ms: float, allreduce_ms: float, load: float) -> dict:
    """One run's row of timings.csv."""
    import torch
    import torch.distributed as dist

    train_seconds = sum(step_seconds)
    return {"date": datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname(),
            "world_size": world_size, "threads_per_rank": torch.get_num_threads(), "model": args.model,
            "batch_per_rank": args.batch_size, "device": device.type, "backend": dist.get_backend(),
            "epochs": epochs, "samples": samples, "train_seconds": round(train_seconds, 6),
            "samples_per_second": round(samples / train_seconds, 1),
            "step_ms": round(train_seconds * 1000 / len(step_seconds), 3), "compute_ms": round(compute_ms, 3),
            "comm_ms": round(comm_ms, 3), "comm_share": round(comm_ms / (compute_ms + comm_ms), 3),
            "allreduce_ms": round(allreduce_ms, 3), "load": round(load, 2), "noise": round(noise(step_seconds), 4)}


def config(row) -> tuple:
    """Runs are comparable when only the world size (and so the threads per rank) differs."""
    return row["host"], row["device"], row["model"], str(row["batch_per_rank"])


@contextmanager
def locked(run_dir: Path):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ".timings.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs writing one run dir add both rows, never lose one
        yield


def record(run_dir: Path, row: dict, fresh: bool = False) -> list:
    """Append `row` to timings.csv, rewrite the table and plot, and return the table's rows."""
    path = run_dir / "timings.csv"
    with locked(run_dir):
        rows = []
        if path.exists() and not fresh:
            with open(path, newline="") as f:
                rows = [{c: r.get(c, "") for c in COLUMNS} for r in csv.DictReader(f)]
        rows.append(row)
        write_csv(path, rows, COLUMNS)
        table = summarize(rows)
        write_csv(run_dir / "scaling.csv", table, list(table[0]))
        (run_dir / "scaling.md").write_text(markdown(table) + "\n")
        plot(run_dir / "scaling.png", table)
    return table


def _noise(row) -> float:
    return float(row.get("noise") or 0.0)  # rows written before the noise was recorded: unknown, 0


def summarize(rows: list) -> list:
    """The latest run of each world size per configuration, with its speed-up over 1 rank (and its noise)."""
    latest = {}
    for r in rows:
        latest[config(r) + (int(r["world_size"]),)] = r
    table = []
    for key in sorted(latest):
        r = latest[key]
        base = latest.get(key[:4] + (1,))
        speedup = float(r["samples_per_second"]) / float(base["samples_per_second"]) if base else None
        spread = speedup * math.hypot(_noise(r), _noise(base)) if base and base is not r else 0.0
        table.append({"host": r["host"], "device": r["device"], "model": r["model"],
                      "batch_per_rank": int(r["batch_per_rank"]), "world_size": int(r["world_size"]),
                      "threads_per_rank": int(r["threads_per_rank"]), "samples": int(r["samples"]),
                      "train_seconds": float(r["train_seconds"]),
                      "samples_per_second": float(r["samples_per_second"]),
                      "speedup": round(speedup, 3) if speedup is not None else "",
                      "speedup_noise": round(spread, 3) if speedup is not None else "",
                      "compute_ms": float(r["compute_ms"]), "comm_ms": float(r["comm_ms"]),
                      "comm_share": float(r["comm_share"]), "date": r["date"]})
    return table


def markdown(table: list) -> str:
    head = ["model", "batch/rank", "device", "ranks x threads", "samples", "train s", "samples/s", "speed-up",
            "compute ms/step", "comm ms/step", "comm share"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        if r["speedup"] == "":
            speedup = "(no 1-rank run)"
        elif r["world_size"] == 1:
            speedup = f"{r['speedup']:.2f}x"
        else:
            speedup = f"{r['speedup']:.2f}x ± {r['speedup_noise']:.2f}"
        lines.append(f"| {r['model']} | {r['batch_per_rank']} | {r['device']} | "
                     f"{r['world_size']} x {r['threads_per_rank']} | {r['samples']} | {r['train_seconds']:.2f} | "
                     f"{r['samples_per_second']:.0f} | {speedup} | {r['compute_ms']:.3f} | {r['comm_ms']:.3f} | "
                     f"{r['comm_share']:.0%} |")
    return "\n".join(lines)


def plot(path: Path, table: list) -> None:
    """Time per 10 000 samples and speed-up against world size, one line per configuration."""
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
    hosts = {r["host"] for r in table}
    top = max(r["world_size"] for r in table)
    for key in sorted({config(r) for r in table}):
        rows = [r for r in table if config(r) == key]
        label = f"{key[2]}, batch {key[3]}, {key[1]}" + (f", {key[0]}" if len(hosts) > 1 else "")
        sizes = [r["world_size"] for r in rows]
        ax_time.plot(sizes, [1e4 / r["samples_per_second"] for r in rows], "o-", label=label)
        with_base = [r for r in rows if r["speedup"] != ""]
        ax_speed.errorbar([r["world_size"] for r in with_base], [r["speedup"] for r in with_base],
                          yerr=[r["speedup_noise"] for r in with_base], fmt="o-", capsize=3, label=label)
    ax_speed.plot([1, top], [1, top], "k:", label="ideal (W times)")
    ax_time.set(xlabel="world size (ranks)", ylabel="training time per 10 000 samples (s)", title="time")
    ax_speed.set(xlabel="world size (ranks)", ylabel="speed-up over 1 rank", title="speed-up (± noise)")
    for ax in (ax_time, ax_speed):
        ax.grid(alpha=0.3)
        ax.set_xticks(range(1, top + 1))
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def advice(row: dict) -> str:
    """What to try next, depending on what this run already did."""
    more = ([] if row["model"] == "cnn" else ["--model cnn"]) + ([] if row["batch_per_rank"] >= 512 else
                                                                 ["--batch-size 512"])
    if more:
        return (f"A small model on few cores has too little work per step to hide an all_reduce: give each step "
                f"more work ({' '.join(more)}), or give each rank its own GPU.")
    return (f"This run already gave each step the most work this lesson offers ({row['model']} at batch "
            f"{row['batch_per_rank']} per rank); more ranks on the same {os.cpu_count()} cores bring no more "
            f"cores: give each rank its own GPU, or its own cores on more nodes (day 2).")


def explain(row: dict, table: list, numel: int, run_dir: Path) -> None:
    """Say, with this run's numbers, whether this world size pays off and why."""
    w, b, c, m = row["world_size"], row["batch_per_rank"], row["compute_ms"], row["comm_ms"]
    print(f"{w} ranks x {row['threads_per_rank']} threads, {row['model']} at batch {b} per rank: "
          f"compute {c:.3f} ms/step, communication {m:.3f} ms/step -> {row['comm_share']:.0%} of a step "
          f"is communication (the fastest bare all_reduce of the {numel * 4 / 1e6:.2f} MB of gradients: "
          f"{row['allreduce_ms']:.3f} ms)", flush=True)
    cores = os.cpu_count()
    if row["load"] > cores + 1:
        print(f"note: load {row['load']:.1f} on {cores} cores: more processes wanted a core than there were "
              f"(other programs, or more ranks than cores); threads that wait for a core stall each other, "
              f"and these timings are noisy")
    if w == 1:
        print("1 rank has nobody to talk to: its 'communication' is DDP's own bookkeeping around a 1-rank "
              "all_reduce, and noise.  This is the baseline the other world sizes are compared with.")
        return
    print(f"with {w} ranks expect at most {w} x {c:.3f} / ({c:.3f} + {m:.3f}) = {w * c / (c + m):.2f}x the "
          f"speed of 1 rank, if each rank had the compute of 1 rank (its own GPU, its own cores)")
    base = next((r for r in table if config(r) == config(row) and r["world_size"] == 1), None)
    if base is None:
        print(f"no 1-rank run with these settings in {run_dir}; add one with: python {LESSON} 1 --model "
              f"{row['model']} --batch-size {b} --run-dir {run_dir} (or run with --sweep)")
        return
    this = next(r for r in table if config(r) == config(row) and r["world_size"] == w)
    c1, t1, t = base["compute_ms"], base["threads_per_rank"], row["threads_per_rank"]
    measured = row["samples_per_second"] / base["samples_per_second"]
    spread = this["speedup_noise"]
    relative = spread / measured if measured else 0.0
    gain = w * c1 / c
    print(f"1 rank x {t1} threads computes a step of {b} samples in {c1:.3f} ms, each of {w} ranks x {t} "
          f"threads in {c:.3f} ms: speed-up = {w} x c_1 / (c_{w} + m_{w}) = {w} x {c1:.3f} / ({c:.3f} + "
          f"{m:.3f}) = {w * c1 / (c + m):.2f}x predicted, {measured:.2f}x measured over the whole training "
          f"(± {spread:.2f}: the spread of the steps' speeds in both runs)")
    print(f"  = {gain:.2f}x from splitting the cores into ranks ({w} x c_1 / c_{w}) x {c / (c + m):.2f}, the "
          f"share of a step left after communication (c_{w} / (c_{w} + m_{w}))")
    if gain * (1 - relative) > 1:
        split = f"{w} processes x {t} threads compute {gain:.2f}x faster than 1 process x {t1} threads " \
                f"(small operations split badly over threads, and a thread waiting for a busy core stalls " \
                f"the others)"
    elif gain * (1 + relative) < 1:
        split = f"{w} processes x {t} threads compute slower than 1 process x {t1} threads ({gain:.2f}x)"
    else:
        split = (f"the {w} ranks share the cores 1 process had: they add no cores, and how much better they use "
                 f"them ({gain:.2f}x) is within the noise")
    if measured - spread > 1:
        verdict = "pay off"
    elif measured + spread < 1:
        verdict = "do not pay off"
    else:
        verdict = "make no measurable difference"
    print(f"{w} ranks {verdict} here ({measured:.2f}x ± {spread:.2f} against 1.0): {split}; communication "
          f"costs {m:.3f} ms of every {c + m:.3f} ms step ({row['comm_share']:.0%}).", flush=True)
    if verdict != "pay off":
        print(advice(row), flush=True)
