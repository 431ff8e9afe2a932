"""A class on one shared, read-only install (docs/trainers/install.md, "A class on one shared, read-only
install"): the learner's commands of that recipe, as the page writes them, in a fresh clone of the course,
with the trainer's venv, data directory, site profile and course bundle all read-only at once.

The trainer's part is stood in for where it would be slow or would touch this machine: the venv is this very
venv (made by the suite's set-up), the data is tests/test_shared_data.py's prepared directory; the profile and
the bundle are made by the recipe's own commands.  Read-only: bind mounts in one private mount namespace, as in
tests/test_setup.py (for root, the recipe's chmod would not stop a write)."""
import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import REPO, run
from test_docs_commands import blocks
from test_setup import namespaces_or_skip, this_venv, todays_stamp
from test_shared_data import shared_data  # noqa: F401 (a fixture: the prepared data directory)

INSTALL = REPO / "docs" / "trainers" / "install.md"
HEADING = "## A class on one shared, read-only install"
SITE_SETUP_LINE = "source /shared/course-venv/bin/activate"
# The trainer's commands this test does not run, and what stands in for each.
STANDS_IN = {
    "umask": "the mounts are read-only for everyone",
    "export": "the paths below, given to each command",
    "scripts/setup_env.sh": "this venv, which the suite's set-up made",
    "source": "this venv",
    "python": "create_mnist_h5.py: the shared_data fixture runs it",
    "chmod": "read-only bind mounts",
}


def recipe():
    """(the trainer's commands, the learner's commands) of the recipe's two shell blocks, and its text."""
    lines = INSTALL.read_text().splitlines()
    start = lines.index(HEADING) + 1
    end = next(n for n in range(start, len(lines)) if lines[n].startswith("## "))
    found = [[c for _, c in commands] for at, _, commands in blocks(INSTALL) if start < at <= end]
    assert len(found) == 2, f"{INSTALL}: the recipe has the trainer's block and the learner's: {found}"
    return found[0], found[1], " ".join(" ".join(lines[start:end]).split())


def here(command: str, paths: dict) -> str:
    """The recipe's command with its /shared paths made this test's (NAME: the CPU-only profile)."""
    unknown = set(re.findall(r"/shared/[\w.-]+", command)) - set(paths)
    assert not unknown, f"{command}: shared paths the test does not provide: {unknown}"
    for shared, path in sorted(paths.items(), key=lambda kv: -len(kv[0])):
        assert re.fullmatch(r"[\w./-]+", str(path)), path  # also inside the recipe's quotes
        command = command.replace(shared, str(path))
    return re.sub(r"\bNAME\b", "cpu-only", command)


