"""The CUDA path, on a node with GPUs: `pytest -m gpu` (skipped where CUDA sees none, as in CI).

The rest of the suite hides the GPUs (conftest.py); these tests give them back (GPU_ENV).  One GPU is enough:
NCCL cannot put two ranks on one GPU, so the distributed lessons run at world size = the number of GPUs,
which may be 1.  NCCL's collectives are still called at world size 1 (an all_reduce of one rank), and the
device placement the lessons teach (set_device before init, data and model on cuda:<local_rank>, DDP's
device_ids, map_location when loading) is the same at every size.

What is checked:
- lesson 1 all_reduces with NCCL, under its own launcher and torchrun;
- more ranks than GPUs stops with one line before anything starts;
- lessons 2, 4 (both variants) and 6 on the GPU take the steps of lesson 2 on the CPU (float32, the same
  batches) and lessons 4 and 6 match lesson 2 on the GPU as on the CPU; a model saved on the GPU loads here,
  in a process that sees no GPU;
- lesson 5's trace records the GPU's kernels;
- lesson 12 stopped by a signal and resumed on the GPU equals the run that was never stopped, bit for bit;
- lesson 16's checkpoint saved on the GPU (async, NCCL) resumes there and on 2 CPU ranks (within
  SAME_KERNELS and CPU_VS_GPU); its export, read without a GPU, holds the GPU run's weights;
- the benchmark's GPU rows run, and its graphed epoch computes the plain loop's weights.
"""
import csv
import math
import re
import signal

import pytest

from conftest import GPU_ENV, PYTHON, REPO, max_rel_diff, metrics, run
from course.training.output import load_weights
from test_fault_tolerance import Running, assert_bitwise_equal

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STEPS = ["--max-steps", "30", "--seed", "3"]
SAME_KERNELS = 1e-5  # lessons 4/6 vs 2 on one device: the CPU tests' bound (only the sum order differs)
CPU_VS_GPU = 1e-4    # float32 on two devices: other kernels, other rounding; measured on an H100 below


def on_gpu(cmd, **kw):
    return run(cmd, env={**GPU_ENV, **kw.pop("env", {})}, **kw)


