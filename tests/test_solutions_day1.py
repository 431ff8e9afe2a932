"""The solutions of lessons 0-8's exercises do what they say (tests/test_solutions.py: how).
"""
import json
import re
import time
from pathlib import Path

import pytest

from conftest import REPO, max_rel_diff, run
from course.launching.ports import free_port
from solutions_check import (argv, commands, edit_source, metrics, numbers, run_edited, run_solution, sections,
                             solution, weights)


pytestmark = pytest.mark.slow  # the exercises' checks: the full suite (the quick tier proves each lesson's own claim)

# ------------------------------------------------------------------------------------------ lesson 0

@solution("0_torch_dist", 1)
def test_0_1_more_processes_than_cores(tmp_path):
    out = run_solution("0_torch_dist", 1, tmp_path).stdout  # lesson 0 under its own launcher
    assert sorted(re.findall(r"\[rank (\d)\] all_reduce\(SUM\) = 36, mean = 4\.5", out)) == [str(r) for r in range(8)]


@solution("0_torch_dist", 2)
@pytest.mark.slow
def test_0_2_one_rank_alone_waits_then_stops(tmp_path):
    line = edit_source(commands("0_torch_dist", 2)[0], r"\b29533\b", str(free_port()), "solutions/0_torch_dist.md, 2")
    cmd, env = argv(line, tmp_path)
    start = time.monotonic()
    proc = run(cmd, env=env, check=False, timeout=120)
    assert proc.returncode == 1
    assert time.monotonic() - start > 9, "it waited for the other rank"
    assert "within --timeout" in proc.stderr + proc.stdout and "1/2 clients joined" in proc.stderr + proc.stdout


@solution("0_torch_dist", 3)
def test_0_3_torchrun(tmp_path):
    out = run_solution("0_torch_dist", 3, tmp_path).stdout  # lesson 0 under torchrun
    assert sorted(re.findall(r"\[rank (\d)\] all_reduce\(SUM\) = 10, mean = 2\.5", out)) == ["0", "1", "2", "3"]


# ------------------------------------------------------------------------------------------ lesson 1

@solution("1_torch_dist_gpu", 1)
@pytest.mark.gpu
def test_1_1_four_nccl_ranks():
    pytest.skip("needs a node with 4 GPUs (solutions/1_torch_dist_gpu.md says so)")


@solution("1_torch_dist_gpu", 2)
@pytest.mark.gpu
def test_1_2_nccl_debug():
    pytest.skip("needs a GPU node with several GPUs (solutions/1_torch_dist_gpu.md says so)")


@solution("1_torch_dist_gpu", 3)
def test_1_3_gloo_anywhere(tmp_path):
    out = run_solution("1_torch_dist_gpu", 3, tmp_path).stdout
    assert len(re.findall(r"\[rank \d\] of 3 on cpu", out)) == 3
    assert len(re.findall(r"all_reduce\(SUM\) = 6, mean = 2\b", out)) == 3


# ------------------------------------------------------------------------------------------ lesson 2

@solution("2_mnist_training", 1)
@pytest.mark.slow
def test_2_1_the_cnn_is_slower_and_behind_after_200_steps(tmp_path, dataset):
    run_solution("2_mnist_training", 1, tmp_path, line=0)
    run_solution("2_mnist_training", 1, tmp_path, line=1)
    cnn, mlp = metrics(tmp_path / "solutions/2-cnn"), metrics(tmp_path / "solutions/2-mlp")
    assert cnn["steps"] == mlp["steps"] == 200
    # "many times the MLP's seconds": above 3x in this suite's earlier runs, 2.9x once next to the other worker
    assert cnn["train_seconds"] > 1.5 * mlp["train_seconds"]
    assert cnn["test_accuracy"] < mlp["test_accuracy"]


# The MLP's test accuracy after 100 steps of global batch 128, lesson 2's and lesson 4's (2 ranks x 64): the
# solutions state one number for both, and the runs must be within ACCURACY of it.  Float rounding, all that
# another torch build changes, does not move it: lesson 4's weights differ from lesson 2's by 3.4e-7 of the
# largest weight and both print 0.7925 (notebook 4), 1 or 2 threads print 0.7925, and noise of 1e-3 of each
# tensor's largest weight on the final weights moved it by 0.0004 at most (5 x 5 trials). A different training
# does: one step fewer +0.0065, --seed 1 -0.0122, --seed 2 +0.0024 (measured 2026-11-29, torch 2.14.1, 2 cores).
ACCURACY = 0.002  # 20 of the 10000 test images


def stated_accuracy() -> float:
    """The test accuracy that solutions/2_mnist_training.md (exercise 2) and 4_mnist_manual_ddp.md (exercise 1)
    state, one number in every place."""
    said = {page: re.findall(r"test accuracy,? (0\.\d+)", sections(page)[n])
            for page, n in (("2_mnist_training", 2), ("4_mnist_manual_ddp", 1))}
    assert all(said.values()) and len({a for v in said.values() for a in v}) == 1, said
    return float(said["4_mnist_manual_ddp"][0])


