"""Lesson 7: time DDP training at several world sizes, and measure what decides whether more ranks pay off.

    python day1/7_mnist_ddp_pt_timing.py 2 --sweep --quick        # world sizes 1 and 2, one after another
    python day1/7_mnist_ddp_pt_timing.py 2 --sweep --quick --model cnn --batch-size 512
    python day1/7_mnist_ddp_pt_timing.py 4                         # one run with 4 ranks (same as --nproc 4)
    torchrun --nproc_per_node=4 day1/7_mnist_ddp_pt_timing.py     # one run; every call adds one row
    srun --ntasks=4 python day1/7_mnist_ddp_pt_timing.py

A data-parallel step is compute (forward + backward on b samples per rank) plus communication (the
all_reduce of the gradients, and waiting for the slowest rank).  Before training, every rank times a few
steps inside DDP's `no_sync()` (compute alone) and a few without it (compute + all_reduce); the difference
is what communication costs per step.  W ranks do W*b samples per step in c_W + m_W ms, one process does
b samples in c_1 ms, so

    speed-up = W * c_1 / (c_W + m_W)

On a GPU node each rank brings its own GPU, c_W stays c_1, and only communication stands between you and
a speed-up of W.  On one CPU the ranks share the same cores (each gets cores // ranks threads), so W ranks
cannot add compute, only use it differently: more ranks pay off only when one process could not keep its
threads busy (the CNN's small convolutions at batch 512) and the all_reduce is small next to a step.  The
MLP's step is so short that the all_reduce of its 0.4 MB of gradients eats any gain.  On an idle 2-core
VM (--quick) 2 ranks x 1 thread ran the CNN at batch 512 1.05-1.31x faster than 1 process x 2 threads
(this sweep and benchmarks/bench.py, 2026-11-22), and the MLP slower at every batch size.  On a busy
machine (load above the number of cores) threads wait for cores and stall each other, and 1 process x 2
threads crawls: at load 6-8 on 2 cores 2 ranks x 1 thread were 3.5x (CNN) to 15-25x (MLP) faster, which
says more about the load than about DDP.  So every row records the load, and the lesson warns when it is
high.  Training time excludes the evaluation.

Each run appends a row to run_dir/timings.csv; rank 0 rewrites the table (scaling.md, scaling.csv) and the
plot (scaling.png) from the latest run of each world size and configuration; --fresh starts over.
"""
import argparse
import csv
import fcntl
import os
import socket
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from course import cli
from course.evaluate import evaluate
from course.launch import backend_for, detect_launcher, launch, setup_device
from course.models import build_model
from course.output import plot_curves, rank_print, save_weights, write_csv, write_json
from course.profiling import add_profile_args, maybe_profile
from data_tools.datasets import InMemoryMNIST, batches, require

COLUMNS = ["date", "host", "world_size", "threads_per_rank", "model", "batch_per_rank", "device", "backend",
           "epochs", "samples", "train_seconds", "samples_per_second", "step_ms", "compute_ms", "comm_ms",
           "comm_share", "allreduce_ms", "load"]


