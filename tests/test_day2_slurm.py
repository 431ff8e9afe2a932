"""Day 2 on a real two-node Slurm cluster (tests/slurm_cluster.py): lessons 9, 10 and 11 started by
day2/multinode_setup_and_run.sh inside salloc and sbatch allocations, with plain srun and with srun+torchrun.

Every command here is one a user types (see docs/learners/multinode.md), run from the cluster's work
directory, not the repository: the script must find its lessons and the repository's Python by itself.
"""
import json
import os
import re
import shlex
import sys
import time

import pytest
import torch

import reference_runs
from conftest import REPO, metrics
from course.launching.environment import ONE_TASK_SHELL
from course.training.output import load_weights

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPT = REPO / "day2" / "multinode_setup_and_run.sh"
RANK_LINE = re.compile(r"\[rank (\d+)\] local rank (\d+) on node (\d+) \((\S+)\) of world size (\d+), "
                       r"(srun|torchrun), cpu: my value is (\d+)")
TWO_BY_TWO = ["--nodes=2", "--ntasks-per-node=2"]


def salloc(cluster, *args, timeout=300):
    ran = cluster.run(["salloc", *TWO_BY_TWO, str(SCRIPT), *map(str, args)], cwd=cluster.workdir, timeout=timeout)
    assert ran.returncode == 0, f"--- stdout\n{ran.stdout}\n--- stderr\n{ran.stderr}"
    return ran.stdout + ran.stderr


def check_lesson9(output, launcher):
    ranks = sorted(m.groups() for m in RANK_LINE.finditer(output))
    # global rank, local rank, node index, hostname, world size, launcher, the rank's value
    assert ranks == [("0", "0", "0", "node1", "4", launcher, "1"), ("1", "1", "0", "node1", "4", launcher, "2"),
                     ("2", "0", "1", "node2", "4", launcher, "3"), ("3", "1", "1", "node2", "4", launcher, "4")], \
        output
    assert output.count("all_reduce(SUM) = 10, mean = 2.5") == 4
    job, port = re.search(r"multinode: job (\d+), 2 node\(s\) \(node\[1-2\]\), launcher (?:\w+), "
                          r"rank 0 at node1:(\d+)", output).groups()
    assert int(port) == 10_000 + int(job) % 20_000  # derived from the job id (free here: nothing else runs)
    if launcher == "srun":  # torchrun's agents pick the workers' port themselves after their rendezvous
        assert f"rank 0 listened on node1:{port}" in output
    assert "  node 0 (node1): ranks 0(local 0) 1(local 1)" in output
    assert "  node 1 (node2): ranks 2(local 0) 3(local 1)" in output


# Lesson 9 runs with a site profile (--site, a path; tests/slurm_fixture.py): its site_setup runs once, in the
# allocation, and every rank on both nodes sees what it exported, with either launcher.
@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_lesson9_under_salloc(slurm_cluster, site_probe, launcher):
    output = salloc(slurm_cluster, "--site", site_probe.path, "--launcher", launcher, "9_torch_dist_multi_node.py")
    check_lesson9(output, launcher)
    site_probe.check(output)
    assert f"multinode: site profile {site_probe.path}: site_setup done (site probe)" in output


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_lesson9_under_sbatch(slurm_cluster, site_probe, launcher):
    # sbatch runs a copy of the script from Slurm's spool directory: it must still find day2/ and the venv.
    # The profile as an option of the script, or (torchrun) from COURSE_SITE in the submitting shell's
    # environment, as after `export COURSE_SITE=...`
    if launcher == "srun":
        site_option, site_args = [], ("--site", str(site_probe.path))
    else:
        site_option, site_args = [f"--export=ALL,COURSE_SITE={site_probe.path}"], ()
    job, code, output = slurm_cluster.sbatch_wait(
        SCRIPT, *TWO_BY_TWO, *site_option,
        script_args=(*site_args, "--launcher", launcher, "9_torch_dist_multi_node.py"), timeout=300)
    assert code == 0, output
    check_lesson9(output, launcher)
    site_probe.check(output)


