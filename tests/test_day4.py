"""Lessons 18 (what the hardware allows) and 19 (tensor parallel), run for real: gloo, the CPU, a tiny ViT
(width 32, depth 2, 4 heads), one thread a rank.

The reference is one process: lesson 18 at --nproc 1 (DDP over one rank, fp32), batch 32.  Lesson 19 at
T = 2 (torchrun) and T = 4 (its own launcher) takes the same batches of 32 on every rank, from the same
weights (seed 5), with SGD and momentum and the gradient clip active (lr 0.5, clip 0.5 against norms of
1.0-1.6): it must end where the one process ends.

Bounds (the numbers are next to each assertion):
- tensor parallel against one process, after 4 steps: the relative difference of the whole weight vector at
  most 1e-6 (measured 2.8e-8 at T = 2 and 3.0e-8 at T = 4: the row-wise layers' sums are added in another
  order); losses and gradient norms within 1e-6 relative (measured equal to 1.2e-7).
- each rank holds exactly 1/T of the cut parameters (integers: bytes of its pieces against the whole).
- step 1's collectives, counted by torch's CommDebugMode: 2 all_reduces per block forward, 2 backward.
- lesson 18's FLOPs of step 1, counted by FlopCounterMode (with the CPU attention's formula), within 10% of
  6 x parameters x tokens + 12 x depth x tokens x width x tokens (measured 0.97 at width 64; 0.95 here).
- lesson 18 in a network namespace of its own (root): the bytes the interfaces sent per rank against the
  ring formula, at 4 MiB: all_reduce and all_gather within 1% (measured 1.001-1.004); gloo's reduce_scatter
  sends twice the formula (measured 2.002), what an all_reduce of the same tensor sends.
"""
import os
import shutil

import pytest
import torch

from conftest import PYTHON, REPO, lesson, metrics, run
from course.output import load_weights

pytestmark = pytest.mark.slow
HARDWARE, TP = "day4/18_hardware_limits.py", "day4/19_tensor_parallel.py"
COMMON = ["--train-samples", "640", "--batch-size", "32", "--seed", "5", "--lr", "0.5", "--clip-grad-norm", "0.5",
          "--max-steps", "4", "--loader", "memory", "--width", "32", "--depth", "2", "--heads", "4",
          "--precision", "fp32", "--sizes-mib", "0.25"]
EQUAL = 1e-6


def own_network() -> list:
    """`unshare -n` with the loopback up: a network namespace only this run's ranks use (root only)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return []
    return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dataset):
    root = tmp_path_factory.mktemp("day4")
    out = {}
    out["one"] = lesson(HARDWARE, *COMMON, "--nproc", "1", "--run-dir", root / "one", nproc=1)
    out["tp2"] = lesson(TP, *COMMON, "--run-dir", root / "tp2", launcher="torchrun", nproc=2)
    out["tp4"] = lesson(TP, *COMMON, "--nproc", "4", "--run-dir", root / "tp4")
    wire = [*COMMON[:-1], "4", "--max-steps", "2"]
    out["wire"] = run([*own_network(), PYTHON, REPO / HARDWARE, *wire, "--nproc", "2", "--run-dir", root / "wire"])
    return {name: (root / name, proc.stdout) for name, proc in out.items()}


def vector(run_dir) -> torch.Tensor:
    w = load_weights(run_dir / "model.pt")
    return torch.cat([w[k].flatten() for k in sorted(w)])


@pytest.mark.parametrize("t", [2, 4])
def test_tensor_parallel_ends_where_one_process_ends(runs, t):
    """Measured: 2.8e-8 at T = 2, 3.0e-8 at T = 4; bound 1e-6."""
    tp, one = runs[f"tp{t}"][0], runs["one"][0]
    a, b = load_weights(tp / "model.pt"), load_weights(one / "model.pt")
    assert sorted(a) == sorted(b) and all(a[k].shape == b[k].shape for k in a)  # whole weights, one state dict
    rel = ((vector(tp) - vector(one)).norm() / vector(one).norm()).item()
    print(f"T = {t}: tensor parallel against one process, relative weight difference {rel:.3g}")
    assert rel <= EQUAL, rel
    mt, mo = metrics(tp), metrics(one)
    assert mt["steps"] == mo["steps"] == 4 and mt["world_size"] == t and mo["world_size"] == 1
    assert mt["loss_per_step"] == pytest.approx(mo["loss_per_step"], rel=EQUAL)
    assert mt["grad_norm_per_step"] == pytest.approx(mo["grad_norm_per_step"], rel=EQUAL)
    assert min(mo["grad_norm_per_step"]) > 0.5  # the clip at 0.5 was active, over DTensors and plain tensors
    assert mt["identical_weights"] is True  # the uncut parameters stayed equal on every rank


@pytest.mark.parametrize("t", [2, 4])
def test_each_rank_holds_one_tth_of_the_cut_parameters_and_the_collectives_are_counted(runs, t):
    m = metrics(runs[f"tp{t}"][0])
    per_rank = m["per_rank_bytes"]
    assert len(per_rank) == t and all(r["cut"] * t == r["cut_whole"] for r in per_rank), per_rank
    assert m["collectives_step_1"] == {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 4}}  # depth 2
    out = runs[f"tp{t}"][1]
    assert f"each rank holds {1 / t:.4f} of the cut parameters (1/{t} = {1 / t:.4f})" in out
    assert "forward: 4 all_reduce (2 per block); backward: 4 all_reduce (2 per block)" in out


def test_the_counted_flops_are_within_ten_percent_of_the_formula_and_utilization_is_a_fraction(runs):
    m = metrics(runs["one"][0])
    ratio = m["flops_per_step"] / m["flops_formula"]
    print(f"counted / formula: {ratio:.3f}; MFU {m['mfu']:.3f}")
    assert 0.9 <= ratio <= 1.1, ratio
    assert 0 < m["mfu"] < 1 and m["matmul_peak_flops"] > 1e8
    assert f"(counted / formula: {ratio:.3f})" in runs["one"][1]


def test_the_bytes_on_the_wire_are_the_formulas(runs):
    if not own_network():
        pytest.skip("needs root: the bytes sent are counted in a network namespace of the test's own")
    rows = {r["op"]: r for r in metrics(runs["wire"][0])["collectives"]}
    ratios = {op: r["sent"] / r["formula_per_rank"] for op, r in rows.items()}
    print("sent / formula at 4 MiB:", {op: round(v, 4) for op, v in ratios.items()})
    assert 1.0 <= ratios["all_reduce"] <= 1.01 and 1.0 <= ratios["all_gather"] <= 1.01, ratios
    assert 1.99 <= ratios["reduce_scatter"] <= 2.02, ratios  # gloo's reduce_scatter: an all_reduce's bytes
    assert all(r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * (1 if op == "all_reduce" else 0.5))
               for op, r in rows.items())  # 2 ranks: 2(n-1)/n = 1, (n-1)/n = 1/2


def test_bad_tensor_parallel_input_is_one_line_before_any_rank_starts(lesson_main):
    done = lesson_main(TP, "--quick", "--heads", "4", "--nproc", "3")
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "--heads 4 does not divide among 3 tensor-parallel ranks" in done.stderr
    done = lesson_main(TP, "--quick", "--model", "mlp", "--nproc", "2")
    assert done.returncode == 1 and "tensor parallelism cuts the ViT's" in done.stderr, done.stderr
