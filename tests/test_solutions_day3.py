"""The solutions of lessons 13-17's exercises do what they say (tests/test_solutions.py: how).
"""
import re
import signal
import subprocess
import time

import pytest

from conftest import REPO, environ, max_rel_diff, run
from solutions_check import (argv, commands, edit_source, metrics, run_edited, run_solution, sections, solution,
                             weights)
from test_day3_hangs import START_S, ended_by_its_timeout

pytestmark = pytest.mark.slow  # the exercises' checks: the full suite (the quick tier proves each lesson's own claim)


# ------------------------------------------------------------------------------------------ lesson 13

@solution("13_mixed_precision", 1)
@pytest.mark.slow
def test_13_1_clipping_before_unscaling_sees_scaled_gradients(tmp_path, dataset):
    wrong, right = commands("13_mixed_precision", 1)
    source = (REPO / "day3/13_mixed_precision.py").read_text()
    # the unscale_ call and the clip_grad_norm_ statement right after it, at the same indent: swapped
    swapped = edit_source(source, r"^(?P<i>[ \t]*)(?P<unscale>scaler\.unscale_\(\s*optimizer\s*\)[^\n]*)\n"
                                  r"(?P=i)(?P<clip>[^\n]*\bclip_grad_norm_\([^\n]*)\n",
                          r"\g<i>\g<clip>\n\g<i>\g<unscale>\n", "day3/13_mixed_precision.py")
    run_edited(wrong, tmp_path, "day3/13_clip_before_unscale.py", swapped)
    run_solution("13_mixed_precision", 1, tmp_path, line=1)
    bad, good = metrics(tmp_path / "solutions/13-wrong-order"), metrics(tmp_path / "solutions/13-fp32")
    ratio = sorted(b / g for b, g in zip(bad["grad_norm_per_step"], good["grad_norm_per_step"]))[12]
    assert 65536 / 4 < ratio < 65536 * 4
    fell = lambda m: m["loss_per_step"][0] - min(m["loss_per_step"][-5:])  # noqa: E731
    assert fell(bad) < fell(good)


@solution("13_mixed_precision", 2)
@solution("13_mixed_precision", 3)
@pytest.mark.slow
def test_13_bf16_has_no_scaler_and_an_fp16_overflow_is_skipped_on_both_ranks(tmp_path, dataset):
    out = run_solution("13_mixed_precision", 2, tmp_path).stdout
    m = metrics(tmp_path / "solutions/13-bf16")
    assert m["skipped_steps"] == [] and m["test_accuracy"] == 0.1 and m["test_loss"] != m["test_loss"]  # NaN
    assert "weights identical on all ranks: True" in out
    out = run_solution("13_mixed_precision", 3, tmp_path).stdout
    assert metrics(tmp_path / "solutions/13-fp16")["skipped_steps"] == [1]
    assert re.search(r"\[rank 0\] step 1 skipped .*loss scale 65536 -> 32768", out)
    assert re.search(r"\[rank 1\] step 1 skipped .*loss scale 65536 -> 32768", out)


# ------------------------------------------------------------------------------------------ lesson 14

@solution("14_accumulation_checkpointing", 1)
@pytest.mark.slow
def test_14_1_without_no_sync_every_micro_batch_all_reduces_and_the_weights_stay(tmp_path, dataset):
    without, with_ = commands("14_accumulation_checkpointing", 1)
    source = (REPO / "day3/14_accumulation_checkpointing.py").read_text()
    # `model.no_sync() if <the first k-1> else contextlib.nullcontext()` -> `contextlib.nullcontext()`
    sync = r"\bmodel\.no_sync\(\)\s+if\s+[^:\n]+?\s+else\s+(contextlib\.nullcontext\(\))"
    out = run_edited(without, tmp_path, "day3/14_without_no_sync.py",
                     edit_source(source, sync, r"\1", "day3/14_accumulation_checkpointing.py")).stdout
    assert "all_reduce per optimizer step: 4 round(s) of 4 bucket(s)" in out
    assert "all_reduce per optimizer step: 1 round(s) of 1 bucket(s)" in run_solution(
        "14_accumulation_checkpointing", 1, tmp_path, line=1).stdout
    a, b = metrics(tmp_path / "solutions/14-without-no-sync"), metrics(tmp_path / "solutions/14-no-sync")
    assert a["allreduce_bytes_per_sample"] == 4 * b["allreduce_bytes_per_sample"]
    # the same weights to float rounding (measured 3.5e-9, as the solution says: 3e-9)
    assert max_rel_diff(weights(tmp_path / "solutions/14-without-no-sync/model.pt"),
                        weights(tmp_path / "solutions/14-no-sync/model.pt")) < 1e-6


