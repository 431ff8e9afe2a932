"""What the course measures on a GPU, checked here with CUDA faked (no GPU in CI), in one process, no lesson run.

- Timing: a CUDA call returns once its kernels are queued, so every clock reading that times GPU work comes
  after torch.cuda.synchronize(device) (course/measuring/hardware.py's `clock`): day 4's training steps
  (lessons 18-21), lesson 21's pipeline steps (`PipelineClock.step`), lesson 14's steps (`Meter.step`).
  On the CPU the clock alone: torch.cuda is not touched.
- Lesson 14 reports one peak, the step's (course/measuring/memory.py's StepPeak): its counts carry no whole-run
  CUDA peak (mostly the dataset held on the GPU and the evaluation), and its line prints none.
- The bandwidth sweep's sizes by device: lesson 18 without --sizes-mib sweeps 0.25-16 MiB on the CPU (the
  CPU tests stay fast) and on to 1024 MiB on a GPU, where NVLink and InfiniBand are far from full at 16 MiB;
  the readiness check's largest all_reduce: 256 MiB on CPUs as before, 1024 MiB on GPUs.
"""
import importlib.util
import inspect
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.fixture
def readings(monkeypatch):
    """torch.cuda.synchronize and time.perf_counter, faked: each call is logged ("sync" or "clock"), in order;
    the clock advances 1 s a reading."""
    log, now = [], [0.0]

    def clock():
        log.append("clock")
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(time, "perf_counter", clock)
    return log


def synchronized(log) -> bool:
    """Whether every clock reading follows a synchronize (with none of its own in between)."""
    return bool(log) and all(i and log[i - 1] == "sync" for i, what in enumerate(log) if what == "clock")


def lesson(path: str):
    spec = importlib.util.spec_from_file_location(f"lesson_{path.split('/')[1][:2]}", REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DAY4 = ["day4/18_hardware_limits.py", "day4/19_tensor_parallel.py", "day4/20_device_mesh_2d.py",
        "day4/21_pipeline_parallel.py"]


def test_the_clock_synchronizes_a_cuda_device_before_each_reading_and_costs_nothing_on_the_cpu(readings):
    from course.measuring.hardware import clock

    assert clock(CUDA) < clock(CUDA)
    assert readings == ["sync", "clock", "sync", "clock"]
    readings.clear()
    clock(CPU)
    assert readings == ["clock"]


def test_a_pipeline_step_is_timed_once_the_gpu_has_finished(readings):
    from course.measuring.parallel import PipelineClock, StageBook

    book = StageBook(CUDA, 0.0)
    clock = PipelineClock(book, untimed=())
    with clock.step(1):
        readings.append("schedule.step")  # queues the step's kernels and returns
    assert synchronized(readings) and readings.count("clock") == 2, readings
    assert clock.steps == 1 and clock.per_step[0][1] > 0
    readings.clear()
    book.begin(0, "F")  # each mark of a chunk waits for the kernels queued before it
    readings.append("the stage's forward")
    book.end()
    assert synchronized(readings) and readings.count("clock") == 2 and book.busy > 0, readings
    readings.clear()
    with PipelineClock(StageBook(CPU, 0.0), untimed=()).step(1):
        pass
    assert "sync" not in readings


def test_lesson_14s_steps_are_timed_once_the_gpu_has_finished(readings, monkeypatch):
    from course.measuring.accumulation import Meter
    from course.models import ViT

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: readings.append("reset"))
    meter = Meter(ViT(7, 16, 1, 2), CUDA, checkpointed=False)
    meter.step()
    meter.step()
    assert synchronized(readings) and readings.count("clock") == 2, readings


@pytest.mark.parametrize("path", DAY4)
def test_day_4s_training_steps_read_the_synchronized_clock(path):
    """The step loop's two readings, `begun` and the step's end, go through hardware.clock(device): on a GPU
    the HFU (lesson 18) and the step times (lessons 19-21) are then the GPU's, not the time to queue it."""
    source = inspect.getsource(lesson(path).worker)
    assert "begun = hardware.clock(device)" in source
    assert "step_seconds += (hardware.clock(device) - begun) if step else 0.0" in source
    assert "time.perf_counter() - begun" not in source


def test_lesson_14_reports_the_steps_peak_and_no_whole_run_cuda_peak(readings, monkeypatch):
    from course.measuring import accumulation
    from course.models import ViT

    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: calls.append("max") or 220 * 2 ** 20)
    meter = accumulation.Meter(ViT(7, 16, 1, 2), CUDA, checkpointed=False)
    meter.step()
    meter.step()
    counts = meter.summary(2, 32)
    line = accumulation.describe(counts, 1, False)
    assert not calls, calls  # the allocator's peak is StepPeak's alone (memory.py), reset as step 3 begins
    assert not any("cuda" in key for key in counts), counts
    assert "peak" not in line.lower(), line


@pytest.mark.parametrize("path", DAY4[:1])  # lessons 19 and 20 price what their steps sent, on their groups
def test_the_bandwidth_sweep_reaches_1024_mib_on_a_gpu_and_stays_at_16_on_the_cpu(path):
    from course.measuring.hardware import sweep_sizes

    module = lesson(path)
    args = module.build_parser().parse_args([])
    assert sweep_sizes(CPU, args.sizes_mib) == [0.25, 1.0, 4.0, 16.0]
    assert sweep_sizes(CUDA, args.sizes_mib) == [0.25, 1.0, 4.0, 16.0, 64.0, 256.0, 1024.0]
    asked = module.build_parser().parse_args(["--sizes-mib", "1", "64"]).sizes_mib
    assert sweep_sizes(CUDA, asked) == sweep_sizes(CPU, asked) == [1.0, 64.0]
    assert "hardware.sweep_sizes(device, args.sizes_mib)" in inspect.getsource(module.worker)


def test_the_readiness_checks_largest_all_reduce_is_1024_mib_on_gpus_256_on_cpus(monkeypatch, tmp_path):
    from course import readiness

    asked = []
    monkeypatch.setattr(readiness, "bandwidth", lambda results, max_mib, iters, timeout: asked.append(max_mib) or 0)
    readiness.main(["bandwidth", str(tmp_path)])
    readiness.main(["bandwidth", str(tmp_path), "--max-mib", "4"])
    assert asked == [None, 4]
    assert [readiness.top_mib(d, m) for d in (CUDA, CPU) for m in asked] == [1024, 4, 256, 4]
    assert '${READINESS_MAX_MIB:+--max-mib "$READINESS_MAX_MIB"}' in (REPO / "scripts/readiness_job.sh").read_text()
