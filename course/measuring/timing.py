"""Lesson 7's bookkeeping: the table of timing runs (CSV, markdown, plot) and the explanation of one run.

Lesson 7 measures (the parts of a step: compute, communication not overlapped, fixed costs; samples/s; the
CPU other programs used meanwhile); this module records each run as one row of run_dir/timings.csv, keeps
the latest run of each world size per configuration in scaling.csv, scaling.md and scaling.png, and says
with the run's own numbers whether the parts account for the training's step, what speed-up they predict,
and whether more ranks paid off.

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
import statistics
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from course.training.output import write_csv

COLUMNS = ["date", "host", "world_size", "threads_per_rank", "model", "batch_per_rank", "device", "backend",
           "epochs", "samples", "train_seconds", "samples_per_second", "step_ms", "compute_ms", "comm_ms",
           "comm_share", "allreduce_ms", "load", "noise", "fixed_ms", "other_cores", "median_step_ms"]
NOISE_BLOCKS = 5
LESSON = "day1/7_mnist_ddp_pt_timing.py"
ACCOUNTED = 0.15  # the parts "account for" a step when they add up to it within this share
BUSY = 0.5  # other programs using more cores than this make a run's timings a statement about them


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

    from course.launching.cli import NprocGiven, positive_int

    p.add_argument("world_size", nargs="?", type=positive_int, default=None, action=NprocGiven,
                   help="processes to spawn, as in the original workshop's `python 7_mnist_ddp_pt_timing.py "
                        "4`: the same as --nproc")
    p.add_argument("--nproc", type=positive_int, default=argparse.SUPPRESS, action=NprocGiven,
                   help="processes to spawn when started with plain python, also in a one-task srun step "
                        "(ignored under torchrun; under srun with several tasks they are the ranks) (default: 2)")
    return p


def add_args(p):
    """Lesson 7's options besides lesson 6's: the world size, --sweep, --fresh, --probe-steps."""
    from course.launching.cli import positive_int

    add_world_size(p)
    p.add_argument("--sweep", action="store_true",
                   help="run world sizes 1, 2, ..., N one after another, N from world_size or --nproc "
                        "(plain python only)")
    p.add_argument("--fresh", action="store_true", help="drop the earlier rows of run_dir/timings.csv first")
    p.add_argument("--probe-steps", type=positive_int, default=20,
                   help="times each part of a step is timed before training (medians are kept)")
    return p


def world_size_asked(args, parser):
    """The world size asked for on the command line (None if none); a positional and a --nproc that disagree
    are an error, and so is --sweep under a launcher that chose the world size."""
    from course.launching.environment import detect_launcher

    launcher = detect_launcher(args)
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

    from course.measuring.hardware import clock  # on a GPU once its queued work is done

    buffer, times = torch.zeros(numel, device=device), []
    for _ in range(max(steps, 30) + 3):
        dist.barrier()
        start = clock(device)
        dist.all_reduce(buffer)  # what DDP's gradient buckets add up to, in one message
        times.append((clock(device) - start) * 1000)
    return min(times[3:])


def cpu_seconds() -> tuple:
    """(CPU seconds this node has been busy, all programs together; CPU seconds of this process; the clock),
    or None where /proc/stat does not exist."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    return busy, time.process_time(), time.perf_counter()


def other_cores(before, local_world_size: int) -> float:
    """This rank's share of the cores that programs other than the ranks kept busy on its node since
    `before` (cpu_seconds()): the node's busy time split evenly over its ranks, less this rank's own, per
    second, so that the sum over all ranks is the cores other programs used on all nodes."""
    after = cpu_seconds()
    if not (before and after) or after[2] <= before[2]:
        return 0.0
    busy, own, wall = (a - b for a, b in zip(after, before))
    return (busy / local_world_size - own) / wall


def row(args, world_size: int, device, epochs: int, samples: int, step_seconds: list, compute_ms: float,
        comm_ms: float, fixed_ms: float, allreduce_ms: float, other_cores: float) -> dict:
    """One run's row of timings.csv.  load: the 1-minute load average (processes wanting a core, the ranks
    included); other_cores: how many cores other programs kept busy during training, on average."""
    import torch
    import torch.distributed as dist

    train_seconds = sum(step_seconds)
    step_ms = compute_ms + comm_ms + fixed_ms
    return {"date": datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname(),
            "world_size": world_size, "threads_per_rank": torch.get_num_threads(), "model": args.model,
            "batch_per_rank": args.batch_size, "device": device.type, "backend": dist.get_backend(),
            "epochs": epochs, "samples": samples, "train_seconds": round(train_seconds, 6),
            "samples_per_second": round(samples / train_seconds, 1),
            "step_ms": round(train_seconds * 1000 / len(step_seconds), 3), "compute_ms": round(compute_ms, 3),
            "comm_ms": round(comm_ms, 3), "comm_share": round(comm_ms / step_ms, 3),
            "allreduce_ms": round(allreduce_ms, 3), "load": round(os.getloadavg()[0], 2),
            "noise": round(noise(step_seconds), 4), "fixed_ms": round(fixed_ms, 3),
            "other_cores": round(max(0.0, other_cores), 2),
            "median_step_ms": round(statistics.median(step_seconds) * 1000, 3)}


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


