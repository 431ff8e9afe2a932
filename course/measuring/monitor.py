"""Watching the hardware: `--watch-hardware` on the training lessons (through profiling.py, as --profile).

Each rank starts a background thread that, every --watch-interval seconds, writes down what its own process
and its own GPU are doing:
- CPU: the process's CPU% (psutil's CPU times: 100 % = one core busy for the whole interval; all its threads
  together; the last sample's, up to stop(), over at least CPU_WINDOW seconds)
  and its resident memory (RSS: the bytes of RAM it holds, the in-memory dataset included);
- CUDA: through NVML (the library behind nvidia-smi; Python package nvidia-ml-py, module `pynvml`) the GPU's
  utilization (the share of the time some kernel was running), its memory in use (by every process on that
  GPU) and its power draw; and at the end torch's own peak, torch.cuda.max_memory_allocated.

NVML numbers its GPUs physically and ignores CUDA_VISIBLE_DEVICES (which Slurm and torchrun users set), so
cuda:0 of a rank may be NVML's GPU 3: the rank's GPU is found by its UUID, the one id both agree on
(nvmlDeviceGetHandleByUUID), asking NVML about no other GPU: those outside the job's cgroup answer
NO_PERMISSION (find_gpu).

At the end each rank prints one line, writes RUN_DIR/hardware/rank{r}.json (every sample and a summary), and
has written TensorBoard scalars to LOG_DIR/hardware/rank{r}/ while it ran (flushed every few seconds, so a
running or stuck job can be watched).  If training fails, the thread ends with the process and no JSON
file is written.  docs/learners/monitoring.md says what the numbers mean.

Importing this module is cheap: psutil, pynvml and tensorboard are imported only with --watch-hardware.
The flag is not called `--monitor`: torchrun has a `--monitor-interval` option, and its parser (Python 3.11)
stops with "ambiguous option" at a `--monitor` it reads as an abbreviation, even after the script's name.
"""
import argparse
import importlib.util
import math
import os
import threading
import time
from pathlib import Path

DEFAULT_INTERVAL = 0.5
SHORTEST_INTERVAL = 0.01
CPU_WINDOW = 0.1  # seconds: the shortest window the last sample's CPU share is measured over
TB_FLUSH_SECONDS = 5
MB = 1e6


def interval_seconds(text: str) -> float:
    """--watch-interval: a number of seconds, at least SHORTEST_INTERVAL and finite."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < SHORTEST_INTERVAL:
        raise argparse.ArgumentTypeError(f"{text} seconds: give a number of seconds of at least "
                                         f"{SHORTEST_INTERVAL}, e.g. {DEFAULT_INTERVAL}")
    return value


class _MonitorFlag(argparse.Action):
    """--watch-hardware; psutil is checked here, before any rank starts, so that its absence is one line."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=False, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if importlib.util.find_spec("psutil") is None:
            parser.error("--watch-hardware needs the psutil package: pip install psutil "
                         "(it is in requirements.txt)")
        setattr(namespace, self.dest, True)


def add_monitor_args(p):
    p.add_argument("--watch-hardware", action=_MonitorFlag,
                   help="watch the hardware: each rank samples its CPU%%, memory and (CUDA) its GPU's "
                        "utilization, memory and power in a background thread; one line per rank at the "
                        "end, RUN_DIR/hardware/rank*.json, TensorBoard scalars in LOG_DIR/hardware/rank*")
    p.add_argument("--watch-interval", type=interval_seconds, default=DEFAULT_INTERVAL, metavar="SECONDS",
                   help="with --watch-hardware: seconds between two samples")
    return p


# --- the rank's GPU in NVML ------------------------------------------------------------------------------

def _bare_uuid(uuid) -> str:
    """A GPU UUID without NVML's "GPU-" prefix (torch prints it without), lower case."""
    if isinstance(uuid, bytes):
        uuid = uuid.decode()
    uuid = str(uuid).strip().lower()
    return uuid[4:] if uuid.startswith("gpu-") else uuid


