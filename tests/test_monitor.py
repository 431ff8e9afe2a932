"""`--watch-hardware` (course/measuring/monitor.py), watching the hardware from inside each rank: lesson 6 run for real.

- Two real runs of lesson 6, 2 ranks, gloo, the CPU, its own launcher: the whole training set and --quick.  Each rank writes hardware/rank{r}.json and TensorBoard scalars of its own, prints one line,
  and its numbers are plausible: CPU% > 0 while it trains, RSS above the bytes of its in-memory dataset, and
  the whole training set's run holds about the 148 MB more that its float32 images take than --quick's.
  Measured on 2026-11-24 (2 shared cores): 758 and 609 MB max RSS, a difference of 149 MB.  (Compare runs
  of one launcher: a rank started by torchrun held 1060 MB for --quick, a fresh interpreter importing more.)
- A bad --watch-interval is one line; torchrun passes the options on; importing the module imports neither
  psutil, pynvml nor tensorboard.
- The GPU path with NVML replaced by a fake (no GPU here): the rank's GPU is the one whose UUID torch reports,
  also when CUDA_VISIBLE_DEVICES puts NVML's GPU 2 first; its numbers are that GPU's, and stop() ends the
  thread.  A rank whose training raises exits at once (the thread does not keep it alive).
- On a GPU node (pytest -m gpu): the real NVML path, checked against nvidia-smi.
"""
import json
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from conftest import GPU_ENV, PYTHON, REPO, lesson, run

SCRIPT = "day1/6_mnist_ddp_pt.py"
# the float32 images the lesson holds (InMemoryMNIST): 60000 (or --quick's 12800) train + 10000 test, 28x28
TRAIN_MB, QUICK_TRAIN_MB, TEST_MB = (n * 784 * 4 / 1e6 for n in (60_000, 12_800, 10_000))
TAGS = {"hardware/cpu_percent", "hardware/rss_mb", "hardware/step"}
LINE = re.compile(r"^\[rank (\d)\] hardware, (\d+) samples? in [\d.]+ s: CPU (\d+)% mean, (\d+)% max .*"
                  r"RSS (\d+) MB max; every sample in (\S+)$", re.M)