def parts(row) -> tuple:
    """(compute, communication not overlapped, fixed costs): ms per step on each rank, timed before training
    (rows written before the fixed costs were timed have 0 for them)."""
    return float(row["compute_ms"]), float(row["comm_ms"]), float(row.get("fixed_ms") or 0.0)


def predicted(row, base) -> float:
    """The speed-up the parts predict: W ranks do W*b samples in s_W = c_W + m_W + f_W ms, 1 rank does b
    samples in s_1 ms, so W * s_1 / s_W."""
    return int(row["world_size"]) * sum(parts(base)) / sum(parts(row))


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
        c, m, f = parts(r)
        table.append({"host": r["host"], "device": r["device"], "model": r["model"],
                      "batch_per_rank": int(r["batch_per_rank"]), "world_size": int(r["world_size"]),
                      "threads_per_rank": int(r["threads_per_rank"]), "samples": int(r["samples"]),
                      "train_seconds": float(r["train_seconds"]),
                      "samples_per_second": float(r["samples_per_second"]),
                      "speedup": round(speedup, 3) if speedup is not None else "",
                      "speedup_noise": round(spread, 3) if speedup is not None else "",
                      "predicted": round(predicted(r, base), 3) if base else "",
                      "compute_ms": c, "comm_ms": m, "fixed_ms": f, "parts_ms": round(c + m + f, 3),
                      "step_ms": float(r["step_ms"]),
                      "median_step_ms": float(r.get("median_step_ms") or r["step_ms"]),
                      "comm_share": float(r["comm_share"]),
                      "other_cores": float(r.get("other_cores") or 0.0), "date": r["date"]})
    return table


