"""Day 1 lessons 0-4 and 6, run for real (their own launcher and torchrun, gloo on the CPU), each configuration
once per test session (the catalogue of reference runs: tests/reference_runs.py).  Lesson 0 at 8 ranks and
under torchrun, and lessons 4 and 6 under torchrun counting every test image once, are checked by the
exercises that run exactly those commands (tests/test_solutions_day1.py).

The central claim of the course is checked here: W ranks with per-rank batch b, synchronised by hand
(lesson 4, both variants) or by torch DDP (lesson 6), take exactly the steps of one process on the global
batch W*b (lesson 2).  Bound: after 30 steps every parameter tensor differs from the single-process one by
at most 1e-5 of its largest magnitude (float32; measured ~4e-7: the only difference is the order in which
the per-rank means are summed).  Lessons 4 and 6 do the same arithmetic and must agree bitwise.
"""
import re

import pytest
import torch

from conftest import lesson, max_rel_diff, metrics
from course.training.output import load_weights

pytestmark = pytest.mark.slow
REL_BOUND = 1e-5


def means_printed(stdout: str) -> list:
    return [float(m) for m in re.findall(r"mean = ([0-9.]+)", stdout)]


# ------------------------------------------------------------------------------------------ lessons 0, 1

@pytest.mark.quick("0")
def test_lesson0_every_rank_all_reduces_and_prints_the_mean(catalogue):
    out = catalogue("0: 2 ranks, own launcher").stdout
    assert sorted(re.findall(r"\[rank (\d)\] all_reduce\(SUM\) = 3, mean = 1\.5", out)) == ["0", "1"], out


@pytest.mark.parametrize("launcher", [pytest.param("own launcher", marks=pytest.mark.quick("1")), "torchrun"])
def test_lesson1_on_cpu_says_so_and_runs_gloo(catalogue, launcher):
    """The tests hide the GPUs (conftest.py), so this is what a CPU-only machine shows; tests/test_gpu.py
    runs NCCL where there are GPUs."""
    out = catalogue(f"1: 2 ranks, {launcher}").stdout
    assert out.count("No CUDA GPU is visible") == (1 if launcher == "own launcher" else 2)  # once per process
    assert means_printed(out) == [1.5, 1.5]


