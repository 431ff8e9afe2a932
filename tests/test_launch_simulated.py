"""The launch and device logic on hardware this machine does not have: GPUs, Slurm steps and torchrun are
simulated in this process (torch.cuda's answers and the launchers' variables faked), and the course's own
functions, or a lesson's own code, decide.

The Slurm variables are those a real Slurm 22.05 gives a task (seen on tests/slurm_cluster.py's cluster, whose
fake GPUs Slurm hands out like real ones): with --gpus-per-task=1, --gpu-bind=single:1 or map_gpu each task
sees one GPU (CUDA_VISIBLE_DEVICES of one entry) while SLURM_GPUS_ON_NODE counts the step's GPUs on the node;
SLURM_GPUS_PER_TASK is set only where the allocation (salloc/sbatch) asked for GPUs per task, not by
`srun --gpus-per-task`; SLURM_NTASKS and SLURM_STEP_NUM_TASKS are the step's task count inside a step.
tests/test_day2_slurm.py runs the same decisions under the real Slurm.

A fake GPU answers the device count, the capability and the name; asking for the current device, or for
torch.cuda.is_bf16_supported() (which makes a bf16 tensor on the current device, cuda:0 before a rank has
set its own), fails the test.
"""
import os
import runpy
from types import SimpleNamespace

import pytest
import torch

import course.launching.devices
from conftest import REPO
from course.launching.cli import CourseError
from course.launching.devices import setup_device, tasks_on_this_node
from course.launching.environment import ONE_TASK_SHELL
from course.launching.launch import detect_launcher, world_size

LAUNCH_VARIABLES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "CUDA_VISIBLE_DEVICES",
                    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
                    "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_JOB_ID", "SLURM_STEP_ID",
                    "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_TASK", "SLURM_STEP_GPUS", "SLURM_PTY_PORT", "SLURM_TASK_PID"]


@pytest.fixture
def machine(monkeypatch):
    """No launcher, no GPU; `machine.gpus(n, capability, name)` fakes n visible GPUs, `machine.env(...)` sets
    launcher variables.  `machine.capability_asked` and `machine.current` record which GPUs were asked for
    their capability and made current."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    course.launching.devices.use_layout(None, None)
    seen = SimpleNamespace(capability_asked=[], current=[])

    def gpus(n, capability=(8, 0), name="NVIDIA A100-SXM4-40GB"):
        def capability_of(index):
            assert isinstance(index, int) and 0 <= index < n, index
            seen.capability_asked.append(index)
            return capability

        def forbidden(*_, **__):
            raise AssertionError("asked for the current GPU: cuda:0 before this rank set its own")

        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_capability", capability_of)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
        monkeypatch.setattr(torch.cuda, "set_device", seen.current.append)
        monkeypatch.setattr(torch.cuda, "current_device", forbidden)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", forbidden)

    def env(**variables):
        for key, value in variables.items():
            monkeypatch.setenv(key, str(value))

    def no_launcher():
        for key in LAUNCH_VARIABLES:
            monkeypatch.delenv(key, raising=False)

    seen.gpus, seen.env, seen.no_launcher = gpus, env, no_launcher
    return seen


def srun_task(machine, localid, tasks_per_node, nodes=1, procid=None, gpus_on_node=None, visible=None, **more):
    """The variables srun gives task `localid` of a step with `tasks_per_node` tasks on each of `nodes` nodes."""
    ntasks = tasks_per_node * nodes
    machine.env(SLURM_JOB_ID=41, SLURM_STEP_ID=0, SLURM_PROCID=localid if procid is None else procid,
                SLURM_LOCALID=localid, SLURM_NODEID=0, SLURM_NTASKS=ntasks, SLURM_STEP_NUM_TASKS=ntasks,
                SLURM_STEP_TASKS_PER_NODE=f"{tasks_per_node}(x{nodes})" if nodes > 1 else tasks_per_node, **more)
    if gpus_on_node is not None:
        machine.env(SLURM_GPUS_ON_NODE=gpus_on_node)
    if visible is not None:
        machine.env(CUDA_VISIBLE_DEVICES=visible)


def torchrun_worker(machine, local_rank, local_world_size, **more):
    machine.env(RANK=local_rank, LOCAL_RANK=local_rank, WORLD_SIZE=local_world_size,
                LOCAL_WORLD_SIZE=local_world_size, GROUP_RANK=0, **more)


# ------------------------------------------------------------------------------------------ which GPU

@pytest.mark.parametrize("binding, allocation", [
    ("srun --gpus-per-task=1", {}),
    ("srun --gpu-bind=single:1 (or map_gpu)", {}),
    ("salloc --gpus-per-task=1, then srun", {"SLURM_GPUS_PER_TASK": 1}),
])
def test_a_task_slurm_bound_to_one_gpu_takes_cuda0(machine, binding, allocation):
    """Every task sees its own GPU as cuda:0 (CUDA_VISIBLE_DEVICES 0 or 1, of SLURM_GPUS_ON_NODE=4).  The
    old choice trusted SLURM_GPUS_PER_TASK alone, which a step started with srun's own --gpus-per-task or
    --gpu-bind does not have: local rank 1 stopped with 'needs GPU 1'."""
    machine.gpus(1)
    for localid in range(4):
        srun_task(machine, localid, 4, gpus_on_node=4, visible=localid, **allocation)
        assert setup_device("auto", localid) == torch.device("cuda", 0), binding
    assert machine.current == [0, 0, 0, 0]


def test_a_site_binding_without_slurm_gpu_counts_takes_cuda0(machine):
    """A site's own binding (a wrapper that sets CUDA_VISIBLE_DEVICES per task, no gres counts): cuda:0."""
    machine.gpus(1)
    srun_task(machine, 3, 4, visible=3)
    assert setup_device("cuda", 3) == torch.device("cuda", 0)