def markdown(table: list) -> str:
    head = ["model", "batch/rank", "device", "ranks x threads", "samples", "train s", "samples/s", "speed-up",
            "predicted", "compute ms", "comm ms", "fixed ms", "parts ms", "step ms", "comm share", "others' cores"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        if r["speedup"] == "":
            speedup = "(no 1-rank run)"
        elif r["world_size"] == 1:
            speedup = f"{r['speedup']:.2f}x"
        else:
            speedup = f"{r['speedup']:.2f}x ± {r['speedup_noise']:.2f}"
        guess = f"{r['predicted']:.2f}x" if r["predicted"] != "" else ""
        lines.append(f"| {r['model']} | {r['batch_per_rank']} | {r['device']} | "
                     f"{r['world_size']} x {r['threads_per_rank']} | {r['samples']} | {r['train_seconds']:.2f} | "
                     f"{r['samples_per_second']:.0f} | {speedup} | {guess} | {r['compute_ms']:.3f} | "
                     f"{r['comm_ms']:.3f} | {r['fixed_ms']:.3f} | {r['parts_ms']:.3f} | {r['step_ms']:.3f} | "
                     f"{r['comm_share']:.0%} | {r['other_cores']:.2f} |")
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
        line = ax_speed.errorbar([r["world_size"] for r in with_base], [r["speedup"] for r in with_base],
                                 yerr=[r["speedup_noise"] for r in with_base], fmt="o-", capsize=3,
                                 label=f"{label}: measured")
        ax_speed.plot([r["world_size"] for r in with_base], [r["predicted"] for r in with_base], "x--",
                      color=line[0].get_color(), label=f"{label}: predicted from the parts")
    ax_speed.plot([1, top], [1, top], "k:", label="ideal (W times)")
    ax_time.set(xlabel="world size (ranks)", ylabel="training time per 10 000 samples (s)", title="time")
    ax_speed.set(xlabel="world size (ranks)", ylabel="speed-up over 1 rank",
                 title="speed-up: measured (± noise) and predicted")
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
    """Say, with this run's numbers, whether its parts account for its step, what speed-up they predict,
    and whether this world size pays off and why."""
    w, b, t = row["world_size"], row["batch_per_rank"], row["threads_per_rank"]
    c, m, f = parts(row)
    s, step, cores = c + m + f, row["step_ms"], os.cpu_count()
    print(f"{w} ranks x {t} threads, {row['model']} at batch {b} per rank: compute {c:.3f} ms/step, "
          f"communication {m:.3f} ms/step, fixed costs {f:.3f} ms/step (timed before training) -> a step of "
          f"{s:.3f} ms, {row['comm_share']:.0%} of it communication (the fastest bare all_reduce of the "
          f"{numel * 4 / 1e6:.2f} MB of gradients: {row['allreduce_ms']:.3f} ms)", flush=True)
    typical = float(row.get("median_step_ms") or step)
    print(f"training took {step:.3f} ms per step: the parts add up to {s / step:.0%} of it (the median step: "
          f"{typical:.3f} ms)")
    if row["other_cores"] > BUSY:
        print(f"note: other programs kept {row['other_cores']:.2f} of the {cores} cores busy during training: "
              f"a thread that waits for a core stalls the others, and these timings say as much about those "
              f"programs as about DDP")
    if abs(s / step - 1) > ACCOUNTED:
        gap = f"miss {step - s:.3f} ms of a training step" if s < step else \
            f"exceed a training step by {s - step:.3f} ms"
        print(f"the parts {gap}: " + missing(row, cores))
    if w == 1:
        print("1 rank has nobody to talk to: its 'communication' is DDP's own bookkeeping around a 1-rank "
              "all_reduce, and noise.  This is the baseline the other world sizes are compared with.")
        return
    base = next((r for r in table if config(r) == config(row) and r["world_size"] == 1), None)
    if base is None:
        print(f"no 1-rank run with these settings in {run_dir}; add one with: python {LESSON} 1 --model "
              f"{row['model']} --batch-size {b} --run-dir {run_dir} (or run with --sweep)")
        return
    this = next(r for r in table if config(r) == config(row) and r["world_size"] == w)
    c1, m1, f1 = parts(base)
    s1, t1 = c1 + m1 + f1, base["threads_per_rank"]
    measured = row["samples_per_second"] / base["samples_per_second"]
    spread = this["speedup_noise"]
    relative = spread / measured if measured else 0.0
    gain = w * (c1 + f1) / (c + f)
    left, left1 = (c + f) / s, (c1 + f1) / s1
    print(f"speed-up = {w} x s_1 / s_{w} = {w} x {s1:.3f} / {s:.3f} = {w * s1 / s:.2f}x predicted, "
          f"{measured:.2f}x measured over the whole training (± {spread:.2f}: the spread of the steps' speeds "
          f"in both runs)")
    print(f"  = {gain:.2f}x from splitting the cores into ranks ({w} x (c_1 + f_1) / (c_{w} + f_{w}): {w} "
          f"processes x {t} threads against 1 process x {t1} threads, on a step's work without communication) "
          f"x {left / left1:.2f} from communication (what it leaves of a step: {left:.2f} with {w} ranks, "
          f"{left1:.2f} with 1)")
    print(f"with a GPU or node of its own, each rank would keep the compute and fixed costs of 1 rank: about "
          f"{w} x {s1:.3f} / ({c1:.3f} + {f1:.3f} + {m:.3f}) = {w * s1 / (c1 + f1 + m):.2f}x, with the "
          f"communication measured here")
    if gain * (1 - relative) > 1:
        split = f"{w} processes x {t} threads do a step's work {gain:.2f}x faster than 1 process x {t1} " \
                f"threads (small operations split badly over threads, and a thread waiting for a busy core " \
                f"stalls the others)"
    elif gain * (1 + relative) < 1:
        split = f"{w} processes x {t} threads do a step's work slower than 1 process x {t1} threads ({gain:.2f}x)"
    else:
        split = (f"the {w} ranks share the cores 1 process had: they add no cores, and the difference in how "
                 f"they use them ({gain:.2f}x) is within the noise")
    if measured - spread > 1:
        verdict = "pay off"
    elif measured + spread < 1:
        verdict = "do not pay off"
    else:
        verdict = "make no measurable difference"
    print(f"{w} ranks {verdict} here ({measured:.2f}x ± {spread:.2f} against 1.0): {split}; communication "
          f"costs {m:.3f} ms of every {s:.3f} ms step ({row['comm_share']:.0%}).", flush=True)
    if verdict != "pay off":
        print(advice(row), flush=True)


def missing(row: dict, cores: int) -> str:
    """Why the parts timed before training need not add up to a training step: what no part can time."""
    typical = float(row.get("median_step_ms") or row["step_ms"])
    if abs(sum(parts(row)) / typical - 1) <= ACCOUNTED:
        return (f"they account for the median step ({typical:.3f} ms); the mean is longer because of a few slow "
                f"steps (a rank that lost its core for a while, a wait for the slowest rank), which the medians "
                f"of the parts leave out")
    if row["other_cores"] > BUSY:
        return ("other programs took cores while the ranks trained, at other moments than while the parts "
                "were timed")
    if row["world_size"] * row["threads_per_rank"] > cores:
        return (f"{row['world_size']} ranks x {row['threads_per_rank']} threads on {cores} cores take turns: "
                f"a rank that waits for a core holds up the others at the next all_reduce, and how often that "
                f"happens differs between the probe (every part starts after a barrier) and training")
    if sum(parts(row)) > row["step_ms"]:
        return ("each part was timed with every rank starting together after a barrier, all of them computing "
                "at the same moment and competing for the cores and memory; in training the ranks drift apart "
                "and compete less")
    return ("each part was timed on its own, every rank starting together after a barrier; in training the "
            "parts run back to back and the ranks drift apart (the wait for the slowest rank, and the loop "
            "itself, are not in the parts)")