def wait_for(device):
    """GPU work is asynchronous: a clock read before it finishes measures nothing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(model, x, y, steps, device):
    """Median ms of forward + backward on this rank: (without the gradient all_reduce, with it)."""
    def one(sync):
        model.zero_grad(set_to_none=True)
        dist.barrier()  # DDP: all ranks start together, so one rank's head start is not counted as waiting
        wait_for(device)
        start = time.perf_counter()
        with nullcontext() if sync else model.no_sync():  # DDP: no_sync() skips the all_reduce
            F.cross_entropy(model(x), y).backward()
        wait_for(device)
        return (time.perf_counter() - start) * 1000

    for _ in range(3):  # warm-up: the first calls allocate memory and pick kernels
        one(False), one(True)
    compute, synced = zip(*[(one(False), one(True)) for _ in range(steps)])  # interleaved: same noise
    model.zero_grad(set_to_none=True)
    return statistics.median(compute), statistics.median(synced)


def time_allreduce(numel, steps, device):
    """Median ms of one all_reduce of a buffer as large as all the gradients: the wire cost alone."""
    buffer, times = torch.zeros(numel, device=device), []
    for _ in range(steps + 3):
        dist.barrier()
        wait_for(device)
        start = time.perf_counter()
        dist.all_reduce(buffer)  # DDP: what DDP's gradient buckets add up to, in one message
        wait_for(device)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times[3:])


def worker(info, args):
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    if rank == 0 and info.launcher != "self" and args.asked and args.asked != world_size:
        rank_print(rank, f"{info.launcher} started {world_size} ranks; the {args.asked} asked for is ignored")
    require(args.dataset, args.data_dir)
    train_set = InMemoryMNIST(args.dataset, "train", args.data_dir, device, limit=args.train_samples or 0)
    test_set = InMemoryMNIST(args.dataset, "test", args.data_dir, device)

    model = build_model(args.model, args.seed + rank).to(device)
    # DDP: broadcasts rank 0's weights at wrap time, then all_reduces gradient buckets during backward
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    sampler.set_epoch(0)
    x, y = next(iter(batches(train_set, sampler, args.batch_size)))  # a real batch; no optimizer step
    numel = sum(p.numel() for p in model.parameters())
    compute_ms, synced_ms = time_steps(model, x, y, args.probe_steps, device)
    allreduce_ms = time_allreduce(numel, args.probe_steps, device)
    probe = torch.tensor([compute_ms, synced_ms, allreduce_ms], dtype=torch.float64, device=device)
    dist.all_reduce(probe)  # DDP: the mean over ranks of each rank's medians
    compute_ms, synced_ms, allreduce_ms = (probe / world_size).tolist()
    comm_ms = max(0.0, synced_ms - compute_ms)

    load = os.getloadavg()[0]  # processes wanting a core, averaged over the last minute: others' too
    prof = maybe_profile(args, rank, device)  # --profile: lesson 5's traces and TensorBoard scalars
    losses, step, samples, train_seconds = [], 0, 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        wait_for(device)
        start = time.perf_counter()
        for x, y in batches(train_set, sampler, args.batch_size):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP: gradients arrive averaged over ranks when backward returns
            optimizer.step()
            losses.append(loss.detach())
            step += 1
            samples += len(y) * world_size  # every rank's batch has the same size (the sampler pads)
            prof.step(loss, world_size * len(y))
            if step == args.max_steps:
                break
        wait_for(device)
        train_seconds += time.perf_counter() - start  # the clock stops before the evaluation
        accuracy, test_loss, counted = evaluate(model.module, test_set, rank, world_size)
        prof.epoch(epoch, accuracy, test_loss)
        if rank == 0:
            rank_print(rank, f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {accuracy:.4f} "
                             f"({counted} test images, each counted once)")
        if step == args.max_steps:
            break
    prof.close()
    rank_print(rank, f"{step} steps on {len(sampler)} samples per epoch in {train_seconds:.2f} s "
                     f"({torch.get_num_threads()} threads)")

    losses = torch.stack(losses)
    dist.all_reduce(losses)  # DDP: the loss of each global batch, averaged over ranks (one call at the end)
    losses = (losses / world_size).tolist()
    if rank == 0:
        global_batch = world_size * args.batch_size
        run = args.run_dir
        row = {"date": datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname(),
               "world_size": world_size, "threads_per_rank": torch.get_num_threads(), "model": args.model,
               "batch_per_rank": args.batch_size, "device": device.type, "backend": dist.get_backend(),
               "epochs": epoch + 1, "samples": samples, "train_seconds": round(train_seconds, 6),
               "samples_per_second": round(samples / train_seconds, 1),
               "step_ms": round(train_seconds * 1000 / step, 3), "compute_ms": round(compute_ms, 3),
               "comm_ms": round(comm_ms, 3), "comm_share": round(comm_ms / (compute_ms + comm_ms), 3),
               "allreduce_ms": round(allreduce_ms, 3), "load": round(load, 2)}
        table = record(run, row, fresh=args.fresh)
        write_json(run / "metrics.json", {
            "lesson": "7_mnist_ddp_pt_timing", "dataset": args.dataset, "model": args.model,
            "world_size": world_size, "backend": dist.get_backend(), "batch_size": args.batch_size,
            "global_batch_size": global_batch, "lr": args.lr, "epochs": args.epochs, "steps": step,
            "samples_seen": samples, "train_seconds": train_seconds, "samples_per_second": samples / train_seconds,
            "threads_per_rank": row["threads_per_rank"], "compute_ms": row["compute_ms"],
            "comm_ms": row["comm_ms"], "allreduce_ms": row["allreduce_ms"],
            "test_accuracy": accuracy, "test_loss": test_loss, "loss_per_step": losses})
        save_weights(run / "model.pt", model)
        plot_curves(run / "loss.png", {f"{world_size} ranks": (range(1, step + 1), losses)}, "step",
                    "training loss (mean over ranks)", f"{args.model}, global batch {global_batch}")
        print(markdown(table), flush=True)
        explain(row, table, numel, run)
    dist.destroy_process_group()


# ---------------------------------------------------------------- the table over runs, and what it says

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


def summarize(rows: list) -> list:
    """The latest run of each world size per configuration, with its speed-up over 1 rank."""
    latest = {}
    for r in rows:
        latest[config(r) + (int(r["world_size"]),)] = r
    table = []
    for key in sorted(latest):
        r = latest[key]
        base = latest.get(key[:4] + (1,))
        speedup = float(r["samples_per_second"]) / float(base["samples_per_second"]) if base else None
        table.append({"host": r["host"], "device": r["device"], "model": r["model"],
                      "batch_per_rank": int(r["batch_per_rank"]), "world_size": int(r["world_size"]),
                      "threads_per_rank": int(r["threads_per_rank"]), "samples": int(r["samples"]),
                      "train_seconds": float(r["train_seconds"]),
                      "samples_per_second": float(r["samples_per_second"]),
                      "speedup": round(speedup, 3) if speedup is not None else "",
                      "compute_ms": float(r["compute_ms"]), "comm_ms": float(r["comm_ms"]),
                      "comm_share": float(r["comm_share"]), "date": r["date"]})
    return table


def markdown(table: list) -> str:
    head = ["model", "batch/rank", "device", "ranks x threads", "samples", "train s", "samples/s", "speed-up",
            "compute ms/step", "comm ms/step", "comm share"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] != "" else "(no 1-rank run)"
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
        ax_speed.plot([r["world_size"] for r in with_base], [r["speedup"] for r in with_base], "o-", label=label)
    ax_speed.plot([1, top], [1, top], "k:", label="ideal (W times)")
    ax_time.set(xlabel="world size (ranks)", ylabel="training time per 10 000 samples (s)", title="time")
    ax_speed.set(xlabel="world size (ranks)", ylabel="speed-up over 1 rank", title="speed-up")
    for ax in (ax_time, ax_speed):
        ax.grid(alpha=0.3)
        ax.set_xticks(range(1, top + 1))
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def explain(row: dict, table: list, numel: int, run_dir: Path) -> None:
    """Say, with this run's numbers, whether this world size pays off and why."""
    w, b, c, m = row["world_size"], row["batch_per_rank"], row["compute_ms"], row["comm_ms"]
    print(f"{w} ranks x {row['threads_per_rank']} threads, {row['model']} at batch {b} per rank: "
          f"compute {c:.3f} ms/step, communication {m:.3f} ms/step -> {row['comm_share']:.0%} of a step "
          f"is communication (a bare all_reduce of the {numel * 4 / 1e6:.2f} MB of gradients: "
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
        print(f"no 1-rank run with these settings in {run_dir}; add one with: python "
              f"day1/7_mnist_ddp_pt_timing.py 1 --model {row['model']} --batch-size {b} --run-dir {run_dir}"
              f" (or run with --sweep)")
        return
    c1, t1, t = base["compute_ms"], base["threads_per_rank"], row["threads_per_rank"]
    measured = row["samples_per_second"] / base["samples_per_second"]
    gain = w * c1 / c
    print(f"1 rank x {t1} threads computes a step of {b} samples in {c1:.3f} ms, each of {w} ranks x {t} "
          f"threads in {c:.3f} ms: speed-up = {w} x c_1 / (c_{w} + m_{w}) = {w} x {c1:.3f} / ({c:.3f} + "
          f"{m:.3f}) = {w * c1 / (c + m):.2f}x predicted, {measured:.2f}x measured over the whole training")
    print(f"  = {gain:.2f}x from splitting the cores into ranks ({w} x c_1 / c_{w}) x {c / (c + m):.2f}, the "
          f"share of a step left after communication (c_{w} / (c_{w} + m_{w}))")
    if gain >= 1.1:
        split = f"{w} processes x {t} threads compute {gain:.2f}x faster than 1 process x {t1} threads " \
                f"(small operations split badly over threads, and a thread waiting for a busy core stalls " \
                f"the others)"
    elif gain > 0.9:
        split = f"the {w} ranks share the cores 1 process had, so they add no compute ({gain:.2f}x)"
    else:
        split = f"{w} processes x {t} threads compute slower than 1 process x {t1} threads ({gain:.2f}x)"
    verdict = "pay off" if measured >= 1.1 else "do not pay off"
    print(f"{w} ranks {verdict} here: {split}; communication costs {m:.3f} ms of every {c + m:.3f} ms step "
          f"({row['comm_share']:.0%}).", flush=True)
    if measured < 1.1:
        print("A small model on few cores has too little work per step to hide an all_reduce: give each step "
              "more work (--model cnn --batch-size 512), or give each rank its own GPU.", flush=True)


def run(args, parser):
    launcher = detect_launcher()
    nproc = getattr(args, "nproc", None)
    if args.world_size and nproc and args.world_size != nproc:
        parser.error(f"world size {args.world_size} and --nproc {nproc} disagree; give one of them")
    args.asked = args.world_size or nproc  # under torchrun/srun the launcher's world size wins
    args.nproc = args.asked or 2
    if args.sweep and launcher != "self":
        parser.error(f"--sweep starts its own workers; under {launcher} run one world size per call "
                     f"(each call adds a row to the table)")
    require(args.dataset, args.data_dir)
    if args.fresh and launcher == "self":
        (args.run_dir / "timings.csv").unlink(missing_ok=True)
        args.fresh = False  # a sweep starts over once, then adds a row per world size
    for world_size in range(1, args.nproc + 1) if args.sweep else [args.nproc]:
        launch(worker, args, nproc=world_size)  # a sweep: a fresh set of processes for every world size


def build_parser():
    p = cli.add_distributed(cli.parser(__doc__, "day1/7_mnist_ddp_pt_timing.py"))
    p.add_argument("world_size", nargs="?", type=cli.positive_int, default=None,
                   help="processes to spawn, as in the original workshop's `python 7_mnist_ddp_pt_timing.py "
                        "4`: the same as --nproc")
    p.add_argument("--nproc", type=cli.positive_int, default=argparse.SUPPRESS,
                   help="processes to spawn when started with plain python (ignored under torchrun/srun, "
                        "which choose the world size) (default: 2)")
    p.add_argument("--sweep", action="store_true",
                   help="run world sizes 1, 2, ..., N one after another, N from world_size or --nproc "
                        "(plain python only)")
    p.add_argument("--fresh", action="store_true", help="drop the earlier rows of run_dir/timings.csv first")
    p.add_argument("--probe-steps", type=cli.positive_int, default=20,
                   help="steps timed with and without the gradient all_reduce before training")
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0,
                   help="DDP's gradient bucket size in MB (the MLP's gradients are 0.4 MB: one bucket)")
    return add_profile_args(p)


if __name__ == "__main__":
    parser = build_parser()
    cli.main(lambda args: run(args, parser), parser)