def test_rank0s_address_comes_from_the_profile_or_your_export_and_is_checked_on_the_first_node(slurm_cluster,
                                                                                             tmp_path):
    """A profile's SITE_MASTER_ADDR='{host}i' (JSC's InfiniBand names; the test nodes answer to node1i too) is
    where the ranks meet, an exported MASTER_ADDR (node1's IP, under torchrun) is kept, and one that is not the
    first node's (node2), or a loopback one, is one line before any rank (before: the script overwrote
    MASTER_ADDR with the first node's name, whatever the site needed)."""
    profile = tmp_path / "ib.env"
    profile.write_text(f"SITE_MASTER_ADDR='{{host}}i'\nsite_setup() {{\n    export PYTHON={sys.executable}\n}}\n")
    output = salloc(slurm_cluster, "--site", profile, "9_torch_dist_multi_node.py")
    assert re.search(r"launcher srun, rank 0 at node1i:(\d+) \(SITE_MASTER_ADDR=\{host\}i\)\n", output), output
    assert re.search(r"^4 ranks on 2 node\(s\), launched by srun; rank 0 listened on node1i:\d+;", output,
                     flags=re.M), output
    # torchrun's agents meet at node1i, an address that node1's own name does not resolve to: the agent on the
    # first node must host the rendezvous all the same (torchrun would guess from the names: no agent would)
    output = salloc(slurm_cluster, "--site", profile, "--launcher", "torchrun", "9_torch_dist_multi_node.py")
    assert "launcher torchrun, rank 0 at node1i:" in output, output
    assert output.count("all_reduce(SUM) = 10, mean = 2.5") == 4, output
    ip = slurm_cluster.node_ip["node1"]
    ran = slurm_cluster.run(["env", f"MASTER_ADDR={ip}", "salloc", *TWO_BY_TWO, str(SCRIPT), "--launcher",
                             "torchrun", "9_torch_dist_multi_node.py"], timeout=300)
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0 and f"launcher torchrun, rank 0 at {ip}:" in output, output
    assert output.count("all_reduce(SUM) = 10, mean = 2.5") == 4, output
    for addr, said in [("node2", "is not an address of node1, the job's first node, where rank 0 listens"),
                       ("localhost", "is 127.0.0.1: on each of the 2 nodes that node itself, where no rank 0 "
                                     "listens")]:
        ran = slurm_cluster.run(["env", f"MASTER_ADDR={addr}", "salloc", *TWO_BY_TWO, str(SCRIPT),
                                 "9_torch_dist_multi_node.py"], timeout=120)
        errors = [line for line in ran.stderr.splitlines() if line.startswith("error: ")]
        assert ran.returncode == 1 and len(errors) == 1, ran.stdout + ran.stderr
        assert errors[0].startswith(f"error: MASTER_ADDR={addr} (exported) {said}") and errors[0].endswith(
            "; unset MASTER_ADDR, or give a name of node1 that every node reaches (SITE_MASTER_ADDR in the site "
            "profile, e.g. {host}i). No rank was started."), errors[0]
        assert "[rank" not in ran.stdout + ran.stderr


HOLD_PORT = """
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("", int(sys.argv[1])))
s.listen()
open(sys.argv[2], "w").close()
time.sleep(300)
"""


def test_the_script_moves_on_when_the_derived_port_is_taken(slurm_cluster):
    """Another job's rank 0 already listens on our derived port on node1: the script must not pick it."""
    work = slurm_cluster.workdir
    (work / "hold.py").write_text(HOLD_PORT)
    # a lesson given as a path relative to the current directory, not a name in day2/
    (work / "probe.py").write_text('import os\nprint("probe", os.environ["SLURM_PROCID"], os.environ["MASTER_ADDR"], '
                                   'os.environ["MASTER_PORT"], flush=True)\n')
    inside = f"""
        port=$((10000 + SLURM_JOB_ID % 20000))
        srun --overlap --nodes=1 --ntasks=1 --nodelist=node1 {sys.executable} hold.py $port listening &
        holder=$!
        for i in $(seq 100); do [[ -e listening ]] && break; sleep 0.2; done
        echo "derived port $port"
        {SCRIPT} probe.py && rc=0 || rc=$?
        kill $holder
        exit $rc
    """
    ran = slurm_cluster.run(["salloc", *TWO_BY_TWO, "bash", "-c", inside], cwd=work, timeout=120)
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0, output
    derived = int(re.search(r"derived port (\d+)", output).group(1))
    chosen = int(re.search(r"rank 0 at node1:(\d+)", output).group(1))
    assert f"port {derived} is in use on node1" in output
    assert not 10_000 <= chosen < 30_000  # the kernel's pick: never another job's derived port
    probes = sorted(line.split()[1:] for line in output.splitlines() if line.startswith("probe "))
    assert probes == [[str(r), "node1", str(chosen)] for r in range(4)]  # every rank got the same address


