"""A lesson started from inside its own folder (cd day2 && ./multinode_setup_and_run.sh ..., as the original
workshop's users do) writes its outputs relative to that folder, and git shows none of them as untracked.

Two checks: every lesson's default output option (--run-dir, --log-dir, --checkpoint-dir, read from its --help)
and the launchers' log folder are ignored by git when they lie under day1/ to day4/ or slurm/; and real
runs from inside day1/ and day2/, in a copy of the lessons with the repository's .gitignore, leave `git
status` clean.
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, REPO, help_texts_of, run

LESSON_DIRS = ("day1", "day2", "day3", "day4")
# a path option whose default is where outputs go (the data dir's default is the repository's data/)
OUTPUT_OPTION = re.compile(r"--(run-dir|log-dir|checkpoint-dir) [A-Z_]+ .*?\(default: ([^)\s]+)\)")


def lessons() -> list:
    return sorted(str(p.relative_to(REPO)) for d in LESSON_DIRS for p in (REPO / d).glob("*.py"))


def ignored(paths) -> set:
    """The paths (relative to the repository) that git ignores."""
    proc = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=REPO, input="\n".join(paths),
                          capture_output=True, text=True)
    assert proc.returncode in (0, 1), proc.stderr
    return set(proc.stdout.split())


def test_every_default_output_under_a_lesson_folder_is_ignored_by_git():
    defaults = {}
    for script, text in help_texts_of(lessons()).items():
        for option, default in OUTPUT_OPTION.findall(" ".join(text.split())):
            if default != "None" and not default.split("/")[0].isupper():  # None, RUN_DIR/...: in the run dir
                defaults[f"{script} --{option}"] = default
    assert len(defaults) >= 15, f"too few output defaults read from --help: {defaults}"
    wanted = {f"{folder}/{default}/x": where for where, default in defaults.items()
              for folder in (*LESSON_DIRS, "slurm")}
    wanted |= {f"{folder}/logs/x.out": "a launcher's #SBATCH --output=logs/..." for folder in (*LESSON_DIRS, "slurm")}
    shown = sorted(f"{path} ({wanted[path]})" for path in set(wanted) - ignored(wanted))
    assert not shown, "git would show these outputs as untracked: " + "; ".join(shown)


@pytest.mark.slow
def test_lessons_run_from_their_own_folder_leave_nothing_untracked(tmp_path, dataset):
    copy = tmp_path / "repo"
    for part in ("course", "data_tools", "day1", "day2"):
        shutil.copytree(REPO / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".gitignore", copy / ".gitignore")
    git = ["git", "-C", copy, "-c", "user.name=t", "-c", "user.email=t@t"]
    run([*git, "init", "-q"])
    run([*git, "add", "-A"])
    env = {"COURSE_DATA_DIR": str(REPO / "data")}
    quick = ["--quick", "--max-steps", "6"]
    run([PYTHON, "5_mnist_manual_ddp_profile.py", "--nproc", "2", *quick], cwd=copy / "day1", env=env)
    run([PYTHON, "12_ddp_fault_tolerance.py", "--nproc", "2", *quick, "--checkpoint-every", "2"],
        cwd=copy / "day2", env=env)
    written = [p for p in ("day1/log_ddp", "day2/runs/12_ddp_fault_tolerance/checkpoints") if (copy / p).is_dir()]
    assert len(written) == 2, f"the lessons did not write where expected: only {written}"
    untracked = [line for line in run([*git, "status", "--porcelain", "--untracked-files=all"]).stdout.splitlines()
                 if line.startswith("??")]
    assert untracked == [], "git shows outputs of lessons run from their folder:\n" + "\n".join(untracked)