def nvml_index(nvml, torch_uuid) -> int | None:
    """The NVML index of the GPU whose UUID is `torch_uuid` (torch.cuda.get_device_properties(d).uuid), or
    None.  NVML counts every GPU of the node whatever CUDA_VISIBLE_DEVICES says; the UUID is the same in both.
    A GPU outside the job's cgroup (Slurm's ConstrainDevices) answers NO_PERMISSION: it is not the rank's,
    and the others are still read."""
    wanted = _bare_uuid(torch_uuid)
    for index in range(nvml.nvmlDeviceGetCount()):
        try:
            if _bare_uuid(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index))) == wanted:
                return index
        except nvml.NVMLError_NoPermission:
            continue
    return None


def visible_entry(device) -> str | None:
    """The entry of CUDA_VISIBLE_DEVICES that is `device` (a UUID, GPU-... or MIG-..., or an index), or None."""
    entries = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    index = device.index or 0
    return entries[index] if index < len(entries) else None


def find_gpu(nvml, torch_uuid, visible: str | None, cuda_index: int = 0) -> tuple:
    """(NVML's handle, NVML index) of the rank's GPU, or (None, None), asking NVML only about the GPU the job
    may see: by its UUID (torch's, else CUDA_VISIBLE_DEVICES's entry) with nvmlDeviceGetHandleByUUID; failing
    that, through NVML's GPUs by UUID, skipping those that answer NO_PERMISSION (nvml_index); without any
    UUID, by CUDA_VISIBLE_DEVICES's index (else the CUDA index: every GPU visible)."""
    uuid = f"GPU-{_bare_uuid(torch_uuid)}" if torch_uuid else \
        visible if visible and not visible.isdigit() else None
    if uuid is None:
        index = int(visible) if visible else cuda_index
        return nvml.nvmlDeviceGetHandleByIndex(index), index
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        return handle, nvml.nvmlDeviceGetIndex(handle)
    except nvml.NVMLError:  # not found (a MIG slice's UUID), or a driver without these calls
        index = nvml_index(nvml, uuid)
        return (None, None) if index is None else (nvml.nvmlDeviceGetHandleByIndex(index), index)


class _Gpu:
    """The rank's own GPU in NVML; `note` says why there is none."""

    def __init__(self, device):
        import torch

        self.handle, self.note, self.device = None, None, device
        self.info = {}
        try:
            import pynvml
        except ImportError:
            self.note = "GPU numbers need the nvidia-ml-py package: pip install nvidia-ml-py"
            return
        self.nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            self.note = f"NVML could not start ({e}): no GPU numbers"
            return
        props = torch.cuda.get_device_properties(device)
        try:
            handle, index = find_gpu(pynvml, getattr(props, "uuid", None), visible_entry(device), device.index or 0)
        except pynvml.NVMLError as e:
            handle, self.note = None, f"NVML could not find the GPU ({e}): no GPU numbers"
        if handle is None:
            self.note = self.note or (f"no GPU with {device}'s UUID {getattr(props, 'uuid', '?')} in NVML "
                                      "(a MIG slice?): no GPU numbers")
            pynvml.nvmlShutdown()
            return
        self.handle = handle
        self.info = {"device": str(device), "nvml_index": index, "name": props.name,
                     "uuid": str(getattr(props, "uuid", None) or visible_entry(device))}

    def sample(self) -> dict:
        nvml, h = self.nvml, self.handle
        return {"gpu_util_percent": self._read(lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu),
                "gpu_memory_mb": self._read(lambda: nvml.nvmlDeviceGetMemoryInfo(h).used / MB),
                "gpu_power_w": self._read(lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000)}  # milliwatts

    def _read(self, get):
        try:
            return get()
        except self.nvml.NVMLError:  # not supported on this GPU (e.g. power on some boards)
            return None

    def close(self):
        if self.handle is not None:
            self.nvml.nvmlShutdown()
            self.handle = None


