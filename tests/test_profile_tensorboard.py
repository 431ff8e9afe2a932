"""Lesson 5 (and `--profile` on lessons 4 and 6): traces per rank that a real TensorBoard loads.

One `--compare` run of lesson 5 under torchrun (2 ranks, gloo, 8 steps of which steps 3-5 are profiled)
trains three times in the same processes:
per-parameter all_reduce, one flat all_reduce, torch DDP.  The tests read what it wrote the way a user
would: through a real `tensorboard` server and its profiler plugin's HTTP API, and as Chrome trace JSON.
Expected for the MLP (4 parameter tensors, 101 770 float32 = 407 080 bytes of gradients per step):
per-param 4 all_reduce calls per step, flat 1, ddp 1 (all gradients fit one bucket), 407 080 bytes each.
"""
import json
import re

import pytest
import torch

from conftest import lesson, metrics
from course.measuring.profiling import comm_summary, rank_comm_stats
from course.training.output import load_weights
from tensorboard_server import PROFILER_API, tensorboard

LESSON5 = "day1/5_mnist_manual_ddp_profile.py"
QUICK = ["--quick", "--max-steps", "8"]
ACTIVE = 3                                      # the default schedule: wait 1, warmup 1, active 3
CALLS_PER_STEP = {"per-param": 4, "flat": 1, "ddp": 1}
GRADIENT_BYTES = 101_770 * 4                    # the MLP's parameters, float32
VIEWS = {"Overview", "Operator", "Trace", "Distributed", "Memory", "Module"}
SCALARS = {"train/loss_rank0", "test/accuracy", "test/loss", "perf/samples_per_second", "perf/epoch_seconds"}


@pytest.fixture(scope="module")
def compared(dataset, tmp_path_factory):
    """One lesson 5 --compare run: log dir with per-param/, flat/, ddp/; run dir likewise; its stdout."""
    root = tmp_path_factory.mktemp("lesson5")
    proc = lesson(LESSON5, *QUICK, "--compare", "--log-dir", root / "log", "--run-dir", root / "run",
                  launcher="torchrun", nproc=2, timeout=400)  # (torchrun takes --nproc for its own option)
    return root / "log", root / "run", proc.stdout


def table_rows(stdout: str) -> dict:
    """The side-by-side table's rows: sync -> (calls, KB, comm ms, transfer ms, overlap %, step ms)."""
    rows = {}
    number = r"\s+([\d.]+)"
    for m in re.finditer(rf"^(per-param|flat|ddp){number * 4}\s+(\d+)%{number}$", stdout, re.M):
        rows[m[1]] = tuple(float(x) for x in m.groups()[1:])
    return rows


@pytest.mark.slow
def test_compare_prints_the_side_by_side_table_from_the_traces(compared):
    log_dir, run_dir, stdout = compared
    final = stdout[stdout.index("gradient sync, 2 ranks"):]  # the last table: all three variants
    rows = table_rows(final)
    assert rows.keys() == CALLS_PER_STEP.keys(), final
    saved = json.loads((run_dir / "comparison.json").read_text())
    for sync, (calls, kb, comm_ms, transfer_ms, overlap, step_ms) in rows.items():
        assert calls == CALLS_PER_STEP[sync]
        assert kb == pytest.approx(GRADIENT_BYTES / 1000, abs=0.1)
        assert 0 < transfer_ms <= comm_ms < step_ms and 0 <= overlap <= 100
        s = saved[sync]
        assert s["all_reduce_per_step"] == CALLS_PER_STEP[sync] == s["collectives_per_step"]
        assert s["bytes_per_step"] == GRADIENT_BYTES and s["steps"] == ACTIVE and s["ranks"] == 2
        assert s == comm_summary(log_dir / sync)  # the table is what the traces on disk say
        assert metrics(run_dir / sync)["communication"] == s
    # one bucket: DDP can only start its all_reduce when the last gradient exists; nothing left to overlap
    assert saved["ddp"]["overlap_fraction"] < 0.2


@pytest.mark.slow
def test_the_three_synchronizations_train_the_same_model(compared):
    """They only differ in how the mean gradient travels, so the weights agree (to float rounding)."""
    _, run_dir, _ = compared
    weights = {sync: load_weights(run_dir / sync / "model.pt") for sync in CALLS_PER_STEP}
    for sync in ("flat", "ddp"):
        for name, tensor in weights["per-param"].items():
            torch.testing.assert_close(weights[sync][name], tensor, rtol=0, atol=1e-6)
    assert len({metrics(run_dir / s)["test_loss"] for s in CALLS_PER_STEP}) == 1


