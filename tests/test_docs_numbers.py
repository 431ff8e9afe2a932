"""The learners' pages on lessons 3-7 and their solutions quote no timing typed by hand: every time, speed-up
or share they give (a number followed by ms, s, x or %) is either shown in a committed notebook's outputs or
is a fixed fact named below with where it comes from; every four-decimal result they quote (a test accuracy)
is one a notebook shows.  And notebook 7's recorded sweep is its model's arithmetic: the speed-up it
predicts is W x s_1 / s_W of the parts it recorded.

A notebook rebuild changes its numbers; pages that referred to the numbers of an older build would then
contradict the notebooks without anybody noticing, as the guide on scaling once gave a 1-process compute
time four times notebook 7's.  Fast: reads the committed notebooks' JSON, runs nothing.
"""
import ast
import re
import sys

import nbformat
import pytest

from conftest import REPO, run
from course.launching.ports import free_port
from course.measuring import timing

PAGES = ["docs/learners/scaling.md", "docs/learners/profiling.md", *sorted(
    str(p.relative_to(REPO)) for n in range(3, 8) for p in REPO.glob(f"solutions/{n}_*.md"))]
TIMING = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?) ?(ms|s|x|%)(?!\w)")
RESULT = re.compile(r"(?<![\w.])0\.\d{4}(?!\d)")
# numbers with a unit that are not measurements: (page, text as written) -> where they come from
FIXED = {
    ("docs/learners/scaling.md", "15 %"): "the share by which the parts may miss a step: course/measuring/timing.ACCOUNTED",
    ("docs/learners/scaling.md", "4 x"): "lesson 8's scaled learning rate, 4 x lr, not a time",
    ("docs/learners/profiling.md", "10-30 s"): "how long TensorBoard's plugin takes to list runs, a usage hint",
    ("solutions/5_mnist_manual_ddp_profile.md", "0 %"): "the overlap of a bucket that starts after backward",
    ("solutions/5_mnist_manual_ddp_profile.md", "99 %"): "401 408 of 407 080 bytes, exact",
    ("solutions/7_mnist_ddp_pt_timing.md", "1 x"): "a row's 'ranks x threads', not a speed-up",
    ("solutions/7_mnist_ddp_pt_timing.md", "2 x"): "a row's 'ranks x threads', not a speed-up",
}


def notebook_text() -> str:
    """Everything the committed notebooks show as text: streams, Markdown and plain-text outputs."""
    parts = []
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
                parts.append(out.get("text", ""))
                parts += [out.get("data", {}).get(k, "") for k in ("text/markdown", "text/plain")]
    return "\n".join(p if isinstance(p, str) else "".join(p) for p in parts)


def typed_by_hand(page: str, text: str, shown: str) -> list:
    """The numbers of `text` (a page) that are neither fixed facts nor shown by a notebook."""
    found = [m.group(0) for m in TIMING.finditer(text) if (page, m.group(0)) not in FIXED]
    found += RESULT.findall(text)
    return [n for n in found if not any(re.search(rf"(?<![\w.]){re.escape(v)}(?![\d.]\d)", shown)
                                        for v in (n, n.replace(" ", "")))]


@pytest.fixture(scope="module")
def shown():
    return notebook_text()


@pytest.mark.parametrize("page", PAGES)
def test_a_page_quotes_only_numbers_a_notebook_shows(page, shown):
    assert typed_by_hand(page, (REPO / page).read_text(), shown) == []


def test_the_fixed_facts_are_on_their_pages_and_true():
    for page, text in FIXED:
        assert text in (REPO / page).read_text(), f"{page} no longer says {text!r}: remove it from FIXED"
    assert timing.ACCOUNTED == 0.15


def test_a_number_typed_by_hand_is_caught():
    """What the guide on scaling said before its numbers were tied to notebook 7, and a solution's
    overlap from another run than its notebook's, against outputs that show only the first number (the real
    outputs change with every rebuild and may show any of these numbers by chance)."""
    shown = "each rank's step 1.6 ms"
    old = ("each of 2 ranks computes its half-batch step faster than 1 process with 2 threads does the whole "
           "one (1.6 vs 2.7 ms), but the all_reduce of its 0.4 MB of gradients costs 1.9 ms, 55% of the step")
    assert typed_by_hand("docs/learners/scaling.md", old, shown) == ["2.7 ms", "1.9 ms", "55%"]
    assert typed_by_hand("solutions/5_mnist_manual_ddp_profile.md", "ddp  3.0  177.7 ...  26.4%", shown) \
        == ["26.4%"]
    assert typed_by_hand("solutions/4_mnist_manual_ddp.md", "test accuracy 0.7931", shown) == ["0.7931"]