@solution("2_mnist_training", 2)
def test_2_2_batch_128_takes_half_the_steps(tmp_path, dataset):
    out = run_solution("2_mnist_training", 2, tmp_path).stdout
    (accuracy,) = numbers(out, r"^trained 100 steps \(12800 samples\) in .*; test accuracy (0\.\d+) over the 10000",
                          "lesson 2 with batch 128")
    assert abs(accuracy - stated_accuracy()) <= ACCURACY, (accuracy, stated_accuracy())  # lesson 4's 2 ranks x 64


# ------------------------------------------------------------------------------------------ lesson 3

@solution("3_mnist_distributed", 1)
def test_3_1_a_seed_per_rank_makes_different_models(tmp_path, dataset):
    edit, train = commands("3_mnist_distributed", 1)
    sed = re.fullmatch(r"sed 's/(.+)/(.+)/' day1/3_mnist_distributed\.py > day1/3_seed_per_rank\.py", edit)
    assert sed and sed[2] == "build_model(args.model, args.seed + rank)", edit
    source = (REPO / "day1/3_mnist_distributed.py").read_text()
    # the learner's sed replaces its text as typed, and copies the lesson unchanged where it is not found
    assert sed[1] in source, f"day1/3_mnist_distributed.py no longer has {sed[1]!r}: update the solution's sed"
    seed_per_rank = edit_source(source, r"\bbuild_model\(\s*args\.model\s*,\s*args\.seed\s*\)", lambda _: sed[2],
                                "day1/3_mnist_distributed.py")
    out = run_edited(train, tmp_path, "day1/3_seed_per_rank.py", seed_per_rank).stdout
    assert "identical weights on all 2 ranks: False; identical data order: True" in out


# ------------------------------------------------------------------------------------------ lesson 4

@solution("4_mnist_manual_ddp", 1)
def test_4_1_flat_sync_gives_the_same_result(tmp_path, dataset):
    out = run_solution("4_mnist_manual_ddp", 1, tmp_path).stdout
    # --sync flat against per-param and lesson 2's batch 128: the accuracy the solutions state (ACCURACY: why)
    (accuracy,) = numbers(out, r"2 ranks x batch 64 = global batch 128; test accuracy (0\.\d+);", "lesson 4, flat")
    assert abs(accuracy - stated_accuracy()) <= ACCURACY, (accuracy, stated_accuracy())
    # lesson 4 under torchrun: the 2 ranks split the test set and count every image once
    assert metrics(tmp_path / "solutions/4-flat")["world_size"] == 2
    assert "(10000 test images, each counted once)" in out


@solution("4_mnist_manual_ddp", 2)
@pytest.mark.slow
def test_4_2_three_ranks_pad_one_sample(tmp_path, dataset):
    run_solution("4_mnist_manual_ddp", 2, tmp_path)
    shards = json.loads((tmp_path / "solutions/4-three/shards.json").read_text())["shards"]
    seen = [i for shard in shards for i in shard]
    assert [len(s) for s in shards] == [4267] * 3
    assert (len(seen), len(set(seen))) == (12801, 12800)


# ------------------------------------------------------------------------------------------ lesson 5

def comm(log_dir):
    from course.measuring.profiling import comm_summary

    return comm_summary(log_dir)


@solution("5_mnist_manual_ddp_profile", 1)
@pytest.mark.slow
def test_5_1_the_cnn_moves_fewer_bytes(tmp_path, dataset):
    # The bytes are exact.  Times are not asserted (the benchmark measures speed): the share of the step
    # spent in the all_reduce includes waiting for the other rank and moves with the machine's load.
    run_solution("5_mnist_manual_ddp_profile", 1, tmp_path, line=0)
    run_solution("5_mnist_manual_ddp_profile", 1, tmp_path, line=1)
    cnn, mlp = comm(tmp_path / "solutions/5-cnn/log"), comm(tmp_path / "solutions/5-mlp/log")
    assert round(cnn["bytes_per_step"] / 1000, 1) == 177.7 and round(mlp["bytes_per_step"] / 1000, 1) == 407.1


@solution("5_mnist_manual_ddp_profile", 2)
@pytest.mark.slow
def test_5_2_a_small_cap_splits_the_mlp_in_two(tmp_path, dataset):
    out = run_solution("5_mnist_manual_ddp_profile", 2, tmp_path).stdout
    assert re.search(r"^ddp\s+2\.0\s+407\.1", out, re.M), out


