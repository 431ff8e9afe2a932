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
- the bubble: every rank's chunks of the last step, replayed in the order they ran at equal compute times
  (forward 1, backward 2), leave rank 0 waiting (p - 1) / (m + p - 1) of the step (interleaved: (p - 1) /
  (2m + p - 1)), to float rounding: the schedule's order is the formula's.  The bubble measured on this
  machine is the formula's plus what it leaves out (the sends, the stages' real compute, the loss, Python:
  a few ms a slot alone, more under the suite's load: measured 1.18x once at p = 2, m = 4 inside the whole
  suite with 160 ms a stage); it is printed and must not fall below 0.7x the formula (what is left out
  adds waiting; a rank 0 slower than the others waits less).  The measured bubble against the formula is the benchmark's (benchmarks/parallel.py).
- interleaving shrinks the bubble at p = 2, m = 4: by the recorded order (1/9 against 1/5).
- 1F1B holds at most p micro-batches' activations, GPipe all m: at p = 2, m = 4, the first stage's measured
  peak above what it held before the step is at most 0.75 of GPipe's (measured 0.970 against 1.712 MB: 0.57x).
"""
import pytest
import torch

import reference_runs
from catalogue import Runs
from reference_runs import PIPELINE_PLAN, STAGE_MS
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


def replay(timeline: list, ranks: int, per_rank: int) -> tuple:
    """(rank 0's busy time, the step's end) when every rank runs its chunks in the order the timeline recorded
    them, each forward taking 1 / v and each backward 2 / v (v stages a rank: every rank computes the same),
    each as early as its rank is free and its inputs are there: F(s, i) after F(s - 1, i); B(s, i) after
    F(s, i) and B(s + 1, i).  The order alone, without the machine's noise."""
    n_stages = ranks * per_rank
    order = {r: [(s, kind, i) for _, s, kind, i, *_ in sorted((t for t in timeline if t[0] == r), key=lambda t: t[4])]
             for r in range(ranks)}
    done, free, busy = {}, dict.fromkeys(order, 0.0), dict.fromkeys(order, 0.0)
    while any(order.values()):
        moved = False
        for r, chunks in order.items():
            while chunks:
                s, kind, i = chunks[0]
                needs = [(s - 1, "F", i)] if kind == "F" and s else []
                needs += [(s, "F", i)] + ([(s + 1, "B", i)] if s < n_stages - 1 else []) if kind == "B" else []
                if not all(n in done for n in needs):
                    break
                took = (1 if kind == "F" else 2) / per_rank
                done[(s, kind, i)] = free[r] = max([free[r]] + [done[n] for n in needs]) + took
                busy[r] += took
                chunks.pop(0)
                moved = True
        assert moved, f"the recorded order cannot run: every rank waits ({order})"
    return busy[0], free[0]


@pytest.mark.parametrize("name", list(PLAN))
def test_the_schedules_order_makes_the_formulas_bubble(runs, name):
    """Every rank's chunks of the last step, in the order they ran, replayed at equal compute times: rank 0
    waits the formula's share of the step, exactly.  The measured bubble (the machine's noise on top) is
    printed; it is compared with the formula in the benchmark (benchmarks/parallel.py)."""
    run, out = runs[name]
    b, timeline = metrics(run)["pipeline"], metrics(run)["timeline"]
    schedule, p, m, _ = PLAN[name]
    v = 2 if schedule.startswith("interleaved") else 1
    assert b["formula"] == pytest.approx((p - 1) / (v * m + p - 1))
    for r in range(p):  # every chunk of the step once, numbered 0..m-1 on each of the rank's stages
        mine = sorted((s, kind, i) for rank, s, kind, i, *_ in timeline if rank == r)
        assert mine == sorted((r + k * p, kind, i) for k in range(v) for kind in "FB" for i in range(m)), (r, mine)
        assert all(t[4] <= t[5] for t in timeline)
    busy, end = replay(timeline, p, v)
    print(f"{name}: bubble {1 - busy / end:.3f} by the recorded order, {b['formula']:.3f} by the formula, "
          f"{b['measured']:.3f} measured ({b['measured'] / b['formula']:.2f}x the formula; {STAGE_MS} ms a stage)")
    assert busy == pytest.approx(3 * m) and 1 - busy / end == pytest.approx(b["formula"])
    assert b["timed_steps"] == 3  # steps 2, 4 and 5: not step 1 (the shapes) nor step 3 (memory measured)
    # what the formula leaves out (the sends, the loss, Python) adds waiting; only a rank 0 slower than the
    # others (its real compute, the machine's other programs) waits less: never far below the formula
    assert b["measured"] >= 0.7 * b["formula"], (b["per_step"], out)
    assert f"bubble {b['measured']:.3f} measured, {b['formula']:.3f} by the formula (p - 1) / " in out


def test_interleaving_shrinks_the_bubble(runs):
    plain, inter = (metrics(runs[n][0]) for n in ("1f1b-p2-m4", "interleaved-1f1b-p2-m4"))
    assert inter["pipeline"]["formula"] == pytest.approx(1 / 9) and plain["pipeline"]["formula"] == pytest.approx(1 / 5)
    (b1, e1), (b2, e2) = replay(plain["timeline"], 2, 1), replay(inter["timeline"], 2, 2)
    print(f"bubble at p = 2, m = 4 by the recorded order: 1F1B {1 - b1 / e1:.3f}, interleaved {1 - b2 / e2:.3f}; "
          f"measured {plain['pipeline']['measured']:.3f} and {inter['pipeline']['measured']:.3f}")
    assert 1 - b2 / e2 < 1 - b1 / e1


def test_1f1b_holds_fewer_activations_than_gpipe(runs):
    gpipe, one_f = (metrics(runs[n][0])["memory"] for n in ("gpipe-p2-m4", "1f1b-p2-m4"))
    ratio = one_f["peak_above_bytes"] / gpipe["peak_above_bytes"]
    print(f"p = 2, m = 4, stage 0's peak above what it held: 1F1B {one_f['peak_above_bytes'] / 1e6:.3f} MB, "
          f"GPipe {gpipe['peak_above_bytes'] / 1e6:.3f} MB ({ratio:.2f}x)")
    assert ratio <= 0.75, ratio


