"""Lessons 15 and 16 build the model on the meta device and shard it before it has any memory; fp16 under
FSDP2 with GradScaler; the gradients reduce_scattered in fp32 unless --reduce-dtype says otherwise.

The same tiny ViT, seed and batches as tests/test_day3_fsdp.py (whose FSDP2 = DDP test also covers the
initial weights: lesson 13's DDP builds the whole model under the same seed).

- The shards' initial weights (course/training/sharded_init.py) against a whole ViT built under the same seed: equal
  bit for bit at W = 2 (the position embedding's one row: rank 1's shard is empty) and W = 3 (uneven rows);
  `reset_parameters()` on the shards instead ends 0.35 away at W = 2 (measured 2026-11-26: every rank draws
  its rows from its own CPU generator, torch 2.14.1 warns that DTensor random ops may not be complete on a
  CPU mesh).
- No rank builds the whole model: every ViT the lesson constructs (ranks included) has its parameters on
  the meta device.  Checked by hand on the code before: "cpu" on every rank.
- fp16, an inf put into rank 1's gradient shard alone at step 2: both ranks skip step 2 and halve the scale
  (65536 -> 32768); rank 0's own shard was finite: DTensor all_reduces GradScaler's found-inf (max).
- --reduce-dtype bf16 against the default fp32 reduction, both with bf16 compute: different weights
  (the sums rounded to bf16), both within 0.01 of fp32 FSDP2 (measured 2026-11-26: 5.2e-4 reduced in fp32,
  5.5e-4 in bf16, relative, after 4 steps).
- Lesson 16 in fp16: complete.json records GradScaler's state with the position, and a run resumed from
  step 3 (after the skipped step 2) ends with the uninterrupted run's weights (bit for bit) and scaler
  state.  Checked by hand: without the restore the resumed run ends at scale 65536 with 3 good steps counted.
"""
import json
import textwrap

import pytest
import torch

from conftest import PYTHON, REPO, lesson, metrics, run
from course.training.output import load_weights

pytestmark = pytest.mark.slow
SCRIPT15, SCRIPT16 = "day3/15_fsdp2.py", "day3/16_distributed_checkpoint.py"
COMMON = ["--train-samples", "640", "--batch-size", "16", "--seed", "5", "--lr", "0.5", "--clip-grad-norm", "0.5",
          "--max-steps", "4", "--loader", "memory", "--width", "32", "--depth", "2", "--heads", "2", "--nproc", "2"]

# every process (the ranks too) records where each ViT it constructs keeps its parameters
RECORDER = textwrap.dedent("""
    import os
    import course.models

    _init = course.models.ViT.__init__

    def _recorded(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        with open(os.environ["VIT_BUILDS"], "a") as f:
            f.write(next(self.parameters()).device.type + "\\n")

    course.models.ViT.__init__ = _recorded
""")


def vector(run_dir) -> torch.Tensor:
    w = load_weights(run_dir / "model.pt")
    return torch.cat([w[k].flatten() for k in sorted(w)])


def relative(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, catalogue):
    """Lesson 15 at W = 2: fp32 (every ViT built recorded), fp16 with an inf in rank 1's shard at step 2, bf16
    with the default fp32 reduction and with --reduce-dtype bf16 (the reference run "15: fsdp2_bf16", which
    tests/test_day3_fsdp.py reads too)."""
    root = tmp_path_factory.mktemp("fsdp_init")
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(RECORDER)
    env = {"PYTHONPATH": f"{root / 'site'}:{REPO}", "VIT_BUILDS": str(root / "builds.txt")}
    out = {}
    plan = {"fp32": [], "fp16": ["--precision", "fp16", "--overflow-at", "2"],
            "bf16": ["--precision", "bf16"]}
    for name, extra in plan.items():
        proc = lesson(SCRIPT15, *COMMON, *extra, "--run-dir", root / name, env=env if name == "fp32" else None)
        out[name] = (root / name, proc.stdout)
    ran = catalogue("15: fsdp2_bf16")
    out["bf16_reduce_bf16"] = (ran.run_dir, ran.stdout)
    out["builds"] = (root / "builds.txt").read_text().split()
    return out


@pytest.fixture(scope="module")
def runs16(tmp_path_factory, dataset):
    """Lesson 16 in fp16 with step 2 skipped: 6 steps uninterrupted; 3 steps, then resumed to 6."""
    root = tmp_path_factory.mktemp("fsdp_init16")
    out = {}
    fp16 = ["--precision", "fp16", "--overflow-at", "2", "--max-steps", "6", "--checkpoint-every", "3"]
    for name, extra in (("w16", []), ("r16", ["--max-steps", "3"])):
        proc = lesson(SCRIPT16, *COMMON, *fp16, *extra, "--run-dir", root / name)
        out[name] = (root / name, proc.stdout)
    proc = lesson(SCRIPT16, *COMMON, *fp16, "--resume", "--checkpoint-dir", root / "r16" / "checkpoints",
                  "--run-dir", root / "r16b")
    out["r16b"] = (root / "r16b", proc.stdout)
    return out