@solution("5_mnist_manual_ddp_profile", 3)
@pytest.mark.slow
def test_5_3_three_cnn_buckets_overlap_backward(tmp_path, dataset):
    out = run_solution("5_mnist_manual_ddp_profile", 3, tmp_path).stdout
    assert re.search(r"^ddp\s+3\.0\s+177\.7", out, re.M), out
    assert comm(tmp_path / "solutions/5-overlap/log")["overlap_fraction"] > 0  # as the solution says: above 0 %


# ------------------------------------------------------------------------------------------ lesson 6

@solution("6_mnist_ddp_pt", 1)
def test_6_1_two_buckets_give_the_same_weights(tmp_path, dataset):
    out = run_solution("6_mnist_ddp_pt", 1, tmp_path, line=0).stdout
    # lesson 6 under torchrun: the 2 ranks split the test set and count every image once, and it learns
    m = metrics(tmp_path / "solutions/6-default")
    assert m["world_size"] == 2 and m["test_accuracy"] > 0.7 and "(10000 test images, each counted once)" in out
    run_solution("6_mnist_ddp_pt", 1, tmp_path, line=1)
    a, b = weights(tmp_path / "solutions/6-default/model.pt"), weights(tmp_path / "solutions/6-buckets/model.pt")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


@solution("6_mnist_ddp_pt", 2)
@pytest.mark.slow
def test_6_2_the_cnn_under_ddp_and_lesson_4(tmp_path, dataset):
    run_solution("6_mnist_ddp_pt", 2, tmp_path, line=0)
    run_solution("6_mnist_ddp_pt", 2, tmp_path, line=1)
    a, b = weights(tmp_path / "solutions/6-cnn/model.pt"), weights(tmp_path / "solutions/6-cnn-lesson4/model.pt")
    assert max_rel_diff(a, b) == 0.0
    assert metrics(tmp_path / "solutions/6-cnn")["test_accuracy"] == \
        metrics(tmp_path / "solutions/6-cnn-lesson4")["test_accuracy"]


# ------------------------------------------------------------------------------------------ lesson 7

def scaling(run_dir) -> dict:
    import csv

    with open(Path(run_dir) / "scaling.csv", newline="") as f:
        return {int(r["world_size"]): r for r in csv.DictReader(f)}


@solution("7_mnist_ddp_pt_timing", 1)
@pytest.mark.slow
def test_7_1_a_larger_batch_shrinks_the_share_of_communication(tmp_path, dataset):
    """The share is a difference of two medians of a few ms each: on an idle machine 13% at batch 1024 against
    about 50% at 64, but the suite's other workers can swamp one probe (0.634 against 0.519 seen once in a
    whole run).  Each attempt runs both exercise lines afresh; the claim must hold in one of three."""
    env = {"OMP_NUM_THREADS": None}  # the lesson's own threads per rank, as in a terminal
    seen = []
    for _ in range(3):
        run_solution("7_mnist_ddp_pt_timing", 1, tmp_path, line=0, env=env)
        run_solution("7_mnist_ddp_pt_timing", 1, tmp_path, line=1, env=env)
        b64, b1024 = scaling(tmp_path / "solutions/7-b64"), scaling(tmp_path / "solutions/7-b1024")
        seen.append((float(b1024[2]["comm_share"]), float(b64[2]["comm_share"])))
        if seen[-1][0] < seen[-1][1]:
            break
    assert seen[-1][0] < seen[-1][1], f"(batch 1024, batch 64) comm shares of each attempt: {seen}"


@solution("7_mnist_ddp_pt_timing", 2)
def test_7_2_each_torchrun_call_adds_a_row(tmp_path, dataset):
    run_solution("7_mnist_ddp_pt_timing", 2, tmp_path, line=0)
    run_solution("7_mnist_ddp_pt_timing", 2, tmp_path, line=1)
    rows = scaling(tmp_path / "solutions/7-torchrun")
    assert sorted(rows) == [1, 2] and rows[2]["speedup"]
    assert len((tmp_path / "solutions/7-torchrun/timings.csv").read_text().strip().splitlines()) == 3


# ------------------------------------------------------------------------------------------ lesson 8

@solution("8_mnist_ddp_pt_lr", 1)
@solution("8_mnist_ddp_pt_lr", 2)
@pytest.mark.slow
def test_8_more_ranks_lag_further_without_scaling_and_the_scaled_lr_catches_up(tmp_path, dataset):
    run_solution("8_mnist_ddp_pt_lr", 1, tmp_path, line=0)
    two = metrics(tmp_path / "solutions/8")["deviation"]["mean"]
    run_solution("8_mnist_ddp_pt_lr", 1, tmp_path, line=1)
    four = metrics(tmp_path / "solutions/8")["deviation"]["mean"]
    assert four > two > 0
    run_solution("8_mnist_ddp_pt_lr", 2, tmp_path)  # the same run dir: the same reference
    scaled = metrics(tmp_path / "solutions/8")
    assert scaled["lr"] == pytest.approx(0.04)
    assert abs(scaled["deviation"]["mean"]) < four / 2