def test_lesson1_nccl_without_enough_gpus_is_a_clear_error():
    proc = lesson("day1/1_torch_dist_gpu.py", "--backend", "nccl", "--nproc", str(torch.cuda.device_count() + 1),
                  check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert re.search(r"needs CUDA GPUs and none is visible|NCCL needs one GPU per rank", proc.stderr)


# ------------------------------------------------------------------------------------------ lesson 2

@pytest.mark.quick("2")
def test_lesson2_learns_fashion_mnist_in_one_epoch(catalogue):
    """One epoch of the MLP (SGD, lr 0.01, momentum 0.9, batch 64): measured 0.844 test accuracy on
    Fashion-MNIST.  Chance is 0.10 and a linear classifier reaches ~0.84 after many epochs; 0.80 leaves
    room for other seeds and thread counts while failing any broken loop, label or normalization."""
    ran = catalogue("2: one epoch")
    m = metrics(ran.run_dir)
    assert m["test_accuracy"] >= 0.80, ran.stdout
    assert m["steps"] == 938 and m["samples_seen"] == 60_000
    assert (ran.run_dir / "loss.png").stat().st_size > 10_000 and (ran.run_dir / "model.pt").exists()
    assert m["loss_per_step"][-1] < m["loss_per_step"][0] / 3


def test_lesson2_under_torchrun_and_refuses_more_processes(dataset, tmp_path):
    lesson("day1/2_mnist_training.py", "--max-steps", "5", "--run-dir", tmp_path, launcher="torchrun", nproc=1)
    assert metrics(tmp_path)["steps"] == 5
    proc = lesson("day1/2_mnist_training.py", "--max-steps", "5", "--run-dir", tmp_path / "x",
                  launcher="torchrun", nproc=2, check=False)
    assert proc.returncode != 0 and "single-process baseline" in proc.stderr


# ------------------------------------------------------------------------------------------ lesson 3

@pytest.mark.parametrize("launcher", [pytest.param("own launcher", marks=pytest.mark.quick("3")), "torchrun"])
def test_lesson3_ranks_end_bitwise_identical(catalogue, launcher):
    ran = catalogue(f"3: 40 steps, 2 ranks, {launcher}")
    m = metrics(ran.run_dir)
    assert m["identical_weights"] and m["identical_data_order"], ran.stdout
    assert [r["steps"] for r in m["ranks"]] == [40, 40]  # each rank did all the work
    # and the weights are exactly lesson 2's: N copies of one single-process run
    a, b = load_weights(ran.run_dir / "model.pt"), load_weights(catalogue("2: 40 steps").run_dir / "model.pt")
    assert max_rel_diff(a, b) <= REL_BOUND


def test_lesson3_calls_only_several_processes_replication(tmp_path, capsys):
    """Rank 0's report: "N processes did N x S steps ... replication" is false for one process."""
    from types import SimpleNamespace

    from course.training.replicas import report

    args = SimpleNamespace(run_dir=tmp_path, dataset="fashion", model="mlp", batch_size=64)
    notes = {"rank": 0, "weights": "w", "data_order": "d", "steps": 5, "train_seconds": 0.1}
    report([notes], args, 5, 0.5, torch.nn.Linear(2, 2))
    assert "replication" not in capsys.readouterr().out
    report([notes, {**notes, "rank": 1}], args, 5, 0.5, torch.nn.Linear(2, 2))
    assert "2 processes did 2 x 5 steps to produce one model: this is replication" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ lessons 4, 6

EQUAL_RUNS = {("per-param", 2): "4: per-param, 2 x 32", ("flat", 2): "4: flat, 2 x 32", ("ddp", 2): "6: 2 x 32",
              ("per-param", 4): "4: per-param, 4 x 16", ("ddp", 4): "6: 4 x 16"}  # 30 steps each, own launcher
# (the flat variant is covered at world size 2; torchrun: test_ddp_lessons_under_torchrun_... in the exercises)


@pytest.mark.parametrize("variant, world", [pytest.param("per-param", 2, marks=pytest.mark.quick("4")),
                                            ("flat", 2), pytest.param("ddp", 2, marks=pytest.mark.quick("6")),
                                            ("per-param", 4),
                                            ("ddp", 4)])
def test_data_parallel_equals_one_process_on_the_global_batch(catalogue, variant, world):
    single, d = catalogue("2: 30 steps, batch 64").run_dir, catalogue(EQUAL_RUNS[variant, world]).run_dir
    m = metrics(d)
    assert m["world_size"] == world and m["global_batch_size"] == 64 and m["steps"] == 30
    diff = max_rel_diff(load_weights(d / "model.pt"), load_weights(single / "model.pt"))
    assert diff <= REL_BOUND, f"{variant} x{world}: max relative difference {diff:.2e}"
    # the logged global-batch loss is the single process's loss, step by step
    assert m["loss_per_step"] == pytest.approx(metrics(single)["loss_per_step"], rel=1e-4)


def test_manual_ddp_equals_torch_ddp(catalogue):
    def weights(variant, world):
        return load_weights(catalogue(EQUAL_RUNS[variant, world]).run_dir / "model.pt")

    for world in (2, 4):
        assert max_rel_diff(weights("per-param", world), weights("ddp", world)) <= REL_BOUND
    assert max_rel_diff(weights("flat", 2), weights("per-param", 2)) <= REL_BOUND


def test_without_synchronisation_the_ranks_would_drift(catalogue):
    """The equality above is not trivially true: lesson 3 (no gradient all_reduce) on the same shards would
    differ.  Here: the single-process run at the per-rank batch is far from the global-batch run."""
    single, per_rank = catalogue("2: 30 steps, batch 64").run_dir, catalogue("2: 30 steps, batch 32").run_dir
    assert max_rel_diff(load_weights(per_rank / "model.pt"), load_weights(single / "model.pt")) > 1e-3


@pytest.mark.parametrize("world", [2, 4])
def test_lesson4_shards_are_disjoint_and_cover_the_data(catalogue, world):
    layout = (catalogue(EQUAL_RUNS["per-param", world]).run_dir / "shards.json").read_text()
    import json

    shards = json.loads(layout)["shards"]
    assert len(shards) == world and all(len(s) == 60_000 // world for s in shards)
    seen = [i for s in shards for i in s]
    assert len(set(seen)) == len(seen) == 60_000  # disjoint, and together every sample once


def test_lesson4_padding_when_the_data_does_not_divide(dataset, tmp_path):
    """1001 samples over 4 ranks: DistributedSampler pads to 1004 by repeating 3 samples; every sample is
    still covered.  (Evaluation never pads: see course/training/evaluate.py.)"""
    import json

    lesson("day1/4_mnist_manual_ddp.py", "--nproc", "4", "--train-samples", "1001", "--max-steps", "1",
           "--run-dir", tmp_path)
    shards = json.loads((tmp_path / "shards.json").read_text())["shards"]
    seen = [i for s in shards for i in s]
    assert [len(s) for s in shards] == [251] * 4 and set(seen) == set(range(1001)) and len(seen) == 1004

