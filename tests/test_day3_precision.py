"""Lesson 13 (mixed precision under DDP), run for real: gloo, 2 ranks, the CPU, the ViT, one thread a rank.

Every run starts from the same weights (seed 5: rank 0's, broadcast by DDP) and takes the same first global
batch; SGD's first step (momentum buffer = gradient) moves the weights by exactly lr x the clipped gradient,
so the clipped, averaged gradient of step 1 is (w0 - w1) / lr, read from the weights the lesson saves.

Bounds, measured on 2026-11-24 (see the numbers in each test):
- bf16 against fp32: the relative difference of the whole gradient vector, |g16 - g32| / |g32|, at most 0.05.
  autocast rounds the inputs of every matrix product to bf16 (8 significant bits: a relative rounding of up to
  2^-9 = 0.2 % per number) and the errors of every product forward and backward add up; measured 0.0047.
- fp16 against fp32: at most 0.01 (11 significant bits: 2^-12 = 0.02 % per number); measured 0.0006.
- the clip (0.05) is far below the gradient's norm (~1-3), so clipping is active and the clipped gradient has
  norm 0.05 in all three; after unscale_ fp16's clipped gradient equals fp32's within the fp16 bound above.
  Without unscale_ the norm clipped is the scaled one (x65536) and the step 65536x too small: measured with
  the line removed, a gradient norm of 96616 instead of 1.47 and a step of norm 7.8e-7 instead of 0.05.
"""
import re
import warnings
from argparse import Namespace

import pytest
import torch

import reference_runs
from catalogue import Runs
from conftest import max_rel_diff, metrics
from course.training.output import load_weights

pytestmark = pytest.mark.slow
SCRIPT = "day3/13_mixed_precision.py"
LR, CLIP = 1.0, 0.05
COMMON = list(reference_runs.PRECISION)  # the reference runs' arguments
BOUND = {"bf16": 0.05, "fp16": 0.01}


@pytest.fixture(scope="module")
def runs(catalogue):
    """One step each in fp32 (under torchrun), bf16 and fp16 (the lesson's own launcher); two fp16 steps with
    an inf in rank 1's loss at step 2; one fp32 step of the compiled model (--compile: the slowest run here,
    tens of seconds of compiling on a CPU).
    (Reference runs: tests/reference_runs.py, "13: ...".)"""
    return Runs(catalogue, "13: ")


def initial_weights() -> dict:
    """Rank 0's initial weights (DDP broadcasts them), built as the lesson builds them."""
    from course.models import ViT

    torch.manual_seed(5)
    return {k: v.detach().clone() for k, v in ViT(7, 32, 2, 2).state_dict().items()}


def first_gradient(run_dir) -> torch.Tensor:
    """The clipped gradient of step 1, averaged over ranks, as one vector: (w0 - w1) / lr."""
    w0, w1 = initial_weights(), load_weights(run_dir / "model.pt")
    return torch.cat([((w0[k] - w1[k]) / LR).flatten() for k in sorted(w0)])


@pytest.mark.parametrize("precision", [pytest.param("bf16", marks=pytest.mark.quick("13")), "fp16"])
def test_16_bit_gradients_agree_with_fp32(runs, precision):
    """Measured 2026-11-24: bf16 0.0047, fp16 0.0006 (relative, whole vector); see the module docstring."""
    g32, g16 = first_gradient(runs["fp32"][0]), first_gradient(runs[precision][0])
    rel = ((g16 - g32).norm() / g32.norm()).item()
    assert rel <= BOUND[precision], rel
    assert rel > 1e-6, "no difference at all: autocast did not compute in 16 bits"
    # the unclipped norm the ranks saw agrees too (fp16's after unscale_, not the scaled one)
    n32, n16 = metrics(runs["fp32"][0])["grad_norm_per_step"][0], metrics(runs[precision][0])["grad_norm_per_step"][0]
    assert n32 > 10 * CLIP and abs(n16 - n32) / n32 <= BOUND[precision], (n16, n32)