def test_tasks_that_share_the_nodes_gpus_take_their_local_rank(machine):
    machine.gpus(4)
    for localid in range(4):
        srun_task(machine, localid, 4, gpus_on_node=4, visible="0,1,2,3")
        assert setup_device("auto", localid) == torch.device("cuda", localid)
    assert machine.current == [0, 1, 2, 3]


def test_tasks_bound_to_two_gpus_each_take_distinct_ones(machine):
    """--gpus-per-task=2 with 2 tasks: each sees 2 of the step's 4; any of its own is its alone."""
    machine.gpus(2)
    srun_task(machine, 1, 2, gpus_on_node=4, visible="2,3")
    assert setup_device("cuda", 1) == torch.device("cuda", 1)


# What each task of a node with 4 GPUs (two sockets: GPUs 0,1 and 2,3) sees, by binding (seen as Slurm sets
# CUDA_VISIBLE_DEVICES per task, SLURM_GPUS_ON_NODE the step's 4): --gpu-bind=closest gives a task every GPU
# of its socket, and srun's default distribution deals the tasks to the sockets in turn (cyclic).
BINDINGS = {
    "--gpu-bind=single:1": ["0", "1", "2", "3"],
    "--gpus-per-task=2 (2 tasks)": ["0,1", "2,3"],
    "--gpu-bind=closest, cyclic over sockets": ["0,1", "2,3", "0,1", "2,3"],
    "SLURM_GPU_BIND=closest (a site default), cyclic": ["0,1", "2,3", "0,1", "2,3"],
    "--gpu-bind=closest, one GPU per socket": ["0", "1", "0", "1"],  # 4 tasks, a step of 2 GPUs
}


