"""Every input a lesson reads is bad input too: each of its options and each environment variable its code
reads gets bad values from the tables below, and each bad value ends the lesson before any rank starts with
one line on stderr naming what is wrong, a non-zero exit, and no run dir left behind.

The options come from each lesson's --help and the variables from its code (every course/ and data_tools/
module it imports, followed module by module), so that a new option or variable without bad values here
fails the first two tests: nothing can skip the walk.  The lessons run in this process (conftest's
lesson_main), where starting a rank is a test failure.

What the walk cannot ask of every option alike (the words of a refusal, its exact exit code, values bad only
together, the variables that decide the launch) is in one explicit table, SAID, at the end.
"""
import ast
import os
import re
from pathlib import Path

import pytest

from conftest import REPO, help_texts_of

LESSONS = sorted(str(p.relative_to(REPO)) for d in ("day1", "day2", "day3", "day4", "day5") for p in (REPO / d).glob("*.py"))
USAGE_OPTION = re.compile(r"\[(--[\w-]+)(?: ([A-Z_]+|\{[^}]*\}))?\]")

# Bad values of every option that takes one (flags take none; a choice is checked by argparse, and each gets
# "nosuch").  "FILE" stands for an existing regular file, "MISSING" for a path that does not exist.
BAD_OPTION_VALUES = {
    "--nproc": ["0", "two"],
    "--timeout": ["0", "-5", "soon"],
    "--epochs": ["0", "1.5"],
    "--batch-size": ["0", "-64"],
    "--lr": ["0", "-0.1", "nan", "fast"],
    "--seed": ["zero"],
    "--train-samples": ["0", "60001"],  # the data has 60 000
    "--max-steps": ["0", "x"],
    "--data-dir": ["MISSING", "FILE"],
    "--run-dir": ["FILE", "FILE/sub"],
    "--log-dir": ["FILE"],
    "--checkpoint-dir": ["FILE"],
    "--checkpoint-every": ["0"],
    "--keep": ["0"],
    "--log-every": ["0"],
    "--step-sleep": ["-1", "x"],
    "--bucket-cap-mb": ["0", "x"],
    "--watch-interval": ["0", "x"],
    "--wait": ["-1", "x"], "--warmup": ["-1"], "--active": ["0"],  # the profiler's schedule
    "--probe-steps": ["0", "x"],
    "--compare-after": ["-1", "x"], "--smooth-samples": ["0", "x"], "--warmup-steps": ["-1", "x"],
    "--samples": ["0", "x"], "--steps": ["0", "x"],
    "--workers": ["-1", "x"],
    "--clip-grad-norm": ["-1", "x"],
    "--width": ["0", "x"], "--depth": ["0", "x"], "--heads": ["0", "7"],  # 7 heads do not divide the width
    "--overflow-at": ["-1", "x"], "--overflow-rank": ["-1", "2"],  # 2 ranks: 0 and 1
    "--accumulate": ["0", "x"],
    "--memory-budget-mb": ["-1", "x"],  # 0: no budget
    "--export": ["FILE/model.pt"],
    "--debug-server": ["x", "70000"],
    "--save-every": ["0", "x"],
    "--sizes-mib": ["0", "-1", "x"],
    "--inner": ["0", "x", "3"],  # 3 does not divide lesson 20's 4 ranks into rows
    "--microbatches": ["0", "x", "7"],  # 7 does not split lesson 21's default batch of 64 evenly
    "--stage-ms": ["-1", "x", "nan"],
    "--text-dir": ["MISSING", "FILE"],
    "--hidden": ["0", "x"], "--seq-len": ["0", "x", "1000000"],  # a million bytes: more than the held-out text
    "--eval-rows": ["0", "x"], "--sample-tokens": ["-1", "x"], "--temperature": ["0", "x"],
    "--prompt": [""],
    "--model-dir": ["MISSING", "FILE", "EMPTY_DIR"], "--answer-tokens": ["-1", "x"],
}
# A lesson whose option takes a value the others refuse: its own bad values.
BAD_OPTION_VALUES_OF = {("day5/23_hf_finetuning.py", "--max-steps"): ["-1", "x"]}  # 0: load and save only
# Options that are used only with another one: the bad value is given with it.
OPTION_NEEDS = {"--log-dir": [("--profile",)], "--watch-interval": [("--watch-hardware",)],
                "--overflow-rank": [("--overflow-at", "3")]}
