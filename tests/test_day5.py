"""Lesson 22 (pre-training a small GPT, offline), run for real: gloo, the CPU, a tiny GPT (width 32, depth 2,
4 heads, MLP hidden 64, 32 tokens a row), Python's documentation topics, 6 AdamW steps.

The reference is one process (--nproc 1: the model whole) on a global batch of 16 rows.  Every layout trains on
the same 16 rows a step, from the same weights (seed 5): FSDP2 at 2 ranks (torchrun) and 4 (its own launcher),
FSDP2 x TP with sequence parallelism on a 1 x 2 and a 2 x 2 mesh, activation checkpointing and compile with FSDP2
at 2 and at 4 ranks; bf16 in one process, with FSDP2 at 2 ranks and on the 2 x 2 mesh.
Bounds (measured values beside each):
- fp32 layouts against one process after 6 steps: the relative difference of the whole weight vector at most
  1e-5 (measured 6e-8 to 1.1e-7, compiled at 2 and at 4 ranks 1.1e-7: the sums of the sharded gradients come in
  another order, and AdamW divides by the square root of tiny second moments in the first steps); every step's
  loss within 1e-5 relative.
- activation checkpointing: the same numbers as without it, bit for bit (it recomputes the same operations),
  and a smaller step-3 peak above what the step began with (measured 1.21 against 2.34 MB a rank at 2 ranks:
  0.52; 0.68 against 1.21 MB at 4: 0.57).
- bf16 with FSDP2 at 2 ranks and on the 2 x 2 mesh against bf16 in one process: losses within 1e-3 relative
  (measured 1.8e-5 and 5.3e-5).
- the loss falls: step 6's loss below step 1's, which is near ln 256 = 5.55 (a byte uniformly guessed).
- tokens per step, FLOPs per token (torchtitan's formula, computed here from the model), MFU from tokens/s, FLOPs
  and peak: exact arithmetic.
- the sample at the end begins with the prompt, and is what the written weights give with the same seed.
"""
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

import reference_runs
from catalogue import Runs
from conftest import PYTHON, REPO, end_process_tree, environ, metrics, run
from course.checkpoints import dcp as ckpt
from course.gpt import GPT
from course.training.output import load_weights
from slurm_cluster import follow_requeue
from data_tools import text

pytestmark = pytest.mark.slow
LESSON = "day5/22_gpt_pretraining.py"
SIZES = dict(width=32, depth=2, heads=4, hidden=64)
EQUAL = 1e-5
RESUMABLE = (*reference_runs.GPT, "--batch-size", "8", "--max-steps", "60")  # as "22: fsdp2, 60 steps"
# Resumed here to step 20, as "22: fsdp2, 20 steps" (the stop comes a step or two after step 4's checkpoint; the
# learning rate does not depend on --max-steps, so the first 20 steps of a 60-step run are a 20-step run's):
# each resume trains 12-15 steps instead of 52-55.  The Slurm test resumes the requeued job's own command, to 60.
RESUMED_TO = 20


@pytest.fixture(scope="module")
def runs(catalogue):
    """The reference runs "22: one", "fsdp2", ... (tests/reference_runs.py)."""
    return Runs(catalogue, "22: ")


def vector(run_dir) -> torch.Tensor:
    w = load_weights(run_dir / "model.pt")
    return torch.cat([w[k].flatten() for k in sorted(w)])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.quick("22")
@pytest.mark.parametrize("layout", ["fsdp2", "fsdp-tp 2x2"])
def test_each_layout_trains_what_one_process_trains(runs, layout):
    one, _ = runs["one"]
    other, out = runs[layout]
    diff = relative(vector(other), vector(one))
    print(f"{layout}: weights {diff:.1e} from one process's after 6 steps")
    assert diff <= EQUAL, diff
    ours, theirs = metrics(other)["loss_per_step"], metrics(one)["loss_per_step"]
    assert len(ours) == len(theirs) == 6
    assert all(abs(a - b) <= EQUAL * b for a, b in zip(ours, theirs)), (ours, theirs)
    assert metrics(other)["global_batch_rows"] == metrics(one)["global_batch_rows"] == 16


