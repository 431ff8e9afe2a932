"""Lessons 19 and 20 build the model on the meta device (as lesson 15 does), and lesson 19's plan with
--sequence-parallel (lessons 19 and 20).

The tiny ViT, seed and batches of tests/test_day4.py (tests/reference_runs.py's DAY4), whose reference runs
this module reads beside its own: one process (lesson 18 at --nproc 1), plain TP at T = 2 and FSDP2 x TP.

Every run here is launched with a sitecustomize (RECORDER) that records, in every process: the device of each
ViT constructed (the plan before the ranks start, then each rank); the whole initial weights when the optimizer
is made (rank 0 writes them; `full_tensor()` of each DTensor, a collective every rank makes); and each call of
torch.nn.utils.clip_grad_norm_.  None of this changes what the lessons compute.

- No rank builds the whole model: every ViT the lessons construct has its parameters on the meta device
  (lesson 19, lesson 20 under both layouts).  Seen failing on the code before: "cpu" on every rank.
- The initial weights, as the optimizer receives them, are a whole ViT's at the same seed, bit for bit
  (measured 0.0 in every run: made on the CPU one block at a time, course/training/sharded_init.py).
- --sequence-parallel (the code before had no such flag: these runs failed with argparse's exit 2):
  (a) FSDP2 x TP with it puts every parameter on one mesh (metrics.json's parameter_meshes: 1, against 2
      without) and clips with torch's clip_grad_norm_ alone: one call per step and rank;
  (b) step 3's activation peak measured by StepPeak (peak_above_bytes) is below plain TP's at the same sizes
      (measured 2026-11-29, CPU, live tensors, 1 MB = 1e6 bytes: lesson 19 at T = 2 1.130 MB against
      1.230 MB; lesson 20 FSDP2 x TP 0.612 MB against 0.649 MB);
  (c) training ends where one process ends, within test_day4.py's 1e-6 (measured 2.9e-8 to 3.0e-8 at T = 2
      and 3.6e-8 to 3.8e-8 under FSDP2 x TP, relative weight difference after 4 steps, in several runs).
"""
import textwrap

import pytest
import torch

import reference_runs
from catalogue import Runs
from conftest import REPO, lesson, metrics
from course.models import model_from_args
from course.training.output import load_weights

pytestmark = pytest.mark.slow
TP, MESH = "day4/19_tensor_parallel.py", "day4/20_device_mesh_2d.py"
COMMON = list(reference_runs.DAY4)
EQUAL = 1e-6

RECORDER = textwrap.dedent("""
    import os
    import torch
    import course.models

    _init = course.models.ViT.__init__

    def _recorded(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        with open(os.environ["VIT_BUILDS"], "a") as f:
            f.write(next(self.parameters()).device.type + "\\n")

    course.models.ViT.__init__ = _recorded

    _sgd = torch.optim.SGD.__init__

    def _sgd_recorded(self, params, *args, **kwargs):
        params = list(params)
        _sgd(self, params, *args, **kwargs)
        whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]  # every rank: collectives
        import torch.distributed as dist
        if dist.get_rank() == 0:
            torch.save([w.detach().cpu() for w in whole], os.environ["INITIAL_WEIGHTS"])

    torch.optim.SGD.__init__ = _sgd_recorded

    _clip = torch.nn.utils.clip_grad_norm_

    def _clip_recorded(*args, **kwargs):
        with open(os.environ["CLIP_CALLS"], "a") as f:
            f.write("clip_grad_norm_\\n")
        return _clip(*args, **kwargs)

    torch.nn.utils.clip_grad_norm_ = _clip_recorded
""")

PLAN = {  # name: (script, arguments after COMMON)
    "tp2": (TP, ["--nproc", "2", "--max-steps", "1"]),
    "tp2-sp": (TP, ["--nproc", "2", "--sequence-parallel"]),
    "fsdp-tp-sp": (MESH, ["--nproc", "4", "--batch-size", "16", "--sequence-parallel"]),
    "hsdp": (MESH, ["--nproc", "4", "--batch-size", "8", "--layout", "hsdp", "--max-steps", "1"]),
}