MULTI_NODE = {"day2/9_torch_dist_multi_node.py", "day2/10_mnist_ddp_pt_multinode.py",
              "day2/11_mnist_ddp_pt_multinode_streaming.py"}

# What each environment variable a lesson reads may not be, with the launcher it belongs to (the variables
# that make the launch torchrun's or srun's are set, valid, around it).
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SRUN = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost",
        "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_ID": "0"}
BAD_ENV_VALUES = {
    "RANK": (TORCHRUN, ["x", "-1", "2"]),
    "WORLD_SIZE": (TORCHRUN, ["0", "x"]),
    "LOCAL_RANK": (TORCHRUN, ["x", "-1"]),
    "LOCAL_WORLD_SIZE": (TORCHRUN, ["0", "x"]),
    "GROUP_RANK": (TORCHRUN, ["x"]),
    "MASTER_PORT": (TORCHRUN, ["x", "70000"]),
    "MASTER_ADDR": (TORCHRUN, [""]),
    "SLURM_PROCID": (SRUN, ["x", "2"]),
    "SLURM_STEP_NUM_TASKS": (SRUN, ["0", "x"]),
    "SLURM_LOCALID": (SRUN, ["x"]),
    "SLURM_NODEID": (SRUN, ["x"]),
    "SLURM_JOB_ID": (SRUN, ["x"]),
    "SLURM_TASK_PID": (SRUN, ["x", "0"]),
    "OMP_NUM_THREADS": ({}, ["0", "x"]),
    "SLURM_CPUS_PER_TASK": ({}, ["0", "x"]),  # a rank's threads (course/launching/devices.py)
    "COURSE_DATA_DIR": ({}, ["MISSING"]),
    "COURSE_MODEL_DIR": ({}, ["MISSING", "FILE", "EMPTY_DIR"]),  # lesson 23's model, staged for the class
    # read by torch, taught by the course; checked before torch is imported (course/launching/requires.py)
    "TORCH_DISTRIBUTED_DEBUG": ({}, ["bogus", "", "1"]),
    "TORCH_LOGS": ({}, ["bogus", "", "help", "ddp_graphs,", "torch.nosuch"]),
    "TORCH_NCCL_BLOCKING_WAIT": ({}, ["maybe", ""]),
    "TORCH_NCCL_DESYNC_DEBUG": ({}, ["maybe"]),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": ({}, ["maybe"]),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ({}, ["x", "7"]),
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": ({}, ["x", "-1"]),
}
# Variables that only lessons with one of these options use (the others import the module that reads them).
ENV_USED_WITH = {"COURSE_DATA_DIR": "--data-dir", "COURSE_MODEL_DIR": "--model-dir"}
# Variables read without bad values here, and why.
ENV_NOT_WALKED = {
    "SLURM_STEP_TASKS_PER_NODE": "read only to count a node's ranks, as the launchers give it",
    "SLURM_TASKS_PER_NODE": "read only to count a node's ranks, as the launchers give it",
    "SLURM_STEP_NODELIST": "a host list handed to scontrol, which names what it cannot expand",
    "SLURM_JOB_NODELIST": "a host list handed to scontrol, which names what it cannot expand",
    "SLURM_STEP_ID": "only compared, never parsed",
    "SLURM_PTY_PORT": "only whether it is set: srun --pty sets it for every task of its step",
    "SLURM_GPUS_ON_NODE": "printed, and compared as a count of GPUs when it is a whole number (else read as unset)",
    "SLURM_GPU_BIND": "only printed, in the line about tasks bound to the same GPUs",
    "SLURMD_NODENAME": "only printed and compared: the node a rank runs on (lessons 19-20's mesh groups, lesson 21's "
                       "stages)",
    "SLURM_RESTART_COUNT": "set by Slurm itself on a requeue, only counted",
    "TORCHELASTIC_RESTART_COUNT": "set by torchrun itself, only counted",
    "CUDA_VISIBLE_DEVICES": "read by the CUDA runtime; course/launching/devices.py says when a rank sees no GPU",
    "CUBLAS_WORKSPACE_CONFIG": "set by lesson 12 for reproducible kernels, not read",
    "PYTHONPATH": "only passed on, with the repository put first, to the fresh interpreter that makes day 5's "
                  "estimate where a fork is unsafe (course/fit.py); Python itself reads it",
    "COURSE_START_METHOD": "how --nproc starts its ranks; a bad value, or fork where it is unsafe, is one line "
                           "(tests/test_launch.py)",
    "COURSE_EXIT_GRACE": "a test aid",
    "TORCH_FR_BUFFER_SIZE": "set by lesson 17 for its ranks",
    "TORCH_FR_DUMP_TEMP_FILE": "set by lesson 17 for its ranks",
    # the site profile's values that only the readiness check reads (scripts/readiness_check.sh before it submits,
    # course/readiness.py in its job): each bad value is one line and nothing is submitted, walked in
    # tests/test_readiness.py (BAD_READINESS_VALUES)
    "SITE_NCCL_TRANSPORT": "read by the readiness check only: tests/test_readiness.py walks its bad values",
    "SITE_LINK_GBPS": "read by the readiness check only: tests/test_readiness.py walks its bad values",
    "SITE_MIN_BUSBW_SHARE": "read by the readiness check only: tests/test_readiness.py walks its bad values",
}