@pytest.mark.parametrize("layout, world", [("fsdp4", 4), ("fsdp-tp 1x2", 2), ("compiled", 2), ("compiled 4", 4)])
def test_the_other_layouts_train_what_one_process_trains_too(runs, layout, world):
    one, _ = runs["one"]
    other, out = runs[layout]
    diff = relative(vector(other), vector(one))
    print(f"{layout}: weights {diff:.1e} from one process's after 6 steps")
    assert diff <= EQUAL, diff
    m = metrics(other)
    assert (m["world_size"], m["batch_size"] * m["replicas"], m["global_batch_rows"]) == (world, 16, 16)
    assert ("memory of step 3 not measured (torch.compile's CPU kernels)" in out) is layout.startswith("compiled")


def test_the_layouts_are_what_they_say(runs):
    """A run that silently fell back to one process, or to another mesh, would pass the equality above."""
    for layout, (world, inner, replicas) in {"fsdp2": (2, 1, 2), "fsdp4": (4, 1, 4), "fsdp-tp 1x2": (2, 2, 1),
                                             "fsdp-tp 2x2": (4, 2, 2)}.items():
        m = metrics(runs[layout][0])
        assert (m["world_size"], m["inner"], m["replicas"], m["backend"]) == (world, inner, replicas, "gloo"), layout
        assert m["layout"] == layout.split()[0].rstrip("24")
        rows = 16 // replicas
        assert m["batch_size"] == rows and m["tokens_per_step"] == 16 * 32
    assert metrics(runs["one"][0])["layout"] == "one process"


def test_each_rank_holds_only_its_share_of_the_model(runs):
    """Step 3 began with the parameters, gradients and AdamW's two moments held: 4 x 4 bytes a parameter, whole
    in one process, about a quarter of it on each of 4 FSDP2 ranks (the shards' rows are padded to equal
    pieces)."""
    whole = metrics(runs["one"][0])["memory"]["held_before_bytes"]
    params = sum(p.numel() for p in GPT(**SIZES).parameters())
    assert whole >= 16 * params
    for layout, ranks in (("fsdp4", 4), ("fsdp-tp 2x2", 4), ("fsdp2", 2)):
        held = metrics(runs[layout][0])["memory"]["held_before_bytes"]
        print(f"{layout}: {held} bytes held before step 3 against {whole} in one process")
        assert held <= whole / ranks * 1.15, (layout, held, whole)


@pytest.mark.parametrize("plain, checkpointed", [("fsdp2", "checkpointed"), ("fsdp4", "checkpointed 4")])
def test_activation_checkpointing_changes_no_number_and_holds_less(runs, plain, checkpointed):
    plain, checkpointed = runs[plain][0], runs[checkpointed][0]
    assert metrics(checkpointed)["world_size"] == metrics(plain)["world_size"]
    assert torch.equal(vector(plain), vector(checkpointed))
    assert metrics(plain)["loss_per_step"] == metrics(checkpointed)["loss_per_step"]
    above = {name: metrics(d)["memory"]["peak_above_bytes"] for name, d in (("plain", plain), ("ckpt", checkpointed))}
    print(f"step 3's peak above what it began with: {above}")
    assert above["ckpt"] < 0.85 * above["plain"], above


@pytest.mark.parametrize("layout, world", [("bf16 fsdp2", 2), ("bf16 fsdp-tp 2x2", 4)])
def test_bf16_with_fsdp2_and_on_the_mesh_follows_bf16_in_one_process(runs, layout, world):
    one, mesh = metrics(runs["bf16 one"][0]), metrics(runs[layout][0])
    assert one["precision"] == mesh["precision"] == "bf16" and mesh["world_size"] == world
    worst = max(abs(a - b) / b for a, b in zip(mesh["loss_per_step"], one["loss_per_step"]))
    print(f"{layout}: losses within {worst:.1e} (relative) of one bf16 process")
    assert worst <= 1e-3, worst
    fp32 = metrics(runs["one"][0])["loss_per_step"]
    assert one["loss_per_step"] != fp32  # bf16 really ran: its losses are not fp32's