def working_tree_over(clone: Path) -> None:
    """The repository's working tree as it is now (uncommitted changes, new files) over a clone of its commit."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]).stdout
    for name in filter(None, listed.split("\0")):
        source, target = REPO / name, clone / name
        if source.is_file() or source.is_symlink():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            shutil.copy2(source, target, follow_symlinks=False)
        elif not source.exists():
            target.unlink(missing_ok=True)


def listing(path: Path) -> dict:
    """{path: (size, mtime)} of a file, or of a directory and everything under it."""
    found = {path: path.stat()}
    if path.is_dir():
        for root, dirs, files in os.walk(path):
            found.update({Path(root, n): Path(root, n).lstat() for n in dirs + files})
    return {p: (s.st_size, s.st_mtime_ns) for p, s in found.items()}


@pytest.mark.slow
def test_a_learner_uses_the_shared_venv_data_and_profile_read_only_from_a_fresh_clone(shared_data, tmp_path):
    namespaces_or_skip("mount")
    trainer, learner, text = recipe()
    venv = this_venv()
    shared, home = tmp_path / "trainer", tmp_path / "home"
    shared.mkdir()
    home.mkdir()
    paths = {"/shared/course-venv": venv, "/shared/course-data": shared_data,
             "/shared/course-site.env": shared / "course-site.env", "/shared/course.bundle": shared / "course.bundle"}
    profile, bundle = paths["/shared/course-site.env"], paths["/shared/course.bundle"]

    # The trainer: the profile and the bundle by the recipe's commands, then the edit it asks for.
    for command in trainer:
        if command.startswith(("cp ", "git bundle create ")):
            run(["bash", "-c", here(command, paths)], timeout=60)
        else:
            assert command.split()[0] in STANDS_IN, f"a trainer's command the test neither runs nor stands in for: " \
                                                    f"{command}"
    assert f"end its `site_setup` with `{SITE_SETUP_LINE}`" in text
    setup = profile.read_text()
    end = setup.index("\n}", setup.index("site_setup() {"))
    profile.write_text(setup[:end] + "\n    " + here(SITE_SETUP_LINE, paths) + setup[end:])
    stamp = tmp_path / "stamp"  # the venv as set up from today's requirement files
    stamp.write_text(todays_stamp() + "\n")

    # What a learner may only read: each a read-only bind mount, checked unwritable before anything runs.
    shared_paths = [venv, shared_data, profile, bundle]
    mounts = [f"mount --bind -o ro {p} {p}" for p in shared_paths]
    mounts.append(f"mount --bind -o ro {stamp} {venv / '.course-requirements'}")
    probes = [f"! touch {p / 'probe' if p.is_dir() else p} 2>/dev/null" for p in shared_paths]
    before = {p: listing(p) for p in shared_paths[1:]}
    start = tmp_path / "start"
    start.touch()
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not d.startswith(str(venv)))
    env = {"HOME": str(home), "PATH": path, "VIRTUAL_ENV": None, "PYTHON": None, "VENV": None,
           **{name: None for name in os.environ if name.startswith(("COURSE_", "SITE_"))}}

    def as_learner(commands, cwd):
        script = " && ".join([*mounts, *probes, *commands])
        return run(["unshare", "--mount", "bash", "-c", script], env=env, cwd=cwd, timeout=180)

    # The learner: the clone (with this working tree over it: the tests check the checkout as it is), then
    # every other command of the recipe as written; submit.sh with --dry-run (no Slurm here).
    first, *rest = learner
    assert first.startswith("git clone ") and first.endswith(" && cd ~/course"), first
    as_learner([here(first, paths)], tmp_path)
    clone = home / "course"
    working_tree_over(clone)
    assert all("--site" not in c for c in rest), "the learner's commands name no profile: COURSE_SITE does"
    commands = [here(c, paths) + (" --dry-run" if c.startswith("slurm/submit.sh") and "--dry-run" not in c else "")
                for c in rest]
    done = as_learner(commands, clone)

    assert "==>" not in done.stdout, done.stdout  # nothing created or installed
    assert not re.search(r"^(note|error):", done.stderr, re.M), done.stderr
    assert f"already prepared in {shared_data}" in done.stdout
    assert "outputs: runs/2_mnist_training/metrics.json" in done.stdout
    assert (clone / "runs" / "2_mnist_training" / "metrics.json").is_file()
    assert not (clone / "data").exists(), "the lesson's data came from the clone, not from COURSE_DATA_DIR"
    submitted = [line for line in done.stdout.splitlines() if line.startswith("sbatch ")]
    assert len(submitted) == sum(c.startswith("slurm/submit.sh") for c in rest), done.stdout
    for line in submitted:  # the profile of COURSE_SITE, by its path, handed to the job
        assert f"--export=ALL,COURSE_REPO={clone},COURSE_SITE_ENV={profile} {clone}/slurm/0_torch_dist.sh" in line
        assert "--ntasks-per-node=4" in line  # the profile's shape: the CPU-only one, 4 ranks

    # The job's side, as slurm/lib/job.sh starts it from what submit.sh exported: the profile's site_setup
    # activates the shared venv, and the lesson runs on it.
    job = as_learner([f'export COURSE_REPO="$PWD" COURSE_SITE_ENV={profile}', "source slurm/lib/site.sh",
                      'course_site_resolve ""', "course_site_setup", 'echo "job python: $PYTHON"',
                      '"$PYTHON" course/launching/requires.py day1/0_torch_dist.py',
                      '"$PYTHON" day1/0_torch_dist.py --nproc 2'], clone)
    assert f"job python: {venv}/bin/python" in job.stdout, job.stdout
    assert job.stdout.count("mean = 1.5") == 2, job.stdout

    # Nothing written under the shared paths; the learner's outputs are in the clone.
    written = run(["find", venv, "-newer", start, "-print", "-quit"]).stdout
    assert written == "", f"written into the shared venv: {written}"
    for p in shared_paths[1:]:
        assert listing(p) == before[p], f"written under {p}"