def options_of(help_text: str) -> dict:
    """{option: metavar or '{choices}' or None (a flag)} from a --help text's usage lines."""
    usage = help_text.split("\n\n")[0]
    return {o: (m or None) for o, m in USAGE_OPTION.findall(" ".join(usage.split())) if o != "--help"}


@pytest.fixture(scope="module")
def lesson_options():
    return {script: options_of(text) for script, text in help_texts_of(LESSONS).items()}


def environment_read_by(script: Path) -> set:
    """Names of the environment variables `script`'s code reads, its course/ and data_tools/ modules'
    included (os.environ[...], .get, .setdefault, .pop, `in os.environ`, os.getenv)."""
    from test_requires import imports_of

    names, seen, todo = set(), set(), [script]
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        todo += list(imports_of(path)[1])
        for node in ast.walk(ast.parse(path.read_text())):
            key = None
            if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
                key = node.slice
            elif isinstance(node, ast.Call) and node.args and (
                    ast.unparse(node.func).endswith(("environ.get", "environ.setdefault", "environ.pop", "getenv"))):
                key = node.args[0]
            elif isinstance(node, ast.Compare) and any(ast.unparse(c).endswith("environ") for c in node.comparators):
                key = node.left
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                names.add(key.value)
    return names


def test_every_option_of_every_lesson_has_bad_values(lesson_options):
    missing = sorted(f"{script} {option}" for script, options in lesson_options.items()
                     for option, metavar in options.items()
                     if metavar and not metavar.startswith("{") and option not in BAD_OPTION_VALUES)
    assert missing == [], f"options without bad values in BAD_OPTION_VALUES: {missing}"


def test_every_environment_variable_a_lesson_reads_has_bad_values():
    read = {name for script in LESSONS for name in environment_read_by(REPO / script)}
    assert {"RANK", "MASTER_PORT", "SLURM_PROCID", "COURSE_DATA_DIR"} <= read  # the scan finds them
    missing = sorted(read - set(BAD_ENV_VALUES) - set(ENV_NOT_WALKED))
    assert missing == [], f"variables read without bad values in BAD_ENV_VALUES or a reason in ENV_NOT_WALKED: {missing}"


