"""What a lesson needs from the Python environment that runs it, checked once before any rank starts.

    python course/launching/requires.py day2/11_mnist_ddp_pt_multinode_streaming.py [the lesson's arguments]

Every lesson calls require(__file__) first, before it imports torch; the launchers run this file once per job.
Prints nothing and exits 0 when the interpreter has every package the lesson (with these arguments) imports
and a torch release with what the lesson uses; otherwise one line naming what is missing, the interpreter
and where it looked, and exit 1.  The Slurm launchers (slurm/lib/job.sh) and multinode_setup_and_run.sh run
it with the ranks' PYTHON after the site set-up: a site's PyTorch module without h5py then stops the job in one
line instead of failing on every rank.  Nothing is imported: packages are found with importlib.util.find_spec
and torch's release is read from its metadata, so the check takes a fraction of a second.
"""
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

# import name -> the package pip installs it from (requirements.txt)
PACKAGES = {"torch": "torch", "numpy": "numpy", "matplotlib": "matplotlib", "h5py": "h5py", "psutil": "psutil",
            "tensorboard": "tensorboard"}
EVERY_LESSON = ("torch", "numpy", "matplotlib")  # the model and data, the plots of the run dir
BY_LESSON = {  # imported by these lessons only (lazily, where they read or write an HDF5 file or TensorBoard events)
    "11_mnist_ddp_pt_multinode_streaming": ("h5py",),
    "create_mnist_h5": ("h5py",),
    "5_mnist_manual_ddp_profile": ("tensorboard",),
    "test-profile": ("tensorboard",),
}
BY_OPTION = {"--watch-hardware": ("psutil", "tensorboard"), "--profile": ("tensorboard",)}
# The oldest torch release with what a lesson uses: (folder or lesson name, (major, minor), what it uses).
TORCH_FROM = [("day3", (2, 6), "torch.distributed.fsdp.fully_shard, FSDP2's public API (lessons 15-16; "
                               "lessons 13-17 are tested with 2.14.1)"),
              ("day4", (2, 14), "torch.distributed.all_gather_single and reduce_scatter_single, the names the "
                                "collectives have since all_gather_into_tensor and reduce_scatter_tensor were "
                                "deprecated, and DTensor's tensor parallelism (lessons 18-19 are tested with "
                                "2.14.1)")]


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


def message(lesson: str, missing: list) -> str:
    return (f"error: {Path(lesson).name} needs {'; '.join(missing)}: not found by {sys.executable} "
            f"(looked in {', '.join(p for p in sys.path if p.endswith('-packages')) or 'no site-packages'}); "
            f"install it there (pip install -r requirements.txt; the course's own venv: ./quickstart.sh), or load "
            f"the module or environment that has it (on a cluster: in the site profile's site_setup). No rank was "
            f"started.")


def require(lesson_file: str) -> None:
    """A lesson's first step, before it imports torch: what it needs with the arguments it was given, or one
    line and exit 1 (a torch without fully_shard would otherwise be an ImportError from the lesson's imports)."""
    missing = problems(lesson_file, sys.argv[1:])
    if missing:
        print(message(lesson_file, missing), file=sys.stderr)
        raise SystemExit(1)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python course/launching/requires.py LESSON.py [its arguments]", file=sys.stderr)
        return 2
    lesson, rest = argv[0], argv[1:]
    missing = problems(lesson, rest)
    if missing:
        print(message(lesson, missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