def monitored(run_dir) -> dict:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted((run_dir / "hardware").glob("rank*.json"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dataset):
    root = tmp_path_factory.mktemp("hardware")
    full, quick = root / "full", root / "quick"
    # an earlier run of 4 ranks into the --quick run's dir: its ranks 2 and 3 must not look like this run's
    for r in (2, 3):
        (quick / "hardware" / f"rank{r}").mkdir(parents=True)
        (quick / "hardware" / f"rank{r}.json").write_text("{}")
        (quick / "hardware" / f"rank{r}" / "events.out.tfevents.1.old").write_text("")
    (quick / "hardware" / "rank0").mkdir()
    (quick / "hardware" / "rank0" / "events.out.tfevents.1.old").write_text("")
    out = {}
    out["full"] = (full, lesson(SCRIPT, "--nproc", "2", "--epochs", "1", "--max-steps", "300", "--loader", "memory",
                                "--watch-hardware", "--watch-interval", "0.1", "--run-dir", full).stdout)
    out["quick"] = (quick, lesson(SCRIPT, "--nproc", "2", "--quick", "--loader", "memory", "--watch-hardware",
                                  "--run-dir", quick).stdout)
    return out


@pytest.mark.slow
def test_each_rank_records_plausible_numbers(runs):
    run_dir, stdout = runs["full"]
    files = monitored(run_dir)
    assert sorted(files) == [0, 1], list((run_dir / "hardware").iterdir())
    lines = {int(m[1]): m for m in LINE.finditer(stdout)}
    assert sorted(lines) == [0, 1], stdout
    for rank, data in files.items():
        s, samples = data["summary"], data["samples"]
        assert data["rank"] == rank and data["world_size"] == 2
        assert s["samples"] == len(samples) >= 3, s  # 300 steps take more than 0.3 s here
        assert s["steps"] == samples[-1]["step"] == 300
        # in time order; "t" is in ms, and stop()'s last sample may fall in the thread's last one's ms
        assert all(a["t"] <= b["t"] and a["step"] <= b["step"] for a, b in zip(samples, samples[1:]))
        assert all(a["t"] < b["t"] for a, b in zip(samples[:-1], samples[1:-1]))  # the thread's own: 1 per interval
        assert s["gpu"] is None and "gpu_util_percent" not in samples[0]
        # a training rank keeps a core busy; psutil counts 100 % per core, this process only
        assert 0 < s["cpu_percent_mean"] <= s["cpu_percent_max"] <= 100 * s["cores_allowed"] + 10, s
        assert s["rss_mb_max"] > TRAIN_MB + TEST_MB, s
        assert s["rss_mb_max"] == max(x["rss_mb"] for x in samples)
        line = lines[rank]
        assert (int(line[2]), int(line[3]), int(line[4]), int(line[5])) == (
            s["samples"], round(s["cpu_percent_mean"]), round(s["cpu_percent_max"]), round(s["rss_mb_max"]))
        assert line[6] == str(run_dir / "hardware" / f"rank{rank}.json")


@pytest.mark.slow
def test_the_whole_training_set_shows_in_the_resident_memory(runs):
    """RSS is this process's memory: the run that holds 148 MB more images holds about that much more."""
    full, quick = ({r: d["summary"]["rss_mb_max"] for r, d in monitored(runs[k][0]).items()} for k in runs)
    for rank in (0, 1):
        extra = full[rank] - quick[rank]
        assert 0.5 * (TRAIN_MB - QUICK_TRAIN_MB) < extra < 2 * (TRAIN_MB - QUICK_TRAIN_MB), (full, quick)


@pytest.mark.slow
def test_tensorboard_scalars_per_rank_and_no_earlier_run(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name in runs:
        run_dir = runs[name][0]
        for rank, data in monitored(run_dir).items():
            events = list((run_dir / "hardware" / f"rank{rank}").glob("events.out.tfevents.*"))
            assert len(events) == 1, events  # the earlier run's file is gone
            acc = EventAccumulator(str(events[0].parent))
            acc.Reload()
            assert set(acc.Tags()["scalars"]) == TAGS
            rss = [e.value for e in acc.Scalars("hardware/rss_mb")]
            assert rss == pytest.approx([x["rss_mb"] for x in data["samples"]], rel=1e-6)
            assert [e.value for e in acc.Scalars("hardware/step")] == [x["step"] for x in data["samples"]]
    quick = runs["quick"][0] / "hardware"
    assert sorted(p.name for p in quick.iterdir()) == ["rank0", "rank0.json", "rank1", "rank1.json", "rank2",
                                                        "rank3"]
    assert not list(quick.glob("rank[23]/*")), "the files of ranks this run does not have are removed"


@pytest.mark.slow
@pytest.mark.parametrize("interval, says", [("0", "0 seconds: give a number of seconds of at least 0.01, e.g. 0.5"),
                                            ("soon", "'soon' is not a number of seconds")])
def test_a_bad_interval_is_one_line(tmp_path, interval, says):
    proc = lesson(SCRIPT, "--watch-hardware", "--watch-interval", interval, "--run-dir", tmp_path / "run", check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"python {SCRIPT}: error: argument --watch-interval: {says} (see --help)"], proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text", ["inf", "nan", "-1", "0.001", ""])
def test_interval_values_refused(text):
    import argparse

    from course.measuring.monitor import interval_seconds
    with pytest.raises(argparse.ArgumentTypeError):
        interval_seconds(text)
    assert interval_seconds("0.25") == 0.25


def test_torchrun_passes_the_options_on_to_the_lesson():
    """torchrun has its own --monitor-interval: a lesson option `--monitor` would stop torchrun's parser
    ("ambiguous option"), even after the script's name."""
    import argparse

    from torch.distributed.run import get_args_parser

    from course.measuring.profiling import add_profile_args
    options = []
    for action in add_profile_args(argparse.ArgumentParser())._actions:
        if action.option_strings[0] != "-h":
            options += [action.option_strings[0]] + (["0.2"] if action.nargs != 0 else [])
    assert "--watch-interval" in options  # the monitor's options are among them
    assert get_args_parser().parse_args([SCRIPT, *options]).training_script_args == options


def test_importing_the_plumbing_imports_no_monitoring_package():
    code = ("import sys; import course.measuring.profiling, course.measuring.monitor; "
            "print(sorted(m for m in ('psutil', 'pynvml', 'tensorboard') if m in sys.modules))")
    assert run([PYTHON, "-c", code]).stdout.strip() == "[]"


# --- the GPU path, NVML faked --------------------------------------------------------------------------

# NVML's GPUs of a node, by physical index; CUDA_VISIBLE_DEVICES=2,0 makes torch's cuda:0 NVML's GPU 2
NODE = [{"uuid": "GPU-0f3a1c52-0000-4000-8000-00000000000a", "util": 11, "used": 1_000e6, "mw": 100_000},
        {"uuid": "GPU-0f3a1c52-0000-4000-8000-00000000000b", "util": 22, "used": 2_000e6, "mw": 200_000},
        {"uuid": "GPU-0f3a1c52-0000-4000-8000-00000000000c", "util": 77, "used": 7_000e6, "mw": 300_000}]
VISIBLE = [2, 0]


class TorchUuid:
    """torch's _CUuuid prints as 8-4-4-4-12 hex digits, without NVML's "GPU-"."""

    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text


def by_uuid(uuid):
    import pynvml

    found = [h for h in NODE if h["uuid"] == (uuid.decode() if isinstance(uuid, bytes) else uuid)]
    if not found:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
    return found[0]


@pytest.fixture
def fake_gpu(monkeypatch):
    import pynvml
    import torch

    calls = []
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: calls.append("init"))
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: len(NODE))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: NODE[i])
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", by_uuid)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetIndex", lambda h: NODE.index(h))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda h: h["uuid"].encode())  # older releases: bytes
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", lambda h: SimpleNamespace(gpu=h["util"]))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda h: SimpleNamespace(used=h["used"]))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", lambda h: h["mw"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(
        name="Fake GPU", uuid=TorchUuid(NODE[VISIBLE[torch.device(d).index]]["uuid"][4:])))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 5_000e6)
    return calls