@solution("14_accumulation_checkpointing", 2)
@pytest.mark.slow
def test_14_2_checkpointing_a_deeper_model_keeps_a_smaller_share(tmp_path, dataset):
    run_solution("14_accumulation_checkpointing", 2, tmp_path)
    run_solution("14_accumulation_checkpointing", 2, tmp_path, line=1)
    plain, ckpt = metrics(tmp_path / "solutions/14-depth8"), metrics(tmp_path / "solutions/14-depth8-checkpointed")
    ratio = ckpt["saved_for_backward_bytes"] / plain["saved_for_backward_bytes"]
    assert abs(plain["saved_for_backward_bytes"] / 2 ** 20 - 6.2) < 0.1 and 0.09 < ratio < 0.11, ratio  # 6.2 MB, 0.10x
    w1, w2 = (weights(tmp_path / f"solutions/{n}/model.pt") for n in ("14-depth8", "14-depth8-checkpointed"))
    assert all(w1[k].equal(w2[k]) for k in w1)


@solution("14_accumulation_checkpointing", 3)
@pytest.mark.slow
def test_14_3_an_overflow_during_accumulation_skips_one_step_once(tmp_path, dataset):
    out = run_solution("14_accumulation_checkpointing", 3, tmp_path).stdout
    assert metrics(tmp_path / "solutions/14-fp16")["skipped_steps"] == [3]
    for rank in (0, 1):
        assert len(re.findall(rf"\[rank {rank}\] step \d+ skipped .*loss scale 65536 -> 32768", out)) == 1, out
    assert re.search(r"\[rank 1\] step 3 skipped \(inf/NaN gradients; own loss inf\)", out)


# ------------------------------------------------------------------------------------------ lesson 15

@solution("15_fsdp2", 1)
@pytest.mark.slow
def test_15_1_four_ranks_fit_two_mb_two_ranks_stop_before_starting(tmp_path, dataset):
    out = run_solution("15_fsdp2", 1, tmp_path).stdout
    assert "FSDP2 1.563 MB on the fullest of 4 ranks, DDP's full replica 6.179 MB: 0.253 of DDP's" in out
    assert "measured on the fullest rank: 1.56 MB, within it" in out
    stopped = run_solution("15_fsdp2", 1, tmp_path, line=1, check=False)
    lines = stopped.stderr.strip().splitlines()
    assert stopped.returncode == 1 and len(lines) == 1, stopped.stderr
    assert "FSDP2 over 2 ranks needs 3.10 MB (does not fit)" in lines[0]
    assert not (tmp_path / "solutions/15-two").exists()


@solution("15_fsdp2", 2)
@pytest.mark.slow
def test_15_2_bf16_gathers_in_bf16_and_keeps_fp32_shards(tmp_path, dataset):
    bf16 = run_solution("15_fsdp2", 2, tmp_path).stdout
    fp32 = run_solution("15_fsdp2", 2, tmp_path, line=1).stdout
    held = "[rank 0] holds parameters 0.267 MB, gradients 0.267 MB, optimizer state 0.267 MB"
    assert held in bf16 and held in fp32
    assert "after forward 0.265 MB" in bf16 and "after forward 0.274 MB" in fp32
    a, b = metrics(tmp_path / "solutions/15-bf16"), metrics(tmp_path / "solutions/15-fp32")
    gaps = [abs(x - y) for x, y in zip(a["loss_per_step"], b["loss_per_step"])]
    assert len(gaps) == 10 and 0 < max(gaps) < 0.01, gaps  # measured: at most 0.0005


@solution("15_fsdp2", 3)
@pytest.mark.slow
def test_15_3_adamw_doubles_the_optimizer_state(tmp_path, dataset):
    said = sections("15_fsdp2")[3]  # "replace its optimizer line `...SGD(...)` with `...AdamW(...)`"
    assert "`optimizer = torch.optim.SGD(model.parameters()" in said, said
    adamw = re.search(r"`(optimizer = torch\.optim\.AdamW\(.*?\))`", said)[1]
    source = (REPO / "day3/15_fsdp2.py").read_text()
    # the SGD optimizer's assignment, its arguments up to the closing parenthesis (one level of nesting)
    sgd = r"\boptimizer\s*=\s*torch\.optim\.SGD\(\s*model\.parameters\(\)(?:[^()]|\([^()]*\))*\)"
    (line,) = commands("15_fsdp2", 3)
    out = run_edited(line, tmp_path, "day3/15_fsdp2_adamw.py",
                     edit_source(source, sgd, lambda _: adamw, "day3/15_fsdp2.py")).stdout
    assert "[rank 0] holds parameters 1.034 MB, gradients 1.034 MB, optimizer state 2.067 MB, total 4.135 MB" in out
    assert "DDP's full replica 8.238 MB: 0.502 of DDP's" in out
    assert "measured on the fullest rank: 4.13 MB, over it" in out


