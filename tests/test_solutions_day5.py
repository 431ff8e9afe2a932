"""The solutions of lesson 22's exercises do what they say (tests/test_solutions.py: how).

A tiny GPT at the lesson's default size, 5 or 20 steps.  The seconds and tokens/s are the machine's; the checks
hold what does not vary: losses, the sample, bytes held, the one-line refusal, the documents counted.
"""
import math
import re

import pytest

from conftest import REPO
from solutions_check import commands, metrics, refusals, run_once, sections, solution

pytestmark = pytest.mark.slow  # the exercises' checks: the full suite (the quick tier proves each lesson's own claim)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """ran(line): the solution's command line run once in this module's directory (runs/ -> it)."""
    return run_once(tmp_path_factory.mktemp("solutions_day5"))


@solution("22_gpt_pretraining", 1)
def test_22_1_checkpointing_changes_no_number_and_holds_less(ran):
    plain, checkpointed = commands("22_gpt_pretraining", 1)
    out_plain, out_ckpt = ran(plain).stdout, ran(checkpointed).stdout
    a, b = metrics(ran.tmp / "solutions/22-plain"), metrics(ran.tmp / "solutions/22-checkpointed")
    assert a["loss_per_step"] == b["loss_per_step"] and a["sample"] == b["sample"]
    stated = re.search(r"held-out loss (\d\.\d+) nats", sections("22_gpt_pretraining")[1]).group(1)
    assert f"held-out loss {a['heldout_loss']:.4f}" in out_plain
    assert f"held-out loss {b['heldout_loss']:.4f}" in out_ckpt
    assert abs(a["heldout_loss"] - float(stated)) < 1e-3, (a["heldout_loss"], stated)
    said = re.findall(r"held when it began, at most (\d+\.\d+) MB more", sections("22_gpt_pretraining")[1])
    above = [a["memory"]["peak_above_bytes"] / 2 ** 20, b["memory"]["peak_above_bytes"] / 2 ** 20]
    assert [f"{x:.3f}" for x in above] == said, (above, said)  # bytes held: the same on every run
    assert a["memory"]["held_before_bytes"] == b["memory"]["held_before_bytes"]


@solution("22_gpt_pretraining", 2)
def test_22_2_sizes_tensor_parallelism_cannot_cut_stop_before_any_rank(ran):
    (line,) = commands("22_gpt_pretraining", 2)
    said = refusals("22_gpt_pretraining", 2)
    stopped = ran(line, check=False)
    assert stopped.returncode == 1 and stopped.stderr.strip().splitlines() == said, stopped.stderr
    assert not (ran.tmp / "solutions/22-four").exists()


@solution("22_gpt_pretraining", 3)
def test_22_3_your_own_text_is_read_and_learnt(ran):
    (line,) = commands("22_gpt_pretraining", 3)
    out = ran(line).stdout
    files = [p for p in (REPO / "docs" / "learners").rglob("*") if p.suffix in (".md", ".txt", ".rst")
             and p.is_file() and p.stat().st_size]
    assert f"[rank 0] --text-dir docs/learners: {len(files)} documents, " in out, out
    stated = re.search(r"--text-dir docs/learners: (\d+) documents", sections("22_gpt_pretraining")[3]).group(1)
    assert int(stated) == len(files), (stated, len(files))  # the solution counts this checkout's pages
    m = metrics(ran.tmp / "solutions/22-docs")
    assert m["steps"] == 20 and m["heldout_loss"] < math.log(256) - 1.0, m["heldout_loss"]
