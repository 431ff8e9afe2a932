"""Lessons 18 (what the hardware allows), 19 (tensor parallel) and 20 (2-D meshes), run for real: gloo, the
CPU, a tiny ViT (width 32, depth 2, 4 heads), one thread a rank.

The reference is one process: lesson 18 at --nproc 1 (DDP over one rank, fp32), batch 32.  Lesson 19 at
T = 2 (torchrun) and T = 4 (its own launcher) takes the same batches of 32 on every rank, from the same
weights (seed 5), with SGD and momentum and the gradient clip active (lr 0.5, clip 0.5 against norms of
1.0-1.6): it must end where the one process ends.  So must lesson 20 on a 2 x 2 mesh, with the same global
batch of 32: FSDP2 x TP (its own launcher; 2 rows of 16) and HSDP (torchrun; 4 ranks of 8).

Bounds (the numbers are next to each assertion):
- tensor parallel against one process, after 4 steps: the relative difference of the whole weight vector at
  most 1e-6 (measured 2.8e-8 at T = 2 and 3.0e-8 at T = 4: the row-wise layers' sums are added in another
  order); losses and gradient norms within 1e-6 relative (measured equal to 1.2e-7).
- each rank holds exactly 1/T of the cut parameters (integers: bytes of its pieces against the whole).
- lesson 20 against one process, after 4 steps: the same bounds (measured 3.3e-8 and 3.4e-8); every
  parameter cut, the ranks' pieces adding up to what the placements say (integers); the mesh's rows [0, 1]
  and [2, 3]; step 1's collectives: TP's 2 + 2 all_reduces per block (FSDP2 x TP only), FSDP2's all_gather
  and reduce_scatter once per block and root, HSDP's all_reduce of each gradient shard across the rows.
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

import reference_runs
from catalogue import Runs
from conftest import PYTHON, REPO, metrics, run
from course.training.output import load_weights

pytestmark = pytest.mark.slow
HARDWARE, TP, MESH = "day4/18_hardware_limits.py", "day4/19_tensor_parallel.py", "day4/20_device_mesh_2d.py"
COMMON = list(reference_runs.DAY4)  # the reference runs' arguments
EQUAL = 1e-6


def own_network() -> list:
    """`unshare -n` with the loopback up: a network namespace only this run's ranks use (root only)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return []
    return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]


@pytest.fixture(scope="module")
def runs(catalogue):
    """The reference runs "18-20: one", "tp2", "tp4", "fsdp-tp" and "hsdp" (tests/reference_runs.py)."""
    return Runs(catalogue, "18-20: ")


@pytest.fixture(scope="module")
def wire(tmp_path_factory, dataset):
    """Lesson 18 at 4 MiB in a network namespace of its own (root), so that its interfaces' counters see only
    its ranks: no other test reads it."""
    run_dir = tmp_path_factory.mktemp("wire")
    run([*own_network(), PYTHON, REPO / HARDWARE, *COMMON[:-1], "4", "--max-steps", "2", "--nproc", "2",
         "--run-dir", run_dir])
    return run_dir


def vector(run_dir) -> torch.Tensor:
    w = load_weights(run_dir / "model.pt")
    return torch.cat([w[k].flatten() for k in sorted(w)])


@pytest.mark.parametrize("t", [pytest.param(2, marks=pytest.mark.quick("19")), 4])
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


@pytest.mark.parametrize("layout", [pytest.param("fsdp-tp", marks=pytest.mark.quick("20")), "hsdp"])
def test_a_2d_mesh_ends_where_one_process_ends(runs, layout):
    """Measured: 3.3e-8 (FSDP2 x TP) and 3.4e-8 (HSDP); bound 1e-6."""
    mesh, one = runs[layout][0], runs["one"][0]
    a, b = load_weights(mesh / "model.pt"), load_weights(one / "model.pt")
    assert sorted(a) == sorted(b) and all(a[k].shape == b[k].shape for k in a)
    rel = ((vector(mesh) - vector(one)).norm() / vector(one).norm()).item()
    print(f"{layout}: against one process, relative weight difference {rel:.3g}")
    assert rel <= EQUAL, rel
    mt, mo = metrics(mesh), metrics(one)
    assert mt["steps"] == 4 and mt["world_size"] == 4 and mt["global_batch_size"] == mo["batch_size"] == 32
    assert mt["loss_per_step"] == pytest.approx(mo["loss_per_step"], rel=EQUAL)
    assert mt["grad_norm_per_step"] == pytest.approx(mo["grad_norm_per_step"], rel=EQUAL)


