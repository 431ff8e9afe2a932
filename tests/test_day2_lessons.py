"""Day 2 lessons on this machine, without Slurm: how they refuse to start, lesson 9 across two local
"nodes" (two torchrun agents), lesson 11 from the HDF5 file against the same chunks from memory.

The runs on the real two-node Slurm are in test_day2_slurm.py.
"""
import json
import os
import re
import subprocess

import pytest
import torch

import reference_runs
from conftest import PYTHON, REPO, lesson, metrics
from course.launching.ports import free_port
from course.training.output import load_weights


LESSONS = {9: "day2/9_torch_dist_multi_node.py", 10: "day2/10_mnist_ddp_pt_multinode.py",
           11: "day2/11_mnist_ddp_pt_multinode_streaming.py"}
SCRIPT = REPO / "day2/multinode_setup_and_run.sh"
LESSON10 = reference_runs.LESSON10  # the arguments of the reference runs "10: ..."
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def clean_env(**extra):
    """This machine's environment without any launcher's variables (the tests may run inside a job)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in LAUNCHER_VARS}
    return {**env, **{k: str(v) for k, v in extra.items()}}


def bare(cmd, cwd=REPO, timeout=120, **env):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=clean_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def test_a_lesson_started_outside_any_launcher_says_how_to_launch_it(tmp_path):
    """End to end, in a fresh interpreter, the exit code the shell sees: the one such refusal of a lesson that no
    launcher started.  Lessons 9 and 11 the same way, and lesson 9 in a Slurm job's shell outside any step,
    in this process: tests/test_every_input.py."""
    ran = bare([PYTHON, REPO / LESSONS[10], "--run-dir", tmp_path / "run"])
    assert ran.returncode == 1, ran.stdout + ran.stderr
    name = os.path.basename(LESSONS[10])
    for how in ("does not start its own processes", "salloc --nodes 2 --ntasks-per-node=2",
                f"./day2/multinode_setup_and_run.sh {name}",
                f"torchrun --standalone --nproc_per_node=2 {LESSONS[10]}"):
        assert how in ran.stderr, ran.stderr
    assert "Traceback" not in ran.stderr and ran.stderr.strip().count("\n") == 0, ran.stderr  # one line
    assert not (tmp_path / "run").exists()  # nothing written, not even an empty run dir


def test_the_script_outside_an_allocation_says_how_to_get_one(tmp_path):
    ran = bare([SCRIPT, "10_mnist_ddp_pt_multinode.py", "--quick"], cwd=tmp_path)  # from any directory
    assert ran.returncode == 1
    assert "not inside a Slurm allocation" in ran.stderr
    assert "salloc --nodes 2 --ntasks-per-node=2" in ran.stderr  # day 2's allocation (docs/lessons.toml)
    assert f"sbatch --nodes 2 --ntasks-per-node=2 --time=00:30:00 {SCRIPT} 10_mnist_ddp_pt_multinode.py --quick" \
        in ran.stderr


@pytest.mark.parametrize("args, message", [
    (["--launcher", "mpirun", "9_torch_dist_multi_node.py"], "--launcher must be srun or torchrun"),
    (["12_no_such_lesson.py"], "no lesson '12_no_such_lesson.py'"),
    ([], "usage:"),
])
def test_the_script_refuses_bad_arguments(tmp_path, args, message):
    ran = bare([SCRIPT, *args], cwd=tmp_path, SLURM_JOB_ID=4242)
    assert ran.returncode == 2 and message in ran.stderr, ran.stderr


@pytest.mark.slow
@pytest.mark.quick("9")
def test_lesson9_on_two_local_nodes_as_two_torchrun_agents():
    """The notebook's way to show two nodes on one machine: two agents, static rendezvous on 127.0.0.1."""
    port = free_port()
    agents = [subprocess.Popen([PYTHON, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                                "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
                                REPO / LESSONS[9]], cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = []
    for agent in agents:
        out, _ = agent.communicate(timeout=180)
        outputs.append(out)
        assert agent.returncode == 0, out
    joined = "\n".join(outputs)
    assert "[rank 0] local rank 0 on node 0" in joined and "[rank 1] local rank 0 on node 1" in joined
    assert joined.count("all_reduce(SUM) = 3, mean = 1.5") == 2
    assert "2 ranks on 2 node(s), launched by torchrun" in joined


@pytest.mark.slow
@pytest.mark.quick("10")
def test_lesson10_on_two_local_nodes_ends_with_the_weights_of_one_node(catalogue, tmp_path):
    """Two torchrun agents on this machine as two nodes of one rank each: global rank 1 is local rank 0 of
    node 1, global rank 0 alone writes, and DDP across the "nodes" ends where 2 ranks on one node end (gloo
    sums in rank order: measured equal).  The same on the real two-node Slurm: tests/test_day2_slurm.py."""
    port, run_dir = free_port(), tmp_path / "two-nodes"
    agents = [subprocess.Popen([PYTHON, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                                "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
                                REPO / LESSONS[10], *LESSON10, "--run-dir", run_dir], cwd=REPO, env=clean_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    try:
        outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    finally:
        for agent in agents:  # one agent failed or hung: the other and its rank go too
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)
    joined = "\n".join(outputs)
    assert re.search(r"^\[rank 1\] local rank 0 of node 1 \(", joined, re.M), joined
    one = catalogue("10: 2 ranks, torchrun").run_dir
    two, single = metrics(run_dir), metrics(one)
    assert two["world_size"] == single["world_size"] == 2 and two["steps"] == single["steps"] == 25
    assert two["written_by"][0] == 0  # global rank 0, not one writer per node
    a, b = load_weights(run_dir / "model.pt"), load_weights(one / "model.pt")
    worst = max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)
    assert worst <= 1e-6, f"max relative weight difference {worst:.3g}"
    assert two["loss_per_step"] == pytest.approx(single["loss_per_step"], rel=1e-6)


def one_rank(*args, **env):
    """A lesson as rank 0 of a world of 1, as torchrun would start it (no agent: fast error-path tests)."""
    return bare([PYTHON, *args], RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, GROUP_RANK=0, MASTER_ADDR="127.0.0.1",
                MASTER_PORT=free_port(), **env)


def test_lesson11_without_the_file_names_the_command_that_creates_it(dataset, tmp_path):
    """End to end, in a fresh interpreter, the exit code the shell sees: the one such refusal of a lesson given
    torchrun's variables."""
    missing = tmp_path / "nowhere.h5"
    ran = one_rank(REPO / LESSONS[11], "--h5-file", missing, "--run-dir", tmp_path / "run")
    assert ran.returncode == 1, ran.stderr
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert lines == [f"python {LESSONS[11]}: error: {missing} does not exist; create it with: "
                     f"python data_tools/create_mnist_h5.py --dataset {dataset} --output {missing}"]


def test_lesson11_refuses_a_file_of_another_dataset(lesson_main, monkeypatch, mnist_h5, tmp_path):
    """In this process, as one_rank would start it: the file is read before the rank starts."""
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    ran = lesson_main(LESSONS[11], "--dataset", "mnist", "--h5-file", mnist_h5.path, "--run-dir", tmp_path / "run",
                      env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "GROUP_RANK": "0",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    assert ran.returncode == 1 and ran.stderr.strip().count("\n") == 0, ran.stderr
    assert f"holds {mnist_h5.dataset}, not mnist; pass --dataset {mnist_h5.dataset}" in ran.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.quick("11")
def test_lesson11_from_hdf5_equals_from_memory_given_the_same_order(mnist_h5, tmp_path):
    """2 ranks, 6500 samples in chunks of 700 (9 x 700 + 200): 5 chunks each, but 3500 vs 3000 samples, so
    55 vs 47 steps per epoch: the uneven case join() handles.  Two epochs, so the momentum fix matters."""
    common = ["--h5-file", mnist_h5.path, "--train-samples", "6500", "--epochs", "2", "--seed", "7",
              "--save-order"]
    runs, printed = {}, {}
    for source, workers in (("h5", "1"), ("memory", "0")):
        runs[source] = tmp_path / source
        printed[source] = lesson(LESSONS[11], *common, "--source", source, "--workers", workers, "--run-dir",
                                 runs[source], launcher="torchrun", nproc=2, timeout=300).stdout
    for source, run_dir in runs.items():
        # every rank took part in all 110 steps, and says how many were on its own batches (the rest it
        # shadowed under join()): its steps per epoch, summed
        own = {int(r): int(n) for r, n in re.findall(r"^\[rank (\d)\] 110 steps \((\d+) on its own batches\)",
                                                     printed[source], re.M)}
        per_epoch = metrics(run_dir)["per_epoch"]
        assert own == {r: sum(e["steps_per_rank"][r] for e in per_epoch) for r in (0, 1)}, printed[source]
    for source, run_dir in runs.items():
        m = metrics(run_dir)
        assert m["source"] == source and m["world_size"] == 2 and m["epochs"] == 2
        for epoch in m["per_epoch"]:  # counted by the lesson itself, across ranks
            assert (epoch["seen_once"], epoch["seen_never"], epoch["seen_more"]) == (6500, 0, 0)
            assert sorted(epoch["steps_per_rank"]) == [47, 55]
        assert m["replicas_identical"] is True  # weights and momentum equal on both ranks after join()
        assert m["steps"] == 110
    orders = {s: json.loads((d / "order.json").read_text())["epochs"] for s, d in runs.items()}
    assert orders["h5"] == orders["memory"]  # the same order...
    for epoch in orders["h5"]:
        assert sorted(i for rank in epoch for i in rank) == list(range(6500))  # each sample once, by index
    assert orders["h5"][0] != orders["h5"][1]
    h5, memory = load_weights(runs["h5"] / "model.pt"), load_weights(runs["memory"] / "model.pt")
    assert h5.keys() == memory.keys()
    for name in h5:  # ...gives the same weights, bit for bit: the file changes where bytes come from, nothing else
        assert torch.equal(h5[name], memory[name]), name
