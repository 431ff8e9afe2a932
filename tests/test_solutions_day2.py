"""The solutions of lessons 9-12's and create_mnist_h5's exercises do what they say (tests/test_solutions.py: how).
"""
import re
import shlex
import signal
import subprocess
import time

import pytest

from conftest import REPO, environ, max_rel_diff, run
from course.launching.ports import free_port
from solutions_check import (SOLUTIONS, argv, commands, edit_source, metrics, run_solution, sections, solution,
                             weights)

pytestmark = pytest.mark.slow  # the exercises' checks: the full suite (the quick tier proves each lesson's own claim)


# ------------------------------------------------------------------------------------------ lesson 9

def two_agents(name, n, tmp, wait=0.0) -> list:
    """Start the exercise's two torchrun commands (node 0 first, `wait` seconds apart) on a free port."""
    port = str(free_port())
    procs = []
    for line in commands(name, n)[:2]:
        line = edit_source(line, r"--master_port=\d+", f"--master_port={port}", f"solutions/{name}.md, {n}")
        cmd, env = argv(line, tmp)
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
def test_9_2_on_a_cluster(slurm_cluster):
    """The exercise's two commands as written (the script's path made absolute: Slurm's files go to the
    cluster's directory), on the test's two-node Slurm: what the solution says they print."""
    allocate, launch = commands("9_torch_dist_multi_node", 2)
    script, *args = shlex.split(launch)
    ran = slurm_cluster.run([*shlex.split(allocate), str(REPO / script), *args], timeout=300)
    out = ran.stdout + ran.stderr
    assert ran.returncode == 0, out
    ranks = re.findall(r"^\[rank (\d+)\] local rank (\d+) on node (\d+) \((\S+)\)", out, flags=re.M)
    assert sorted(rank for rank, *_ in ranks) == ["0", "1", "2", "3"], out
    assert len({host for *_, host in ranks}) == 2 and sorted({local for _, local, *_ in ranks}) == ["0", "1"], out
    assert out.count("all_reduce(SUM) = 10, mean = 2.5") == 4, out
    assert ("4 ranks on 2 host names, local ranks 0-1 on each node, and `all_reduce(SUM) = 10, mean = 2.5` on "
            "every rank") in sections("9_torch_dist_multi_node")[2]


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