def test_lesson10_on_two_nodes_ends_with_the_weights_of_one_node(slurm_cluster, catalogue):
    args = list(reference_runs.LESSON10)  # as the reference run "10: 4 ranks, torchrun"
    two_nodes = slurm_cluster.workdir / "lesson10"
    output = salloc(slurm_cluster, "10_mnist_ddp_pt_multinode.py", *args, "--run-dir", two_nodes)
    one_node = catalogue("10: 4 ranks, torchrun").run_dir

    two, one = metrics(two_nodes), metrics(one_node)
    assert (two["world_size"], two["nodes"], two["launcher"]) == (4, 2, "srun")
    assert (one["world_size"], one["nodes"], one["launcher"]) == (4, 1, "torchrun")
    assert [(p["host"], p["local_rank"]) for p in two["placement"]] == [
        ("node1", 0), ("node1", 1), ("node2", 0), ("node2", 1)]
    assert two["written_by"] == [0, "node1"]  # global rank 0, not one writer per node
    assert sorted(os.listdir(two_nodes)) == ["loss.png", "metrics.json", "model.pt"]
    assert "[rank 0] local rank 0 of node 0 (node1), which runs global ranks [0, 1]" in output
    assert "[rank 2] local rank 0 of node 1 (node2), which runs global ranks [2, 3]" in output
    assert two["steps"] == one["steps"] == 25

    a, b = load_weights(two_nodes / "model.pt"), load_weights(one_node / "model.pt")
    worst = max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)
    print(f"lesson 10, 2 nodes vs 1 node: max relative weight difference {worst:.3g}")  # shown with -s
    assert worst <= 1e-6, f"max relative difference {worst:.3g}"  # measured: 0 (gloo sums in rank order)
    assert two["loss_per_step"] == pytest.approx(one["loss_per_step"], rel=1e-6)


def test_lesson11_streams_every_sample_once_on_two_nodes(slurm_cluster, mnist_h5):
    run_dir = slurm_cluster.workdir / "lesson11"
    # 6500 samples in chunks of 700: 10 chunks for 4 ranks, 3/3/2/2 of them, one only 200 samples: uneven
    output = salloc(slurm_cluster, "--launcher", "torchrun", "11_mnist_ddp_pt_multinode_streaming.py",
                    "--h5-file", mnist_h5.path, "--train-samples", "6500", "--epochs", "2", "--workers", "1",
                    "--save-order", "--run-dir", run_dir)
    m = metrics(run_dir)
    assert (m["world_size"], m["nodes"], m["launcher"], m["source"]) == (4, 2, "torchrun", "h5")
    assert [p["host"] for p in m["placement"]] == ["node1", "node1", "node2", "node2"]
    for epoch in m["per_epoch"]:
        assert (epoch["seen_once"], epoch["seen_never"], epoch["seen_more"]) == (6500, 0, 0)
        assert epoch["chunks_per_rank"] == [3, 3, 2, 2] and len(set(epoch["steps_per_rank"])) > 1
    assert m["replicas_identical"] is True
    for epoch in json.loads((run_dir / "order.json").read_text())["epochs"]:
        assert sorted(i for rank in epoch for i in rank) == list(range(6500))
    assert "each seen exactly once" in output
    assert torch.isfinite(torch.tensor(m["loss_per_step"])).all()


# ------------------------------------------------------------------ launch and device choice under Slurm