# ------------------------------------------------------------------------------------------ lesson 16

@pytest.fixture(scope="module")
def lesson16(tmp_path_factory, dataset):
    """Exercises 1, 2 and 3 go on in one directory: their commands in order, once (~25 s here)."""
    tmp = tmp_path_factory.mktemp("solutions16")
    out = {}
    for n in (1, 2, 3):
        out[n] = [run(argv(line, tmp)[0]) for line in commands("16_distributed_checkpoint", n)]
    return tmp, out


def _relative16(a, b) -> float:
    import torch

    wa, wb = weights(a), weights(b)
    va, vb = (torch.cat([w[k].flatten() for k in sorted(w)]) for w in (wa, wb))
    return ((va - vb).norm() / vb.norm()).item()


@solution("16_distributed_checkpoint", 1)
@pytest.mark.slow
def test_16_1_saved_by_two_ranks_resumed_by_one_process(lesson16):
    tmp, out = lesson16
    said = out[1][-1].stdout
    assert f"[rank 0] resumed from {tmp}/solutions/16-resume/step-000000003 (saved by 2 ranks): step 3" in said
    assert "[rank 0] steps 4 to 6 (3 steps) in" in said
    rel = _relative16(tmp / "solutions/16-one/model.pt", tmp / "solutions/16-two/model.pt")
    assert 0 <= rel < 1e-6, rel  # measured 2.7e-8: float rounding


@solution("16_distributed_checkpoint", 2)
@pytest.mark.slow
def test_16_2_a_checkpoint_without_its_marker_is_skipped(lesson16):
    tmp, out = lesson16
    said = out[2][-1].stdout
    d = tmp / "solutions/16-resume"
    assert f"[rank 0] skipping checkpoint {d}/step-000000006 (torn or invalid: no complete.json: never finished)" in said
    assert f"[rank 0] resumed from {d}/step-000000003 (saved by 2 ranks): step 3" in said
    assert "[rank 0] steps 4 to 9 (6 steps) in" in said
    assert sorted(p.name for p in d.iterdir()) == ["step-000000003", "step-000000009"]


@solution("16_distributed_checkpoint", 3)
@pytest.mark.slow
def test_16_3_a_finished_run_leaves_nothing_to_train(lesson16):
    tmp, out = lesson16
    (done,) = out[3]
    assert done.returncode == 0 and done.stdout.strip().splitlines() == [
        f"nothing to train: the newest checkpoint in {tmp}/solutions/16-resume is at step 9 (epoch 0) and this run "
        f"ends at --max-steps 9; raise it to train on, or --export the checkpoint"], done.stdout


# ------------------------------------------------------------------------------------------ lesson 17

@solution("17_debugging_hangs", 1)
@pytest.mark.slow
def test_17_1_uneven_under_torchrun_names_the_barrier_and_the_bucket(tmp_path, dataset):
    """The solution's --timeout is 5 s; the bounds are test_day3_hangs' (its docstring says why)."""
    start = time.perf_counter()
    proc = run_solution("17_debugging_hangs", 1, tmp_path, check=False, timeout=180)
    ended_by_its_timeout(proc, time.perf_counter() - start, 5)
    assert re.search(r"rank 0 waited [\d.]+ s in barrier #(\d+) .*; rank 1 last entered all_reduce #\1 "
                     r"\(shape \[101770\]", proc.stderr), proc.stderr


