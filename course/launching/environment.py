"""Who started this process: the variables a launcher sets, each checked, and which launcher it was.

    torchrun   RANK, LOCAL_RANK, WORLD_SIZE (and LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT)
    srun       SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NUM_TASKS, SLURM_NODEID (inside a job step)
    self       neither: `python lesson.py --nproc N` starts its N ranks itself (course/launching/launch.py)

Known before any rank starts, so that course/launching/launch.py and course/launching/devices.py both read it from here.
"""
import os

from course.launching.cli import CourseError


def nproc_asked(args):
    """The --nproc (or lesson 7's world size) typed on the command line, None when the default stands."""
    return getattr(args, "nproc_given", None)


# The variables a launcher sets for each rank, and what each may hold: (the launcher, least value, "below" another
# variable's value or None).  A rank reads them with int(); a wrong one would be a traceback on every rank, or
# a rank waiting for peers that never come.
LAUNCH_VARIABLES = {  # the sizes first: a rank's range is read from them
    "WORLD_SIZE": ("torchrun", 1, None), "SLURM_STEP_NUM_TASKS": ("srun", 1, None),
    "RANK": ("torchrun", 0, "WORLD_SIZE"), "LOCAL_RANK": ("torchrun", 0, None),
    "LOCAL_WORLD_SIZE": ("torchrun", 1, None), "GROUP_RANK": ("torchrun", 0, None),
    "SLURM_PROCID": ("srun", 0, "SLURM_STEP_NUM_TASKS"),
    "SLURM_LOCALID": ("srun", 0, None), "SLURM_NODEID": ("srun", 0, None), "SLURM_JOB_ID": ("Slurm", 0, None),
    "MASTER_PORT": ("the launcher, or you", 0, None), "OMP_NUM_THREADS": ("you or the launcher", 1, None),
    "SLURM_TASK_PID": ("srun", 1, None),
    "SLURM_CPUS_PER_TASK": ("Slurm (--cpus-per-task)", 1, None),  # a rank's threads: devices.usable_cpus
}

# The shell on a compute node that the docs give (docs/learners/running-lessons.md, JupyterLab there): one task
# with all the allocation's cores on the node (srun >= 22.05 does not take --cpus-per-task from salloc), its GPUs
# (a step gets all of the job's by default).  A plain `srun --pty bash` in an allocation of N tasks is a step of N
# tasks: N shells, of which only task 0's has the terminal; the others end at once.
ONE_TASK_SHELL = "srun --ntasks=1 --cpus-per-task=$SLURM_JOB_CPUS_PER_NODE --pty bash"


def check_launch_environment() -> None:
    """Before any rank starts: every launch variable that is set holds a whole number in its range (MASTER_PORT
    a port, MASTER_ADDR a name), or one line naming it, its value and who sets it.  A lesson started from the
    shell of an srun --pty step of several tasks is one line too (its ranks would never come)."""
    env = os.environ
    for name, (setter, least, below) in LAUNCH_VARIABLES.items():
        if name not in env:
            continue
        value = env[name].strip()
        limit = env.get(below, "").strip() if below else ""
        highest = int(limit) - 1 if limit.isdigit() else (65_535 if name == "MASTER_PORT" else None)
        ok = value.isdigit() and int(value) >= least and (highest is None or int(value) <= highest)
        if not ok:
            allowed = f"a whole number from {least}" + (f" to {highest}" if highest is not None else "")
            raise CourseError(f"{name}={env[name]!r} is not {allowed} (set by {setter}); unset it, or start "
                              f"the lesson with the launcher that sets it")
    if "MASTER_ADDR" in env and not env["MASTER_ADDR"].strip():
        raise CourseError("MASTER_ADDR is set but empty: give rank 0's hostname, or unset it")
    torchrun = all(k in env for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))  # its ranks: torchrun's world
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", "1"))
    if not torchrun and "SLURM_PROCID" in env and tasks > 1 and started_from_a_pty_step_shell():
        if int(env["SLURM_PROCID"]) != 0:
            raise SystemExit(1)  # a task without the terminal (srun --pty gives the other tasks /dev/null)
        raise CourseError(f"this shell is task 0 of a Slurm step of {tasks} tasks (srun --pty bash in an "
                          f"allocation of {tasks} tasks starts {tasks} shells; the other {tasks - 1} ended at "
                          f"once), so this lesson would wait for {tasks - 1} ranks that never come: leave it "
                          f"(exit) and open a one-task shell: {ONE_TASK_SHELL}")


def started_from_a_pty_step_shell() -> bool:
    """Whether this process was started from the shell (or a notebook) of an `srun --pty` step, not as a task.
    srun --pty gives every task of its step SLURM_PTY_PORT; SLURM_TASK_PID is the process srun started for the
    task: the lesson itself under `srun [--pty] python lesson.py`, the shell under `srun --pty bash`."""
    task = os.environ.get("SLURM_TASK_PID", "").strip()
    return "SLURM_PTY_PORT" in os.environ and task.isdigit() and int(task) != os.getpid()


def detect_launcher(args=None) -> str:
    """"torchrun", "srun" or "self".  With the lesson's `args`, an explicit --nproc inside a one-task srun step
    is "self"; inside a step of several tasks it must agree with their number."""
    check_launch_environment()
    if all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return "torchrun"
    # SLURM_STEP_NUM_TASKS exists only inside an srun step, not in a batch script's own shell, where a
    # plain `python lesson.py` must spawn its workers itself instead of waiting for peers that never come.
    if "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ:
        asked, tasks = nproc_asked(args), int(os.environ["SLURM_STEP_NUM_TASKS"])
        if asked is None or asked == tasks:
            return "srun"
        if tasks == 1:
            return "self"
        if int(os.environ["SLURM_PROCID"]) != 0:
            raise SystemExit(1)  # task 0 says why, once
        raise CourseError(f"--nproc {asked} inside a Slurm step of {tasks} tasks: srun has started {tasks} "
                          f"ranks already; leave out --nproc (srun's tasks are the ranks), or start one task "
                          f"(srun --ntasks=1 ... --nproc {asked}) to have the lesson start {asked} ranks itself")
    return "self"


def world_size(args) -> int:
    """The world size a run will have, known before any rank starts: torchrun's, the srun step's, or --nproc."""
    launcher = detect_launcher(args)
    if launcher == "torchrun":
        return int(os.environ["WORLD_SIZE"])
    if launcher == "srun":
        return int(os.environ["SLURM_STEP_NUM_TASKS"])
    return args.nproc