# ------------------------------------------------------------------------------------------ notebook 7's model

def sweep_rows() -> list:
    """Notebook 7's recorded rows of its table (nbhelpers.record_result)."""
    from test_notebook_consistency import load, results

    return [r for _, r in results(load(["7_mnist_ddp_pt_timing"]))]


def test_notebook_7_predicts_with_the_parts_it_recorded():
    rows = sweep_rows()
    missing = [r for r in rows if "fixed_ms" not in r]
    assert rows and not missing, ("notebook 7 predates the parts of a step (compute, communication, fixed "
                                  "costs): rebuild it (python notebooks/build_notebooks.py 7)")
    for r in rows:
        base = next(b for b in rows if (b["model"], b["batch_per_rank"], b["world_size"])
                    == (r["model"], r["batch_per_rank"], 1))
        s1, s = (b["compute_ms"] + b["comm_ms"] + b["fixed_ms"] for b in (base, r))
        assert r["predicted"] == pytest.approx(r["world_size"] * s1 / s, abs=2e-3), r
        assert r["speedup"] == pytest.approx(r["samples_per_second"] / base["samples_per_second"], abs=2e-3), r


# ------------------------------------------------------------------------------------------ the guide on profiling

BUCKETS = r'''
import os, sys, torch, torch.distributed as dist, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
sys.path.insert(0, sys.argv[1])
from course.models import build_model
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
for model_name, cap in (("mlp", 0.1), ("mlp", 0.01), ("mlp", 0.005), ("cnn", 0.01)):
    model, sent = DDP(build_model(model_name, 0), bucket_cap_mb=cap), []
    model.register_comm_hook(None, lambda state, bucket: sent[-1].append(bucket.buffer().numel() * 4)
                             or allreduce_hook(state, bucket))
    for step in range(3):
        sent.append([])
        F.cross_entropy(model(torch.randn(8, 1, 28, 28)), torch.randint(0, 10, (8,))).backward()
    print(model_name, cap, [sorted(s) for s in sent])
'''


def test_buckets_follow_the_cap_after_the_first_step_as_the_guide_on_profiling_says():
    """docs/learners/profiling.md: DDP's first step sends one bucket, then buckets are rebuilt in the order
    gradients arrive and closed once they hold the cap: the MLP's small tensors (5 672 bytes) stay below
    0.1 and 0.01 MB until 1.weight joins them; 0.005 MB makes two buckets; the CNN makes three at 0.01 MB."""
    out = run([sys.executable, "-c", BUCKETS, str(REPO), str(free_port())], timeout=120).stdout
    one, mlp = [407080], [[407080]] * 3
    assert f"mlp 0.1 {mlp}" in out and f"mlp 0.01 {mlp}" in out, out
    assert f"mlp 0.005 {[one, [5672, 401408], [5672, 401408]]}" in out, out
    cnn = re.search(r"^cnn 0.01 (.*)$", out, re.M)[1]
    assert cnn.startswith("[[177704], [") and all(len(s) == 3 and sum(s) == 177704 for s in ast.literal_eval(cnn)[1:]), out
    page = (REPO / "docs/learners/profiling.md").read_text()
    assert "5 672 bytes" in page and "401 408 bytes" in page and "three buckets at 0.01 MB" in page


# ------------------------------------------------------------------------------------------ quoted lines

QUOTED_LINE = re.compile(r"(day\d/)?(\d+_\w+\.py)(?:\", line |:)(\d+)")


def test_a_line_of_a_lesson_quoted_in_the_docs_is_a_collective_of_that_lesson():
    """Pages and notebooks quote where lesson 17's ranks stood ("17_debugging_hangs.py:152", a stack's
    'File ".../17_debugging_hangs.py", line 152'): each such line of the lesson as it is now must hold a
    collective or a backward (what a rank waits in), so that an edit above it cannot leave the quote behind."""
    texts = {p: p.read_text() for p in [*REPO.glob("docs/**/*.md"), *REPO.glob("solutions/*.md"),
                                          *REPO.glob("notebooks/src/*.py"), REPO / "README.md"]}
    quoted = [(p, m) for p, t in texts.items() for m in QUOTED_LINE.finditer(t)]
    assert any(m.group(2) == "17_debugging_hangs.py" for _, m in quoted)  # the pages still quote lesson 17
    for page, m in quoted:
        lesson = next(REPO.glob(f"day*/{m.group(2)}"))
        line = lesson.read_text().splitlines()[int(m.group(3)) - 1]
        assert re.search(r"dist\.\w+\(|\.backward\(", line), \
            f"{page.relative_to(REPO)} quotes {m.group(0)}, which is now: {line.strip()!r}"