class Recorded:
    """Each PLAN run with the RECORDER, launched when a test first asks for it: recorded[name] -> {"run_dir",
    "builds", "initial", "clips"}."""

    def __init__(self, root):
        self.root, self.done = root, {}
        (root / "site").mkdir()
        (root / "site" / "sitecustomize.py").write_text(RECORDER)

    def __getitem__(self, name: str) -> dict:
        if name not in self.done:
            script, extra = PLAN[name]
            files = {key: self.root / f"{name}.{key}" for key in ("builds", "initial", "clips")}
            env = {"PYTHONPATH": f"{self.root / 'site'}:{REPO}", "VIT_BUILDS": str(files["builds"]),
                   "INITIAL_WEIGHTS": str(files["initial"]), "CLIP_CALLS": str(files["clips"])}
            lesson(script, *COMMON, *extra, "--run-dir", self.root / name, env=env, timeout=600)
            self.done[name] = {"run_dir": self.root / name, "builds": files["builds"].read_text().split(),
                               "initial": torch.load(files["initial"], weights_only=True),
                               "clips": files["clips"].read_text().split() if files["clips"].exists() else []}
        return self.done[name]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, dataset):
    return Recorded(tmp_path_factory.mktemp("day4_init"))


@pytest.fixture(scope="module")
def runs(catalogue):
    return Runs(catalogue, "18-20: ")


def vector(run_dir) -> torch.Tensor:
    w = load_weights(run_dir / "model.pt")
    return torch.cat([w[k].flatten() for k in sorted(w)])


@pytest.mark.parametrize("name", list(PLAN))
def test_no_rank_builds_the_whole_model(recorded, name):
    builds = recorded[name]["builds"]
    assert len(builds) >= 2 and set(builds) == {"meta"}, builds  # the plan before the ranks, then each rank


@pytest.mark.parametrize("name", list(PLAN))
def test_the_initial_weights_are_one_processs(recorded, name):
    args = type("Args", (), dict(model="vit", patch=7, width=32, depth=2, heads=4))
    whole = [p.detach() for p in model_from_args(args, 5).parameters()]
    initial = recorded[name]["initial"]
    assert [w.shape for w in initial] == [w.shape for w in whole]
    diff = max((a - b).abs().max().item() for a, b in zip(initial, whole))
    print(f"{name}: initial weights against a whole ViT at seed 5: max difference {diff}")
    assert diff == 0.0


def test_sequence_parallel_puts_every_parameter_on_one_mesh_and_torch_clips_it(recorded, runs):
    sp, plain = metrics(recorded["fsdp-tp-sp"]["run_dir"]), metrics(runs["fsdp-tp"][0])
    assert sp["sequence_parallel"] is True and sp["layout"] == "fsdp-tp"
    assert sp["parameter_meshes"] == 1 and plain["parameter_meshes"] == 2
    # torch's clip_grad_norm_, once per step on each of the 4 ranks, and nothing else clipped
    assert recorded["fsdp-tp-sp"]["clips"] == ["clip_grad_norm_"] * 4 * sp["steps"]


@pytest.mark.parametrize("sp_name, plain_name", [("tp2-sp", "tp2"), ("fsdp-tp-sp", "fsdp-tp")])
def test_sequence_parallel_lowers_the_activation_peak(recorded, runs, sp_name, plain_name):
    sp, plain = (metrics(d)["memory"] for d in (recorded[sp_name]["run_dir"], runs[plain_name][0]))
    assert sp["measured_step"] == plain["measured_step"] == 3
    print(f"{sp_name}: step 3's activation peak {sp['peak_above_bytes'] / 1e6:.3f} MB against "
          f"{plain_name}'s {plain['peak_above_bytes'] / 1e6:.3f} MB")
    assert sp["peak_above_bytes"] < plain["peak_above_bytes"]


@pytest.mark.parametrize("name", ["tp2-sp", "fsdp-tp-sp"])
def test_sequence_parallel_ends_where_one_process_ends(recorded, runs, name):
    sp, one = recorded[name]["run_dir"], runs["one"][0]
    rel = ((vector(sp) - vector(one)).norm() / vector(one).norm()).item()
    print(f"{name}: against one process, relative weight difference {rel:.3g}")
    assert rel <= EQUAL, rel
    ms, mo = metrics(sp), metrics(one)
    assert ms["steps"] == mo["steps"] == 4 and ms["global_batch_size"] == mo["batch_size"] == 32
    assert ms["loss_per_step"] == pytest.approx(mo["loss_per_step"], rel=EQUAL)
    assert ms["grad_norm_per_step"] == pytest.approx(mo["grad_norm_per_step"], rel=EQUAL)
