"""Every input a lesson reads is bad input too: each of its options and each environment variable its code
reads gets bad values from the tables below, and each bad value ends the lesson before any rank starts with
one line on stderr naming what is wrong, a non-zero exit, and no run dir left behind.

The options come from each lesson's --help and the variables from its code (every course/ and data_tools/
module it imports, followed module by module), so that a new option or variable without bad values here
fails the first two tests: nothing can skip the walk.  The lessons run in this process (conftest's
lesson_main), where starting a rank is a test failure.
"""
import ast
import re
from pathlib import Path

import pytest

from conftest import REPO, help_texts_of

LESSONS = sorted(str(p.relative_to(REPO)) for d in ("day1", "day2", "day3", "day4") for p in (REPO / d).glob("*.py"))
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
}
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
    "OMP_NUM_THREADS": ({}, ["0", "x"]),
    "COURSE_DATA_DIR": ({}, ["MISSING"]),
}
# Variables that only lessons with one of these options use (the others import the module that reads them).
ENV_USED_WITH = {"COURSE_DATA_DIR": "--data-dir"}
# Variables read without bad values here, and why.
ENV_NOT_WALKED = {
    "SLURM_STEP_TASKS_PER_NODE": "read only to count a node's ranks, as the launchers give it",
    "SLURM_TASKS_PER_NODE": "read only to count a node's ranks, as the launchers give it",
    "SLURM_STEP_NODELIST": "a host list handed to scontrol, which names what it cannot expand",
    "SLURM_JOB_NODELIST": "a host list handed to scontrol, which names what it cannot expand",
    "SLURM_STEP_ID": "only compared, never parsed",
    "SLURM_GPUS_ON_NODE": "only printed",
    "SLURMD_NODENAME": "only printed and compared: the node a rank runs on (lesson 20's mesh rows, lesson 21's stages)",
    "SLURM_RESTART_COUNT": "set by Slurm itself on a requeue, only counted",
    "TORCHELASTIC_RESTART_COUNT": "set by torchrun itself, only counted",
    "CUDA_VISIBLE_DEVICES": "read by the CUDA runtime; course/launching/devices.py says when a rank sees no GPU",
    "CUBLAS_WORKSPACE_CONFIG": "set by lesson 12 for reproducible kernels, not read",
    "COURSE_START_METHOD": "how --nproc starts its ranks; a bad value, or fork where it is unsafe, is one line "
                           "(tests/test_launch.py)",
    "COURSE_EXIT_GRACE": "a test aid",
    "TORCH_FR_BUFFER_SIZE": "set by lesson 17 for its ranks",
    "TORCH_FR_DUMP_TEMP_FILE": "set by lesson 17 for its ranks",
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
    return value.replace("FILE", str(file)).replace("MISSING", str(tmp_path / "missing"))


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
        for value in ["nosuch"] if metavar.startswith("{") else BAD_OPTION_VALUES[option]:
            run_dir = tmp_path / f"run-{len(failures)}-{option}-{value.replace('/', '_')}"
            needs = [word for given in OPTION_NEEDS.get(option, []) if given[0] in options for word in given]
            args = [option, concrete(value, tmp_path), *needs]
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
                check(lesson_main, script, ["--run-dir", run_dir] if has_run_dir else [], [name], run_dir,
                      f"{name}={value!r} {script}", failures)
    assert failures == [], "\n".join(failures)
