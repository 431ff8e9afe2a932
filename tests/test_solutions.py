"""The exercises' solutions (solutions/<notebook>.md) do what they say.

Every "Try it yourself" item of a notebook has a solution section in solutions/<notebook>.md, in the same
order; every solution section has a check here.  A check runs the commands of its section's first ```bash
block, as written there (`python` is this interpreter, `torchrun` is `python -m torch.distributed.run`, with
`--standalone` added when a command names no rendezvous, `runs/...` is a temporary directory, `VAR=value`
prefixes are the command's environment), and checks what the solution says the learner should see.
Solutions that need a GPU node or a real cluster are skipped with that reason.  Quick sizes throughout; the
costly ones are marked slow.
"""
import json
import re
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PYTHON, REPO, environ, max_rel_diff, run

SOLUTIONS = REPO / "solutions"
NOTEBOOK_SOURCES = REPO / "notebooks" / "src"


# ------------------------------------------------------------------------------------------ reading solutions

def exercises_in_notebook(name) -> int:
    """How many numbered items the notebook's "Try it yourself" section has."""
    text = (NOTEBOOK_SOURCES / f"{name}.py").read_text()
    if "## Try it yourself" not in text:
        return 0
    section = text.split("## Try it yourself", 1)[1].split("# %%", 1)[0]
    return len(re.findall(r"^# (?:\d+\.|-) ", section, re.M))  # numbered items, or bullets


def sections(name) -> dict:
    """{exercise number: its section's text} of solutions/<name>.md."""
    text = (SOLUTIONS / f"{name}.md").read_text()
    parts = re.split(r"^## (\d+)\. .*$", text, flags=re.M)
    return {int(n): body for n, body in zip(parts[1::2], parts[2::2])}


def commands(name, n) -> list:
    """The command lines of the first ```bash block of exercise n."""
    block = re.search(r"```bash\n(.*?)```", sections(name)[n], re.S)
    assert block, f"solutions/{name}.md, exercise {n}: no ```bash block"
    return [l.split("  #")[0].strip() for l in block.group(1).splitlines() if l.strip()]


def argv(line, tmp) -> tuple:
    """(argv, environment changes) for a solution's command line."""
    words = shlex.split(line)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    words = [str(tmp / w[len("runs/"):]) if w.startswith("runs/") else w for w in words]
    if words[0] == "python":
        words[0] = PYTHON
    elif words[0] == "torchrun":
        rest = words[1:]
        if not any(w.startswith(("--standalone", "--master_port", "--rdzv")) for w in rest):
            rest = ["--standalone", *rest]
        words = [PYTHON, "-m", "torch.distributed.run", *rest]
    return words, env


