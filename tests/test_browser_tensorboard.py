"""day1/test-profile.py (DDP on dummy data) seen through a real TensorBoard: its HTTP API and a real browser.

test-profile.py runs under torchrun with 2 ranks and 10 steps into a fresh log dir; a `tensorboard` on
127.0.0.1 loads it; the profiler plugin must list both ranks and DDP's one gloo all_reduce per profiled
step, and headless Chromium must draw the loss curve on TensorBoard's Scalars page with one point per step.
The screenshot is kept in test-artifacts/ (or $TEST_ARTIFACTS).
"""
import json
import os
from pathlib import Path

import pytest

from conftest import REPO, lesson, require_chromium
from headless_chromium import Chromium, scalar_chart_points
from tensorboard_server import PROFILER_API, tensorboard

pytestmark = pytest.mark.slow

STEPS, ACTIVE = 10, 3
GRADIENT_BYTES = 101_770 * 4  # the MLP's float32 gradients: one DDP bucket


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """test-profile.py's log dir, served by a real TensorBoard for the module's tests; stopped afterwards."""
    root = tmp_path_factory.mktemp("test_profile")
    log_dir = root / "log"
    proc = lesson("day1/test-profile.py", "--steps", STEPS, "--log-dir", log_dir,
                  launcher="torchrun", nproc=2, timeout=300)
    with tensorboard(log_dir, runs={"log"}, work_dir=root) as tb:
        yield log_dir, proc.stdout, tb


@pytest.mark.quick("test-profile")
def test_test_profile_writes_one_trace_per_rank(served):
    log_dir, stdout, _ = served
    traces = sorted(log_dir.glob("rank*.pt.trace.json"))
    assert [p.name.split(".")[0] for p in traces] == ["rank0", "rank1"]
    # the key_averages table (its top rows depend on the machine's load: all_reduce is checked in the traces)
    assert "2 traces for 2 ranks" in stdout and "Self CPU time total" in stdout, stdout
    for rank, path in enumerate(traces):
        trace = json.loads(path.read_text())
        assert trace["distributedInfo"]["rank"] == rank
        names = [e.get("name") for e in trace["traceEvents"]]
        assert sum(n.startswith("ProfilerStep#") for n in names if n) == ACTIVE
        assert names.count("gloo:all_reduce") == ACTIVE  # DDP: one bucket, one all_reduce per step


def test_tensorboard_shows_the_ranks_and_the_communication(served):
    _, _, tb = served
    views = set(tb.json(f"{PROFILER_API}/views", run="log"))
    assert {"Overview", "Operator", "Trace", "Distributed", "Memory", "Module"} <= views
    assert tb.json(f"{PROFILER_API}/workers", run="log", view="Overview") == ["rank0", "rank1"]
    (span,) = tb.json(f"{PROFILER_API}/spans", run="log", worker="rank0")
    ops = tb.json(f"{PROFILER_API}/distributed/commops", run="log", worker="All", span=span)["data"]
    for rank in ("rank0", "rank1"):
        row = dict(zip([c["name"] for c in ops[rank]["columns"]], ops[rank]["rows"][0]))
        assert (row["Name"], row["Calls"], row["Total Size (bytes)"]) == \
            ("gloo:all_reduce", ACTIVE, ACTIVE * GRADIENT_BYTES)
    assert {"train/loss_rank0", "perf/samples_per_second"} <= tb.json("/data/plugin/scalars/tags")["."].keys()


LOSS_CHART_POINTS = scalar_chart_points("train/loss_rank0")  # points of the loss curve on the Scalars page


@pytest.mark.browser
def test_scalars_page_draws_the_loss_chart(served):
    require_chromium()
    _, _, tb = served
    artifacts = Path(os.environ.get("TEST_ARTIFACTS", REPO / "test-artifacts"))
    with Chromium(window=(1400, 1600)) as browser:
        browser.open(f"{tb.url}/#scalars")
        try:
            points = browser.wait_for(f"{LOSS_CHART_POINTS} >= {STEPS}", timeout=90) and \
                browser.evaluate(LOSS_CHART_POINTS)
        finally:
            shot = browser.screenshot(artifacts / "tensorboard-scalars.png")
    assert points == STEPS, f"the loss chart has {points} points, expected {STEPS}; see {shot}"
    assert shot.stat().st_size > 10_000