# --- the sampling thread ----------------------------------------------------------------------------------

def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _max(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


class Monitor:
    """A thread that samples this rank's process (and GPU) every `interval` seconds until stop()."""

    def __init__(self, rank: int, world_size: int, device, interval: float, json_path: Path, tb_dir: Path):
        import psutil

        self.rank, self.world_size, self.device, self.interval = rank, world_size, device, interval
        self.json_path, self.tb_dir = Path(json_path), Path(tb_dir)
        self.process = psutil.Process()
        self.gpu = _Gpu(device) if device.type == "cuda" else None
        self.samples, self.steps = [], 0
        self.writer = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"monitor-rank{rank}", daemon=True)
        self.summary = None

    def start(self):
        from torch.utils.tensorboard import SummaryWriter

        for old in self.tb_dir.glob("events.out.tfevents.*"):  # TensorBoard would draw an old run beside it
            old.unlink(missing_ok=True)
        self.json_path.unlink(missing_ok=True)  # a failed run leaves no file rather than an earlier run's
        self.writer = SummaryWriter(str(self.tb_dir), flush_secs=TB_FLUSH_SECONDS)
        self._marks = [self._cpu_mark()]  # (clock, CPU seconds) as each sample's window began, and now
        self.start_time = self._marks[0][0]
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval):
            self._record()

    def _cpu_mark(self) -> tuple:
        times = self.process.cpu_times()  # every thread of the process, in ticks of 10 ms (/proc/PID/stat)
        return time.perf_counter(), times.user + times.system

    def _cpu_percent(self, now: tuple, last: bool) -> float | None:
        """The CPU time used since the previous sample over the seconds since then, x 100 (psutil's
        cpu_percent).  The last sample's window ends at stop(), often a few ms later: over so short a window
        Linux's ticks of CPU time (10 ms) give any share (255.7 % was seen on 2 cores).  It reaches back
        over the earlier samples' windows until it spans CPU_WINDOW seconds; no share if the run was shorter."""
        i = len(self._marks) - 1
        while last and i > 0 and now[0] - self._marks[i][0] < CPU_WINDOW:
            i -= 1
        since, cpu = self._marks[i]
        if now[0] <= since or (last and now[0] - since < CPU_WINDOW):
            return None
        return 100 * (now[1] - cpu) / (now[0] - since)

    def _record(self, last: bool = False):
        memory, now = self.process.memory_info(), self._cpu_mark()
        sample = {"t": round(now[0] - self.start_time, 3), "step": self.steps,
                  "cpu_percent": self._cpu_percent(now, last), "rss_mb": memory.rss / MB}
        self._marks.append(now)
        if self.gpu is not None and self.gpu.handle is not None:
            sample.update(self.gpu.sample())
        self.samples.append(sample)
        n = len(self.samples)
        for key, value in sample.items():  # "step", the training steps done: flat on every rank in a hang
            if key != "t" and value is not None:
                self.writer.add_scalar(f"hardware/{key}", value, n)

    def stop(self) -> dict:
        """End the thread (one last sample), write the JSON file, print the rank's line; once."""
        if self.summary is not None:
            return self.summary
        self._stop.set()
        self._thread.join()
        self._record(last=True)  # the end of the run, also when it was shorter than one interval
        self.writer.close()
        self.summary = self._summarize()
        if self.gpu is not None:
            self.gpu.close()
        from course.training.output import rank_print, write_json

        write_json(self.json_path, {"rank": self.rank, "world_size": self.world_size, "summary": self.summary,
                                    "samples": self.samples})
        rank_print(self.rank, self.line())
        return self.summary

    def _summarize(self) -> dict:
        import torch

        column = {key: [s.get(key) for s in self.samples] for key in self.samples[-1]}
        try:
            cores = len(self.process.cpu_affinity())
        except (AttributeError, OSError):  # not offered on macOS
            cores = None
        summary = {"samples": len(self.samples), "interval_s": self.interval, "seconds": self.samples[-1]["t"],
                   "steps": self.steps, "torch_threads": torch.get_num_threads(), "cores_allowed": cores,
                   "cpu_percent_mean": _mean(column["cpu_percent"]), "cpu_percent_max": _max(column["cpu_percent"]),
                   "rss_mb_max": _max(column["rss_mb"]), "gpu": None}
        if self.gpu is not None:
            gpu = {**self.gpu.info, "note": self.gpu.note}
            if self.gpu.info:
                gpu.update(util_percent_mean=_mean(column["gpu_util_percent"]),
                           memory_used_mb_max=_max(column["gpu_memory_mb"]),
                           power_w_mean=_mean(column["gpu_power_w"]),
                           torch_max_allocated_mb=torch.cuda.max_memory_allocated(self.device) / MB)
            summary["gpu"] = gpu
        return summary

    def line(self) -> str:
        s = self.summary

        def num(value, unit):
            return "n/a" if value is None else f"{value:.0f}{unit}"

        cpu = (f"CPU {num(s['cpu_percent_mean'], '%')} mean, {num(s['cpu_percent_max'], '%')} max "
               f"(100% = one core; {s['torch_threads']} torch thread{'s' * (s['torch_threads'] > 1)}), "
               f"RSS {num(s['rss_mb_max'], ' MB')} max")
        gpu = ""
        if s["gpu"] is not None:
            g = s["gpu"]
            gpu = (f"{g['note']}; " if g["note"] else
                   f"GPU {g['nvml_index']} ({g['name']}) {num(g['util_percent_mean'], '%')} busy, "
                   f"{num(g['memory_used_mb_max'], ' MB')} used max (torch's tensors "
                   f"{num(g['torch_max_allocated_mb'], ' MB')} max), {num(g['power_w_mean'], ' W')} mean; ")
        samples = f"{s['samples']} sample{'s' * (s['samples'] > 1)}"
        return (f"hardware, {samples} in {s['seconds']:.1f} s: {gpu}{cpu}; "
                f"every sample in {self.json_path}")