@pytest.mark.parametrize("layout", ["fsdp-tp", "hsdp"])
def test_a_2d_mesh_cuts_every_parameter_and_counts_its_collectives(runs, layout):
    m, out = metrics(runs[layout][0]), runs[layout][1]
    names = ["dp", "tp"] if layout == "fsdp-tp" else ["replicate", "shard"]
    assert m["mesh"]["dims"] == names and m["mesh"]["rows"] == [[0, 1], [2, 3]] and m["mesh"]["rows_in_one_node"]
    assert f"mesh 2 x 2 ({', '.join(names)}): rows (the '{names[1]}' groups) [0, 1] on " in out
    per_rank = m["per_rank_bytes"]
    assert all(r["whole_ones"] == 0 for r in per_rank) and "and no parameter is whole" in out
    whole = per_rank[0]["cut_whole"]
    if layout == "hsdp":  # each row holds the model once between its 2 ranks; the rows are replicas
        assert per_rank[0]["pieces"] == [2]
        assert per_rank[0]["cut"] + per_rank[1]["cut"] == whole == per_rank[2]["cut"] + per_rank[3]["cut"]
        assert [r["cut"] for r in per_rank[:2]] == [r["cut"] for r in per_rank[2:]]
    else:  # what TP cut: 1/4 on each rank; the rest 1/2 on each rank of a row's column
        assert per_rank[0]["pieces"] == [2, 4]
        assert sum(r["cut"] for r in per_rank) == round(4 * per_rank[0]["cut_share"]) < 2 * whole
    comms = m["collectives_step_1"]  # depth 2: 2 blocks and the root
    fsdp = {"forward": {"all_gather (FSDP2)": 3}, "backward": {"all_gather (FSDP2)": 2, "reduce_scatter (FSDP2)": 3}}
    if layout == "fsdp-tp":
        assert comms["forward"] == {**fsdp["forward"], "all_reduce": 4}
        assert comms["backward"] == {**fsdp["backward"], "all_reduce": 4}
    else:
        assert comms["forward"] == fsdp["forward"]
        assert comms["backward"] == {**fsdp["backward"], "all_reduce (FSDP2)": 3}


@pytest.mark.quick("18")
def test_the_counted_flops_are_within_ten_percent_of_the_formula_and_utilization_is_a_fraction(runs):
    m = metrics(runs["one"][0])
    ratio = m["flops_per_step"] / m["flops_formula"]
    print(f"counted / formula: {ratio:.3f}; HFU vs measured peak {m['hfu']:.3f}")
    assert 0.9 <= ratio <= 1.1, ratio
    assert 0 < m["hfu"] < 1 and m["matmul_peak_flops"] > 1e8
    assert f"HFU vs measured peak {m['hfu']:.3f}" in runs["one"][1]  # not MFU: see the lesson's docstring
    assert f"(counted / formula: {ratio:.3f})" in runs["one"][1]


def test_the_bytes_on_the_wire_are_the_formulas(request):
    if not own_network():
        pytest.skip("needs root: the bytes sent are counted in a network namespace of the test's own")
    rows = {r["op"]: r for r in metrics(request.getfixturevalue("wire"))["collectives"]}
    ratios = {op: r["sent"] / r["formula_per_rank"] for op, r in rows.items()}
    print("sent / formula at 4 MiB:", {op: round(v, 4) for op, v in ratios.items()})
    assert 1.0 <= ratios["all_reduce"] <= 1.01 and 1.0 <= ratios["all_gather"] <= 1.01, ratios
    assert 1.99 <= ratios["reduce_scatter"] <= 2.02, ratios  # gloo's reduce_scatter: an all_reduce's bytes
    assert all(r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * (1 if op == "all_reduce" else 0.5))
               for op, r in rows.items())  # 2 ranks: 2(n-1)/n = 1, (n-1)/n = 1/2