@solution("17_debugging_hangs", 2)
@pytest.mark.slow
def test_17_2_sigusr1_prints_every_ranks_stack(tmp_path, dataset):
    """SIGUSR1 (faulthandler), py-spy and torch's debug server (--debug-server) on the same waiting ranks; the
    debug server's page process ends with the run (its port is free again)."""
    import urllib.request

    from course.launching.ports import free_port

    cmd, env = argv(commands("17_debugging_hangs", 2)[0], tmp_path)
    port = free_port()
    cmd = [str(port) if c == "25999" else c for c in cmd]
    assert str(port) in cmd, cmd
    run_dir = tmp_path / "solutions" / "17-stacks"
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=environ(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pages = {}
    try:
        deadline = time.monotonic() + START_S  # starting and training up to the checkpoint: the machine's load
        while not (run_dir / "checkpoint.pt").exists():  # written just before rank 0's barrier
            assert time.monotonic() < deadline and proc.poll() is None, "the run never reached its checkpoint"
            time.sleep(0.2)
        time.sleep(2)  # both ranks now wait: rank 0 in the barrier, rank 1 in backward's all_reduce
        for page in ("stacks", "fr_trace_json"):  # rank 0 starts the page's process: it may take seconds
            while page not in pages and time.monotonic() < deadline + 20:
                try:
                    pages[page] = urllib.request.urlopen(f"http://127.0.0.1:{port}/{page}", timeout=30).read().decode()
                except OSError:
                    time.sleep(0.5)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        # py-spy on every process under the launcher (the two ranks, and a fork server where there is one)
        import psutil

        spy = REPO / ".venv" / "bin" / "py-spy" if (REPO / ".venv" / "bin" / "py-spy").exists() else "py-spy"
        dumps = [subprocess.run([str(spy), "dump", "--pid", str(child.pid)], capture_output=True, text=True,
                                timeout=60) for child in psutil.Process(proc.pid).children(recursive=True)]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=START_S)
    assert err.count("(most recent call first)") >= 2, err
    assert re.search(r'line \d+ in barrier', err) and re.search(r'line \d+ in backward', err), err
    # the debug server: both ranks' Python stacks, rank 0 first, and both ranks' flight recorders
    stacks = pages.get("stacks", "")
    assert re.search(r"Rank 0: .*?line \d+ in barrier.*?Rank 1: .*?line \d+ in backward", stacks, re.S), stacks
    records = pages.get("fr_trace_json", "")
    assert "Rank 1: " in records and '"profiling_name": "gloo:barrier"' in records, records[:3000]
    with pytest.raises(OSError):  # the page's process ended with rank 0
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
    spied = "".join(d.stdout + d.stderr for d in dumps)
    if "Permission denied" in spied or "ptrace" in spied.lower():
        pytest.skip(f"py-spy cannot attach here (no ptrace rights): {spied.strip()[:200]}")
    assert re.search(r"barrier \(.*distributed_c10d.py:\d+\)", spied) and "backward" in spied, spied


@solution("17_debugging_hangs", 3)
def test_17_3_detail_names_both_shapes(tmp_path):
    out = run_solution("17_debugging_hangs", 3, tmp_path, check=False, timeout=180).stdout  # 12 s idle; >60 s once under the suite's load
    assert "TensorShape=[4]" in out and "TensorShape=[5]" in out and out.count("Detected mismatch") == 2, out


@solution("15_fsdp2", 4)
@pytest.mark.slow
def test_15_4_accumulation_under_fsdp2_trains_what_one_larger_batch_trains(tmp_path, dataset):
    import textwrap

    source = (REPO / "day3/15_fsdp2.py").read_text()
    new = re.search(r"```python\n(.*?)```", sections("15_fsdp2")[4], re.S).group(1)
    assert "set_requires_gradient_sync(i == 3)" in new
    # the lines that begin the loop's body, as the solution names them: from `loss = F.cross_entropy(model(x)...`
    # to `scaler.scale(loss).backward()`, at one indent, at most 4 lines apart
    body = (r"^(?P<i>[ \t]*)loss\s*=\s*F\.cross_entropy\(\s*model\(\s*x\s*\)[^\n]*\n"
            r"(?:(?P=i)[^\n]*\n){0,3}?(?P=i)scaler\.scale\(\s*loss\s*\)\.backward\(\)[^\n]*\n")
    accumulate = edit_source(source, body, lambda m: textwrap.indent(new, m["i"]), "day3/15_fsdp2.py")
    edited, plain = commands("15_fsdp2", 4)
    run_edited(edited, tmp_path, "day3/15_fsdp2_accumulate.py", accumulate)
    run_solution("15_fsdp2", 4, tmp_path, line=1)
    a, b = metrics(tmp_path / "solutions/15-accumulate"), metrics(tmp_path / "solutions/15-batch64")
    assert a["steps"] == b["steps"] == 4 and a["global_batch_size"] == b["global_batch_size"] == 128
    rel = max_rel_diff(weights(tmp_path / "solutions/15-accumulate/model.pt"),
                       weights(tmp_path / "solutions/15-batch64/model.pt"))
    print(f"4 micro-batches of 16 against batches of 64: largest relative weight difference {rel:.3g}")
    assert rel < 1e-5, rel