def remove_other_ranks(monitor_dir: Path, tb_root: Path, world_size: int) -> None:
    """Rank 0: the files of ranks this run does not have (an earlier run with more ranks) would be read as
    this run's."""
    for path in Path(monitor_dir).glob("rank*.json"):
        if path.stem[4:].isdigit() and int(path.stem[4:]) >= world_size:
            path.unlink(missing_ok=True)
    for directory in Path(tb_root).glob("rank*"):
        if directory.name[4:].isdigit() and int(directory.name[4:]) >= world_size:
            for old in directory.glob("events.out.tfevents.*"):
                old.unlink(missing_ok=True)


class _Watching:
    """What maybe_profile returns with --watch-hardware: the profiler's (or the do-nothing) object, and the
    monitor, counting the training steps and stopping at close()."""

    def __init__(self, prof, monitor: Monitor):
        self.prof, self.monitor = prof, monitor

    def step(self, loss=None, samples=0):
        self.prof.step(loss, samples)
        self.monitor.steps += 1

    def epoch(self, epoch, accuracy, test_loss):
        self.prof.epoch(epoch, accuracy, test_loss)

    def close(self):
        self.prof.close()
        self.monitor.stop()


def watching(prof, args, rank: int, device):
    """`prof` with this rank's Monitor started beside it (maybe_profile calls this with --watch-hardware)."""
    import torch.distributed as dist

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    monitor_dir = Path(args.run_dir) / "hardware"
    tb_root = Path(getattr(args, "log_dir", None) or args.run_dir) / "hardware"
    if rank == 0:
        remove_other_ranks(monitor_dir, tb_root, world_size)
    from course.training.output import writable_log_dir

    writable_log_dir(tb_root / f"rank{rank}")  # or one line naming it
    monitor = Monitor(rank, world_size, device, args.watch_interval, monitor_dir / f"rank{rank}.json",
                      tb_root / f"rank{rank}")
    return _Watching(prof, monitor.start())
