"""Lesson 7: every run adds one timing row (with the measured compute and communication per step), the
table and the plot cover the kept runs, and the printed explanation uses exactly the measured numbers.

Speed itself is not asserted: on 2 shared cores it depends on what else runs.  What is asserted is that
the lesson measures, records and explains consistently, under its own launcher and under torchrun.
"""
import csv
import os
import re
import shutil

import pytest

from conftest import lesson, metrics

SCRIPT = "day1/7_mnist_ddp_pt_timing.py"
COLUMNS = ["date", "host", "world_size", "threads_per_rank", "model", "batch_per_rank", "device", "epochs",
           "samples", "train_seconds", "samples_per_second", "step_ms", "compute_ms", "comm_ms", "comm_share",
           "load"]
STEPS = 30


def timings(run_dir) -> list:
    with open(run_dir / "timings.csv", newline="") as f:
        return list(csv.DictReader(f))


def default_threads(ranks_on_node: int) -> int:
    """What course.launch gives each rank when OMP_NUM_THREADS is not set: the node's cores // its ranks."""
    return max(1, os.cpu_count() // ranks_on_node)


def probe_lines(stdout: str) -> dict:
    """{world size: (threads, compute ms, communication ms)} from the lines the lesson prints."""
    found = re.findall(r"^(\d+) ranks x (\d+) threads, mlp at batch 64 per rank: compute ([\d.]+) ms/step, "
                       r"communication ([\d.]+) ms/step", stdout, re.M)
    return {int(w): (int(t), float(c), float(m)) for w, t, c, m in found}


@pytest.fixture(scope="module")
def sweep(dataset, tmp_path_factory):
    """One command, as in the workshop: world sizes 1 and 2, one after another; with OMP_NUM_THREADS unset, as
    on a user's machine (the tests set it to 1 elsewhere), so that the threads per rank are the lesson's own."""
    run_dir = tmp_path_factory.mktemp("lesson7")
    out = lesson(SCRIPT, "2", "--sweep", "--quick", "--max-steps", STEPS, "--run-dir", run_dir, timeout=240,
                 env={"OMP_NUM_THREADS": None})
    return run_dir, out


@pytest.mark.slow
def test_a_sweep_adds_one_row_per_world_size_and_explains_with_the_measured_numbers(sweep):
    run_dir, out = sweep
    rows = timings(run_dir)
    assert [int(r["world_size"]) for r in rows] == [1, 2]
    for r in rows:
        w = int(r["world_size"])
        assert all(r[c] != "" for c in COLUMNS), r
        assert int(r["threads_per_rank"]) == default_threads(w)
        assert int(r["samples"]) == STEPS * 64 * w
        assert float(r["samples_per_second"]) == pytest.approx(int(r["samples"]) / float(r["train_seconds"]),
                                                               rel=1e-3)
        assert float(r["compute_ms"]) > 0 and float(r["comm_ms"]) >= 0
    # the explanation prints exactly the recorded numbers, for each world size
    printed = probe_lines(out.stdout)
    assert set(printed) == {1, 2}
    for r in rows:
        threads, compute, comm = printed[int(r["world_size"])]
        assert (threads, compute, comm) == (int(r["threads_per_rank"]), float(r["compute_ms"]), float(r["comm_ms"]))
    one, two = rows
    c1, c2, m2 = float(one["compute_ms"]), float(two["compute_ms"]), float(two["comm_ms"])
    measured = float(two["samples_per_second"]) / float(one["samples_per_second"])
    expected = (f"2 x {c1:.3f} / ({c2:.3f} + {m2:.3f}) = {2 * c1 / (c2 + m2):.2f}x predicted, "
                f"{measured:.2f}x measured")
    assert expected in out.stdout
    verdict = re.search(r"^2 ranks (pay off|do not pay off|make no measurable difference) here "
                        r"\(([\d.]+)x ± ([\d.]+) against 1.0\)", out.stdout, re.M)
    assert verdict, out.stdout
    speedup, spread = float(verdict[2]), float(verdict[3])
    assert speedup == pytest.approx(measured, abs=6e-3)
    # the verdict is the position of 1.0 against speed-up ± noise, not a fixed threshold
    assert verdict[1] == ("pay off" if speedup - spread > 1 else "do not pay off" if speedup + spread < 1
                          else "make no measurable difference") or abs(abs(speedup - 1) - spread) < 0.006
    # advice never repeats what the run did: this run was the MLP at batch 64
    if verdict[1] != "pay off":
        assert "--model cnn --batch-size 512" in out.stdout
    # the table and the plot exist and hold both world sizes
    table = (run_dir / "scaling.md").read_text()
    assert "| mlp | 64 | cpu | 1 x" in table and "| mlp | 64 | cpu | 2 x" in table and "1.00x" in table
    with open(run_dir / "scaling.csv", newline="") as f:
        scaling = list(csv.DictReader(f))
    assert [int(r["world_size"]) for r in scaling] == [1, 2]
    assert float(scaling[1]["speedup"]) == pytest.approx(measured, abs=2e-3)
    assert (run_dir / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert metrics(run_dir)["world_size"] == 2


@pytest.mark.slow
def test_torchrun_chooses_the_world_size_and_adds_one_row(sweep, tmp_path):
    shutil.copy(sweep[0] / "timings.csv", tmp_path)
    out = lesson(SCRIPT, "3", "--quick", "--max-steps", STEPS, "--run-dir", tmp_path, launcher="torchrun",
                 nproc=2, timeout=180)
    assert "torchrun started 2 ranks; the 3 asked for is ignored" in out.stdout
    rows = timings(tmp_path)
    assert [int(r["world_size"]) for r in rows] == [1, 2, 2]
    threads, compute, comm = probe_lines(out.stdout)[2]
    assert (threads, compute, comm) == (int(rows[2]["threads_per_rank"]), float(rows[2]["compute_ms"]),
                                        float(rows[2]["comm_ms"]))
    with open(tmp_path / "scaling.csv", newline="") as f:
        scaling = list(csv.DictReader(f))
    assert [(int(r["world_size"]), r["date"]) for r in scaling] == [(1, rows[0]["date"]), (2, rows[2]["date"])]
    assert (tmp_path / "scaling.png").exists() and (tmp_path / "scaling.md").exists()


def test_the_table_keeps_the_latest_run_per_world_size_and_fresh_starts_over(tmp_path):
    from course import timing

    def row(world_size, samples_per_second, date, model="mlp"):
        return {"date": date, "host": "h", "world_size": world_size, "threads_per_rank": 1, "model": model,
                "batch_per_rank": 64, "device": "cpu", "backend": "gloo", "epochs": 1, "samples": 1000,
                "train_seconds": 1000 / samples_per_second, "samples_per_second": samples_per_second,
                "step_ms": 1.0, "compute_ms": 1.0, "comm_ms": 0.5, "comm_share": 0.333, "allreduce_ms": 0.1,
                "noise": 0.05}

    timing.record(tmp_path, row(1, 100.0, "d1"))
    timing.record(tmp_path, row(2, 150.0, "d2"))
    timing.record(tmp_path, row(2, 300.0, "d3"))
    table = timing.record(tmp_path, row(2, 50.0, "d4", model="cnn"))
    assert len(timings(tmp_path)) == 4
    assert [(r["model"], r["world_size"], r["speedup"]) for r in table] == [("cnn", 2, ""), ("mlp", 1, 1.0),
                                                                            ("mlp", 2, 3.0)]
    assert "(no 1-rank run)" in (tmp_path / "scaling.md").read_text()
    # the speed-up's noise: both runs' noises in quadrature
    assert table[2]["speedup_noise"] == pytest.approx(3.0 * (2 * 0.05 ** 2) ** 0.5, abs=1e-3)
    assert "3.00x ± 0.21" in (tmp_path / "scaling.md").read_text()
    table = timing.record(tmp_path, row(1, 100.0, "d5"), fresh=True)
    assert len(timings(tmp_path)) == 1 and len(table) == 1


@pytest.mark.parametrize("speed, noise, verdict", [(130.0, 0.05, "pay off"), (70.0, 0.05, "do not pay off"),
                                                   (104.0, 0.05, "make no measurable difference"),
                                                   (130.0, 0.4, "make no measurable difference")])
def test_the_verdict_puts_1_against_the_speedup_and_its_noise(tmp_path, capsys, speed, noise, verdict):
    from course import timing

    def row(world_size, samples_per_second, model="mlp", batch=64):
        return {"date": "d", "host": "h", "world_size": world_size, "threads_per_rank": 1, "model": model,
                "batch_per_rank": batch, "device": "cpu", "backend": "gloo", "epochs": 1, "samples": 1000,
                "train_seconds": 1000 / samples_per_second, "samples_per_second": samples_per_second,
                "step_ms": 1.0, "compute_ms": 1.0, "comm_ms": 0.5, "comm_share": 0.333, "allreduce_ms": 0.1,
                "load": 0.0, "noise": noise}

    for model, batch in (("mlp", 64), ("cnn", 512)):
        timing.record(tmp_path, row(1, 100.0, model, batch))
        two = row(2, speed, model, batch)
        table = timing.record(tmp_path, two)
        timing.explain(two, table, 1000, tmp_path)
        out = capsys.readouterr().out
        assert f"2 ranks {verdict} here ({speed / 100:.2f}x ± " in out
        if verdict == "pay off":
            assert "give each step more work" not in out
        elif model == "mlp":
            assert "(--model cnn --batch-size 512)" in out
        else:  # the run already was the CNN at batch 512: no advice to do what it did
            assert "--model cnn" not in out and "--batch-size 512" not in out and "its own GPU" in out


def test_bad_world_sizes_are_one_line_and_exit_2(tmp_path):
    out = lesson(SCRIPT, "2", "--nproc", "3", "--run-dir", tmp_path, check=False, timeout=60)
    assert out.returncode == 2 and "disagree" in out.stderr and "Traceback" not in out.stderr
    out = lesson(SCRIPT, "0", "--run-dir", tmp_path, check=False, timeout=60)
    assert out.returncode == 2 and "must be at least 1" in out.stderr
    # --sweep spawns its own workers: under torchrun it is refused before any process group starts
    out = lesson(SCRIPT, "--sweep", "--run-dir", tmp_path, check=False, timeout=60,
                 env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    assert out.returncode == 2 and "--sweep" in out.stderr and "torchrun" in out.stderr
    assert not (tmp_path / "timings.csv").exists()


def test_help_shows_the_world_size_argument():
    out = lesson(SCRIPT, "--help", timeout=60)
    assert "world_size" in out.stdout and "--sweep" in out.stdout and "--nproc" in out.stdout
