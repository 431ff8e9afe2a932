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
- lessons 19 and 20 price what the step sent where it ran (integers, exact): each kind of call on its mesh
  dimension's group (rank 0's: the row [0, 1], the column [0, 2]; 2 ranks, not the world's 4), with the bytes
  computed here from the model's shapes (TP: [batch, tokens, width] in fp32; FSDP2: every parameter's piece
  padded to ceil(d0 / n) rows, n pieces; HSDP's all_reduce: one piece), x the calls per step.  On two nodes
  (two torchrun agents with a node name each, and the real two-node Slurm) the "tp" rows are inside a node
  and the "dp" columns across.
- lesson 18's FLOPs of step 1, counted by FlopCounterMode (with the CPU attention's formula), within 10% of
  6 x parameters x tokens + 12 x depth x tokens x width x tokens (measured 0.97 at width 64; 0.95 here).
- lesson 18 in a network namespace of its own (root): the bytes the interfaces sent per rank against the
  ring formula, at 4 MiB: all_reduce and all_gather within 1% (measured 1.001-1.004); gloo's reduce_scatter
  sends twice the formula (measured 2.002), what an all_reduce of the same tensor sends.
"""
import math
import os
import re
import shutil
import subprocess

import pytest
import torch

import reference_runs
from catalogue import Runs
from conftest import PYTHON, REPO, metrics, run
from course.launching.ports import free_port
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
    run([*own_network(), PYTHON, REPO / HARDWARE, *COMMON, "--sizes-mib", "4", "--max-steps", "2", "--nproc", "2",
         "--run-dir", run_dir])
    return run_dir


def vector(run_dir) -> torch.Tensor:
    w = load_weights(run_dir / "model.pt")
    return torch.cat([w[k].flatten() for k in sorted(w)])


@pytest.mark.parametrize("t", [1, pytest.param(2, marks=pytest.mark.quick("19")), 4])
def test_tensor_parallel_ends_where_one_process_ends(runs, t):
    """Measured: 2.8e-8 at T = 2, 3.0e-8 at T = 4; bound 1e-6.  T = 1 (a mesh of one rank: nothing is cut
    and nothing sent) runs too, and says so."""
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
    if t == 1:
        assert "no parameter is cut on one rank" in runs["tp1"][1]


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


TOKENS, WIDTH, DEPTH = (28 // 7) ** 2, 32, 2  # the reference runs' ViT (tests/reference_runs.py, DAY4)
COLUMN_WISE, ROW_WISE = ("qkv", "mlp.0"), ("proj", "mlp.2")  # the lessons' TP plan (Megatron-LM's pairs)


def tp_piece(name: str, shape: tuple, t: int) -> tuple:
    """A block parameter's shape on one of T tensor-parallel ranks: column-wise layers keep 1/T of their output
    rows (weight and bias), row-wise ones 1/T of their weight's input columns (the bias whole)."""
    layer, kind = name.rsplit(".", 1)
    if layer in COLUMN_WISE:
        return (shape[0] // t, *shape[1:])
    if layer in ROW_WISE and kind == "weight":
        return (shape[0], shape[1] // t)
    return shape


def gathered(shapes: list, n: int) -> int:
    """The elements FSDP2 all_gathers for one unit over n ranks (and reduce_scatters back): each parameter cut
    along its first dimension as torch.chunk cuts it, every rank's piece padded to the largest, ceil(d0 / n)."""
    return sum(n * -(-s[0] // n) * math.prod(s[1:]) for s in shapes)


def sent_by_the_step(layout: str, batch: int, t: int = 2, n: int = 2) -> set:
    """What one training step sends, from the sizes alone: {(dim, rank 0's group, op, bytes in fp32, calls)}.
    TP: 2 all_reduces forward and 2 backward per block, each of one activation [batch, tokens, width]. FSDP2:
    one all_gather per unit forward (the blocks and the root), one per block backward (the root stays
    gathered), one reduce_scatter per unit.  HSDP: then one all_reduce per unit of the gradient shard."""
    from course.models import ViT

    model = ViT(7, WIDTH, DEPTH, 4)
    block = [tp_piece(k, tuple(p.shape), t if layout != "hsdp" else 1) for k, p in model.blocks[0].named_parameters()]
    root = [tuple(p.shape) for k, p in model.named_parameters() if not k.startswith("blocks.")]
    if layout == "tp":
        return {("tp", tuple(range(t)), "all_reduce", 4 * batch * TOKENS * WIDTH, 4 * DEPTH)}
    row, column = ((0, 1), (0, 2))
    inside, across = ("tp", "dp") if layout == "fsdp-tp" else ("shard", "replicate")
    fsdp_on, fsdp_group = (across, column) if layout == "fsdp-tp" else (inside, row)
    sent = {(fsdp_on, fsdp_group, "all_gather", 4 * gathered(block, n), 2 * DEPTH),
            (fsdp_on, fsdp_group, "all_gather", 4 * gathered(root, n), 1),
            (fsdp_on, fsdp_group, "reduce_scatter", 4 * gathered(block, n), DEPTH),
            (fsdp_on, fsdp_group, "reduce_scatter", 4 * gathered(root, n), 1)}
    if layout == "fsdp-tp":
        return sent | {("tp", row, "all_reduce", 4 * batch * TOKENS * WIDTH, 4 * DEPTH)}
    return sent | {("replicate", column, "all_reduce", 4 * gathered(block, n) // n, DEPTH),
                   ("replicate", column, "all_reduce", 4 * gathered(root, n) // n, 1)}


def priced(m: dict) -> set:
    return {(r["dim"], tuple(r["group"]), r["op"], r["bytes"], r["calls"]) for r in m["collectives_priced"]}


@pytest.mark.parametrize("name, layout, batch", [("tp2", "tp", 32), ("tp4", "tp", 32), ("fsdp-tp", "fsdp-tp", 16),
                                                 ("hsdp", "hsdp", 8)])
def test_each_collective_is_priced_on_its_mesh_dimensions_group_with_the_bytes_the_step_sent(runs, name, layout,
                                                                                           batch):
    """Not an all_reduce over every rank at sizes the training never sends (the sweep of lesson 18): each kind
    of call of step 1 again, on this rank's row or column of the mesh (`mesh.get_group(dim)`), with the tensor
    the step sent, x the calls per step; on one machine every group is inside one node."""
    m = metrics(runs[name][0])
    t = m["world_size"] if layout == "tp" else 2
    assert priced(m) == sent_by_the_step(layout, batch, t), sorted(priced(m))
    assert all(r["dtype"] == "float32" and r["ranks"] == len(r["group"]) and r["seconds"] > 0
               and r["seconds_per_step"] == pytest.approx(r["calls"] * r["seconds"]) for r in m["collectives_priced"])
    dims = m["collectives_per_dimension"]
    assert sorted(dims) == sorted(m["mesh"]["dims"]) and not any(d["inter_node"] for d in dims.values())
    if layout != "tp":  # a row or a column of the 2 x 2 mesh: 2 ranks, not the world's 4
        assert m["world_size"] == 4 and {d["ranks"] for d in dims.values()} == {2}
    for dim, d in dims.items():
        rows = [r for r in m["collectives_priced"] if r["dim"] == dim]
        assert d["calls"] == sum(r["calls"] for r in rows) and d["bytes"] == sum(r["calls"] * r["bytes"] for r in rows)
        assert d["seconds"] == pytest.approx(sum(r["calls"] * r["seconds"] for r in rows))
        assert f"'{dim}' ({d['ranks']} ranks, inside one node): {d['calls']} calls, {d['bytes'] / 1e6:.3f} MB" in runs[name][1]


def test_on_two_nodes_the_tp_rows_are_priced_inside_a_node_and_the_dp_columns_across(tmp_path):
    """Two torchrun agents on this machine as two nodes of 2 ranks, each agent's ranks told their node's name
    (SLURMD_NODENAME, which the lessons read as Slurm's name of the node): FSDP2 x TP with --inner 2 keeps each
    row, TP's group, on one node, and FSDP2's columns span both.  The same on the real two-node Slurm: the next
    test, and lesson 20's batch job (tests/test_slurm_launchers.py, check_20_device_mesh_2d)."""
    port, run_dir = free_port(), tmp_path / "two-nodes"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}
    agents = [subprocess.Popen([PYTHON, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                                "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
                                REPO / MESH, *COMMON, "--batch-size", "16", "--max-steps", "2", "--inner", "2",
                                "--run-dir", run_dir], cwd=REPO, env={**env, "SLURMD_NODENAME": f"node{node + 1}"},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    try:
        outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    finally:
        for agent in agents:  # one agent failed or hung: the other and its ranks go too
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)
    rows_on_nodes_columns_across("\n".join(outputs), metrics(run_dir))


@pytest.mark.slurm
def test_on_the_two_node_slurm_the_tp_rows_are_priced_inside_a_node_and_the_dp_columns_across(slurm_cluster):
    """The same under the real two-node Slurm (tests/slurm_cluster.py): srun's tasks 0-1 on node1, 2-3 on node2,
    --inner 2 as lesson 20's launcher passes the tasks per node.  The node names are Slurm's (SLURMD_NODENAME)."""
    run_dir = slurm_cluster.workdir / "lesson20-priced"
    ran = slurm_cluster.run(["salloc", "--nodes=2", "--ntasks-per-node=2", "srun", "--kill-on-bad-exit=1", PYTHON,
                             "-u", REPO / MESH, *COMMON, "--batch-size", "16", "--max-steps", "2", "--inner", "2",
                             "--run-dir", run_dir], timeout=300)
    assert ran.returncode == 0, f"--- stdout\n{ran.stdout}\n--- stderr\n{ran.stderr}"
    rows_on_nodes_columns_across(ran.stdout, metrics(run_dir))


def rows_on_nodes_columns_across(out: str, m: dict) -> None:
    """FSDP2 x TP on 2 nodes x 2 ranks, --inner 2: TP's rows each on one node, FSDP2's columns across both,
    every collective priced on its own group with the bytes the step sent, and reported as such."""
    print("\n".join(line for line in out.splitlines() if re.match(r"(dimension|tp|dp) |per step,", line)))  # -s
    assert m["mesh"]["hosts"] == ["node1", "node1", "node2", "node2"] and m["mesh"]["rows_in_one_node"]
    assert m["mesh"]["spans_nodes"] == {"dp": True, "tp": False}
    dims = m["collectives_per_dimension"]
    assert dims["tp"]["inter_node"] is False and dims["dp"]["inter_node"] is True
    assert all(r["inter_node"] == (r["dim"] == "dp") for r in m["collectives_priced"])
    assert priced(m) == sent_by_the_step("fsdp-tp", 16)
    assert re.search(r"^tp +\[0, 1\] +inside a node +all_reduce ", out, re.M), out
    assert re.search(r"^dp +\[0, 2\] +across nodes +all_gather ", out, re.M), out
    assert "'dp' (2 ranks, across nodes): 8 calls" in out and "'tp' (2 ranks, inside one node): 8 calls" in out


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




def test_the_bytes_sent_are_counted_over_the_interfaces_present_at_both_reads(tmp_path, monkeypatch):
    """An interface removed between the two reads (another job's veth pair) takes nothing away, one added
    adds nothing; what the interfaces present at both sent is counted, loopback included."""
    from course.measuring import hardware

    def proc_net_dev(tx: dict) -> None:
        lines = ["Inter-|   Receive                                                |  Transmit",
                 " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop "
                 "fifo colls carrier compressed"]
        lines += [f"{name:>6}: 7 1 0 0 0 0 0 0 {sent} 1 0 0 0 0 0 0" for name, sent in tx.items()]
        hardware.NET_DEV.write_text("\n".join(lines) + "\n")

    monkeypatch.setattr(hardware, "NET_DEV", tmp_path / "dev")
    proc_net_dev({"lo": 1000, "eth0": 50, "veth1": 10 ** 9})
    before = hardware.sent_bytes()
    assert before == {"lo": 1000, "eth0": 50, "veth1": 10 ** 9}
    proc_net_dev({"lo": 4000, "eth0": 60, "veth2": 10 ** 6})
    assert hardware.sent_since(before) == 3010
    monkeypatch.setattr(hardware, "NET_DEV", tmp_path / "absent")
    assert hardware.sent_bytes() == {} and hardware.sent_since({}) == 0  # not Linux: nothing counted