@pytest.mark.quick("22")
def test_it_learns_the_text(runs):
    m = metrics(runs["one"][0])
    losses = m["loss_per_step"]
    assert abs(losses[0] - math.log(256)) < 0.3, losses[0]  # about a uniform guess over 256 bytes
    assert losses[-1] < losses[0] - 0.2, losses
    assert m["heldout_loss"] < math.log(256)
    assert m["corpus"].startswith("python-docs: ")


def test_throughput_and_mfu_are_the_formulas_of_the_run(runs):
    for name in ("one", "fsdp2", "fsdp-tp 2x2"):
        m = metrics(runs[name][0])
        model = GPT(**SIZES)
        params = sum(p.numel() for p in model.parameters())
        embedding = model.model.embed_tokens.weight.numel()
        assert (m["parameters"], m["embedding_parameters"]) == (params, embedding)
        assert m["flops_per_token"] == 6 * (params - embedding) + 12 * 2 * 32 * 32
        per_rank = m["tokens_per_step"] / m["step_seconds"] / m["world_size"]
        assert m["tokens_per_second_per_rank"] == pytest.approx(per_rank, rel=1e-9)
        assert m["mfu"] == pytest.approx(per_rank * m["flops_per_token"] / m["peak_flops"], rel=1e-9)
        assert 0 < m["mfu"] < 1 and "matmul timed on this cpu" in m["peak_flops_from"]


def lesson_module():
    spec = importlib.util.spec_from_file_location("lesson22", REPO / LESSON)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sample_is_what_the_written_weights_say(runs):
    """Rank 0 samples from the weights it writes: the same weights and seed here give the same text."""
    run_dir, out = runs["fsdp-tp 2x2"]
    m = metrics(run_dir)
    assert m["sample"].startswith("The ") and f"sample: {m['sample']!r}" in out
    model = GPT(**SIZES)
    model.load_state_dict(load_weights(run_dir / "model.pt"))
    lesson = lesson_module()
    args = lesson.build_parser().parse_args(["--seed", "5", "--seq-len", "32", "--sample-tokens", "30"])
    assert lesson.sample(model, args, torch.device("cpu")) == m["sample"]


