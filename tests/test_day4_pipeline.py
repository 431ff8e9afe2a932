"""Lesson 21 (pipeline parallel), run for real: gloo, the CPU, a tiny ViT (width 32, depth 4, 4 heads), one
thread a rank.

The reference is one process: lesson 18 at --nproc 1 (DDP over one rank, fp32), batch 32.  Lesson 21 takes
the same batches of 32, cut into m micro-batches, through p stages, from the same weights (seed 5), with SGD
and momentum and the gradient clip active (lr 0.5, clip 0.5): it must end where
the one process ends: GPipe at p = 2 (m = 2 and 4), 1F1B at p = 2 (m = 4) and p = 4 (m = 4 under torchrun,
m = 8), interleaved 1F1B at p = 2 (4 stages, m = 4).  Every run simulates STAGE_MS of compute per stage and
micro-batch forward and twice that backward (a sleep), so that its bubble can be measured.

Bounds (measured in one run of this file alone, 2026-11-27):
- against one process, after 5 steps: the relative difference of the whole weight vector at most 1e-6
  (measured 3.1e-8 to 3.3e-8: the micro-batches' gradients are added up in another order); losses and
  gradient norms within 1e-6 relative.
- the bubble of rank 0's median timed step (steps 2, 4 and 5: step 1 also learns the shapes, step 3's
  memory is measured), 1 - (the seconds its stage computed) / (the schedule's seconds), against
  (p - 1) / (m + p - 1), within 15% at p = 2 and 4, m = p and 2p (the course's goal); measured 1.01x, 1.01x,
  1.00x and 1.01x with 160 ms per stage forward.  What the formula leaves out (the sends, the stages' real
  compute) is a few ms a slot alone and grows with the suite's load: with 80 ms, 1.00-1.02x alone but 1.17x
  once at p = 2, m = 4 inside the whole suite (the step 4.5% longer than the schedule's); with 40 ms, 1.16x
  at p = 4, m = 8.
- interleaving shrinks the measured bubble at p = 2, m = 4 (measured 0.123 against 1F1B's 0.201).
- 1F1B holds at most p micro-batches' activations, GPipe all m: at p = 2, m = 4, the first stage's measured
  peak above what it held before the step is at most 0.75 of GPipe's (measured 0.970 against 1.712 MB: 0.57x).
"""
import pytest
import torch

import reference_runs
from catalogue import Runs
from reference_runs import PIPELINE_PLAN
from conftest import metrics
from course.training.output import load_weights

pytestmark = pytest.mark.slow
HARDWARE, PIPELINE = "day4/18_hardware_limits.py", "day4/21_pipeline_parallel.py"
COMMON = list(reference_runs.PIPELINE)  # the reference runs' arguments
EQUAL = 1e-6
# name: (schedule, ranks, micro-batches, launcher); each a reference run "21: NAME" (tests/reference_runs.py)
PLAN = PIPELINE_PLAN


@pytest.fixture(scope="module")
def runs(catalogue):
    return Runs(catalogue, "21: ")


def vector(run_dir) -> torch.Tensor:
    w = load_weights(run_dir / "model.pt")
    return torch.cat([w[k].flatten() for k in sorted(w)])


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.quick("21")) if name == "1f1b-p2-m4" else name
                                  for name in PLAN])
def test_a_pipeline_ends_where_one_process_ends(runs, name):
    pp, one = runs[name][0], runs["one"][0]
    a, b = load_weights(pp / "model.pt"), load_weights(one / "model.pt")
    assert sorted(a) == sorted(b) and all(a[k].shape == b[k].shape for k in a)  # the stages make one ViT
    rel = ((vector(pp) - vector(one)).norm() / vector(one).norm()).item()
    print(f"{name}: against one process, relative weight difference {rel:.3g}")
    assert rel <= EQUAL, rel
    mp, mo = metrics(pp), metrics(one)
    schedule, p, m, _ = PLAN[name]
    assert mp["steps"] == mo["steps"] == 5 and mp["world_size"] == p and mp["pipeline"]["microbatches"] == m
    assert mp["pipeline"]["stages"] == p * (2 if schedule.startswith("interleaved") else 1)
    assert mp["loss_per_step"] == pytest.approx(mo["loss_per_step"], rel=EQUAL)
    assert mp["grad_norm_per_step"] == pytest.approx(mo["grad_norm_per_step"], rel=EQUAL)
    assert min(mo["grad_norm_per_step"]) > 0.5  # the clip at 0.5 was active, over the stages' gradients


@pytest.mark.parametrize("name", ["gpipe-p2-m2", "gpipe-p2-m4", "1f1b-p4-m4", "1f1b-p4-m8"])
def test_the_bubble_is_the_formulas_within_15_percent(runs, name):
    b, out = metrics(runs[name][0])["pipeline"], runs[name][1]
    _, p, m, _ = PLAN[name]
    assert b["formula"] == pytest.approx((p - 1) / (m + p - 1))
    ratio = b["measured"] / b["formula"]
    print(f"{name}: bubble {b['measured']:.3f} measured, {b['formula']:.3f} formula ({ratio:.2f}x); rank 0 computed "
          f"{b['busy_seconds'] * 1e3:.0f} of {b['seconds'] * 1e3:.0f} ms in the median of {b['timed_steps']} timed "
          f"steps ({b['simulated_seconds'] * 1e3:.0f} simulated)")
    assert b["timed_steps"] == 3  # steps 2, 4 and 5: not step 1 (the shapes) nor step 3 (memory measured)
    assert 0.85 <= ratio <= 1.15, (b["per_step"], out)
    assert f"bubble {b['measured']:.3f} measured, {b['formula']:.3f} by the formula (p - 1) / (m + p - 1)" in out


def test_interleaving_shrinks_the_bubble(runs):
    plain, inter = (metrics(runs[n][0])["pipeline"] for n in ("1f1b-p2-m4", "interleaved-1f1b-p2-m4"))
    assert inter["formula"] == pytest.approx(1 / 9) and plain["formula"] == pytest.approx(1 / 5)
    print(f"bubble at p = 2, m = 4: 1F1B {plain['measured']:.3f}, interleaved {inter['measured']:.3f}")
    assert inter["measured"] < plain["measured"]


def test_1f1b_holds_fewer_activations_than_gpipe(runs):
    gpipe, one_f = (metrics(runs[n][0])["memory"] for n in ("gpipe-p2-m4", "1f1b-p2-m4"))
    ratio = one_f["peak_above_bytes"] / gpipe["peak_above_bytes"]
    print(f"p = 2, m = 4, stage 0's peak above what it held: 1F1B {one_f['peak_above_bytes'] / 1e6:.3f} MB, "
          f"GPipe {gpipe['peak_above_bytes'] / 1e6:.3f} MB ({ratio:.2f}x)")
    assert ratio <= 0.75, ratio