# Which GPU course/launching/devices.py gives a rank, under the GPU variables the real Slurm sets for it.  The test
# cluster's GPUs are character devices Slurm hands out like GPUs: CUDA would find none, so the probe gives
# course/launching/devices.py a torch whose CUDA sees what CUDA_VISIBLE_DEVICES lists, as the real one would on a GPU
# node (and costs no torch import per task), and prints which of the node's GPUs the rank took.  One write
# per line: the ranks of a node share the output pipe.
GPU_PROBE = """
import os, socket, sys, types
sys.path.insert(0, {repo!r})
visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
torch = sys.modules["torch"] = types.ModuleType("torch")
torch.cuda = types.SimpleNamespace(is_available=lambda: bool(visible), device_count=lambda: len(visible),
                                   set_device=lambda index: None)
torch.device = lambda kind, index=None: types.SimpleNamespace(type=kind, index=index)
from course.launching.cli import CourseError
from course.launching.devices import setup_device
rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
where = f"gpu probe {{sys.argv[1]}}: rank {{rank}} on {{socket.gethostname()}}"
try:
    line = f"{{where}} takes GPU {{visible[setup_device('cuda', local_rank).index]}} of {{','.join(visible)}}"
    code = 0
except CourseError as e:
    line, code = f"{{where}} error: {{e}}", 1
os.write(1, (line + "\\n").encode())
sys.exit(code)
"""
DCP = ["--train-samples", "640", "--seed", "5", "--loader", "memory", "--width", "32", "--depth", "2", "--heads",
       "2", "--checkpoint-every", "3"]
RUNNING_LESSONS = REPO / "docs" / "learners" / "running-lessons.md"
ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # a terminal's: bash's bracketed-paste switches


def documented(start: str) -> str:
    """The one command line of docs/learners/running-lessons.md that starts with `start` (its comment dropped)."""
    found = [line.split("  #")[0].strip() for line in RUNNING_LESSONS.read_text().splitlines()
             if line.startswith(start)]
    assert len(found) == 1, (start, found)
    return found[0]


def docs_interactive_shell(salloc_start: str = "salloc --nodes 1 "):
    """The JupyterLab route of docs/learners/running-lessons.md as typed there: its salloc line (the test nodes
    have 2 GPUs where the docs ask for 4) running its shell command on the compute node in a terminal (`script`
    gives srun --pty one): the list to run, with the shell's input (the lines typed there) to give it."""
    salloc = [word.replace("--gpus-per-node=4", "--gpus-per-node=2") for word in shlex.split(documented(salloc_start))]
    shell = documented("srun --ntasks=1 ")
    assert shell == ONE_TASK_SHELL  # the command the lessons' one line gives (course/launching/environment.py)
    return in_a_terminal(salloc, shell)


def in_a_terminal(salloc: list, shell: str) -> list:
    """`salloc ... script ... SHELL`: salloc's command runs SHELL in a terminal (srun --pty needs one)."""
    return [*salloc, "script", "--quiet", "--return", "--command", shell, "/dev/null"]


def typed(output: str) -> str:
    """What a terminal showed, as plain lines."""
    return ESCAPES.sub("", output.replace("\r\n", "\n"))