def test_the_loss_curve_is_in_tensorboard(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = runs["fsdp2"]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    logged = [e.value for e in events.Scalars("train/loss")]
    assert logged == pytest.approx(metrics(run_dir)["loss_per_step"], rel=1e-6)
    assert [e.value for e in events.Scalars("heldout/loss")] == pytest.approx([metrics(run_dir)["heldout_loss"]])


# ------------------------------------------------------------------- stopped by a signal, resumed from DCP

@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """60 steps at 2 ranks, a checkpoint every 4; SIGUSR1 to ONE rank once the first is published (what srun
    passes on from `sbatch --signal`): the other rank learns of it only through the all_reduce after each step.  Returns
    the run dir, the step it stopped after and its output; a copy of its checkpoints is kept for the resharding
    test (the resume below writes into the original)."""
    run_dir = tmp_path_factory.mktemp("22-stopped")
    cmd = [PYTHON, LESSON, *RESUMABLE, "--nproc", "2", "--checkpoint-every", "4", "--run-dir", run_dir]
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=environ(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:  # rank 0 names each checkpoint it publishes
            lines.append(line)
            if re.match(r"\[rank 0\] checkpoint \S+ \(step 4\)", line):
                break
        ranks = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()  # forked by the launcher
        assert len(ranks) == 2, (ranks, lines)
        os.kill(int(ranks[-1]), signal.SIGUSR1)
        out = "".join(lines) + proc.communicate(timeout=240)[0]
    finally:
        end_process_tree(proc.pid)
    assert proc.returncode == 0, out
    stop = int(re.search(r"^\[rank 0\] stopped after step (\d+) by a stop signal", out, re.M).group(1))
    shutil.copytree(run_dir / "checkpoints", run_dir.parent / "22-stopped-checkpoints")
    return run_dir, stop, out


def test_a_signal_to_one_rank_stops_both_after_the_same_step_with_a_checkpoint(stopped):
    run_dir, stop, out = stopped
    assert 4 <= stop < 60, out  # it stopped before the end
    assert f"[rank 1] stopped after step {stop} " in out, out  # both ranks, after the same step
    assert not (run_dir / "metrics.json").exists()  # a stopped run writes no results, only its checkpoint
    newest, info = ckpt.newest(run_dir / "checkpoints")
    assert newest.name == f"step-{stop:09d}" and info["step"] == stop and len(info["losses"]) == stop
    assert info["world_size"] == 2 and info["global_batch_size"] == 16
    assert len(ckpt.final_dirs(run_dir / "checkpoints")) <= 2  # --keep 2: the periodic ones rotated
    assert ckpt.share_intact(newest, info, 0, 1)  # every file's sha256 as complete.json records it


def test_resumed_at_the_same_ranks_it_ends_bit_for_bit_as_the_uninterrupted_run(stopped, runs):
    run_dir, stop, _ = stopped
    assert stop < RESUMED_TO, f"stopped after step {stop}: nothing left to resume before step {RESUMED_TO}"
    reference, _ = runs[f"fsdp2, {RESUMED_TO} steps"]
    out = run([PYTHON, LESSON, *RESUMABLE, "--max-steps", str(RESUMED_TO), "--nproc", "2", "--checkpoint-every", "4",
               "--run-dir", run_dir, "--resume"]).stdout
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{stop:09d}'} (saved by 2 ranks): step {stop}" in out, out
    ours, theirs = load_weights(run_dir / "model.pt"), load_weights(reference / "model.pt")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert metrics(run_dir)["loss_per_step"] == metrics(reference)["loss_per_step"]  # the stopped run's too
    assert metrics(run_dir)["steps"] == RESUMED_TO and metrics(run_dir)["sample"] == metrics(reference)["sample"]


def test_resumed_on_a_2x2_mesh_the_checkpoint_is_resharded_and_trains_on_alike(stopped, runs, tmp_path):
    """DCP reads, for each rank's pieces of the 2-D mesh, the rows of the 1-D FSDP2 shards that hold them."""
    run_dir, stop, _ = stopped
    assert stop < RESUMED_TO, f"stopped after step {stop}: nothing left to resume before step {RESUMED_TO}"
    reference, _ = runs[f"fsdp2, {RESUMED_TO} steps"]
    out = run([PYTHON, LESSON, *RESUMABLE, "--max-steps", str(RESUMED_TO), "--nproc", "4", "--layout", "fsdp-tp",
               "--run-dir", tmp_path, "--checkpoint-dir", run_dir.parent / "22-stopped-checkpoints",
               "--resume"]).stdout
    assert f"(saved by 2 ranks): step {stop}" in out, out
    diff = relative(vector(tmp_path), vector(reference))
    print(f"stopped after step {stop} at 2 ranks, resumed on a 2 x 2 mesh: weights {diff:.1e} from uninterrupted")
    assert 0 < diff <= EQUAL, diff  # not bitwise (the sums come in another order), within float32 rounding
    assert metrics(tmp_path)["layout"] == "fsdp-tp" and metrics(tmp_path)["replicas"] == 2


@pytest.mark.slurm
def test_on_slurm_the_launcher_passes_the_signal_on_requeues_and_the_job_resumes(slurm_cluster, runs):
    """slurm/22_gpt_pretraining.sh on the two-node Slurm, one rank per node (--layout fsdp: the 2-rank run).
    SIGUSR1 to the batch script (what --signal=B:USR1@120 sends; here by scancel once step 4's checkpoint is
    published): the trap passes it on through srun, the ranks stop after the same step with a checkpoint, the
    script requeues the job, and the second run (same job id) resumes and ends with the uninterrupted weights."""
    reference, _ = runs["fsdp2, 60 steps"]
    run_dir = slurm_cluster.workdir / "lesson22-requeue"
    (slurm_cluster.workdir / "logs").mkdir(exist_ok=True)  # the launcher's --output=logs/%x-%j.out
    done = slurm_cluster.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
                              "--time=10", f"--export=ALL,COURSE_REPO={REPO},OMP_NUM_THREADS=1",
                              str(REPO / "slurm/22_gpt_pretraining.sh"), *RESUMABLE, "--layout", "fsdp",
                              "--checkpoint-every", "4", "--run-dir", str(run_dir)], timeout=60)
    assert done.returncode == 0, done.stderr
    job, signalled = int(done.stdout.strip().split(";")[0]), []

    def signal_after_step_4(log):
        if not signalled and re.search(r"^\[rank 0\] checkpoint \S+ \(step 4\)", log, re.M):
            sent = slurm_cluster.run(["scancel", "--batch", "--signal=USR1", str(job)])
            assert sent.returncode == 0, sent.stderr
            signalled.append(True)

    info = follow_requeue(slurm_cluster, job, "logs/22_gpt_pretraining-{job}.out", while_running=signal_after_step_4)
    log = info["log"]
    assert signalled and info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log
    assert "run 1 of job" in log and "run 2 of job" in log and f"requeueing job {job}" in log, log
    stop = int(re.search(r"^\[rank 0\] stopped after step (\d+) by a stop signal", log, re.M).group(1))
    assert 4 <= stop < 60 and f"[rank 1] stopped after step {stop} " in log, log
    assert f"(saved by 2 ranks): step {stop}" in log, log
    ours, theirs = load_weights(run_dir / "model.pt"), load_weights(reference / "model.pt")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), log
    assert metrics(run_dir)["loss_per_step"] == metrics(reference)["loss_per_step"]