def test_nvml_index_follows_the_uuid_not_the_cuda_number(fake_gpu):
    import pynvml

    from course.measuring.monitor import nvml_index
    assert [nvml_index(pynvml, NODE[i]["uuid"][4:]) for i in VISIBLE] == [2, 0]
    assert nvml_index(pynvml, NODE[1]["uuid"].upper()) == 1
    assert nvml_index(pynvml, "MIG-0f3a1c52-0000-4000-8000-00000000000c") is None


def test_a_rank_samples_its_own_gpu_and_stops(fake_gpu, tmp_path, capsys):
    import torch

    from course.measuring.monitor import Monitor
    monitor = Monitor(0, 2, torch.device("cuda", 0), 0.02, tmp_path / "rank0.json", tmp_path / "tb").start()
    time.sleep(0.15)
    summary = monitor.stop()
    assert not any(t.name.startswith("monitor-") for t in threading.enumerate())
    gpu = summary["gpu"]
    assert (gpu["nvml_index"], gpu["uuid"], gpu["note"]) == (2, NODE[2]["uuid"][4:], None)
    assert (gpu["util_percent_mean"], gpu["memory_used_mb_max"], gpu["power_w_mean"],
            gpu["torch_max_allocated_mb"]) == (77, 7000, 300, 5000)
    samples = json.loads((tmp_path / "rank0.json").read_text())["samples"]
    assert len(samples) >= 2 and {s["gpu_util_percent"] for s in samples} == {77}
    assert fake_gpu == ["init", "shutdown"]
    out = capsys.readouterr().out
    assert "GPU 2 (Fake GPU) 77% busy, 7000 MB used max (torch's tensors 5000 MB max), 300 W mean" in out, out
    assert monitor.stop() is summary  # a second stop does nothing