@pytest.fixture(scope="module")
def launched(slurm_cluster, dataset):
    """What each case printed and its exit code: {case: (code, output)}.  One Slurm job per case, one after
    another (a few seconds each, lesson 16's two runs about a minute on 2 cores)."""
    work = slurm_cluster.workdir / "launch-cases"
    work.mkdir()
    (work / "probe.py").write_text(GPU_PROBE.format(repo=str(REPO)))
    python, probe = sys.executable, str(work / "probe.py")
    lesson0, lesson16 = str(REPO / "day1" / "0_torch_dist.py"), str(REPO / "day3" / "16_distributed_checkpoint.py")
    dcp = " ".join([*DCP, "--checkpoint-dir", str(work / "dcp" / "checkpoints")])
    one_task_step = (f"{python} {lesson0} --nproc 2 && "
                     f"{python} {lesson16} {dcp} --nproc 4 --batch-size 16 --max-steps 3 --run-dir {work}/dcp/w4 && "
                     f"{python} {lesson16} {dcp} --nproc 2 --batch-size 32 --max-steps 6 --resume "
                     f"--run-dir {work}/dcp/r2\nexit $?\n")  # typed into the shell: the exit code is the chain's
    cases = {
        "per-task": ["srun", "-N1", "-n2", "--gpus-per-task=1", python, probe, "per-task"],
        "map_gpu": ["srun", "-N1", "-n2", "--gres=gpu:2", "--gpu-bind=map_gpu:1,0", python, probe, "map_gpu"],
        "shared": ["srun", "-N1", "-n2", "--gres=gpu:2", python, probe, "shared"],
        "too-many": ["srun", "-N1", "-n3", "--gres=gpu:2", python, probe, "too-many"],
        # day 2's script in an allocation with a GPU per task: srun's tasks keep theirs, torchrun's agent
        # gets the GPUs of all its ranks
        "multinode": ["salloc", *TWO_BY_TWO, "--gpus-per-task=1", "bash", "-c",
                      f"{SCRIPT} {probe} multinode-srun && {SCRIPT} --launcher torchrun {probe} multinode-torchrun"],
        # the docs' shell on a compute node (JupyterLab's route), in their allocation of 4 tasks: the lesson
        # starts --nproc ranks
        "one-task step": (docs_interactive_shell(), one_task_step),
        "two-task step": ["salloc", "-N1", "-n2", "srun", "-n2", python, lesson0, "--nproc", "3"],
    }
    done = {}
    for name, case in cases.items():
        cmd, typed_in = case if isinstance(case, tuple) else (case, None)
        start = time.monotonic()
        ran = slurm_cluster.run(cmd, cwd=work, timeout=600, input=typed_in)
        done[name] = (ran.returncode, typed(ran.stdout + ran.stderr))
        print(f"{name}: exit code {ran.returncode} after {time.monotonic() - start:.1f} s")  # shown with -s
    return work, done


def probes(output, case, hosts=True):
    """(rank, node, what it did) of every probe of `case`; without `hosts`, (rank, what it did) for a step on
    one node, whichever Slurm chose."""
    seen = sorted(re.findall(rf"^gpu probe {case}: rank (\d+) on (node\d) (.*)$", output, flags=re.M))
    return seen if hosts else [(rank, what) for rank, _, what in seen]


def test_each_rank_takes_a_gpu_of_its_own_however_slurm_binds_them(launched):
    """--gpus-per-task=1 and --gpu-bind=map_gpu show each task one GPU, as cuda:0 (the old choice, which
    trusted SLURM_GPUS_PER_TASK alone, stopped task 1 of srun --gpus-per-task=1, where Slurm does not set
    it); tasks that share the step's GPUs take their local rank's."""
    _, done = launched
    code, output = done["per-task"]
    assert code == 0 and probes(output, "per-task", hosts=False) == [("0", "takes GPU 0 of 0"),
                                                                      ("1", "takes GPU 1 of 1")], output
    code, output = done["map_gpu"]
    assert code == 0 and probes(output, "map_gpu", hosts=False) == [("0", "takes GPU 1 of 1"),
                                                                    ("1", "takes GPU 0 of 0")], output
    code, output = done["shared"]
    assert code == 0 and probes(output, "shared", hosts=False) == [("0", "takes GPU 0 of 0,1"),
                                                                   ("1", "takes GPU 1 of 0,1")], output


def test_more_tasks_than_gpus_is_one_line_in_every_task(launched):
    _, done = launched
    code, output = done["too-many"]
    seen = probes(output, "too-many", hosts=False)
    assert code != 0 and [rank for rank, _ in seen] == ["0", "1", "2"], output
    assert all(what.startswith("error: 3 Slurm tasks on this node share 2 visible GPU(s)") for _, what in seen)


def test_day2_script_gives_torchruns_agent_the_gpus_of_all_its_ranks(launched):
    """In an allocation made with --gpus-per-task=1, the torchrun agent's step would inherit one GPU per
    task, one for the node's two ranks (before: both on cuda:0, NCCL's 'Duplicate GPU detected')."""
    _, done = launched
    code, output = done["multinode"]
    assert code == 0, output
    assert probes(output, "multinode-srun") == [("0", "node1", "takes GPU 0 of 0"), ("1", "node1", "takes GPU 1 of 1"),
                                                ("2", "node2", "takes GPU 0 of 0"), ("3", "node2", "takes GPU 1 of 1")]
    assert probes(output, "multinode-torchrun") == [
        ("0", "node1", "takes GPU 0 of 0,1"), ("1", "node1", "takes GPU 1 of 0,1"),
        ("2", "node2", "takes GPU 0 of 0,1"), ("3", "node2", "takes GPU 1 of 0,1")], output


