"""Lesson 8: with the learning rate scaled by the world size (the linear scaling rule), the loss curve of
W ranks tracks the 1-process curve at equal samples seen; without scaling it lags behind.

The bound: with --quick (MLP, batch 64 per rank, base lr 0.01, 3 epochs of 12 800 samples), the moving means
over 2 560 samples of 2 and of 4 ranks with the scaled lr stay within 0.10 of the 1-process curve at every
point after the first 12 800 samples.  Measured on 2 cores, seeds 0-2, max |gap|: 2 ranks 0.019-0.029,
4 ranks 0.031-0.068 (seed 0, tested here: 0.019 and 0.031).  Without scaling: 2 ranks 0.057-0.064, 4 ranks
0.135-0.165, always further than with scaling and always behind (mean gap +0.045 and +0.11, against
+0.002-0.021 with scaling).  The lesson prints the gaps (and writes them into metrics.json) in its own
words, and sets a scaled and an unscaled run side by side; the bound is the tests' alone.
"""
import re
import shutil

import pytest

from conftest import lesson, metrics

SCRIPT = "day1/8_mnist_ddp_pt_lr.py"
BOUND = 0.10
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the curves do not depend on threads; 2 threads on busy cores crawl


def printed_gap(stdout: str) -> float:
    return float(re.search(r"max \|gap\| ([\d.]+) at \d+ samples", stdout).group(1))


@pytest.fixture(scope="module")
def two_ranks(dataset, tmp_path_factory):
    """One command, as a learner types it: the 1-process reference first, then 2 ranks."""
    run_dir = tmp_path_factory.mktemp("lesson8")
    out = lesson(SCRIPT, "--nproc", "2", "--quick", "--run-dir", run_dir, env=ONE_THREAD, timeout=240)
    return run_dir, out, metrics(run_dir)


def reference(run_dir):
    (path,) = run_dir.glob("reference_ws1_*.csv")
    return path


@pytest.mark.slow
@pytest.mark.quick("8")
def test_two_ranks_with_the_scaled_lr_track_one_process(two_ranks):
    run_dir, out, m = two_ranks
    assert "running it first" in out.stdout
    assert reference(run_dir).name == "reference_ws1_fashion-mnist_mlp_b64_lr0.01_seed0_n12800.csv"
    assert m["world_size"] == 2 and m["lr"] == pytest.approx(0.02) and m["scaled"]
    assert m["samples_seen"] == 3 * 12800
    dev = m["deviation"]
    assert dev["after_samples"] == 12800 and dev["window_samples"] == 2560
    assert dev["points"] == (3 * 12800 - 12800) // 128 + 1
    assert dev["max_abs"] <= BOUND, dev
    assert printed_gap(out.stdout) == pytest.approx(dev["max_abs"], abs=1e-4)
    assert "bound" not in out.stdout and "tests" not in out.stdout  # no test vocabulary for the learner
    assert "run the same command --no-scale to see 2 ranks with lr 0.01 against the same curve" in out.stdout