def test_a_gpu_nvml_does_not_list_gives_a_note(fake_gpu, tmp_path, capsys, monkeypatch):
    import torch

    from course.measuring.monitor import Monitor
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(
        name="Fake GPU", uuid=TorchUuid("0f3a1c52-0000-4000-8000-0000000000ff")))  # e.g. a MIG slice
    summary = Monitor(0, 1, torch.device("cuda", 0), 0.02, tmp_path / "r.json", tmp_path / "tb").start().stop()
    assert summary["gpu"]["note"].startswith("no GPU with cuda:0's UUID 0f3a1c52-0000-4000-8000-0000000000ff")
    assert "util_percent_mean" not in summary["gpu"] and summary["rss_mb_max"] > 0
    assert fake_gpu == ["init", "shutdown"]
    assert "] hardware, 1 sample in " in capsys.readouterr().out


@pytest.fixture
def cgroup(fake_gpu, monkeypatch):
    """NVML's GPU 1 is outside the job's cgroup (Slurm's ConstrainDevices): NVML lists it but answers
    NO_PERMISSION to anything about it.  Returns what NVML was asked, as ("index" or "uuid", which)."""
    import pynvml

    asked = []

    def guarded(kind, get):
        def call(which):
            asked.append((kind, which))
            if which in (1, NODE[1]["uuid"]):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
            return get(which)
        return call

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", guarded("index", lambda i: NODE[i]))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", guarded("uuid", by_uuid))
    return asked


@pytest.mark.parametrize("driver", ["by UUID", "no nvmlDeviceGetHandleByUUID"])
def test_a_gpu_outside_the_jobs_cgroup_is_skipped_not_fatal(cgroup, tmp_path, monkeypatch, driver):
    """NO_PERMISSION from a GPU the job may not see stops nothing: the rank's GPU (NVML's 2) is read; asked by
    its UUID, NVML is asked about no other GPU."""
    import pynvml
    import torch

    from course.measuring.monitor import Monitor, nvml_index
    if driver != "by UUID":
        def missing(uuid):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", missing)
    summary = Monitor(0, 1, torch.device("cuda", 0), 0.02, tmp_path / "r.json", tmp_path / "tb").start().stop()
    gpu = summary["gpu"]
    assert (gpu["note"], gpu["nvml_index"], gpu["util_percent_mean"]) == (None, 2, 77), gpu
    if driver == "by UUID":
        assert cgroup == [("uuid", NODE[2]["uuid"])]
    else:
        assert ("index", 1) in cgroup and ("index", 2) in cgroup  # went past GPU 1's NO_PERMISSION
    assert nvml_index(pynvml, NODE[2]["uuid"]) == 2