@pytest.mark.parametrize("binding", BINDINGS)
def test_bound_tasks_take_distinct_gpus_or_every_task_stops_with_one_line(machine, monkeypatch, binding):
    """Every task of the node, one after the other: the physical GPUs they take (CUDA_VISIBLE_DEVICES at the
    index chosen) are all different, or each task stops before init with one line naming the flags that give
    a task a GPU of its own.  The old choice, local rank % visible, put tasks 0 and 2 of --gpu-bind=closest on
    GPU 0 and NCCL stopped with 'Duplicate GPU detected'."""
    monkeypatch.delenv("SLURM_GPU_BIND", raising=False)
    if binding.startswith("SLURM_GPU_BIND"):
        monkeypatch.setenv("SLURM_GPU_BIND", "closest")
    sets = BINDINGS[binding]
    on_node = len({gpu for seen in sets for gpu in seen.split(",")})
    taken, lines = [], []
    for localid, seen in enumerate(sets):
        machine.gpus(len(seen.split(",")))
        srun_task(machine, localid, len(sets), gpus_on_node=on_node, visible=seen)
        try:
            taken.append(seen.split(",")[setup_device("cuda", localid).index])
        except CourseError as e:
            lines.append(str(e))
    if "closest" not in binding:
        assert lines == [] and len(set(taken)) == len(sets), taken
        return
    assert taken == [] and machine.current == [] and len(lines) == len(sets), (taken, lines)
    line = lines[0]
    assert line.startswith(f"{len(sets)} Slurm tasks on this node each see {len(sets[0].split(','))} GPU(s) of "
                           f"the {on_node} the step has here") and "\n" not in line, line
    assert "srun --gpus-per-task=1, or --gpu-bind=single:1" in line, line
    assert ("SLURM_GPU_BIND=closest here" if binding.startswith("SLURM") else "--gpu-bind=closest") in line, line


@pytest.mark.parametrize("localid", [0, 1, 2])
def test_more_slurm_tasks_than_shared_gpus_is_one_line_in_every_task(machine, localid):
    """3 tasks on a node whose step has 2 GPUs that every task sees: every task stops with the same line, the
    tasks that would have had a GPU too (the old check stopped local rank 2 alone and left 0 and 1 waiting
    for it at init_process_group)."""
    machine.gpus(2)
    srun_task(machine, localid, 3, gpus_on_node=2, visible="0,1")
    with pytest.raises(CourseError) as e:
        setup_device("auto", localid)
    assert str(e.value).startswith("3 Slurm tasks on this node share 2 visible GPU(s)")
    assert "--gpus-per-task=1" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("local_rank", [0, 3])
def test_torchrun_in_a_task_with_one_gpu_is_one_line_not_four_ranks_on_cuda0(machine, local_rank):
    """`srun --ntasks-per-node=1 torchrun --nproc_per_node=4` in an allocation made with --gpus-per-task=1:
    the torchrun task was given one GPU, which its 4 workers would share.  The old choice put all four on
    cuda:0 (SLURM_GPUS_PER_TASK is set), and NCCL stopped with 'Duplicate GPU detected'."""
    machine.gpus(1)
    torchrun_worker(machine, local_rank, 4, SLURM_JOB_ID=41, SLURM_STEP_ID=0, SLURM_GPUS_PER_TASK=1,
                    SLURM_GPUS_ON_NODE=1, CUDA_VISIBLE_DEVICES=0)
    with pytest.raises(CourseError, match=r"^4 torchrun ranks on this node share 1 visible GPU\(s\).*"
                                          r"give the torchrun task all the node's GPUs \(srun --gpus-per-task=4"):
        setup_device("auto", local_rank)
    assert machine.current == []


def test_torchrun_ranks_take_their_local_rank(machine):
    machine.gpus(4)
    for local_rank in range(4):
        torchrun_worker(machine, local_rank, 4)
        assert setup_device("auto", local_rank) == torch.device("cuda", local_rank)