def test_clipping_after_unscale_equals_fp32_clipping(runs):
    g32, g16 = first_gradient(runs["fp32"][0]), first_gradient(runs["fp16"][0])
    # clipping was active: the step's gradient has norm CLIP (up to float rounding) in both
    assert abs(g32.norm().item() - CLIP) / CLIP < 1e-3, g32.norm()
    assert abs(g16.norm().item() - CLIP) / CLIP < BOUND["fp16"], g16.norm()


def test_overflow_on_one_rank_skips_the_step_on_every_rank(runs):
    run_dir, out = runs["overflow"]
    m = metrics(run_dir)
    assert m["steps"] == 2 and m["skipped_steps"] == [2] and m["identical_weights"] is True, out
    # both ranks say they skipped step 2; rank 0's own loss was finite, rank 1's was inf
    skips = dict(re.findall(r"\[rank (\d)\] step 2 skipped \(inf/NaN gradients; own loss (\S+)\)", out))
    assert set(skips) == {"0", "1"}, out
    assert skips["1"] == "inf" and float(skips["0"]) < 10, skips
    assert re.search(r"loss scale 65536 -> 32768", out)
    # the skipped step left the weights as they were after step 1: exactly the 1-step fp16 run's
    before, after = load_weights(runs["fp16"][0] / "model.pt"), load_weights(run_dir / "model.pt")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.isfinite(torch.cat([v.flatten() for v in after.values()])).all()


def test_the_compiled_model_gives_the_eager_gradients(runs):
    """torch.compile (inductor, DDP's graph split at its buckets) reorders and fuses floating-point work: the
    gradient may differ in the last bits.  Measured 2026-11-25: the first step's clipped gradient 1.3e-6 relative
    (whole vector), the weights 6.0e-7 (largest per-tensor difference); after 3 steps 7.8e-7.  Bound: 1e-5."""
    compiled, out = runs["compiled"]
    g32, gc = first_gradient(runs["fp32"][0]), first_gradient(compiled)
    rel = ((gc - g32).norm() / g32.norm()).item()
    assert rel <= 1e-5, rel
    assert max_rel_diff(load_weights(compiled / "model.pt"), load_weights(runs["fp32"][0] / "model.pt")) <= 1e-5
    n32, nc = metrics(runs["fp32"][0])["grad_norm_per_step"][0], metrics(compiled)["grad_norm_per_step"][0]
    assert abs(nc - n32) / n32 <= 1e-5, (nc, n32)
    # compiled before training, and said so once, by rank 0; the timed steps are the training's alone
    said = re.findall(r"^\[rank (\d)\] compiled the forward and backward pass in ([\d.]+) s", out, re.M)
    assert [r for r, _ in said] == ["0"] and float(said[0][1]) > 0, out
    assert out.index("compiled the forward") < out.index("[rank 0] 1 steps in"), "compiled before training"


def test_a_dtype_autocast_cannot_compute_in_is_one_clear_error(monkeypatch):
    """CPU builds before torch 2.2 had no fp16 autocast: autocast warned and computed in fp32.  The check
    turns that into an error before any rank starts (torch 2.14's CPU has both dtypes: simulated here)."""
    from course.launching.cli import CourseError
    from course.training import precision

    real = torch.autocast

    def without_fp16(device_type, dtype=None, **kw):
        if dtype == torch.float16:
            warnings.warn("In CPU autocast, but the target dtype is not supported. Disabling autocast.")
            return real(device_type, dtype=dtype, enabled=False)
        return real(device_type, dtype=dtype, **kw)

    for precision_ in ("fp32", "bf16", "fp16"):  # the real CPU autocast takes all three
        precision.check_precision(Namespace(precision=precision_, device="cpu"))
    monkeypatch.setattr(torch, "autocast", without_fp16)
    precision.check_precision(Namespace(precision="bf16", device="cpu"))
    with pytest.raises(CourseError, match=r"^--precision fp16: this cpu has no fp16 autocast \(In CPU autocast"):
        precision.check_precision(Namespace(precision="fp16", device="cpu"))
    # GPUs before Ampere pass autocast's bf16 check (emulation): tests/test_launch_simulated.py checks those