@pytest.mark.slow
def test_key_averages_tables_are_printed_and_saved(compared):
    log_dir, _, stdout = compared
    assert stdout.count("(prof.key_averages();") == 3
    assert re.search(r"^\s+c10d::allreduce_\s", stdout, re.M)
    for sync in CALLS_PER_STEP:
        for rank in (0, 1):
            assert "Self CPU time total" in (log_dir / sync / f"rank{rank}.key_averages.txt").read_text()


@pytest.mark.slow
def test_chrome_traces_are_valid_json_with_the_expected_events(compared):
    log_dir, _, _ = compared
    for sync, calls in CALLS_PER_STEP.items():
        for rank in (0, 1):
            path = log_dir / sync / "chrome_trace" / f"rank{rank}.json"
            trace = json.loads(path.read_text())  # plain JSON: what Perfetto and chrome://tracing open
            (tb_file,) = (log_dir / sync).glob(f"rank{rank}.*.pt.trace.json")
            assert tb_file.read_bytes() == path.read_bytes()  # the same trace TensorBoard reads
            info = trace["distributedInfo"]
            assert (info["backend"], info["rank"], info["world_size"]) == ("gloo", rank, 2)
            events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
            names = [e["name"] for e in events]
            # the profiler counts from 0: #2-#4 are training steps 3-5; wait (#0), warmup (#1) are not in it
            assert sorted(n for n in names if n.startswith("ProfilerStep#")) == \
                ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
            for label in ("forward", "backward", "gradient sync"):  # the lesson's record_function spans
                assert names.count(label) == ACTIVE
            assert names.count("gloo:all_reduce") == calls * ACTIVE
            assert names.count("c10d::allreduce_") == calls * ACTIVE
            assert any(e["cat"] == "python_function" for e in events)  # with_stack
            assert any(e.get("name") == "[memory]" for e in trace["traceEvents"])  # profile_memory
            assert any("Input Dims" in e.get("args", {}) for e in events)  # record_shapes
            assert rank_comm_stats(trace)["all_reduce_per_step"] == calls


@pytest.mark.slow
@pytest.mark.quick("5")
def test_tensorboard_loads_every_view_and_counts_the_all_reduces(compared, tmp_path):
    """A real TensorBoard: per variant both workers, all six views, gloo:all_reduce as often as expected,
    and the plugin's own communication times equal lesson 5's table (computed independently)."""
    log_dir, run_dir, _ = compared
    table = json.loads((run_dir / "comparison.json").read_text())
    with tensorboard(log_dir, runs=CALLS_PER_STEP.keys(), work_dir=tmp_path) as tb:
        for sync, calls in CALLS_PER_STEP.items():
            assert set(tb.json(f"{PROFILER_API}/views", run=sync)) == VIEWS
            assert tb.json(f"{PROFILER_API}/workers", run=sync, view="Overview") == ["rank0", "rank1"]
            assert tb.json(f"{PROFILER_API}/workers", run=sync, view="Distributed") == ["All"]
            (span,) = tb.json(f"{PROFILER_API}/spans", run=sync, worker="rank0")
            ops = tb.json(f"{PROFILER_API}/distributed/commops", run=sync, worker="All", span=span)["data"]
            assert ops.keys() == {"rank0", "rank1"}
            transfer, latency = [], []
            for rank_ops in ops.values():
                columns = [c["name"] for c in rank_ops["columns"]]
                (row,) = [r for r in rank_ops["rows"] if r[0] == "gloo:all_reduce"]
                row = dict(zip(columns, row))
                assert row["Calls"] == calls * ACTIVE, (sync, row)
                assert row["Total Size (bytes)"] == GRADIENT_BYTES * ACTIVE, (sync, row)
                transfer.append(row["Data Transfer Time (us)"] / ACTIVE / 1000)
                latency.append(row["Total Latency (us)"] / ACTIVE / 1000)
            assert sum(transfer) / 2 == pytest.approx(table[sync]["transfer_ms_per_step"], rel=1e-3)
            assert sum(latency) / 2 == pytest.approx(table[sync]["comm_ms_per_step"], rel=0.02)
            overlap = tb.json(f"{PROFILER_API}/distributed/overlap", run=sync, worker="All", span=span)["data"]
            assert {"2", "3", "4"} <= overlap.keys()  # per-step computation/communication, per rank
            for view in ("overview", "operation", "memory", "module"):
                status, body = tb.get(f"{PROFILER_API}/{view}", run=sync, worker="rank0", span=span,
                                      group_by="Operation")
                assert status == 200 and body.strip() not in ("", "null"), (sync, view, body[:200])
            status, body = tb.get(f"{PROFILER_API}/trace", run=sync, worker="rank1", span=span)
            assert status == 200 and "gloo:all_reduce" in body
        tags = tb.json("/data/plugin/scalars/tags")
        for sync in CALLS_PER_STEP:
            assert SCALARS <= tags[sync].keys(), tags
        losses = tb.json("/data/plugin/scalars/scalars", run="ddp", tag="train/loss_rank0")
        assert [step for _, step, _ in losses] == list(range(1, 9))