@pytest.mark.parametrize("launcher", ["self", "torchrun"])
def test_lesson1_all_reduce_with_nccl(gpus, launcher):
    script = REPO / "day1" / "1_torch_dist_gpu.py"
    cmd = [PYTHON, script] if launcher == "self" else \
        [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", script]
    out = on_gpu(cmd).stdout
    assert "No CUDA GPU" not in out
    for r in range(gpus):
        assert re.search(rf"^\[rank {r}\] of {gpus} on cuda:{r} \(", out, re.M), out
    total = gpus * (gpus + 1) / 2
    assert out.count(f"all_reduce(SUM) = {total:g}") == gpus, out


@pytest.mark.parametrize("script", ["day1/4_mnist_manual_ddp.py", "day1/6_mnist_ddp_pt.py"])
def test_more_ranks_than_gpus_is_one_line_before_anything_starts(gpus, script, tmp_path):
    proc = on_gpu([PYTHON, REPO / script, "--nproc", gpus + 1, "--run-dir", tmp_path], check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert f"with {gpus + 1} ranks needs {gpus + 1} GPUs (one per rank), this machine has {gpus}" in proc.stderr
    assert "--backend gloo --device cpu" in proc.stderr
    assert "[rank" not in proc.stdout + proc.stderr  # refused before any rank was started
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory, gpus, dataset):
    """30 steps at global batch 64: lesson 2 on the CPU and on the GPU; lessons 4 and 6 with one rank per GPU."""
    root = tmp_path_factory.mktemp("gpu")
    b = 64 // gpus
    runs = {}
    for name, script, extra in (("cpu", "day1/2_mnist_training.py", ["--device", "cpu", "--batch-size", "64"]),
                                ("gpu", "day1/2_mnist_training.py", ["--batch-size", "64"]),
                                ("per-param", "day1/4_mnist_manual_ddp.py", ["--sync", "per-param"]),
                                ("flat", "day1/4_mnist_manual_ddp.py", ["--sync", "flat"]),
                                ("ddp", "day1/6_mnist_ddp_pt.py", [])):
        if script != "day1/2_mnist_training.py":
            extra = [*extra, "--batch-size", str(b), "--nproc", str(gpus)]
        runs[name] = (root / name, on_gpu([PYTHON, REPO / script, *STEPS, *extra, "--run-dir", root / name]))
    return runs


def test_lesson2_on_the_gpu_takes_the_steps_it_takes_on_the_cpu(gpu_runs):
    (cpu, cpu_out), (gpu, gpu_out) = gpu_runs["cpu"], gpu_runs["gpu"]
    assert " on cpu;" in cpu_out.stdout and " on cuda:0;" in gpu_out.stdout
    # the model was saved from the GPU; this process sees none (conftest.py): load_weights maps it to the CPU
    diff = max_rel_diff(load_weights(gpu / "model.pt"), load_weights(cpu / "model.pt"))
    print(f"lesson 2, 30 steps, GPU vs CPU: max relative difference {diff:.2e}")
    assert diff <= CPU_VS_GPU
    assert metrics(gpu)["loss_per_step"] == pytest.approx(metrics(cpu)["loss_per_step"], rel=1e-4)


@pytest.mark.parametrize("variant", ["per-param", "flat", "ddp"])
def test_ddp_lessons_with_nccl_equal_one_gpu_on_the_global_batch(gpu_runs, variant, gpus):
    d, _ = gpu_runs[variant]
    m = metrics(d)
    assert m["backend"] == "nccl" and m["world_size"] == gpus and m["global_batch_size"] == 64
    diff = max_rel_diff(load_weights(d / "model.pt"), load_weights(gpu_runs["gpu"][0] / "model.pt"))
    print(f"{variant} x{gpus} with NCCL vs lesson 2 on the GPU: max relative difference {diff:.2e}")
    assert diff <= SAME_KERNELS
    assert m["loss_per_step"] == pytest.approx(metrics(gpu_runs["gpu"][0])["loss_per_step"], rel=1e-4)


def test_manual_ddp_equals_torch_ddp_on_the_gpu(gpu_runs):
    manual = load_weights(gpu_runs["per-param"][0] / "model.pt")
    assert max_rel_diff(manual, load_weights(gpu_runs["ddp"][0] / "model.pt")) <= SAME_KERNELS
    assert max_rel_diff(manual, load_weights(gpu_runs["flat"][0] / "model.pt")) <= SAME_KERNELS


def test_lesson5_trace_records_gpu_kernels(gpus, dataset, tmp_path):
    on_gpu([PYTHON, REPO / "day1" / "5_mnist_manual_ddp_profile.py", "--nproc", gpus, "--quick",
            "--log-dir", tmp_path / "log", "--run-dir", tmp_path / "run"])
    traces = sorted((tmp_path / "log").rglob("*.pt.trace.json"))
    assert len(traces) == gpus, traces
    for trace in traces:
        text = trace.read_text()
        assert '"cat": "kernel"' in text and "nccl" in text.lower(), trace  # GPU kernels, NCCL's among them


def test_lesson12_stopped_and_resumed_on_the_gpu_equals_the_uninterrupted_run(gpus, dataset, tmp_path):
    """One rank per GPU, 50 steps at global batch 64, a SIGUSR1 after step 10: the checkpoint holds the
    GPU's tensors; resuming loads them with map_location onto the rank's own GPU."""
    args = [PYTHON, REPO / "day2" / "12_ddp_fault_tolerance.py", "--nproc", gpus, "--train-samples", "1600",
            "--epochs", "2", "--batch-size", str(64 // gpus), "--seed", "5", "--checkpoint-every", "7",
            "--log-every", "1"]
    steps = 2 * math.ceil(1600 / 64)
    on_gpu([*args, "--run-dir", tmp_path / "reference"])
    first = Running([*args, "--step-sleep", "0.1", "--run-dir", tmp_path / "stopped"], env=GPU_ENV)
    try:
        first.wait_for(r"^\[rank 0\] step 10 ")
        first.proc.send_signal(signal.SIGUSR1)
        assert first.finish() == 0, first.output
    finally:
        first.kill()
    stop = int(re.search(rf"^\[rank 0\] stopped after step (\d+) of {steps} ", first.output, re.M).group(1))
    assert 10 <= stop < steps
    out = on_gpu([*args, "--run-dir", tmp_path / "stopped"]).stdout
    assert f": step {stop}" in out and "resuming from" in out, out
    assert_bitwise_equal(tmp_path / "stopped", tmp_path / "reference")


def test_lesson16_checkpoint_saved_on_the_gpu_resumes_there_and_on_the_cpu(gpus, dataset, tmp_path):
    """Lesson 16 with NCCL, one rank per GPU, async saves (their own gloo group) at steps 3 and 6: resumed
    from step 3 on the GPU it ends where the uninterrupted run ends (SAME_KERNELS); resumed by 2 CPU ranks
    (gloo, other kernels) within CPU_VS_GPU; the export, in a process that sees no GPU, holds the GPU run's
    weights bit for bit."""
    import shutil

    args = [PYTHON, REPO / "day3" / "16_distributed_checkpoint.py", "--train-samples", "640", "--seed", "5",
            "--lr", "0.5", "--width", "32", "--depth", "2", "--heads", "2", "--max-steps", "6",
            "--checkpoint-every", "3", "--loader", "memory"]
    on_gpu([*args, "--nproc", gpus, "--batch-size", str(64 // gpus), "--async-save", "--run-dir", tmp_path / "gpu"])
    for name, extra, env in (("gpu-resumed", ["--nproc", gpus, "--batch-size", str(64 // gpus)], GPU_ENV),
                             ("cpu-resumed", ["--nproc", "2", "--batch-size", "32", "--device", "cpu"], None)):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        shutil.copytree(tmp_path / "gpu/checkpoints/step-000000003", tmp_path / name / "checkpoints/step-000000003")
        out = run([*args, *extra, "--resume", "--run-dir", tmp_path / name], env=env).stdout
        assert "step 3" in out and "steps 4 to 6 (3 steps)" in out, out
    gpu = load_weights(tmp_path / "gpu/model.pt")
    # same GPU, same world size: equal unless a CUDA kernel (attention's backward) adds in varying order
    assert max_rel_diff(load_weights(tmp_path / "gpu-resumed/model.pt"), gpu) <= SAME_KERNELS
    assert max_rel_diff(load_weights(tmp_path / "cpu-resumed/model.pt"), gpu) <= CPU_VS_GPU
    run([*args[:2], "--export", tmp_path / "export.pt", "--checkpoint-dir", tmp_path / "gpu/checkpoints"])
    exported = load_weights(tmp_path / "export.pt")
    assert all((exported[k] == gpu[k]).all() for k in gpu)


def test_benchmark_gpu_rows(gpus, dataset, tmp_path):
    out = on_gpu([PYTHON, REPO / "benchmarks" / "bench.py", "--smoke", "--sections", "input,train",
                  "--device", "cuda", "--out", tmp_path]).stdout
    rows = {r["name"]: r for r in csv.DictReader((tmp_path / "bench.csv").open())}
    gpu_rows = {name: r for name, r in rows.items() if name.lstrip().startswith("[cuda]")}
    assert len(gpu_rows) >= 6, out
    assert all(math.isfinite(float(r["value"])) for r in gpu_rows.values()), out
    same = [r for name, r in gpu_rows.items() if "graphed vs the plain loop" in name]
    assert len(same) == 1 and float(same[0]["value"]) <= 1e-6, out
