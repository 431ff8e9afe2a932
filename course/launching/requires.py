"""What a lesson needs from the Python environment that runs it, checked once before any rank starts.

    python course/launching/requires.py day2/11_mnist_ddp_pt_multinode_streaming.py [the lesson's arguments]

Every lesson calls require(__file__) first, before it imports torch; the launchers run this file once per job.
Prints nothing and exits 0 when the interpreter has every package the lesson (with these arguments) imports
and a torch release with what the lesson uses; otherwise one line naming what is missing, the interpreter
and where it looked, and exit 1.  The Slurm launchers (slurm/lib/job.sh) and multinode_setup_and_run.sh run
it with the ranks' PYTHON after the site set-up: a site's PyTorch module without h5py then stops the job in one
line instead of failing on every rank.  Nothing is imported: packages are found with importlib.util.find_spec
and torch's release is read from its metadata, so the check takes a fraction of a second.

The variables torch reads that the course teaches (TORCH_DISTRIBUTED_DEBUG, TORCH_LOGS, TORCH_NCCL_*) are
checked here too: a value torch refuses is a traceback in every process, at `import torch` or at
init_process_group; here it is one line each, and exit 1.
"""
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys
from pathlib import Path

# import name -> the package pip installs it from (requirements.txt)
PACKAGES = {"torch": "torch", "numpy": "numpy", "matplotlib": "matplotlib", "h5py": "h5py", "psutil": "psutil",
            "tensorboard": "tensorboard", "safetensors": "safetensors"}
EVERY_LESSON = ("torch", "numpy", "matplotlib")  # the model and data, the plots of the run dir
BY_LESSON = {  # imported by these lessons only (lazily, where they read or write an HDF5 file or TensorBoard events)
    "11_mnist_ddp_pt_multinode_streaming": ("h5py",),
    "create_mnist_h5": ("h5py",),
    "5_mnist_manual_ddp_profile": ("tensorboard",),
    "test-profile": ("tensorboard",),
    "22_gpt_pretraining": ("tensorboard", "safetensors"),
    "23_hf_finetuning": ("tensorboard", "safetensors"),
}
BY_OPTION = {"--watch-hardware": ("psutil", "tensorboard"), "--profile": ("tensorboard",)}
# The oldest torch release with what a lesson uses: (folder or lesson name, (major, minor), what it uses).
TORCH_FROM = [("day3", (2, 6), "torch.distributed.fsdp.fully_shard, FSDP2's public API (lessons 15-16; "
                               "lessons 13-17 are tested with 2.14.1)"),
              ("day4", (2, 14), "torch.distributed.all_gather_single and reduce_scatter_single, the names the "
                                "collectives have since all_gather_into_tensor and reduce_scatter_tensor were "
                                "deprecated, and DTensor's tensor parallelism (lessons 18-19 are tested with "
                                "2.14.1)"),
              ("day5", (2, 14), "DTensor's tensor parallelism with sequence parallelism and "
                                "torch.distributed.checkpoint's HuggingFaceStorageReader and Writer (lessons 22-23 "
                                "are tested with 2.14.1)")]


def needs(lesson: str, argv=()) -> list:
    """The import names lesson `lesson` (a path) needs when run with the arguments `argv`."""
    name = Path(lesson).stem
    wanted = list(EVERY_LESSON) + list(BY_LESSON.get(name, ()))
    for option, packages in BY_OPTION.items():
        if any(a == option or a.startswith(option + "=") for a in argv):
            wanted += packages
    return list(dict.fromkeys(wanted))