def test_the_launchers_layout_wins_over_the_environment(machine):
    """`--nproc 2` inside a one-task srun step: the ranks inherit the step's variables (one task on the
    node), but course/launching/launch.py records that the node runs 2 ranks, started by the lesson itself."""
    machine.gpus(1)
    srun_task(machine, 0, 1, gpus_on_node=2, visible=0)
    course.launching.devices.use_layout(2, "self")
    try:
        with pytest.raises(CourseError, match=r"^2 ranks on this node share 1 visible GPU"):
            setup_device("cuda", 1)
    finally:
        course.launching.devices.use_layout(None, None)


def test_tasks_per_node_is_this_nodes_count(monkeypatch):
    """SLURM_STEP_TASKS_PER_NODE=2(x2),1: the third node runs one task (the old parse took the first count)."""
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2),1")
    counts = []
    for node in range(3):
        monkeypatch.setenv("SLURM_NODEID", str(node))
        counts.append(tasks_on_this_node())
    assert counts == [2, 2, 1]

# ------------------------------------------------------------------------------------ threads per rank

@pytest.mark.parametrize("launcher, ranks, cpus_per_task, affinity, threads", [
    ("srun", 2, 2, 64, 2),        # srun --ntasks-per-node=2 --cpus-per-task=2 on a 64-CPU node, tasks not bound
    ("srun", 2, 2, 1, 1),         # the same, each task bound to one CPU: no more than it may use
    ("srun", 2, None, 64, 32),    # no --cpus-per-task: the tasks count as sharing what they see, as before
    ("self", 2, None, 4, 2),      # taskset -c 0-3 python lesson.py --nproc 2: the ranks share the 4
    ("torchrun", 4, 8, 64, 2),    # srun --cpus-per-task=8 torchrun --nproc_per_node=4: the task's 8, shared
    ("self", 2, 8, 64, 4),        # --nproc 2 in a one-task step (srun --cpus-per-task=8 --pty bash)
])
def test_threads_per_rank_come_from_the_cpus_the_rank_may_use(monkeypatch, launcher, ranks, cpus_per_task,
                                                              affinity, threads):
    """Not os.cpu_count(): the old rule gave each of 2 srun tasks with --cpus-per-task=2 on a 64-CPU node
    32 threads, 16 times the CPUs Slurm gave it."""
    from course.launching.devices import share_cpu_cores

    asked = []
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    if cpus_per_task is not None:
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(cpus_per_task))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)))
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    share_cpu_cores(ranks, launcher)
    assert asked == [threads]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # set by you or the launcher: it wins
    share_cpu_cores(ranks, launcher)
    assert asked == [threads]


def test_lesson1_puts_a_bound_task_on_its_own_gpu_and_stops_torchrun_ranks_that_share_one(machine, monkeypatch):
    """Lesson 1's own worker, up to its init_process_group: the device it chose, or its one line."""
    import torch.distributed as dist

    worker = runpy.run_path(str(REPO / "day1" / "1_torch_dist_gpu.py"), run_name="lesson1")["worker"]

    class Joined(Exception):
        pass

    def init_process_group(*_, **__):
        raise Joined(tuple(machine.current))

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    args = SimpleNamespace(backend="nccl", timeout=10)
    machine.gpus(1)
    srun_task(machine, 1, 2, gpus_on_node=2, visible=1)  # srun --gpus-per-task=1: task 1 sees its GPU as cuda:0
    with pytest.raises(Joined) as joined:
        worker(SimpleNamespace(rank=1, local_rank=1, world_size=2, local_world_size=2, launcher="srun"), args)
    assert joined.value.args[0] == (0,)
    with pytest.raises(CourseError, match="^2 torchrun ranks on this node share 1 visible GPU"):
        worker(SimpleNamespace(rank=1, local_rank=1, world_size=2, local_world_size=2, launcher="torchrun"), args)


# ---------------------------------------------------------------------------- init_process_group(device_id=)