@pytest.fixture(scope="module")
def four_ranks(two_ranks, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lesson8_4")
    shutil.copy(reference(two_ranks[0]), run_dir)  # the same 1-process reference: not run again
    out = lesson(SCRIPT, "--nproc", "4", "--quick", "--run-dir", run_dir, env=ONE_THREAD, timeout=240)
    return run_dir, out, metrics(run_dir)


@pytest.mark.slow
def test_four_ranks_with_the_scaled_lr_track_one_process(four_ranks):
    run_dir, out, m = four_ranks
    assert "running it first" not in out.stdout
    assert m["world_size"] == 4 and m["lr"] == pytest.approx(0.04)
    assert m["deviation"]["max_abs"] <= BOUND, m["deviation"]
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_without_scaling_four_ranks_lag_behind(two_ranks, four_ranks, tmp_path):
    shutil.copy(reference(two_ranks[0]), tmp_path)
    shutil.copy(four_ranks[0] / "gaps.json", tmp_path)  # the scaled run's comparison, as if run here before
    out = lesson(SCRIPT, "--nproc", "4", "--quick", "--no-scale", "--run-dir", tmp_path, env=ONE_THREAD,
                 timeout=240)
    unscaled, scaled = metrics(tmp_path), four_ranks[2]
    assert unscaled["lr"] == pytest.approx(0.01) and not unscaled["scaled"]
    # the point of the lesson: the 1-process lr leaves 4 ranks behind (higher loss), the scaled lr does not
    assert unscaled["deviation"]["max_abs"] > scaled["deviation"]["max_abs"]
    assert unscaled["deviation"]["mean"] > scaled["deviation"]["mean"] > -0.02
    assert "behind (higher" in out.stdout
    # the two runs side by side, in the learner's words
    s, u = scaled["deviation"], unscaled["deviation"]
    assert (f"4 ranks against 1 process: with the lr scaled to 0.04 on average {abs(s['mean']):.4f} "
            f"{'behind' if s['mean'] > 0 else 'ahead'}") in out.stdout
    assert f"with the 1-process lr 0.01 on average {u['mean']:.4f} behind" in out.stdout
    assert f"{u['mean_abs'] / s['mean_abs']:.1f}x closer to 1 process" in out.stdout
    assert "bound" not in out.stdout


@pytest.mark.slow
def test_torchrun_says_how_to_make_the_reference_then_uses_it(two_ranks, tmp_path):
    out = lesson(SCRIPT, "--quick", "--max-steps", "6", "--warmup-steps", "4", "--run-dir", tmp_path,
                 launcher="torchrun", nproc=2, env=ONE_THREAD, timeout=180)
    assert "no 1-process reference" in out.stdout
    command = re.search(r"python day1/8_mnist_ddp_pt_lr.py --nproc 1 .*", out.stdout).group(0)
    assert f"--run-dir {tmp_path}" in command and "--epochs 3" in command and "--train-samples 12800" in command
    m = metrics(tmp_path)
    assert m["deviation"] is None and not list(tmp_path.glob("reference_ws1_*.csv"))
    # warmup: from the base lr 0.01 to 2 x 0.01 in 4 equal steps, then the scaled lr
    assert m["lr_per_step"] == pytest.approx([0.01, 0.0125, 0.015, 0.0175, 0.02, 0.02])
    # with the reference in place torchrun's run is the self-launched one, step for step
    shutil.copy(reference(two_ranks[0]), tmp_path)
    lesson(SCRIPT, "--quick", "--run-dir", tmp_path, launcher="torchrun", nproc=2, env=ONE_THREAD, timeout=180)
    assert metrics(tmp_path)["deviation"] == pytest.approx(two_ranks[2]["deviation"], abs=1e-4)


def test_deviation_is_the_largest_gap_of_the_moving_means():
    from course.training import curves as lesson8
    reference = [(64 * (i + 1), 2.0 - 0.001 * i) for i in range(400)]
    shifted = [(256 * (i + 1), 2.0 - 0.001 * (4 * i + 1.5) + 0.05) for i in range(100)]  # 4 ranks, +0.05
    dev = lesson8.deviation(shifted, reference, window=2560, after=10240)
    assert dev["max_abs"] == pytest.approx(0.05, abs=1e-9) and dev["mean"] == pytest.approx(0.05, abs=1e-9)
    assert dev["points"] == len([x for x, _ in shifted if x >= 10240])
    bumped = [(x, loss + (0.3 if x == 20480 else 0.0)) for x, loss in shifted]  # one bad step of 10 in a window
    assert lesson8.deviation(bumped, reference, 2560, 10240)["max_abs"] == pytest.approx(0.05 + 0.03, abs=1e-9)
    assert lesson8.deviation(shifted, reference[:100], 2560, 10240) is None  # the reference ends earlier


def test_help_names_the_schedule_options():
    """(A bad --warmup-steps: tests/test_every_input.py.)"""
    out = lesson(SCRIPT, "--help", timeout=60)
    assert "--no-scale" in out.stdout and "--warmup-steps" in out.stdout
