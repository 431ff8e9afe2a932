"""Profiling plumbing: lesson 5's bookkeeping, its profiler behind a `--profile` flag, and reading traces back.

Lesson 5 teaches torch.profiler and SummaryWriter inline; this module checks its schedule, keeps the extra
copies of each trace, runs its `--compare` variants and prints their table; it repeats the same profiler
setup for the lessons that only offer it as an option (`--profile` on 4, 6 and 10), and reads the traces
back to count what the gradient synchronization costs.

A trace is Chrome's trace-event JSON, {"traceEvents": [{"name", "cat", "ph", "ts", "dur", "tid", "args"},
...]}, times in microseconds.  What we read from it:
- `ProfilerStep#N` (written by `prof.step()`): one interval per profiled training step, on the main thread;
- `c10d::allreduce_`: one per all_reduce call, with the tensors' shapes (`record_shapes=True`);
- `gloo:all_reduce` (CPU) or `nccl...` kernels (GPU): the collective actually running, on gloo's own
  threads or on a CUDA stream; its duration includes waiting for the slowest rank;
- `autograd::engine::evaluate_function: ...` on the main thread: backward computing gradients.
"""
import argparse
import json
import math
import shutil
import time
from pathlib import Path

TRACE_GLOBS = ("rank*.pt.trace.json", "rank*.pt.trace.json.gz", "events.out.tfevents.*",
               "chrome_trace/rank*.json", "rank*.key_averages.txt")
SCHEDULE = {"wait": 1, "warmup": 1, "active": 3}  # lesson 5 explains the three numbers


def add_profile_args(p):
    """`--profile` and `--log-dir` for lessons that offer profiling as an option (lesson 5 explains it), and
    `--watch-hardware`, `--watch-interval` (course/measuring/monitor.py)."""
    p.add_argument("--profile", action="store_true",
                   help=f"trace training steps {SCHEDULE['wait'] + SCHEDULE['warmup'] + 1}-"
                        f"{sum(SCHEDULE.values())} with torch.profiler (one trace per rank) and write "
                        "TensorBoard scalars, as lesson 5 does")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="where --profile writes traces and scalars, and --watch-hardware its TensorBoard "
                        "scalars (default: the run dir)")
    from course.measuring.monitor import add_monitor_args

    return add_monitor_args(p)  # --watch-hardware: watching the hardware (course/measuring/monitor.py)


def clear_previous(log_dir: Path) -> None:
    """Remove the traces and event files an earlier run left in `log_dir` (only those).

    TensorBoard merges every file of a directory into one run: old traces would show up as extra spans and
    old scalars as a zigzag over the new ones.  Choose another log dir to keep an earlier run.
    """
    for pattern in TRACE_GLOBS:
        for path in Path(log_dir).glob(pattern):
            path.unlink(missing_ok=True)


def view_hint(log_dir, traces="chrome_trace/rank*.json") -> str:
    return (f"view with: tensorboard --logdir {log_dir} --host 127.0.0.1   "
            f"(traces also open in https://ui.perfetto.dev: {Path(log_dir) / traces})")


# --- lesson 5's bookkeeping ----------------------------------------------------------------------------

def add_schedule_args(p):
    """Lesson 5's --log-dir and profiler schedule (--wait, --warmup, --active)."""
    from course.launching.cli import non_negative_int, positive_int

    p.add_argument("--log-dir", type=Path, default=Path("log_ddp"),
                   help="where every rank writes its trace and rank 0 its TensorBoard scalars")
    p.add_argument("--wait", type=non_negative_int, default=1, help="profiler schedule: steps skipped")
    p.add_argument("--warmup", type=non_negative_int, default=1,
                   help="profiler schedule: then steps traced and discarded")
    p.add_argument("--active", type=positive_int, default=3, help="profiler schedule: then steps recorded")
    return p


def _schedule(args) -> str:
    return f"--wait {args.wait} --warmup {args.warmup} --active {args.active}"


def check_schedule(args) -> None:
    """Before any rank starts: the schedule fits in --max-steps, and the log dir can be written."""
    from course.launching.cli import CourseError
    from course.training.output import writable_log_dir

    profiled = args.wait + args.warmup + args.active
    if args.max_steps is not None and args.max_steps < profiled:
        raise CourseError(f"--max-steps {args.max_steps} ends training before the profiler has recorded: its "
                          f"schedule needs {profiled} steps ({_schedule(args)})")
    writable_log_dir(args.log_dir)