def torch_release():
    """(major, minor) of the installed torch, or None when it is not installed."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def problems(lesson: str, argv=()) -> list:
    """What is missing for `lesson`: packages (pip names) and a torch too old for it."""
    missing = [f"{PACKAGES.get(m, m)} (import {m})" for m in needs(lesson, argv) if _absent(m)]
    release = torch_release()
    if release is not None:
        path = Path(lesson).resolve()
        for where, oldest, uses in TORCH_FROM:
            if where in (path.parent.name, path.stem) and release < oldest:
                missing.append(f"torch >= {oldest[0]}.{oldest[1]} for {uses}; this is torch "
                               f"{importlib.metadata.version('torch')}")
    return missing


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a broken package counts as missing
        return True


# c10d's getCvarBool (torch/include/torch/csrc/distributed/c10d/Utils.hpp): these words in any case, nothing else
ON_OR_OFF = ("y", "yes", "1", "t", "true", "n", "no", "0", "f", "false")


def environment_problems() -> list:
    """One line for each variable torch reads (and the course teaches) that holds a value torch 2.14.1 refuses:
    TORCH_DISTRIBUTED_DEBUG (a ValueError when torch.distributed is imported), TORCH_LOGS (a ValueError at
    `import torch`), and the NCCL process group's switches ("Invalid value for environment variable" at
    init_process_group, on GPUs)."""
    found = []
    debug = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    if debug is not None and debug.upper() not in ("OFF", "INFO", "DETAIL"):
        found.append(f"TORCH_DISTRIBUTED_DEBUG={debug!r} is not OFF, INFO or DETAIL, and torch stops on it when "
                     f"torch.distributed is imported; set one of them (DETAIL: lesson 17), or unset it")
    logs = os.environ.get("TORCH_LOGS")
    if logs is not None and torch_logs_problem(logs):
        found.append(f"TORCH_LOGS={logs!r}: {torch_logs_problem(logs)}, and torch stops on it at import torch; "
                     f"give names from: TORCH_LOGS=help python -c 'import torch' (lesson 13: TORCH_LOGS=ddp_graphs), "
                     f"or unset it")
    for name, value in (("TORCH_NCCL_BLOCKING_WAIT", os.environ.get("TORCH_NCCL_BLOCKING_WAIT")),
                        ("TORCH_NCCL_DESYNC_DEBUG", os.environ.get("TORCH_NCCL_DESYNC_DEBUG")),
                        ("TORCH_NCCL_DUMP_ON_TIMEOUT", os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT"))):
        if value is not None and value.lower() not in ON_OR_OFF:
            found.append(f"{name}={value!r} is neither on nor off for torch (1, true, yes, y, t or 0, false, no, "
                         f"n, f), and NCCL's process group stops on it at init_process_group; use 1 or 0, or unset it")
    handling = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    if handling is not None and handling.strip() not in ("0", "1", "2", "3"):
        found.append(f"TORCH_NCCL_ASYNC_ERROR_HANDLING={handling!r} is not 0, 1, 2 or 3 (no handling, tear down, "
                     f"clean up only, tear down without cleaning up: the default), the modes torch knows; use one, "
                     f"or unset it")
    dump_ms = os.environ.get("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC")
    if dump_ms is not None and not dump_ms.strip().isdigit():
        found.append(f"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC={dump_ms!r} is not a whole number of milliseconds, and "
                     f"NCCL's process group stops on it at init_process_group; give one, or unset it")
    return found


def torch_logs_problem(value: str):
    """Why torch would refuse TORCH_LOGS=value, or None: torch._logging._internal._parse_log_settings, read
    without importing torch: its regex, then each name a registered log or artifact (the register_log and
    register_artifact calls of torch/_logging/_registrations.py), "all", or a module that exists.  Set but
    empty, it is refused too."""
    if value == "":  # parsed as {} where a LogState is expected: an AttributeError at import torch (2.14.1)
        return "set but empty, which torch cannot read"
    if value in ("help", "+help"):
        return "torch answers 'help' with its list of names instead of running"
    if not re.fullmatch(r"((\+|-)?[\w\.]+,\s*)*(\+|-)?[\w\.]+?", value):
        return "not names separated by commas, each with + (more) or - (less) before it or nothing"
    spec = importlib.util.find_spec("torch")  # a top-level package: found without being imported
    registrations = Path(spec.origin).parent / "_logging" / "_registrations.py" if spec and spec.origin else None
    if registrations is None or not registrations.is_file():
        return None  # another torch layout: torch says it itself
    known = set(re.findall(r'register_(?:log|artifact)\(\s*"([\w.]+)"', registrations.read_text()))
    for name in re.sub(r"\s+", "", value).split(","):
        bare = name.replace("+", "").replace("-", "")
        if bare != "all" and bare not in known and not _module_exists(bare):
            return f"{bare!r} is not a log or artifact name torch knows, nor a module"
    return None


def _module_exists(qualified: str) -> bool:
    """Whether a module of that dotted name exists, found without importing any package on the way."""
    parts = qualified.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return False
    for i in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            return False
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]),
                                                        list(spec.submodule_search_locations))
    return spec is not None


def message(lesson: str, missing: list) -> str:
    return (f"error: {Path(lesson).name} needs {'; '.join(missing)}: not found by {sys.executable} "
            f"(looked in {', '.join(p for p in sys.path if p.endswith('-packages')) or 'no site-packages'}); "
            f"install it there (pip install -r requirements.txt; the course's own venv: ./quickstart.sh), or load "
            f"the module or environment that has it (on a cluster: in the site profile's site_setup). No rank was "
            f"started.")


def require(lesson_file: str) -> None:
    """A lesson's first step, before it imports torch: what it needs with the arguments it was given, or one
    line and exit 1 (a torch without fully_shard would otherwise be an ImportError from the lesson's imports)."""
    missing, variables = problems(lesson_file, sys.argv[1:]), environment_problems()
    if missing:
        print(message(lesson_file, missing), file=sys.stderr)
    for line in variables:
        print(f"error: {Path(lesson_file).name}: {line}", file=sys.stderr)
    if missing or variables:
        raise SystemExit(1)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python course/launching/requires.py LESSON.py [its arguments]", file=sys.stderr)
        return 2
    lesson, rest = argv[0], argv[1:]
    missing, variables = problems(lesson, rest), environment_problems()
    if missing:
        print(message(lesson, missing), file=sys.stderr)
    for line in variables:
        print(f"error: {Path(lesson).name}: {line}", file=sys.stderr)
    return 1 if missing or variables else 0


if __name__ == "__main__":
    sys.exit(main())