def test_no_rank_builds_the_whole_model(runs):
    builds = runs["builds"]
    assert len(builds) >= 2 and set(builds) == {"meta"}, builds  # the plan before the ranks, then each rank


INIT = textwrap.dedent("""
    import sys, types, warnings
    import torch, torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from course.models import model_from_args
    from course.training.sharded_init import init_vit_shards

    dist.init_process_group("gloo")
    w = dist.get_world_size()
    args = types.SimpleNamespace(model="vit", patch=7, width=32, depth=2, heads=2)
    results = {}
    for how in ("course", "reset_parameters"):
        with torch.device("meta"):
            model = model_from_args(args, 5)
        mesh = init_device_mesh("cpu", (w,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        if how == "course":
            init_vit_shards(model, args, 5)
        else:
            torch.manual_seed(5)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for m in model.modules():
                    if hasattr(m, "reset_parameters"):
                        m.reset_parameters()
                model.position.normal_(0, 0.02)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            whole = model_from_args(args, 5).state_dict()
            assert list(full) == list(whole)
            results[how] = max((full[k] - whole[k]).abs().max().item() for k in whole)
        else:
            assert full == {}, sorted(full)  # cpu_offload: rank 0 alone keeps the whole weights
    if dist.get_rank() == 0:
        print("RESULT", results["course"], results["reset_parameters"], flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("w", [2, 3])
def test_the_shards_start_with_the_whole_models_initial_weights(tmp_path, w):
    script = tmp_path / "init.py"
    script.write_text(INIT)
    proc = run([PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={w}", script],
               env={"PYTHONPATH": str(REPO)})
    (line,) = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    ours, reset = map(float, line.split()[1:])
    print(f"W = {w}: max difference from the whole ViT: init_vit_shards {ours}, reset_parameters {reset:.3g}")
    assert ours == 0.0 and reset > 0.1


def test_fp16_a_step_with_an_inf_in_one_shard_is_skipped_on_every_rank(runs):
    run_dir, out = runs["fp16"]
    m = metrics(run_dir)
    assert m["precision"] == "fp16" and m["skipped_steps"] == [2] and m["steps"] == 4
    said = sorted(l for l in out.splitlines() if " skipped (" in l)
    assert said == ["[rank 0] step 2 skipped (inf/NaN gradients; an inf put in my shard: False); "
                    "loss scale 65536 -> 32768",
                    "[rank 1] step 2 skipped (inf/NaN gradients; an inf put in my shard: True); "
                    "loss scale 65536 -> 32768"], out
    assert all(x == x for x in m["loss_per_step"]) and torch.isfinite(vector(run_dir)).all()
    # fp16 computes in 16 bits but keeps fp32 shards: close to the fp32 run, not equal (a step was skipped)
    assert 0 < relative(vector(run_dir), vector(runs["fp32"][0])) < 0.1


def test_gradients_are_reduced_in_fp32_unless_asked(runs):
    fp32, bf16, bf16_bf16 = (vector(runs[n][0]) for n in ("fp32", "bf16", "bf16_reduce_bf16"))
    a, b = relative(bf16, fp32), relative(bf16_bf16, fp32)
    print(f"bf16 compute against fp32 after 4 steps: reduced in fp32 {a:.3g}, reduced in bf16 {b:.3g}")
    assert not torch.equal(bf16, bf16_bf16)
    assert 1e-5 < a <= 0.01 and 1e-5 < b <= 0.01, (a, b)


def test_lesson16_fp16_resume_restores_the_loss_scale(runs16):
    whole, first, resumed = (runs16[n][0] for n in ("w16", "r16", "r16b"))
    marker = lambda d, step: json.loads((d / "checkpoints" / f"step-{step:09d}" / "complete.json").read_text())  # noqa: E731
    saved = marker(first, 3)["scaler"]
    assert saved["scale"] == 32768.0 and saved["_growth_tracker"] == 1, saved  # after step 2's skip, one good step
    # the resumed run saved its step 6 into the directory it resumed from
    assert marker(first, 6)["scaler"] == marker(whole, 6)["scaler"] == {**saved, "_growth_tracker": 4}
    assert metrics(resumed)["first_step"] == 3 and metrics(whole)["skipped_steps"] == [2]
    assert torch.equal(vector(resumed), vector(whole))