def check_first_epoch(args, steps_per_epoch: int) -> None:
    """The profiled window must hold training steps only, not an evaluation: all in the first epoch."""
    from course.launching.cli import CourseError

    profiled = args.wait + args.warmup + args.active
    first_epoch_steps = min(steps_per_epoch, args.max_steps or math.inf)
    if first_epoch_steps < profiled:
        raise CourseError(f"the profiler schedule needs {profiled} training steps ({_schedule(args)}) but the "
                          f"first epoch has {first_epoch_steps}; raise --max-steps/--train-samples or lower "
                          f"--active")


def profiled_steps(args) -> list:
    """The training steps the schedule records, counted from 1."""
    return list(range(args.wait + args.warmup + 1, args.wait + args.warmup + args.active + 1))


def cleared(log_dir, rank: int) -> Path:
    """Rank 0 creates `log_dir` and removes an earlier run's traces and scalars from it (clear_previous)."""
    log_dir = Path(log_dir)
    if rank == 0:
        log_dir.mkdir(parents=True, exist_ok=True)
        clear_previous(log_dir)
    return log_dir


def save_extras(prof, log_dir: Path, rank: int, args) -> None:
    """After tensorboard_trace_handler: the trace again under a fixed name (chrome_trace/rank{r}.json, for
    https://ui.perfetto.dev or chrome://tracing), and the costliest operators (rank{r}.key_averages.txt)."""
    (log_dir / "chrome_trace").mkdir(exist_ok=True)
    trace = max(log_dir.glob(f"rank{rank}.*.pt.trace.json"), key=lambda path: path.stat().st_mtime)
    shutil.copyfile(trace, log_dir / "chrome_trace" / f"rank{rank}.json")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    (log_dir / f"rank{rank}.key_averages.txt").write_text(table + "\n")
    if rank == 0:
        print(f"[rank 0] --sync {args.sync}: the costliest operators of {args.active} profiled steps "
              f"(prof.key_averages(); every rank's table is in {log_dir}/rank*.key_averages.txt)\n"
              f"{table}", flush=True)


def epoch_scalars(writer, epoch: int, accuracy: float, test_loss: float, seconds: float, samples: int) -> None:
    """Rank 0's TensorBoard scalars of one epoch: test accuracy and loss, training time and samples/s."""
    writer.add_scalar("test/accuracy", accuracy, epoch)
    writer.add_scalar("test/loss", test_loss, epoch)
    writer.add_scalar("perf/epoch_seconds", seconds, epoch)
    writer.add_scalar("perf/samples_per_second", samples / seconds, epoch)


SYNCS = ("per-param", "flat", "ddp")


def variants(args) -> list:
    """The runs lesson 5 makes: one with args, or with --compare one per --sync, each into its own
    sub-directory of --log-dir and --run-dir."""
    if not args.compare:
        return [args]
    return [argparse.Namespace(**{**vars(args), "sync": sync, "log_dir": args.log_dir / sync,
                                  "run_dir": args.run_dir / sync}) for sync in SYNCS]


def print_communication(communication: dict, args, world_size: int) -> None:
    print(f"gradient sync in the profiled steps (mean over {world_size} ranks, from the traces):\n"
          f"{comm_table({args.sync: communication})}\n{view_hint(args.log_dir)}", flush=True)


def print_comparison(rows: dict, args, world_size: int) -> None:
    """--compare: all three variants in one table, and in run_dir/comparison.json."""
    from course.training.output import write_json

    write_json(args.run_dir / "comparison.json", rows)
    print(f"\ngradient sync, {world_size} ranks, {args.model}, batch {args.batch_size} per rank: mean "
          f"over ranks and {args.active} profiled steps (comm time includes waiting for the slowest "
          f"rank)\n{comm_table(rows)}", flush=True)
    print(view_hint(args.log_dir, traces="*/chrome_trace/rank*.json"), flush=True)


class _Off:
    """--profile not given: every call does nothing, and neither the profiler nor tensorboard is imported."""

    def step(self, loss=None, samples=0):
        pass

    def epoch(self, epoch, accuracy, test_loss):
        pass

    def close(self):
        pass