def concrete(value: str, tmp_path) -> str:
    file = tmp_path / "a-file"
    file.write_text("not a directory\n")
    if value == "EMPTY_DIR":
        (tmp_path / "empty-dir").mkdir(exist_ok=True)
        return str(tmp_path / "empty-dir")
    if value == "HF_MODEL":  # a Hugging Face model directory as lesson 22 writes it: the course's GPT, default size
        from course.checkpoints import hf
        from course.gpt import GPT

        model_dir = tmp_path / "hf-model"
        if not model_dir.exists():
            hf.save_whole(model_dir, GPT().state_dict(), GPT().sizes, 64)
        return str(model_dir)
    return value.replace("FILE", str(file)).replace("MISSING", str(tmp_path / "missing"))


# What a lesson needs to get past its own input to the option or variable under test: (option, value).
INPUTS = {"day5/23_hf_finetuning.py": ("--model-dir", "HF_MODEL")}


def inputs(script: str, tmp_path, but: str = None) -> list:
    option, value = INPUTS.get(script, (None, None))
    return [] if option in (None, but) else [option, concrete(value, tmp_path)]


def one_line_before_any_rank(done, names, run_dir, case):
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0, f"{case}: exit 0"
    assert len(lines) == 1, f"{case}: expected one line, got:\n{done.stderr}"
    assert any(n in lines[0] for n in names), f"{case}: the line names none of {names}: {lines[0]}"
    assert not run_dir.exists(), f"{case}: left {run_dir} behind"


def check(lesson_main, script, args, names, run_dir, case, failures):
    try:
        done = lesson_main(script, *args)
        one_line_before_any_rank(done, names, run_dir, case)
    except AssertionError as e:
        failures.append(f"{case}: {str(e).splitlines()[0][:300]}")


@pytest.mark.parametrize("script", LESSONS)
def test_every_bad_option_value_is_one_line_before_any_rank(lesson_main, lesson_options, monkeypatch, dataset,
                                                            tmp_path, script):
    options = lesson_options[script]
    if script in MULTI_NODE:  # these start only under a launcher: torchrun's variables
        for key, val in TORCHRUN.items():
            monkeypatch.setenv(key, val)
    failures = []
    for option, metavar in options.items():
        if metavar is None:
            continue
        bad = ["nosuch"] if metavar.startswith("{") else BAD_OPTION_VALUES_OF.get((script, option)) or \
            BAD_OPTION_VALUES[option]
        for value in bad:
            run_dir = tmp_path / f"run-{len(failures)}-{option}-{value.replace('/', '_')}"
            needs = [word for given in OPTION_NEEDS.get(option, []) if given[0] in options for word in given]
            args = [option, concrete(value, tmp_path), *needs, *inputs(script, tmp_path, but=option)]
            if "--run-dir" in options and option != "--run-dir":
                args += ["--run-dir", run_dir]
            check(lesson_main, script, args, [option, value, args[1]], run_dir, f"{script} {option} {value}", failures)
    assert failures == [], "\n".join(failures)


@pytest.mark.parametrize("script", LESSONS)
def test_every_bad_environment_value_is_one_line_before_any_rank(lesson_main, lesson_options, monkeypatch, dataset,
                                                                 tmp_path, script):
    read = {name for name in environment_read_by(REPO / script)
            if ENV_USED_WITH.get(name, "--help") in [*lesson_options[script], "--help"]}
    has_run_dir = "--run-dir" in lesson_options[script]
    launched = TORCHRUN if script in MULTI_NODE else {}  # these start only under a launcher
    failures = []
    for name, (around, values) in BAD_ENV_VALUES.items():
        if name not in read:
            continue
        for value in values:
            run_dir = tmp_path / f"run-{name}-{value}"
            with monkeypatch.context() as m:
                for other in set(TORCHRUN) | set(SRUN):
                    m.delenv(other, raising=False)
                for key, val in {**(around or launched), name: concrete(value, tmp_path)}.items():
                    m.setenv(key, val)
                check(lesson_main, script, [*(["--run-dir", run_dir] if has_run_dir else []),
                                            *inputs(script, tmp_path, but=ENV_USED_WITH.get(name))], [name], run_dir,
                      f"{name}={value!r} {script}", failures)
    assert failures == [], "\n".join(failures)