# ------------------------------------------------------------------------ the text, packed (in this process)

def test_rows_share_their_edge_token_and_the_targets_are_the_next_tokens():
    tokens = torch.arange(23, dtype=torch.uint8)
    rows = text.PackedText(tokens, 5)
    assert len(rows) == 4  # (23 - 1) // 5
    for i in range(len(rows)):
        x, y = rows[i]
        assert x.tolist() == list(range(5 * i, 5 * i + 5)) and y.tolist() == list(range(5 * i + 1, 5 * i + 6))
    covered = torch.cat([rows[i][0] for i in range(len(rows))])
    assert covered.tolist() == list(range(20))  # every input token once, none padded


def test_documents_end_with_the_end_token_and_every_tenth_is_held_out():
    docs = [(f"d{i:02}", f"text {i}".encode()) for i in range(25)]
    train, held = text.split(docs)
    assert [n for n, _ in held] == ["d09", "d19"] and len(train) == 23
    stream = text.stream(held)
    assert bytes(stream.tolist()) == b"text 9\0text 19\0"
    assert text.decode(text.encode("héllo")) == "héllo"


def test_the_default_corpus_is_pythons_own_documentation():
    docs = text.documents("python-docs")
    assert len(docs) > 50 and all(b"\0" not in data for _, data in docs)
    assert sum(len(d) for _, d in docs) > 300_000


def test_a_text_dir_is_read_and_bad_ones_are_one_line(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.md").write_text(f"# note {i}\n" * 50)
    (tmp_path / "skip.bin").write_bytes(b"\0\1")
    assert [n for n, _ in text.documents(text_dir=tmp_path)] == ["0.md", "1.md", "2.md"]
    (tmp_path / "bad.txt").write_bytes(b"a\0b")
    out = run([PYTHON, REPO / LESSON, "--text-dir", tmp_path, "--run-dir", tmp_path / "run"], check=False, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1 and len(lines) == 1 and "NUL bytes" in lines[0] and "bad.txt" in lines[0], out.stderr
    assert not (tmp_path / "run").exists()


def test_tensor_parallel_sizes_that_do_not_divide_are_one_line(tmp_path):
    out = run([PYTHON, REPO / LESSON, "--nproc", "4", "--layout", "fsdp-tp", "--inner", "4",
               "--hidden", "66", "--run-dir", tmp_path / "run"], check=False, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1 and len(lines) == 1 and "--hidden (66)" in lines[0], out.stderr