# The lessons that join a process group; lesson 0 joins with gloo on the CPU only (no device to bind).
JOINING = sorted(str(p.relative_to(REPO)) for d in ("day1", "day2", "day3", "day4") for p in (REPO / d).glob("*.py")
                 if "init_process_group(" in p.read_text() and p.name != "0_torch_dist.py")
DEVICE_ID = 'device if device.type == "cuda" else None'


def test_every_lesson_binds_its_process_group_to_its_gpu_the_same_way():
    """Each lesson's init_process_group passes device_id, written as every other lesson writes it: its GPU on a
    GPU (NCCL connects at init, on that GPU: a mismatch shows there, and barrier() knows its device instead of
    warning at every call), None on the CPU (torch 2.14.1 refuses a CPU device_id: "must be an accelerator")."""
    import ast

    assert len(JOINING) == 21, JOINING
    found = {}
    for script in JOINING:
        calls = [node for node in ast.walk(ast.parse((REPO / script).read_text())) if isinstance(node, ast.Call)
                 and ast.unparse(node.func) == "dist.init_process_group"]
        found[script] = [next((ast.unparse(k.value) for k in c.keywords if k.arg == "device_id"), None) for c in calls]
    assert found == {script: [DEVICE_ID.replace('"', "'")] for script in JOINING}


# What a lesson needs, besides --device (lesson 1: --backend) and --quick, to reach its init_process_group as
# one rank; {tmp}: a directory of the test's own
TO_INIT = {"day1/5_mnist_manual_ddp_profile.py": ["--log-dir", "{tmp}/log"],
           "day1/test-profile.py": ["--log-dir", "{tmp}/log"],
           "day2/11_mnist_ddp_pt_multinode_streaming.py": ["--h5-file", "{h5}"],
           "day2/12_ddp_fault_tolerance.py": ["--checkpoint-dir", "{tmp}/ckpt"],
           "day3/15_fsdp2.py": ["--memory-budget-mb", "0"],  # 0: no budget, which one rank would not meet
           "day3/16_distributed_checkpoint.py": ["--memory-budget-mb", "0"],
           "day4/20_device_mesh_2d.py": ["--inner", "1"]}
NO_DATA = ("day1/1_torch_dist_gpu.py", "day1/test-profile.py", "day2/9_torch_dist_multi_node.py")  # no --quick


@pytest.mark.parametrize("script", JOINING)
def test_every_lesson_passes_its_ranks_gpu_as_device_id(machine, monkeypatch, dataset, request, tmp_path, script):
    """Each lesson as torchrun's only rank on a node with one (fake) GPU, up to its init_process_group, which
    records what it was given: device_id is the GPU the rank made current; with --device cpu, None."""
    import torch.distributed as dist

    class Joined(Exception):
        pass

    def init_process_group(*_, **kwargs):
        raise Joined(kwargs.get("device_id", "missing"))

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    h5 = request.getfixturevalue("mnist_h5").path if "11_" in script else None
    machine.gpus(1)
    machine.env(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_WORLD_SIZE=1, GROUP_RANK=0, MASTER_ADDR="127.0.0.1",
                MASTER_PORT=29500)
    seen = {}
    for device in ("cuda", "cpu"):
        tmp = tmp_path / device
        argv = [str(REPO / script), *(["--backend", {"cuda": "nccl", "cpu": "gloo"}[device]] if "1_torch" in script
                                      else ["--device", device]),
                *([] if script in NO_DATA else ["--quick", "--run-dir", str(tmp / "run")]),
                *(a.format(tmp=tmp, h5=h5) for a in TO_INIT.get(script, []))]
        monkeypatch.setattr("sys.argv", argv)
        with pytest.raises(Joined) as joined:
            runpy.run_path(argv[0], run_name="__main__")
        seen[device] = joined.value.args[0]
    assert seen == {"cuda": torch.device("cuda", 0), "cpu": None}, seen

# ------------------------------------------------------------------------------------- which launcher