def test_without_torchs_uuid_the_gpu_is_cuda_visible_devices_entry(cgroup, tmp_path, monkeypatch):
    """A torch whose device properties have no UUID: CUDA_VISIBLE_DEVICES's entry for the rank's device, a
    UUID (NVML's GPU 2) or an index, names the GPU."""
    import torch

    from course.measuring.monitor import Monitor
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(name="Fake GPU"))
    for visible, index in ((f"{NODE[0]['uuid']},{NODE[2]['uuid']}", 2), ("1,0", 0)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        gpu = Monitor(0, 1, torch.device("cuda", 1), 0.02, tmp_path / "r.json", tmp_path / "tb").start().stop()["gpu"]
        assert (gpu["note"], gpu["nvml_index"], gpu["uuid"]) == (None, index, visible.split(",")[1]), gpu
    assert ("index", 1) not in cgroup and ("uuid", NODE[1]["uuid"]) not in cgroup


class FakeProcess:
    """psutil.Process on a clock the test moves: CPU times as the kernel counts them, in ticks of 10 ms, so
    that a window of a few ms can hold several ticks (psutil's cpu_percent as psutil computes it)."""

    def __init__(self, clock, cpu):
        self.clock, self.cpu, self.last = clock, cpu, None

    def cpu_times(self):
        return SimpleNamespace(user=self.cpu[0], system=0.0)

    def cpu_percent(self):
        now = (self.clock[0], self.cpu[0])
        last, self.last = self.last, now
        return 0.0 if last is None else 100 * (now[1] - last[1]) / (now[0] - last[0])

    def memory_info(self):
        return SimpleNamespace(rss=100e6)

    def cpu_affinity(self):
        return [0, 1]


def test_the_last_samples_cpu_share_is_over_a_window_long_enough(tmp_path, monkeypatch):
    """The last sample is taken at stop(), here 10 ms after the one before: 25.6 ms of CPU time counted in
    those 10 ms (ticks arrive late) would say 256 % on 2 cores.  Its window reaches back over the samples
    before until it is CPU_WINDOW long; a run shorter than that gives no share rather than any share."""
    import torch

    from course.measuring import monitor as m
    clock, cpu = [100.0], [5.0]
    monkeypatch.setattr(m, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    mon = m.Monitor(0, 1, torch.device("cpu"), 3600, tmp_path / "r.json", tmp_path / "tb")
    mon.process = FakeProcess(clock, cpu)
    mon.start()
    for _ in range(3):  # three samples 50 ms apart, one core busy (45 ms of CPU, then 55 ms)
        clock[0] += 0.05
        cpu[0] += 0.045 if len(mon.samples) % 2 else 0.055
        mon._record()
    clock[0] += 0.01
    cpu[0] += 0.0256
    s = mon.stop()
    shares = [x["cpu_percent"] for x in mon.samples]
    assert shares[:3] == pytest.approx([110, 90, 110]), shares
    assert shares[3] == pytest.approx(100 * (0.055 + 0.045 + 0.0256) / 0.11), shares  # over the last 2 and stop()'s
    assert s["cpu_percent_max"] <= 100 * s["cores_allowed"], s
    short = m.Monitor(0, 1, torch.device("cpu"), 3600, tmp_path / "s.json", tmp_path / "tb2")
    short.process = FakeProcess(clock, cpu)
    short.start()
    clock[0] += 0.01
    cpu[0] += 0.0256
    assert short.stop()["cpu_percent_max"] is None and "CPU n/a mean, n/a max" in short.line()


def test_a_failing_rank_exits_at_once(tmp_path):
    code = ("import torch, time; from course.measuring.monitor import Monitor; "
            f"Monitor(0, 1, torch.device('cpu'), 0.05, {str(tmp_path / 'r.json')!r}, {str(tmp_path)!r}).start(); "
            "time.sleep(0.2); raise RuntimeError('training failed')")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "training failed" in proc.stderr
    assert time.perf_counter() - start < 30
    assert not (tmp_path / "r.json").exists()  # nothing half-written


# --- the real NVML path ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.slow
def test_real_nvml_on_a_gpu(gpus, tmp_path):
    """The GPU NVML reports is the one nvidia-smi lists with torch's UUID; its numbers are those of a GPU."""
    smi = run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"]).stdout
    physical = {uuid.strip(): int(index) for index, uuid in (line.split(",") for line in smi.strip().splitlines())}
    choices = [GPU_ENV["CUDA_VISIBLE_DEVICES"]]
    if GPU_ENV["CUDA_VISIBLE_DEVICES"] is None and len(physical) > 1:
        choices.append(str(len(physical) - 1))  # the last GPU as cuda:0
    for visible in choices:
        env = {"CUDA_VISIBLE_DEVICES": visible}
        uuid = run([PYTHON, "-c", "import torch; print(torch.cuda.get_device_properties(0).uuid)"],
                   env=env).stdout.split()[-1]
        run_dir = tmp_path / f"run{visible}"
        out = run([PYTHON, REPO / SCRIPT, "--nproc", "1", "--device", "cuda", "--quick", "--watch-hardware",
                   "--run-dir", run_dir], env=env).stdout
        gpu = monitored(run_dir)[0]["summary"]["gpu"]
        assert gpu["note"] is None and gpu["uuid"] == uuid and gpu["nvml_index"] == physical[f"GPU-{uuid}"], gpu
        assert gpu["memory_used_mb_max"] >= gpu["torch_max_allocated_mb"] > 0 and gpu["power_w_mean"] > 0, gpu
        assert 0 <= gpu["util_percent_mean"] <= 100
        assert f"GPU {gpu['nvml_index']} (" in out