# ------------------------------------------------------------------------------ what the walk does not spell out

# The walk asks the same of every option; these refusals say more, so each is written out: the words of the
# line, its exact exit code (2: argparse's, the command line is wrong; 1: a command line that parses but cannot
# run: a world size that does not divide, a path that cannot be written), values that are bad only beside
# another option, a positional argument, and the variables that decide the launch (none at all, a Slurm job's
# shell outside a step, torchrun's, srun's).  Each runs as the walk's cases do: in this process, no rank
# started, one line, and nothing written under the test's tmp dir (its run dir, given where the lesson has one,
# included).  Before each, every launcher variable is removed; `env` sets some again.  "FILE" and "MISSING" as
# above.  Refusals that need more than a command line and its environment (damaged data, HDF5 files,
# checkpoints, a port in use, the number of GPUs) are with the tests that make those.  One refusal per way of
# launching runs end to end in a fresh interpreter, for the exit code the shell sees: the lesson's own
# launcher (tests/test_faults.py, lesson 12 --nproc 0), no launcher at all (tests/test_day2_lessons.py,
# lesson 10), torchrun's variables (tests/test_day2_lessons.py, lesson 11 without its HDF5 file), srun's
# (tests/test_faults.py, a MASTER_PORT in use).
L4, L12 = "day1/4_mnist_manual_ddp.py", "day2/12_ddp_fault_tolerance.py"
TP, MESH, PIPELINE = "day4/19_tensor_parallel.py", "day4/20_device_mesh_2d.py", "day4/21_pipeline_parallel.py"
OUTSIDE = "this multi-node lesson does not start its own processes"
PTY_SHELL_OF_4_TASKS = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                        "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "4",
                        "SLURM_PTY_PORT": "35539", "SLURM_TASK_PID": "1"}  # pid 1 is never the lesson's