def lesson0_args(*argv):
    parser = runpy.run_path(str(REPO / "day1" / "0_torch_dist.py"), run_name="lesson0")["build_parser"]()
    return parser.parse_args(list(argv))


def test_an_explicit_nproc_in_a_one_task_step_starts_that_many_ranks(machine):
    """`srun --ntasks=1 ... --pty bash` (or any `srun -n1`), then `python day1/0_torch_dist.py --nproc 2`: the
    lesson starts 2 ranks itself; without --nproc the step's one task is the one rank, as before."""
    srun_task(machine, 0, 1, SLURM_PTY_PORT=35539, SLURM_TASK_PID=1)  # the shell is the task, not the lesson
    asked = lesson0_args("--nproc", "2")
    assert (detect_launcher(asked), world_size(asked)) == ("self", 2)
    default = lesson0_args()
    assert (detect_launcher(default), world_size(default)) == ("srun", 1)


def test_an_nproc_that_disagrees_with_a_multi_task_step_is_one_line_from_task_0(machine):
    """In a step of 4 tasks srun has started the ranks; --nproc 2 would have each task start 2 of its own."""
    srun_task(machine, 0, 4)
    with pytest.raises(CourseError, match=r"^--nproc 2 inside a Slurm step of 4 tasks: srun has started 4 ranks"):
        detect_launcher(lesson0_args("--nproc", "2"))
    srun_task(machine, 3, 4)
    with pytest.raises(SystemExit) as e:  # the other tasks end without a line of their own
        detect_launcher(lesson0_args("--nproc", "2"))
    assert e.value.code == 1
    assert detect_launcher(lesson0_args("--nproc", "4")) == "srun"


def test_a_lesson_from_the_pty_shell_of_a_multi_task_step_is_one_line_naming_the_one_task_shell(machine):
    """`salloc --ntasks-per-node=4`, then a plain `srun --pty bash`: a step of 4 tasks (seen on the test Slurm:
    every task has SLURM_PTY_PORT, SLURM_TASK_PID is the pid of the task's own process, the shell; only task 0
    has the terminal, the other shells end at once).  A lesson started in that shell, with or without --nproc,
    says so in one line and gives the docs' one-task command (before: it waited for ranks 1-3 until its
    timeout, or refused --nproc as if srun had started the ranks)."""
    shell = 1  # never this process
    for argv in ([], ["--nproc", "2"], ["--nproc", "4"]):
        srun_task(machine, 0, 4, SLURM_PTY_PORT=35539, SLURM_TASK_PID=shell)
        with pytest.raises(CourseError, match=r"^this shell is task 0 of a Slurm step of 4 tasks .* 3 ranks that "
                                              r"never come: .* srun --ntasks=1 --cpus-per-task=\$SLURM_JOB_CPUS_"
                                              r"PER_NODE --pty bash$"):
            detect_launcher(lesson0_args(*argv))
    srun_task(machine, 2, 4, SLURM_PTY_PORT=35539, SLURM_TASK_PID=shell)  # no terminal: no line of its own
    with pytest.raises(SystemExit) as e:
        detect_launcher(lesson0_args())
    assert e.value.code == 1
    # `srun --pty --ntasks=4 python lesson.py`: each lesson is its task's own process, the step's ranks
    for task in range(4):
        srun_task(machine, task, 4, SLURM_PTY_PORT=35539, SLURM_TASK_PID=os.getpid())
        assert detect_launcher(lesson0_args()) == "srun"
    # an ordinary `srun --ntasks=4 python lesson.py` (no SLURM_PTY_PORT), tasks 0 and 3: unaffected
    for task in (0, 3):
        machine.no_launcher()
        srun_task(machine, task, 4, SLURM_TASK_PID=os.getpid())
        assert (detect_launcher(lesson0_args()), world_size(lesson0_args())) == ("srun", 4)