def test_nproc_in_a_one_task_step_starts_that_many_ranks_and_lesson16_resumes_4_to_2(launched):
    """In the docs' shell on a compute node (their salloc, then their `srun --ntasks=1 ... --pty bash`, typed
    into a terminal), an explicit --nproc starts that many ranks (before: one rank, silently), and lesson 16's
    documented 4 -> 2 resume works: the world size its resume check uses is --nproc's, not the step's one task."""
    work, done = launched
    code, output = done["one-task step"]
    assert code == 0, output
    assert sorted(re.findall(r"^\[rank (\d)\] all_reduce\(SUM\) = 3, mean = 1.5$", output, flags=re.M)) == ["0", "1"]
    saved, resumed = metrics(work / "dcp" / "w4"), metrics(work / "dcp" / "r2")
    assert (saved["world_size"], saved["steps"]) == (4, 3), saved
    assert (resumed["world_size"], resumed["first_step"], resumed["steps"]) == (2, 3, 6), resumed
    assert resumed["resumed_from"].endswith("step-000000003")


def test_nproc_that_disagrees_with_a_multi_task_step_is_one_line(launched):
    """srun has started 2 tasks, the command line asks for 3 ranks: task 0 says so once, no task starts
    ranks of its own (before: --nproc was ignored without a word)."""
    _, done = launched
    code, output = done["two-task step"]
    assert code != 0, output
    assert output.count("error: --nproc 3 inside a Slurm step of 2 tasks: srun has started 2 ranks") == 1, output
    assert "all_reduce" not in output


def test_a_lesson_in_the_shell_of_a_plain_srun_pty_in_an_allocation_of_4_tasks_is_one_line_at_once(slurm_cluster):
    """The docs' allocation of 4 tasks, then a plain `srun --pty bash` (the old docs' command): a step of 4 tasks
    whose task 0 is the shell, the other 3 ended at once.  A lesson started there, without and with --nproc,
    stops at once with one line that gives the docs' one-task command (before: without --nproc it waited for
    ranks 1-3 until its --timeout; with --nproc 2 it said srun had started 4 ranks)."""
    docs = docs_interactive_shell()
    command = in_a_terminal(docs[:docs.index("script")], "srun --pty bash")
    lesson = f"{sys.executable} {REPO / 'day1' / '0_torch_dist.py'} --timeout 60"
    lines = f'{lesson}; echo "exit code $?"\n{lesson} --nproc 2; echo "exit code $?"\nexit\n'
    start = time.monotonic()
    ran = slurm_cluster.run(command, timeout=300, input=lines)
    seconds, output = time.monotonic() - start, typed(ran.stdout + ran.stderr)
    said = [line for line in output.splitlines() if "error: this shell is task 0 of a Slurm step of 4 tasks" in line]
    assert len(said) == 2 and all(line.endswith(f"open a one-task shell: {ONE_TASK_SHELL}") for line in said), output
    assert re.findall(r"^exit code (\d+)$", output, flags=re.M) == ["1", "1"], output
    assert "all_reduce" not in output and seconds < 40, (seconds, output)


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_an_salloc_with_cpus_per_task_gives_each_rank_that_many_threads(slurm_cluster, launcher):
    """As a batch job's ranks do (slurm/lib/job.sh): the allocation's --cpus-per-task reaches the ranks'
    srun and their thread count.  Before, srun left it behind (Slurm >= 22.05) and each rank counted the
    node's 4 cores as 2 ranks' share: 2 threads each on an allocation of 1 CPU per task."""
    ran = slurm_cluster.run(["env", "-u", "OMP_NUM_THREADS", "salloc", *TWO_BY_TWO, "--cpus-per-task=1", str(SCRIPT),
                             "--launcher", launcher, str(REPO / "tests" / "threads_of_rank.py"),
                             str(REPO / "day2" / "9_torch_dist_multi_node.py")], cwd=slurm_cluster.workdir, timeout=300)
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0, output
    threads = sorted(re.findall(r"^threads of rank (\d): (\d+) \(OMP_NUM_THREADS=(\w+)\)$", output, flags=re.M))
    assert threads == [(r, "1", "1") for r in "0123"], output