class _Profiling:
    def __init__(self, log_dir: Path, rank: int, device):
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        self.rank, self.log_dir = rank, Path(log_dir)
        handler = tensorboard_trace_handler(str(self.log_dir), worker_name=f"rank{rank}")

        def trace_ready(prof):
            handler(prof)
            (self.log_dir / "chrome_trace").mkdir(parents=True, exist_ok=True)
            trace = max(self.log_dir.glob(f"rank{rank}.*.pt.trace.json"), key=lambda p: p.stat().st_mtime)
            shutil.copyfile(trace, self.log_dir / "chrome_trace" / f"rank{rank}.json")

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler = profile(activities=activities, schedule=schedule(**SCHEDULE, repeat=1),
                                on_trace_ready=trace_ready, record_shapes=True, profile_memory=True,
                                with_stack=True)
        self.writer = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.log_dir))
        self.steps, self.samples = 0, 0
        self.epoch_start = self.last_step = time.perf_counter()
        self.profiler.start()

    def step(self, loss=None, samples=0):
        self.profiler.step()
        self.steps += 1
        self.samples += samples
        self.last_step = time.perf_counter()
        if self.writer is not None and loss is not None:
            self.writer.add_scalar("train/loss_rank0", loss.item(), self.steps)

    def epoch(self, epoch, accuracy, test_loss):
        seconds = self.last_step - self.epoch_start  # the epoch's training steps, not the evaluation
        if self.writer is not None:
            self.writer.add_scalar("test/accuracy", accuracy, epoch)
            self.writer.add_scalar("test/loss", test_loss, epoch)
            self.writer.add_scalar("perf/epoch_seconds", seconds, epoch)
            self.writer.add_scalar("perf/samples_per_second", self.samples / seconds, epoch)
            self.writer.flush()
        self.samples, self.epoch_start = 0, time.perf_counter()

    def close(self):
        self.profiler.stop()
        if self.writer is not None:
            self.writer.close()
            print(f"[rank 0] profile of steps {SCHEDULE['wait'] + SCHEDULE['warmup'] + 1}-"
                  f"{sum(SCHEDULE.values())} and scalars in {self.log_dir}; {view_hint(self.log_dir)}",
                  flush=True)


def maybe_profile(args, rank: int, device):
    """Lesson 5's profiler + SummaryWriter when `--profile` was given, else an object that does nothing.

    Usage: `prof = maybe_profile(args, rank, device)`, `prof.step(loss, samples)` after each optimizer step,
    `prof.epoch(epoch, accuracy, test_loss)` after each evaluation, `prof.close()` after training.
    `samples` is the global number of samples of the step; it gives samples/s per epoch.
    With `--watch-hardware` the object also runs course/measuring/monitor.py's sampling thread until close().
    """
    prof = _profile(args, rank, device)
    if getattr(args, "watch_hardware", False):
        from course.measuring.monitor import watching

        return watching(prof, args, rank, device)
    return prof


def _profile(args, rank: int, device):
    if not getattr(args, "profile", False):
        return _Off()
    log_dir = Path(args.log_dir or args.run_dir)
    if rank == 0:
        from course.training.output import writable_log_dir

        clear_previous(writable_log_dir(log_dir))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # nobody writes its trace before rank 0 has cleared the old ones
    return _Profiling(log_dir, rank, device)


# --- reading traces back ------------------------------------------------------------------------------------