def run_solution(name, n, tmp, line=0, env=None, **kw) -> subprocess.CompletedProcess:
    cmd, own = argv(commands(name, n)[line], tmp)
    return run(cmd, env={**own, **(env or {})}, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(run_dir) -> dict:
    return json.loads((Path(run_dir) / "metrics.json").read_text())


def weights(path):
    from course.output import load_weights

    return load_weights(path)


# ------------------------------------------------------------------------------------------ every exercise has one

CHECKED = {}  # (notebook, exercise) -> test function name, filled by @solution


def solution(name, n):
    def mark(fn):
        CHECKED[(name, n)] = fn.__name__
        return fn
    return mark


def notebooks_with_exercises() -> list:
    return sorted(p.stem for p in NOTEBOOK_SOURCES.glob("*.py") if exercises_in_notebook(p.stem))


def test_every_exercise_has_a_solution_with_a_check():
    for name in notebooks_with_exercises():
        assert (SOLUTIONS / f"{name}.md").is_file(), f"solutions/{name}.md is missing"
        have = sorted(sections(name))
        assert have == list(range(1, exercises_in_notebook(name) + 1)), \
            f"solutions/{name}.md has sections {have} for {exercises_in_notebook(name)} exercises"
        for n in have:
            assert (name, n) in CHECKED, f"no check for solutions/{name}.md exercise {n}"
            assert "```bash" in sections(name)[n], f"solutions/{name}.md exercise {n}: no command"
    assert set(CHECKED) == {(name, n) for name in notebooks_with_exercises() for n in sections(name)}
    assert {p.stem for p in SOLUTIONS.glob("*.md")} - {"README"} == set(notebooks_with_exercises())


def test_the_exercise_count_reads_a_notebook_source():
    assert exercises_in_notebook("0_torch_dist") == 3
    assert exercises_in_notebook("test-profile") == 0


# ------------------------------------------------------------------------------------------ lesson 0

@solution("0_torch_dist", 1)
def test_0_1_more_processes_than_cores(tmp_path):
    out = run_solution("0_torch_dist", 1, tmp_path).stdout
    assert len(re.findall(r"all_reduce\(SUM\) = 36, mean = 4\.5", out)) == 8


@solution("0_torch_dist", 2)
@pytest.mark.slow
def test_0_2_one_rank_alone_waits_then_stops(tmp_path):
    line = commands("0_torch_dist", 2)[0].replace("29533", str(free_port()))
    cmd, env = argv(line, tmp_path)
    start = time.monotonic()
    proc = run(cmd, env=env, check=False, timeout=120)
    assert proc.returncode == 1
    assert time.monotonic() - start > 9, "it waited for the other rank"
    assert "within --timeout" in proc.stderr + proc.stdout and "1/2 clients joined" in proc.stderr + proc.stdout


@solution("0_torch_dist", 3)
def test_0_3_torchrun(tmp_path):
    out = run_solution("0_torch_dist", 3, tmp_path).stdout
    assert len(re.findall(r"mean = 2\.5", out)) == 4


# ------------------------------------------------------------------------------------------ lesson 1

@solution("1_torch_dist_gpu", 1)
@pytest.mark.gpu
def test_1_1_four_nccl_ranks():
    pytest.skip("needs a node with 4 GPUs (solutions/1_torch_dist_gpu.md says so)")


@solution("1_torch_dist_gpu", 2)
@pytest.mark.gpu
def test_1_2_nccl_debug():
    pytest.skip("needs a GPU node with several GPUs (solutions/1_torch_dist_gpu.md says so)")


@solution("1_torch_dist_gpu", 3)
def test_1_3_gloo_anywhere(tmp_path):
    out = run_solution("1_torch_dist_gpu", 3, tmp_path).stdout
    assert len(re.findall(r"\[rank \d\] of 3 on cpu", out)) == 3
    assert len(re.findall(r"all_reduce\(SUM\) = 6, mean = 2\b", out)) == 3


# ------------------------------------------------------------------------------------------ lesson 2

@solution("2_mnist_training", 1)
@pytest.mark.slow
def test_2_1_the_cnn_is_slower_and_behind_after_200_steps(tmp_path, dataset):
    run_solution("2_mnist_training", 1, tmp_path, line=0)
    run_solution("2_mnist_training", 1, tmp_path, line=1)
    cnn, mlp = metrics(tmp_path / "solutions/2-cnn"), metrics(tmp_path / "solutions/2-mlp")
    assert cnn["steps"] == mlp["steps"] == 200
    # "many times the MLP's seconds": above 3x in this suite's earlier runs, 2.9x once next to the other worker
    assert cnn["train_seconds"] > 1.5 * mlp["train_seconds"]
    assert cnn["test_accuracy"] < mlp["test_accuracy"]


@solution("2_mnist_training", 2)
def test_2_2_batch_128_takes_half_the_steps(tmp_path, dataset):
    out = run_solution("2_mnist_training", 2, tmp_path).stdout
    assert "trained 100 steps (12800 samples)" in out
    assert "test accuracy 0.7925" in out  # lesson 4's 2 ranks x 64 (solutions/4_mnist_manual_ddp.md)


# ------------------------------------------------------------------------------------------ lesson 3

@solution("3_mnist_distributed", 1)
def test_3_1_a_seed_per_rank_makes_different_models(tmp_path, dataset):
    edit, train = commands("3_mnist_distributed", 1)
    assert edit.startswith("sed ") and "args.seed + rank" in edit
    copy = tmp_path / "day1" / "3_seed_per_rank.py"
    copy.parent.mkdir()
    source = (REPO / "day1/3_mnist_distributed.py").read_text()
    assert "build_model(args.model, args.seed)" in source
    copy.write_text(source.replace("build_model(args.model, args.seed)", "build_model(args.model, args.seed + rank)"))
    cmd, env = argv(train.replace("day1/3_seed_per_rank.py", str(copy)), tmp_path)
    out = run(cmd, env={**env, "PYTHONPATH": str(REPO)}).stdout
    assert "identical weights on all 2 ranks: False; identical data order: True" in out


# ------------------------------------------------------------------------------------------ lesson 4

@solution("4_mnist_manual_ddp", 1)
def test_4_1_flat_sync_gives_the_same_result(tmp_path, dataset):
    out = run_solution("4_mnist_manual_ddp", 1, tmp_path).stdout
    assert "global batch 128; test accuracy 0.7925" in out


@solution("4_mnist_manual_ddp", 2)
@pytest.mark.slow
def test_4_2_three_ranks_pad_one_sample(tmp_path, dataset):
    run_solution("4_mnist_manual_ddp", 2, tmp_path)
    shards = json.loads((tmp_path / "solutions/4-three/shards.json").read_text())["shards"]
    seen = [i for shard in shards for i in shard]
    assert [len(s) for s in shards] == [4267] * 3
    assert (len(seen), len(set(seen))) == (12801, 12800)


# ------------------------------------------------------------------------------------------ lesson 5

def comm(log_dir):
    from course.profiling import comm_summary

    return comm_summary(log_dir)


@solution("5_mnist_manual_ddp_profile", 1)
@pytest.mark.slow
def test_5_1_the_cnn_moves_fewer_bytes(tmp_path, dataset):
    # The bytes are exact.  Times are not asserted (the benchmark measures speed): the share of the step
    # spent in the all_reduce includes waiting for the other rank and moves with the machine's load.
    run_solution("5_mnist_manual_ddp_profile", 1, tmp_path, line=0)
    run_solution("5_mnist_manual_ddp_profile", 1, tmp_path, line=1)
    cnn, mlp = comm(tmp_path / "solutions/5-cnn/log"), comm(tmp_path / "solutions/5-mlp/log")
    assert round(cnn["bytes_per_step"] / 1000, 1) == 177.7 and round(mlp["bytes_per_step"] / 1000, 1) == 407.1


@solution("5_mnist_manual_ddp_profile", 2)
@pytest.mark.slow
def test_5_2_a_small_cap_splits_the_mlp_in_two(tmp_path, dataset):
    out = run_solution("5_mnist_manual_ddp_profile", 2, tmp_path).stdout
    assert re.search(r"^ddp\s+2\.0\s+407\.1", out, re.M), out


@solution("5_mnist_manual_ddp_profile", 3)
@pytest.mark.slow
def test_5_3_three_cnn_buckets_overlap_backward(tmp_path, dataset):
    out = run_solution("5_mnist_manual_ddp_profile", 3, tmp_path).stdout
    assert re.search(r"^ddp\s+3\.0\s+177\.7", out, re.M), out
    assert comm(tmp_path / "solutions/5-overlap/log")["overlap_fraction"] > 0.05


# ------------------------------------------------------------------------------------------ lesson 6

@solution("6_mnist_ddp_pt", 1)
def test_6_1_two_buckets_give_the_same_weights(tmp_path, dataset):
    run_solution("6_mnist_ddp_pt", 1, tmp_path, line=0)
    run_solution("6_mnist_ddp_pt", 1, tmp_path, line=1)
    a, b = weights(tmp_path / "solutions/6-default/model.pt"), weights(tmp_path / "solutions/6-buckets/model.pt")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


@solution("6_mnist_ddp_pt", 2)
@pytest.mark.slow
def test_6_2_the_cnn_under_ddp_and_lesson_4(tmp_path, dataset):
    run_solution("6_mnist_ddp_pt", 2, tmp_path, line=0)
    run_solution("6_mnist_ddp_pt", 2, tmp_path, line=1)
    a, b = weights(tmp_path / "solutions/6-cnn/model.pt"), weights(tmp_path / "solutions/6-cnn-lesson4/model.pt")
    assert max_rel_diff(a, b) == 0.0
    assert metrics(tmp_path / "solutions/6-cnn")["test_accuracy"] == \
        metrics(tmp_path / "solutions/6-cnn-lesson4")["test_accuracy"]


# ------------------------------------------------------------------------------------------ lesson 7

def scaling(run_dir) -> dict:
    import csv

    with open(Path(run_dir) / "scaling.csv", newline="") as f:
        return {int(r["world_size"]): r for r in csv.DictReader(f)}


@solution("7_mnist_ddp_pt_timing", 1)
@pytest.mark.slow
def test_7_1_a_larger_batch_shrinks_the_share_of_communication(tmp_path, dataset):
    env = {"OMP_NUM_THREADS": None}  # the lesson's own threads per rank, as in a terminal
    run_solution("7_mnist_ddp_pt_timing", 1, tmp_path, line=0, env=env)
    run_solution("7_mnist_ddp_pt_timing", 1, tmp_path, line=1, env=env)
    b64, b1024 = scaling(tmp_path / "solutions/7-b64"), scaling(tmp_path / "solutions/7-b1024")
    assert float(b1024[2]["comm_share"]) < float(b64[2]["comm_share"])


@solution("7_mnist_ddp_pt_timing", 2)
def test_7_2_each_torchrun_call_adds_a_row(tmp_path, dataset):
    run_solution("7_mnist_ddp_pt_timing", 2, tmp_path, line=0)
    run_solution("7_mnist_ddp_pt_timing", 2, tmp_path, line=1)
    rows = scaling(tmp_path / "solutions/7-torchrun")
    assert sorted(rows) == [1, 2] and rows[2]["speedup"]
    assert len((tmp_path / "solutions/7-torchrun/timings.csv").read_text().strip().splitlines()) == 3


# ------------------------------------------------------------------------------------------ lesson 8

@solution("8_mnist_ddp_pt_lr", 1)
@solution("8_mnist_ddp_pt_lr", 2)
@pytest.mark.slow
def test_8_more_ranks_lag_further_without_scaling_and_the_scaled_lr_catches_up(tmp_path, dataset):
    run_solution("8_mnist_ddp_pt_lr", 1, tmp_path, line=0)
    two = metrics(tmp_path / "solutions/8")["deviation"]["mean"]
    run_solution("8_mnist_ddp_pt_lr", 1, tmp_path, line=1)
    four = metrics(tmp_path / "solutions/8")["deviation"]["mean"]
    assert four > two > 0
    run_solution("8_mnist_ddp_pt_lr", 2, tmp_path)  # the same run dir: the same reference
    scaled = metrics(tmp_path / "solutions/8")
    assert scaled["lr"] == pytest.approx(0.04)
    assert abs(scaled["deviation"]["mean"]) < four / 2


# ------------------------------------------------------------------------------------------ lesson 9

def two_agents(name, n, tmp, wait=0.0) -> list:
    """Start the exercise's two torchrun commands (node 0 first, `wait` seconds apart) on a free port."""
    port = str(free_port())
    procs = []
    for line in commands(name, n)[:2]:
        cmd, env = argv(re.sub(r"--master_port=\d+", f"--master_port={port}", line), tmp)
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=environ(env), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
        time.sleep(wait)
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    return outs


@solution("9_torch_dist_multi_node", 1)
def test_9_1_the_first_node_waits_for_the_second(tmp_path):
    first, second = two_agents("9_torch_dist_multi_node", 1, tmp_path, wait=3)
    assert len(re.findall(r"mean = 2\.5", first + second)) == 4
    assert "4 ranks on 2 node(s), launched by torchrun" in first


@solution("9_torch_dist_multi_node", 2)
@pytest.mark.slurm
def test_9_2_on_a_cluster():
    pytest.skip("needs a Slurm allocation; tests/test_day2_slurm.py runs it on the test cluster")


# ------------------------------------------------------------------------------------------ lesson 10

@solution("10_mnist_ddp_pt_multinode", 1)
@pytest.mark.slow
def test_10_1_one_rank_per_node_is_each_nodes_local_rank_0(tmp_path, dataset):
    first, second = two_agents("10_mnist_ddp_pt_multinode", 1, tmp_path)
    assert re.search(r"\[rank 0\] local rank 0 of node 0", first + second)
    assert re.search(r"\[rank 1\] local rank 0 of node 1", first + second)
    m = metrics(tmp_path / "solutions/10")
    assert m["written_by"][0] == 0 and m["nodes"] == 2


@solution("10_mnist_ddp_pt_multinode", 2)
@pytest.mark.gpu
@pytest.mark.slurm
def test_10_2_nccl_between_nodes():
    pytest.skip("needs a cluster with GPUs (solutions/10_mnist_ddp_pt_multinode.md says so)")


# ------------------------------------------------------------------------------------------ lesson 11

def h5_file(tmp):
    """The file written by the commands at the top of solutions/11_...md (made once per test)."""
    text = (SOLUTIONS / "11_mnist_ddp_pt_multinode_streaming.md").read_text()
    line = re.search(r"```bash\n(python data_tools/create_mnist_h5.py [^\n]*)\n```", text).group(1)
    cmd, env = argv(line, tmp)
    run(cmd, env=env)


def epoch0(run_dir):
    return metrics(run_dir)["per_epoch"][0]


@solution("11_mnist_ddp_pt_multinode_streaming", 2)
@pytest.mark.slow
def test_11_2_chunks_of_100(tmp_path, dataset):
    run_solution("11_mnist_ddp_pt_multinode_streaming", 2, tmp_path, line=0)
    run_solution("11_mnist_ddp_pt_multinode_streaming", 2, tmp_path, line=1)
    e = epoch0(tmp_path / "solutions/11/chunk100")
    assert e["seen_once"] == 12800 and sorted(e["chunks_per_rank"]) == [64, 64]


@solution("11_mnist_ddp_pt_multinode_streaming", 1)
@solution("11_mnist_ddp_pt_multinode_streaming", 3)
@pytest.mark.slow
def test_11_workers_read_each_sample_once_and_memory_trains_the_same(tmp_path, dataset):
    h5_file(tmp_path)
    run_solution("11_mnist_ddp_pt_multinode_streaming", 1, tmp_path)
    e = epoch0(tmp_path / "solutions/11/workers")
    assert (e["seen_once"], e["seen_more"], e["seen_never"]) == (12800, 0, 0)
    run_solution("11_mnist_ddp_pt_multinode_streaming", 3, tmp_path, line=0)
    run_solution("11_mnist_ddp_pt_multinode_streaming", 3, tmp_path, line=1)
    h5, memory = tmp_path / "solutions/11/h5", tmp_path / "solutions/11/memory"
    assert metrics(h5)["loss_per_step"] == metrics(memory)["loss_per_step"]
    assert max_rel_diff(weights(h5 / "model.pt"), weights(memory / "model.pt")) == 0.0


# ------------------------------------------------------------------------------------------ lesson 12

def stop_one_rank(cmd, env, sig, after=r"\] step 50 ") -> tuple:
    """Run a lesson-12 command, send `sig` to rank 1 once a line matches `after`; (exit code, output)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=environ(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    pids, lines, sent = {}, [], False
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        lines.append(line)
        if m := re.search(r"\[rank (\d+)\] pid (\d+)", line):
            pids[int(m.group(1))] = int(m.group(2))
        if not sent and re.search(after, line) and 1 in pids:
            import os

            os.kill(pids[1], sig)
            sent = True
        if time.monotonic() > deadline:
            proc.kill()
            break
    return proc.wait(timeout=60), "".join(lines), sent


@solution("12_ddp_fault_tolerance", 1)
@pytest.mark.slow
def test_12_1_stopped_by_a_signal_then_resumed(tmp_path, dataset):
    cmd, env = argv(commands("12_ddp_fault_tolerance", 1)[0], tmp_path)
    code, out, sent = stop_one_rank(cmd, {**env, "OMP_NUM_THREADS": "1"}, signal.SIGUSR1)
    assert sent and code == 0, out
    assert list((tmp_path / "solutions/12/checkpoints").glob("step-*.pt")), out
    out = run(cmd, env=env).stdout
    assert re.search(r"100 steps, 1 stop\(s\), resumed at steps \[\d+", out), out


@solution("12_ddp_fault_tolerance", 2)
@pytest.mark.slow
def test_12_2_a_killed_rank_is_restarted(tmp_path, dataset):
    cmd, env = argv(commands("12_ddp_fault_tolerance", 2)[0], tmp_path)
    code, out, sent = stop_one_rank(cmd, env, signal.SIGKILL)
    assert sent and code == 0, out
    assert metrics(tmp_path / "solutions/12-restart")["steps"] == 100, out


# ------------------------------------------------------------------------------------------ create_mnist_h5

@solution("create_mnist_h5", 1)
@pytest.mark.slow
def test_h5_1_gzip_makes_a_smaller_file(tmp_path, dataset):
    run_solution("create_mnist_h5", 1, tmp_path, line=0)
    run_solution("create_mnist_h5", 1, tmp_path, line=1)
    plain, gz = (tmp_path / "solutions/h5/plain.h5").stat().st_size, (tmp_path / "solutions/h5/gzip.h5").stat().st_size
    assert gz < 0.7 * plain  # 57 % measured


@solution("create_mnist_h5", 2)
def test_h5_2_chunks_of_100(tmp_path, dataset):
    import h5py

    run_solution("create_mnist_h5", 2, tmp_path)
    with h5py.File(tmp_path / "solutions/h5/chunk100.h5", "r") as f:
        images = f["train/images"]
        assert images.chunks == (100, 28, 28) and -(-images.shape[0] // 100) == 600


# ------------------------------------------------------------------------------------------ lesson 13

@solution("13_mixed_precision", 1)
@pytest.mark.slow
def test_13_1_clipping_before_unscaling_sees_scaled_gradients(tmp_path, dataset):
    wrong, right = commands("13_mixed_precision", 1)
    source = (REPO / "day3/13_mixed_precision.py").read_text()
    unscale = "            scaler.unscale_(optimizer)"
    lines = source.splitlines(keepends=True)
    i = next(n for n, l in enumerate(lines) if l.startswith(unscale))
    assert "clip_grad_norm_" in lines[i + 1]
    lines[i], lines[i + 1] = lines[i + 1], lines[i]
    copy = tmp_path / "day3" / "13_clip_before_unscale.py"
    copy.parent.mkdir()
    copy.write_text("".join(lines))
    cmd, env = argv(wrong.replace("day3/13_clip_before_unscale.py", str(copy)), tmp_path)
    run(cmd, env={**env, "PYTHONPATH": str(REPO)})
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
    sync = "with model.no_sync() if i < k - 1 else contextlib.nullcontext():"
    assert source.count(sync) == 1
    copy = tmp_path / "day3" / "14_without_no_sync.py"
    copy.parent.mkdir()
    copy.write_text(source.replace(sync, "with contextlib.nullcontext():"))
    cmd, env = argv(without.replace("day3/14_without_no_sync.py", str(copy)), tmp_path)
    out = run(cmd, env={**env, "PYTHONPATH": str(REPO)}).stdout
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
    sgd = "    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)\n"
    source = (REPO / "day3/15_fsdp2.py").read_text()
    assert source.count(sgd) == 1 and sgd.strip() in sections("15_fsdp2")[3]
    copy = tmp_path / "day3" / "15_fsdp2_adamw.py"
    copy.parent.mkdir()
    copy.write_text(source.replace(sgd, "    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"))
    (line,) = commands("15_fsdp2", 3)
    cmd, env = argv(line.replace("day3/15_fsdp2_adamw.py", str(copy)), tmp_path)
    out = run(cmd, env={**env, "PYTHONPATH": str(REPO)}).stdout
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
    start = time.perf_counter()
    proc = run_solution("17_debugging_hangs", 1, tmp_path, check=False, timeout=120)
    assert proc.returncode != 0 and time.perf_counter() - start < 5 + 3 + 30, proc.stderr
    assert re.search(r"rank 0 waited [\d.]+ s in barrier #(\d+) .*; rank 1 last entered all_reduce #\1 "
                     r"\(shape \[101770\]", proc.stderr), proc.stderr


@solution("17_debugging_hangs", 2)
@pytest.mark.slow
def test_17_2_sigusr1_prints_every_ranks_stack(tmp_path, dataset):
    cmd, env = argv(commands("17_debugging_hangs", 2)[0], tmp_path)
    run_dir = tmp_path / "solutions" / "17-stacks"
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=environ(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "checkpoint.pt").exists():  # written just before rank 0's barrier
            assert time.monotonic() < deadline and proc.poll() is None, "the run never reached its checkpoint"
            time.sleep(0.2)
        time.sleep(2)  # both ranks now wait: rank 0 in the barrier, rank 1 in backward's all_reduce
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        # py-spy on every process under the launcher (the fork server and the two ranks)
        import psutil

        spy = REPO / ".venv" / "bin" / "py-spy" if (REPO / ".venv" / "bin" / "py-spy").exists() else "py-spy"
        dumps = [subprocess.run([str(spy), "dump", "--pid", str(child.pid)], capture_output=True, text=True,
                                timeout=60) for child in psutil.Process(proc.pid).children(recursive=True)]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert err.count("(most recent call first)") >= 2, err
    assert re.search(r'line \d+ in barrier', err) and re.search(r'line \d+ in backward', err), err
    spied = "".join(d.stdout + d.stderr for d in dumps)
    if "Permission denied" in spied or "ptrace" in spied.lower():
        pytest.skip(f"py-spy cannot attach here (no ptrace rights): {spied.strip()[:200]}")
    assert re.search(r"barrier \(.*distributed_c10d.py:\d+\)", spied) and "backward" in spied, spied


@solution("17_debugging_hangs", 3)
def test_17_3_detail_names_both_shapes(tmp_path):
    out = run_solution("17_debugging_hangs", 3, tmp_path, check=False, timeout=60).stdout
    assert "TensorShape=[4]" in out and "TensorShape=[5]" in out and out.count("Detected mismatch") == 2, out
