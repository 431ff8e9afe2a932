"""The solutions of lessons 22's and 23's exercises do what they say (tests/test_solutions.py: how).

A tiny GPT at the lesson's default size, 5 to 40 steps.  The seconds and tokens/s are the machine's; the checks
hold what does not vary: losses, the sample, bytes held, the one-line refusal, the documents counted.
"""
import contextlib
import io
import math
import re
import shutil
import subprocess

import pytest

from conftest import REPO
from course.checkpoints import hf
from solutions_check import commands, edit_source, metrics, refusals, run_edited, run_once, sections, solution

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


# ------------------------------------------------------------------------------------------ lesson 23

L23 = "23_hf_finetuning"


def heredocs(n) -> list:
    """The Python scripts that exercise n's commands feed to `python - <<'EOF'`."""
    return re.findall(r"python - <<'EOF'\n(.*?)\nEOF\n", sections(L23)[n], re.S)


def runs_in(text, tmp, count) -> str:
    """A solution's script with its paths under runs/ moved to `tmp`, as argv moves a command's."""
    return edit_source(text, r"(?<=[\"'])runs/", lambda _: f"{tmp}/", f"solutions/{L23}.md", count=count)


@solution(L23, 1)
def test_23_1_a_check_on_the_optimizer_stops_the_pitfall_before_its_first_step(ran):
    lines = [line for line in commands(L23, 1) if line.startswith("python day5/")]
    pretrain, caught, checked = lines
    ran(pretrain)
    (script,) = heredocs(1)
    copy = ran.tmp / "day5" / "23_checked.py"
    copy.parent.mkdir(exist_ok=True)
    script = edit_source(script, r'Path\("day5/23_hf_finetuning\.py"\)',
                         lambda _: f"Path({str(REPO / 'day5/23_hf_finetuning.py')!r})", f"solutions/{L23}.md")
    exec(edit_source(script, r'Path\("day5/23_checked\.py"\)', lambda _: f"Path({str(copy)!r})",
                     f"solutions/{L23}.md"), {"__name__": "__main__"})
    assert copy.read_text() != (REPO / "day5/23_hf_finetuning.py").read_text()  # the check is in
    stopped = run_edited(caught, ran.tmp, "day5/23_checked.py", copy.read_text(), check=False)
    quoted = re.search(r"nothing written:\n\n```\n(.*?)```", sections(L23)[1], re.S).group(1).splitlines()
    # whichever rank stops first is the one the launcher names: rank 0 or rank 1, as the solution says
    said = {re.sub(r"error: rank \d exited", "error: rank 0 exited", line) for line in stopped.stderr.splitlines()}
    assert stopped.returncode == 1 and set(quoted) <= said, stopped.stderr
    assert not (ran.tmp / "solutions/23-caught/hf").exists()
    fine = run_edited(checked, ran.tmp, "day5/23_checked.py", copy.read_text())
    assert "after 30 steps" in fine.stdout and hf.verify_digests(ran.tmp / "solutions/23-checked/hf")


@solution(L23, 2)
def test_23_2_a_mean_per_rank_no_longer_trains_what_one_process_trains(ran):
    edit, one, two, per_rank = [line for line in commands(L23, 2) if line.startswith(("sed ", "python day5/"))]
    ran(commands(L23, 1)[0])  # lesson 22's model
    copy = ran.tmp / "day5" / "23_per_rank_mean.py"
    copy.parent.mkdir(exist_ok=True)
    done = subprocess.run(["bash", "-c", edit.replace("> day5/23_per_rank_mean.py", f"> {copy}")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and copy.read_text() != (REPO / "day5/23_hf_finetuning.py").read_text(), \
        "the sed no longer matches the lesson's masked_loss: update the solution"
    ran(one), ran(two)
    run_edited(per_rank, ran.tmp, "day5/23_per_rank_mean.py", copy.read_text())
    (script,) = heredocs(2)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(runs_in(script, ran.tmp, 2), {"__name__": "__main__"})
    found = dict(re.findall(r"^(23-\S+): weights (\S+) from one process", printed.getvalue(), re.M))
    assert float(found["23-global"]) < 1e-6, printed.getvalue()  # measured 1.2e-7
    assert float(found["23-per-rank"]) > 1e-4, printed.getvalue()  # measured 6.5e-3


@solution(L23, 3)
def test_23_3_a_damaged_copy_is_one_line_before_any_rank(ran):
    copy_line, flip, lesson = commands(L23, 3)
    ran(commands(L23, 1)[0])  # lesson 22's model
    assert copy_line == "cp -r runs/22_gpt_pretraining/hf runs/solutions/23-damaged", copy_line
    shutil.copytree(ran.tmp / "22_gpt_pretraining/hf", ran.tmp / "solutions/23-damaged")
    code = re.fullmatch(r'python -c "(.*)"', flip).group(1)
    exec(runs_in(code, ran.tmp, 1), {"__name__": "__main__"})
    stopped = ran(lesson, check=False)
    (said,) = refusals(L23, 3)
    assert stopped.returncode == 1 and stopped.stderr.strip() == said.replace("runs/", f"{ran.tmp}/"), stopped.stderr
    assert not (ran.tmp / "solutions/23-damaged-run").exists()