SAID = [  # script, arguments, environment, exit code, what the one line says
    # the parser the day-1 and day-2 training lessons share (course/launching/cli.py), on two of them
    *[(script, args, {}, 2, [said, "(see --help)"]) for script in (L4, L12) for args, said in [
        (["--nproc", "0"], "argument --nproc: 0 must be at least 1"),
        (["--nproc", "-2"], "argument --nproc: -2 must be at least 1"),
        (["--nproc", "-3"], "argument --nproc: -3 must be at least 1"),
        (["--nproc", "two"], "argument --nproc: 'two' is not a whole number"),
        (["--epochs", "0"], "argument --epochs: 0 must be at least 1"),
        (["--batch-size", "-1"], "argument --batch-size: -1 must be at least 1"),
        (["--batch-size", "-8"], "argument --batch-size: -8 must be at least 1"),
        (["--dataset", "cifar"], "argument --dataset: invalid choice: 'cifar'"),
        (["--dataset", "imagenet"], "argument --dataset: invalid choice: 'imagenet'"),
        (["--model", "resnet"], "argument --model: invalid choice: 'resnet'"),
        (["--lr", "0"], "argument --lr: 0.0 must be greater than 0"),
    ]],
    (L12, ["--checkpoint-every", "0"], {}, 2, ["argument --checkpoint-every: 0 must be at least 1", "(see --help)"]),
    # paths that cannot be written: through a file (unwritable even for root, unlike a chmod), or under /proc
    ("day1/2_mnist_training.py", ["--run-dir", "/proc/course-run"], {}, 2,
     ["run dir /proc/course-run cannot be written"]),
    ("day1/6_mnist_ddp_pt.py", ["--run-dir", "FILE"], {}, 2, ["run dir FILE cannot be written", "--run-dir"]),
    (L12, ["--run-dir", "FILE/run"], {}, 2, ["run dir FILE/run cannot be written", "--run-dir"]),
    (L12, ["--checkpoint-dir", "FILE/ckpt"], {}, 1, ["checkpoint dir FILE/ckpt cannot be written", "--checkpoint-dir"]),
    ("day1/5_mnist_manual_ddp_profile.py", ["--log-dir", "FILE/log"], {}, 1,
     ["log dir FILE/log cannot be written", "--log-dir"]),
    ("day1/5_mnist_manual_ddp_profile.py", ["--log-dir", "/proc/no/such/dir"], {}, 1,
     ["log dir /proc/no/such/dir cannot be written"]),
    # lesson 16's --export, checked before the checkpoint is read (tests/test_day3_dcp.py: with an intact one)
    ("day3/16_distributed_checkpoint.py", ["--export", "/proc/no/such/model.pt"], {}, 1,
     ["--export /proc/no/such/model.pt cannot be written (No such file or directory)"]),
    ("day3/16_distributed_checkpoint.py", ["--export", "FILE/model.pt"], {}, 1,
     ["--export FILE/model.pt cannot be written (FILE is a file)", "--export model.pt"]),
    ("day3/16_distributed_checkpoint.py", ["--export", "/proc"], {}, 1,
     ["--export /proc cannot be written (it is a directory)"]),
    ("day1/5_mnist_manual_ddp_profile.py", ["--max-steps", "3"], {}, 1,
     ["--max-steps 3 ends training before the profiler has recorded"]),
    # lesson 7's world sizes (a positional argument: the walk reads options only), and --sweep under torchrun
    ("day1/7_mnist_ddp_pt_timing.py", ["2", "--nproc", "3"], {}, 2, ["disagree"]),
    ("day1/7_mnist_ddp_pt_timing.py", ["0"], {}, 2, ["must be at least 1"]),
    ("day1/7_mnist_ddp_pt_timing.py", ["--sweep"], {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}, 2,
     ["--sweep", "torchrun"]),
    ("day1/8_mnist_ddp_pt_lr.py", ["--warmup-steps", "-1"], {}, 2, ["must be 0 or more"]),
    # the multi-node lessons without a launcher, and in a batch script's own shell (a job, but no srun step)
    *[(script, [], {}, 1, [OUTSIDE, "salloc --nodes 2 --ntasks-per-node=2",
                           f"./day2/multinode_setup_and_run.sh {Path(script).name}",
                           f"torchrun --standalone --nproc_per_node=2 {script}"])
      for script in ("day2/9_torch_dist_multi_node.py", "day2/11_mnist_ddp_pt_multinode_streaming.py")],
    ("day2/9_torch_dist_multi_node.py", [], {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
                                             "SLURM_JOB_NODELIST": "node[1-2]"}, 1,
     ["inside Slurm job 4242 but not in a job step"]),
    # a lesson started from the shell of a plain `srun --pty bash` in an allocation of 4 tasks: a step of 4 tasks
    # whose task 0 (SLURM_TASK_PID, not the lesson) is the shell; with or without --nproc, and a day-2 lesson
    *[(script, args, PTY_SHELL_OF_4_TASKS, 1, ["this shell is task 0 of a Slurm step of 4 tasks",
                                               "ranks that never come",
                                               "srun --ntasks=1 --cpus-per-task=$SLURM_JOB_CPUS_PER_NODE --pty bash"])
      for script, args in [(L4, []), (L4, ["--nproc", "2"]), ("day2/9_torch_dist_multi_node.py", [])]],
    # variables torch reads (the walk gives every lesson more bad values): torch itself would stop with a
    # traceback, at import torch or at init_process_group; the lessons that teach them, and lesson 0
    *[(script, [], {name: value}, 1, [f"{name}={value!r}", said]) for script, name, value, said in [
        ("day3/17_debugging_hangs.py", "TORCH_DISTRIBUTED_DEBUG", "bogus", "is not OFF, INFO or DETAIL"),
        ("day1/0_torch_dist.py", "TORCH_DISTRIBUTED_DEBUG", "", "is not OFF, INFO or DETAIL"),
        ("day3/13_mixed_precision.py", "TORCH_LOGS", "ddp_graph", "'ddp_graph' is not a log or artifact name"),
        ("day3/17_debugging_hangs.py", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "x", "is not 0, 1, 2 or 3"),
        ("day3/17_debugging_hangs.py", "TORCH_NCCL_BLOCKING_WAIT", "on", "is neither on nor off for torch"),
    ]],
    # rank 0 of an srun step told to listen on another host (rank 1, which waits for it: tests/test_faults.py)
    ("day1/6_mnist_ddp_pt.py", [], {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1",
                                    "SLURM_LOCALID": "0", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
                                    "SLURM_NODEID": "0", "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29731"}, 1,
     ["rank 0 runs on", "MASTER_ADDR=192.0.2.1 is not an address of this host"]),
    # day 3
    ("day3/13_mixed_precision.py", ["--quick", "--precision", "fp8"], {}, 2,
     ["argument --precision: invalid choice: 'fp8'"]),
    ("day3/13_mixed_precision.py", ["--quick", "--width", "30", "--heads", "4"], {}, 1,
     ["--width 30 is not a multiple of --heads 4"]),
    ("day3/13_mixed_precision.py", ["--quick", "--compile", "--bucket-cap-mb", "0.5"], {}, 1,
     ["--compile with --bucket-cap-mb 0.5: compiled DDP splits the graph"]),
    ("day3/14_accumulation_checkpointing.py", ["--quick", "--nproc", "2", "--accumulate", "0"], {}, 2,
     ["argument --accumulate: 0 must be at least 1"]),
    ("day3/14_accumulation_checkpointing.py", ["--quick", "--nproc", "2", "--accumulate", "1.5"], {}, 2,
     ["argument --accumulate: '1.5' is not a whole number"]),
    ("day3/14_accumulation_checkpointing.py",
     ["--quick", "--nproc", "2", "--accumulate", "3", "--train-samples", "64", "--batch-size", "16"], {}, 1,
     ["--accumulate 3: each rank's shard of 64 samples holds only 2 batches of 16 (2 ranks)"]),
    ("day3/15_fsdp2.py", ["--quick", "--reshard-after-forward", "maybe"], {}, 2,
     ["argument --reshard-after-forward: invalid choice: 'maybe'"]),
    ("day3/15_fsdp2.py", ["--quick", "--reduce-dtype", "fp8"], {}, 2,
     ["argument --reduce-dtype: invalid choice: 'fp8'"]),
    ("day3/15_fsdp2.py", ["--quick", "--model", "mlp"], {}, 1,
     ["--model mlp: lesson 15 shards the ViT block by block"]),
    ("day3/15_fsdp2.py", ["--quick", "--memory-budget-mb", "-1"], {}, 1,
     ["--memory-budget-mb -1: must be 0 (no budget) or more"]),
    ("day3/15_fsdp2.py", ["--quick", "--nproc", "1"], {}, 1,
     ["per-rank budget 4 MB: DDP's full replica needs 6.18 MB (does not fit); FSDP2 over 1 rank needs 6.18 MB "
      "(does not fit); use more ranks"]),
    ("day3/15_fsdp2.py", ["--quick", "--nproc", "2", "--depth", "8"], {}, 1,
     ["FSDP2 over 2 ranks needs 6.13 MB (does not fit)"]),
    ("day3/17_debugging_hangs.py", ["--bug", "typo"], {}, 2, ["invalid choice: 'typo'"]),
    ("day3/17_debugging_hangs.py", ["--nproc", "1", "--bug", "skip"], {}, 1, ["needs at least 2 ranks"]),
    # day 4: what does not divide among the ranks, the stages, the micro-batches
    (TP, ["--quick", "--heads", "4", "--nproc", "3"], {}, 1,
     ["--heads 4 does not divide among 3 tensor-parallel ranks"]),
    (TP, ["--quick", "--model", "mlp", "--nproc", "2"], {}, 1, ["tensor parallelism cuts the ViT's"]),
    (MESH, ["--quick", "--inner", "3", "--nproc", "4"], {}, 1,
     ["--inner 3 does not divide the 4 ranks into rows", "--inner 1, 2, 4"]),
    (MESH, ["--quick", "--heads", "4", "--inner", "3", "--nproc", "6"], {}, 1,
     ["--heads 4 does not divide among 3 tensor-parallel ranks"]),
    (TP, ["--quick", "--sequence-parallel", "--patch", "4", "--nproc", "2"], {}, 1,
     ["--sequence-parallel cuts the 49 tokens of --patch 4 into 2 equal pieces", "use --patch 1 or 2 or 7 or 14"]),
    (MESH, ["--quick", "--sequence-parallel", "--patch", "4", "--nproc", "4"], {}, 1,
     ["--sequence-parallel cuts the 49 tokens of --patch 4 into 2 equal pieces"]),
    (MESH, ["--quick", "--sequence-parallel", "--layout", "hsdp"], {}, 1,
     ["--sequence-parallel cuts tensor parallelism's activations along the tokens; --layout hsdp has no tensor "
      "parallelism: use --layout fsdp-tp"]),
    (PIPELINE, ["--quick", "--depth", "4", "--nproc", "3"], {}, 1,
     ["--depth 4 blocks do not divide among 3 stages (one per rank)"]),
    (PIPELINE, ["--quick", "--depth", "4", "--nproc", "4", "--schedule", "interleaved-1f1b"], {}, 1,
     ["--depth 4 blocks do not divide among 4 ranks x 2 stages each; use --depth 8"]),
    (PIPELINE, ["--quick", "--batch-size", "30", "--microbatches", "4"], {}, 1,
     ["--batch-size 30 does not split into 4 equal"]),
    (PIPELINE, ["--quick", "--depth", "4", "--nproc", "4", "--schedule", "1f1b", "--microbatches", "2"], {}, 1,
     ["--schedule 1f1b needs at least as many micro-batches as stages: --microbatches 2 < 4 stages"]),
    (PIPELINE, ["--quick", "--nproc", "2", "--schedule", "interleaved-1f1b", "--microbatches", "5", "--batch-size",
                "60"], {}, 1, ["--microbatches 5 is not a multiple of 2; use a multiple of 2"]),
    (PIPELINE, ["--quick", "--model", "mlp"], {}, 1, ["the pipeline's stages are runs of the ViT's blocks"]),
    (PIPELINE, ["--quick", "--stage-ms", "-1"], {}, 2, ["-1.0 must be 0 or more"]),
]


def tree(path: Path) -> list:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("script, args, env, code, said", SAID,
                         ids=[" ".join([Path(s).name.split("_")[0], *a, *e]) for s, a, e, *_ in SAID])
def test_each_refusal_the_walk_does_not_spell_out(lesson_main, lesson_options, monkeypatch, dataset, tmp_path,
                                                 script, args, env, code, said):
    args, said = [concrete(a, tmp_path) for a in args], [concrete(phrase, tmp_path) for phrase in said]
    if "--run-dir" in lesson_options[script] and "--run-dir" not in args:
        args += ["--run-dir", tmp_path / "run"]
    for name in [*TORCHRUN, *(n for n in os.environ if n.startswith("SLURM_"))]:
        monkeypatch.delenv(name, raising=False)
    before = tree(tmp_path)
    done = lesson_main(script, *args, env=env)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert (done.returncode, len(lines)) == (code, 1), f"exit {done.returncode} (expected {code}):\n{done.stderr}"
    for phrase in said:
        assert phrase in lines[0], f"{phrase!r} not in: {lines[0]}"
    assert tree(tmp_path) == before, "written under the test's tmp dir"
