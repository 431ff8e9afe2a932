"""A job's Python must have what its lesson needs (course/launching/requires.py), checked once before any rank: a site's
PyTorch module without h5py, or with a torch older than day 3 needs, is one line naming what is missing and the
interpreter, not a traceback on every rank.

The environments are real interpreters: a bare venv whose only packages are this venv's, seen through a
folder of links that leaves out what the test takes away (h5py) or puts an older torch's metadata in place
of torch's.
"""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from course.launching import requires

SITE_PACKAGES = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir())


def python_without(tmp_path, leave_out=(), torch_version=None) -> Path:
    """A bare venv that sees this venv's packages except those whose names start with `leave_out`; with
    `torch_version`, torch's metadata says that release."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("the tests run outside a venv")
    farm = tmp_path / "packages"
    farm.mkdir()
    for entry in SITE_PACKAGES.iterdir():
        if entry.name.lower().startswith(tuple(leave_out)) or (torch_version and entry.name.startswith("torch-")
                                                                and entry.name.endswith(".dist-info")):
            continue
        (farm / entry.name).symlink_to(entry)
    if torch_version:
        info = farm / f"torch-{torch_version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp_path / "env"], check=True, timeout=60)
    site = next((tmp_path / "env" / "lib").glob("python*/site-packages"))
    (site / "course-packages.pth").write_text(f"{farm}\n")
    return tmp_path / "env" / "bin" / "python"


def launcher_step(python: Path, lesson: str, *args, cwd) -> subprocess.CompletedProcess:
    """A launcher's `job_start` and `step srun ... lesson` (slurm/lib/job.sh), outside Slurm; `echo` stands in
    for srun: "srun reached" if the check passes."""
    env = {**os.environ, "SLURM_JOB_ID": "7", "COURSE_REPO": str(REPO), "PYTHON": str(python)}
    env.pop("COURSE_SITE", None)
    script = ('set -euo pipefail; source "$COURSE_REPO/slurm/lib/job.sh"; job_start; '
              'step echo "srun reached" "$PYTHON" -u "$@"')
    return subprocess.run(["bash", "-c", script, "launcher", str(REPO / lesson), *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=60)


def test_a_job_whose_python_lacks_h5py_stops_before_lesson_11_with_one_line(tmp_path):
    python = python_without(tmp_path, leave_out=("h5py",))
    done = launcher_step(python, "day2/11_mnist_ddp_pt_multinode_streaming.py", "--quick", cwd=tmp_path)
    assert done.returncode == 1 and "srun reached" not in done.stdout, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: 11_mnist_ddp_pt_multinode_streaming.py needs h5py (import h5py): "
                               f"not found by {python} (looked in ")
    assert str(tmp_path / "env") in lines[0] and lines[0].endswith("No rank was started.")
    # the same interpreter runs a lesson that does not read HDF5
    done = launcher_step(python, "day1/2_mnist_training.py", cwd=tmp_path)
    assert done.returncode == 0 and "srun reached" in done.stdout, done.stdout + done.stderr


def test_a_torch_older_than_day_3_needs_is_one_line_before_a_day_3_lesson(tmp_path):
    python = python_without(tmp_path, torch_version="2.5.1")
    done = launcher_step(python, "day3/15_fsdp2.py", cwd=tmp_path)
    assert done.returncode == 1 and "srun reached" not in done.stdout, done.stdout + done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and "torch >= 2.6 for torch.distributed.fsdp.fully_shard" in line, line
    assert "this is torch 2.5.1" in line
    done = launcher_step(python, "day2/10_mnist_ddp_pt_multinode.py", cwd=tmp_path)  # days 1-2: any 2.x
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_watch_hardware_option_adds_psutil(monkeypatch):
    real = requires.importlib.util.find_spec
    monkeypatch.setattr(requires.importlib.util, "find_spec", lambda m: None if m == "psutil" else real(m))
    assert requires.problems("day3/14_accumulation_checkpointing.py", []) == []
    assert requires.problems("day3/14_accumulation_checkpointing.py", ["--watch-hardware"]) == [
        "psutil (import psutil)"]


# Third-party modules a lesson's code imports that the check leaves out, and why.
NOT_CHECKED = {
    "torchvision": "imported only to download a dataset (data_tools/prepare_data.py), never by a rank",
    "pynvml": "optional: without it the hardware monitor says so and goes on without GPU numbers",
}


def imports_of(path: Path):
    """(top-level names of the other modules `path` imports, the course/ and data_tools/ files it imports), at
    any depth of its code: lazy imports inside functions count."""
    names, ours = set(), set()

    def ours_or_name(dotted: str, members=()):
        parts = dotted.split(".")
        if parts[0] not in ("course", "data_tools"):
            names.add(parts[0])
        elif REPO.joinpath(*parts).is_dir():  # from course.launching import cli
            package = REPO.joinpath(*parts)
            ours.update(package / f"{m}.py" for m in members if (package / f"{m}.py").is_file())
        else:  # from course.launching.launch import launch
            ours.add(REPO.joinpath(*parts).with_suffix(".py"))

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                ours_or_name(a.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            ours_or_name(node.module, [a.name for a in node.names])
    return names, ours


def test_every_package_a_lesson_imports_is_checked_for_it():
    """Every third-party module reachable from a lesson (its own imports and those of the course/ and
    data_tools/ modules it imports, followed module by module) is what course/launching/requires.py checks for that
    lesson with all its options, or is in NOT_CHECKED: a new import cannot skip the check."""
    stdlib = set(sys.stdlib_module_names)
    scripts = sorted([*REPO.glob("day*/*.py"), REPO / "data_tools" / "create_mnist_h5.py"])
    assert len(scripts) >= 20
    unchecked = {}
    for script in scripts:
        seen, todo, third_party = set(), [script], set()
        while todo:
            path = todo.pop()
            if path in seen:
                continue
            seen.add(path)
            names, modules = imports_of(path)
            third_party |= names - stdlib
            todo += modules
        checked = set(requires.needs(str(script), list(requires.BY_OPTION)))
        extra = third_party - checked - set(NOT_CHECKED)
        if extra:
            unchecked[script.name] = sorted(extra)
    assert unchecked == {}, f"imported but not checked before the ranks start: {unchecked}"


def test_a_day_3_lesson_started_by_hand_on_a_torch_too_old_says_so_in_one_line(tmp_path):
    """The lesson's own first step (course/launching/requires.py require), before it imports torch: no ImportError from
    `from torch.distributed.fsdp import fully_shard`, no rank; a day-1 lesson goes on on the same interpreter."""
    python = python_without(tmp_path, torch_version="2.5.1")
    done = subprocess.run([python, REPO / "day3" / "15_fsdp2.py", "--nproc", "2", "--quick"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: 15_fsdp2.py needs torch >= 2.6 for "
                                                                   "torch.distributed.fsdp.fully_shard"), done.stderr
    assert "this is torch 2.5.1" in done.stderr and done.stdout == ""
    assert not (tmp_path / "runs").exists()
    done = subprocess.run([python, REPO / "day1" / "0_torch_dist.py", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # days 1-2 ask for no newer torch
    assert done.returncode == 0 and "usage:" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("name, value, said", [
    ("TORCH_DISTRIBUTED_DEBUG", "bogus", "is not OFF, INFO or DETAIL"),
    ("TORCH_LOGS", "bogus", "'bogus' is not a log or artifact name torch knows"),
    ("TORCH_LOGS", "", "set but empty"),
])
def test_a_value_torch_refuses_at_import_is_one_line_before_torch_is_imported(tmp_path, name, value, said):
    """torch 2.14.1 reads these while `import torch` runs and stops with a ValueError (TORCH_LOGS="": an
    AttributeError) before a lesson's first line after it; the lesson's require(__file__) comes first and says
    it in one line (before: a traceback of 10-20 lines in every process started)."""
    done = subprocess.run([sys.executable, REPO / "day1" / "0_torch_dist.py", "--nproc", "2"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env={**os.environ, name: value})
    assert done.returncode == 1 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"error: 0_torch_dist.py: {name}={value!r}"), \
        done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr
    pure = subprocess.run([sys.executable, "-c", "import torch.distributed"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, name: value})
    assert pure.returncode == 1 and "Traceback" in pure.stderr  # what torch does with it on its own