def load_trace(path) -> dict:
    import gzip

    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _merge(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _subtract(intervals, holes):
    """The parts of merged `intervals` not covered by merged `holes`."""
    out = []
    for start, end in intervals:
        for h_start, h_end in holes:
            if h_end <= start or h_start >= end:
                continue
            if h_start > start:
                out.append([start, h_start])
            start = max(start, h_end)
            if start >= end:
                break
        if start < end:
            out.append([start, end])
    return out


def _overlap(a, b) -> float:
    """Total length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _numel(dims) -> int:
    """Elements of the tensors in a recorded input: a shape [..] or a tensor list [[..], [..]]."""
    if not dims:
        return 0
    if isinstance(dims[0], list):
        return sum(_numel(d) for d in dims)
    return math.prod(dims)


def rank_comm_stats(trace: dict, bytes_per_element: int = 4) -> dict:
    """What one rank's trace says about its gradient all_reduces, per profiled step.

    bytes assume float32 gradients (both course models).  Comm time is the collective's own duration:
    on the CPU the gloo thread's `gloo:all_reduce`, on a GPU the NCCL kernels.
    """
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise ValueError("no ProfilerStep events: was prof.step() called inside the profiled window?")
    main_tid = next(e["tid"] for e in events if e["name"].startswith("ProfilerStep#"))

    def in_steps(e):
        return any(start <= e["ts"] < end for start, end in steps)

    calls = [e for e in events
             if e.get("cat") == "cpu_op" and e["name"] == "c10d::allreduce_" and in_steps(e)]
    elements = sum(_numel((e.get("args", {}).get("Input Dims") or [[]])[0]) for e in calls)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:  # on GPUs the collective is an NCCL kernel; compute is every other kernel.  Kernels run
        # after the CPU launched them, maybe after its ProfilerStep ended: take all of the trace's kernels
        comm = [e for e in kernels if "nccl" in e["name"].lower()]
        compute = _merge([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()])
    else:  # on the CPU, gloo runs the collective on its own threads; backward runs on the main thread
        comm = [e for e in events if e["name"].startswith("gloo:") and in_steps(e)]
        backward = _merge([(e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == main_tid
                           and e["name"].startswith("autograd::engine::evaluate_function:") and in_steps(e)])
        # a DDP hook launches (and on the last bucket waits for) the all_reduce from inside backward:
        # that time is communication, not gradient computation
        launches = _merge([(e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == main_tid
                           and e["name"].startswith("c10d::") and in_steps(e)])
        compute = _subtract(backward, launches)
    comm_intervals = _merge([(e["ts"], e["ts"] + e["dur"]) for e in comm])
    comm_time = sum(end - start for start, end in comm_intervals)
    n = len(steps)
    return {"steps": n,
            "comm_spans_us": [(e["ts"] + e["dur"], e["dur"]) for e in sorted(comm, key=lambda e: e["ts"])],
            "all_reduce_per_step": len(calls) / n,
            "collectives_per_step": len(comm) / n,
            "bytes_per_step": elements * bytes_per_element / n,
            "comm_ms_per_step": comm_time / n / 1000,
            "overlap_ms_per_step": _overlap(comm_intervals, compute) / n / 1000,
            "step_ms": sum(end - start for start, end in steps) / n / 1000}


def comm_summary(log_dir) -> dict:
    """rank_comm_stats of every rank's chrome trace in `log_dir`, averaged over the ranks.

    transfer_ms_per_step: every rank takes part in the same collectives in the same order; the i-th one
    lasts, on the rank that arrived last, only as long as moving the data takes, so its shortest duration
    over the ranks is the transfer time and the rest, on the other ranks, is waiting (TensorBoard's
    Distributed view splits it the same way: "Data Transfer Time" and "Synchronizing Time").  On each rank
    that time is the last part of its own i-th collective; when a rank was held up, two of these parts can
    overlap in time and count once (as TensorBoard counts them), so the ranks' sums can differ: their mean.
    """
    paths = sorted(Path(log_dir).glob("chrome_trace/rank*.json"))
    if not paths:
        raise FileNotFoundError(f"no chrome_trace/rank*.json in {log_dir}")
    per_rank = [rank_comm_stats(load_trace(p)) for p in paths]
    spans = [r.pop("comm_spans_us") for r in per_rank]
    summary = {k: sum(r[k] for r in per_rank) / len(per_rank) for k in per_rank[0]}
    summary["ranks"] = len(per_rank)
    if len({len(s) for s in spans}) == 1:
        shortest = [min(dur for _, dur in same) for same in zip(*spans)]
        transfer = [sum(end - start for start, end in _merge([(end - m, end) for (end, _), m in zip(own, shortest)]))
                    for own in spans]
        summary["transfer_ms_per_step"] = sum(transfer) / len(transfer) / summary["steps"] / 1000
    else:  # the ranks' traces do not hold the same collectives: no pairing
        summary["transfer_ms_per_step"] = float("nan")
    summary["overlap_fraction"] = (summary["overlap_ms_per_step"] / summary["comm_ms_per_step"]
                                   if summary["comm_ms_per_step"] else 0.0)
    return summary


def comm_table(rows: dict) -> str:
    """A text table: one row per synchronization variant, from comm_summary."""
    head = (f"{'sync':<10} {'all_reduce':>10} {'KB':>8} {'comm ms':>8} {'of which':>9} {'overlap with':>13} "
            f"{'step ms':>8}\n"
            f"{'':<10} {'per step':>10} {'per step':>8} {'per step':>8} {'transfer':>9} {'backward':>13} "
            f"{'':>8}")
    lines = [head]
    for name, s in rows.items():
        lines.append(f"{name:<10} {s['all_reduce_per_step']:>10.1f} {s['bytes_per_step'] / 1000:>8.1f} "
                     f"{s['comm_ms_per_step']:>8.2f} {s['transfer_ms_per_step']:>9.2f} "
                     f"{100 * s['overlap_fraction']:>12.0f}% {s['step_ms']:>8.2f}")
    return "\n".join(lines)