def test_the_docs_shell_on_a_compute_node_is_the_one_task_shell_the_lessons_name():
    """The JupyterLab route of docs/learners/running-lessons.md opens its shell with the command the one line
    above gives (tests/test_day2_slurm.py runs both as typed there, on the test Slurm)."""
    docs = (REPO / "docs" / "learners" / "running-lessons.md").read_text().splitlines()
    assert [line for line in docs if line.startswith("srun ") and "--pty" in line] == [ONE_TASK_SHELL]


def test_world_size_helpers_follow_the_launcher_not_the_jobs_task_count(machine):
    """A batch script's own shell has SLURM_NTASKS=4 (the job's) but no step: `python lesson.py --nproc 2`
    there runs 2 ranks, and the memory budget and DCP's resume check must plan for 2 (the old helper read 4)."""
    from course.measuring.memory import world_size_of

    machine.env(SLURM_JOB_ID=41, SLURM_PROCID=0, SLURM_NTASKS=4, SLURM_TASKS_PER_NODE="4")
    assert world_size_of(SimpleNamespace(nproc=2)) == 2
    srun_task(machine, 0, 1)  # a one-task step: an explicit --nproc 2, or the step's one task
    assert world_size_of(lesson0_args("--nproc", "2")) == 2
    assert world_size_of(lesson0_args()) == 1
    machine.no_launcher()
    torchrun_worker(machine, 0, 3)
    assert world_size_of(lesson0_args("--nproc", "2")) == 3  # torchrun's world size wins, as documented


# ---------------------------------------------------------------------------------------- precision

def test_bf16_on_a_gpu_before_ampere_is_one_line_naming_the_gpu(lesson_main, machine, dataset):
    """Lesson 13 with --precision bf16 on two V100s (capability 7.0): torch would emulate bf16 (slower than
    fp32, and inductor skips compiling bf16 graphs there); one line says so and what to use.  Both ranks'
    GPUs were read, none was made current."""
    machine.gpus(2, capability=(7, 0), name="Tesla V100-SXM2-16GB")
    done = lesson_main("day3/13_mixed_precision.py", "--quick", "--precision", "bf16", "--nproc", "2")
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "error: --precision bf16: GPU 0 (Tesla V100-SXM2-16GB) has compute capability 7.0; GPUs compute " \
           "bf16 natively from 8.0 (Ampere) on" in done.stderr
    assert "use --precision fp16 where the lesson offers it, else fp32" in done.stderr
    assert machine.capability_asked == [0] and machine.current == []


def test_bf16_on_ampere_passes_and_reads_only_the_ranks_own_gpu(machine):
    from course.training.precision import check_precision

    args = SimpleNamespace(device="auto", precision="bf16", compile=False, bucket_cap_mb=25.0, nproc=2)
    machine.gpus(4)
    check_precision(args)  # --nproc 2 will use GPUs 0 and 1
    assert machine.capability_asked == [0, 1]
    machine.capability_asked.clear()
    torchrun_worker(machine, 3, 4)
    check_precision(args)
    assert machine.capability_asked == [3]
    machine.capability_asked.clear()
    machine.gpus(1)
    machine.no_launcher()
    srun_task(machine, 1, 2, gpus_on_node=2, visible=1)  # bound to one GPU: its cuda:0
    check_precision(args)
    assert machine.capability_asked == [0] and machine.current == []


def test_bf16_on_a_bound_task_before_ampere_names_its_own_gpu(machine):
    from course.training.precision import check_precision

    machine.gpus(1, capability=(7, 5), name="Tesla T4")
    srun_task(machine, 1, 2, gpus_on_node=2, visible=1)
    args = SimpleNamespace(device="cuda", precision="bf16", compile=False, bucket_cap_mb=25.0, nproc=2)
    with pytest.raises(CourseError, match=r"^--precision bf16: GPU 0 \(Tesla T4\) has compute capability 7\.5"):
        check_precision(args)
    args.precision = "fp32"
    check_precision(args)