# ------------------------------------------------------------------------------------------ --profile on 4, 6

@pytest.mark.slow
@pytest.mark.parametrize("script, sync", [("day1/4_mnist_manual_ddp.py", "per-param"),
                                          ("day1/6_mnist_ddp_pt.py", "ddp")])
def test_profile_flag_on_lessons_4_and_6_changes_nothing_but_adds_traces(compared, tmp_path, script, sync):
    """--profile writes lesson 5's traces and scalars, and the weights equal lesson 5's run of that variant."""
    _, run5, _ = compared
    run_dir = tmp_path / "run"
    out = lesson(script, *QUICK, "--nproc", "2", "--profile", "--run-dir", run_dir).stdout
    assert f"scalars in {run_dir}" in out
    for rank in (0, 1):
        trace = json.loads((run_dir / "chrome_trace" / f"rank{rank}.json").read_text())
        assert rank_comm_stats(trace)["all_reduce_per_step"] == CALLS_PER_STEP[sync]
    assert len(list(run_dir.glob("rank*.pt.trace.json"))) == 2 and list(run_dir.glob("events.out.tfevents.*"))
    mine, lesson5 = load_weights(run_dir / "model.pt"), load_weights(run5 / sync / "model.pt")
    for name, tensor in lesson5.items():
        assert torch.equal(mine[name], tensor), name


# ------------------------------------------------------------------------------------------ reading traces

def _x(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat, "args": args}


def test_overlap_counts_only_communication_during_gradient_computation():
    """Synthetic trace: bucket 1's all_reduce runs while backward still computes, bucket 2's while it waits."""
    trace = {"traceEvents": [
        _x("ProfilerStep#3", 0, 1000, cat="user_annotation"),
        _x("autograd::engine::evaluate_function: AddmmBackward0", 100, 300),
        _x("c10d::allreduce_", 150, 10, **{"Input Dims": [[[10, 10]], []]}),  # launch of bucket 1
        _x("gloo:all_reduce", 200, 100, tid=2, cat="user_annotation"),           # 200-300: inside compute
        _x("autograd::engine::evaluate_function: AccumulateGrad", 400, 400),
        _x("c10d::allreduce_", 450, 340, **{"Input Dims": [[[5]], []]}),       # launch + wait: not compute
        _x("gloo:all_reduce", 460, 100, tid=2, cat="user_annotation"),           # during the wait only
        _x("gloo:all_reduce", 1500, 50, tid=2, cat="user_annotation"),           # outside every step
    ]}
    s = rank_comm_stats(trace)
    assert (s["steps"], s["all_reduce_per_step"], s["collectives_per_step"]) == (1, 2, 2)
    assert s["bytes_per_step"] == 105 * 4
    assert s["comm_ms_per_step"] == pytest.approx(0.2)
    assert s["overlap_ms_per_step"] == pytest.approx(0.1)  # bucket 1 only: 200-300 us


# ------------------------------------------------------------------------------------------ bad input

# --max-steps shorter than the schedule and a log dir that cannot be written stop before any rank starts:
# tests/test_every_input.py.  This one is found by the ranks, once they know how many steps an epoch has.

@pytest.mark.slow
def test_too_short_an_epoch_for_the_schedule_is_refused(dataset, tmp_path):
    """2 ranks x 128 samples / batch 64 = 2 steps per epoch: the profiled window would include evaluation."""
    proc = lesson(LESSON5, "--nproc", "2", "--train-samples", "256", "--log-dir", tmp_path / "log",
                  "--run-dir", tmp_path / "run", check=False, timeout=300)
    assert proc.returncode == 1
    assert "the profiler schedule needs 5 training steps" in proc.stderr
    assert not list((tmp_path / "log").glob("rank*"))
