"""The set-up both README commands start with (scripts/setup_env.sh) and the test command (run_tests.sh): the
three ways to install (docs/trainers/install.md), what the set-up refuses before installing, and the system
packages the tests start for real (scripts/system_packages.sh).

Lean by design: the shared venv is this very venv, mounted read-only; the site's PyTorch module is this
venv's packages, linked into a directory on PYTHONPATH; pip installs one small wheel from a local directory.
"""
import base64
import hashlib
import importlib.metadata
import os
import re
import shlex
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, run

SETUP = REPO / "scripts" / "setup_env.sh"
PACKAGES = REPO / "scripts" / "system_packages.sh"
# The interpreter new venvs are made from: this venv's own base, so that linked packages fit its Python.
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)


def one_line(text: str) -> str:
    lines = text.splitlines()
    assert len(lines) == 1, text
    return lines[0]


def test_too_little_disk_stops_before_the_venv_with_one_line(tmp_path):
    """A disk too full for PyTorch: one line naming the free space, the need and the fix; no venv left."""
    venv = tmp_path / "parent" / "venv"
    result = run(["bash", SETUP], env={"VENV": str(venv), "COURSE_MIN_FREE_GB": "1000000"}, check=False,
                 timeout=60)
    assert result.returncode == 1
    assert result.stdout == ""
    line = one_line(result.stderr)
    assert f"GB free on the disk of {tmp_path}," in line and "needs about 1000000 GB" in line
    assert "VENV=" in line
    assert not (tmp_path / "parent").exists()


# ---------------------------------------------------------------- (b) one shared venv, read-only for learners

def this_venv() -> Path:
    if sys.prefix == sys.base_prefix:
        pytest.skip("the tests run outside a venv: there is no venv to share")
    return Path(sys.prefix)


def todays_stamp() -> str:
    """What the set-up records in a venv it installed today's requirement files into."""
    return run(["bash", "-c", "cat requirements*.txt constraints.txt | sha256sum | cut -c1-16"]).stdout.strip()


def namespaces_or_skip(kind: str) -> None:
    """Skip unless this process may make a new `kind` namespace (root, and a container that allows it)."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root: a new {kind} namespace")
    probe = run(["unshare", f"--{kind}", "true"], check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a {kind} namespace here: {probe.stderr.strip()}")


def read_only(venv: Path, command: str, *, over=(), **kw):
    """Run the shell line `command` while `venv` is read-only, as for a learner who may not write into a
    trainer's venv: a read-only bind mount in a private mount namespace (for root, a chmod would not stop a
    write).  `over`: (file, path) pairs, each file mounted read-only over path, as a learner's view."""
    namespaces_or_skip("mount")
    mounts = [(venv, venv), *over]
    script = " && ".join([f"mount --bind -o ro {shlex.quote(str(a))} {shlex.quote(str(b))}" for a, b in mounts]
                         + [command])
    return run(["unshare", "--mount", "bash", "-c", script], **kw)


@pytest.mark.slow
def test_a_read_only_shared_venv_is_used_without_writing_into_it(tmp_path):
    """Up to date: the set-up installs nothing, turns bytecode writing off, and a lesson runs on it; no file
    of the venv is newer than the start (the read-only mount makes pip or a stamp write fail the set-up)."""
    venv = this_venv()
    stamp = tmp_path / "stamp"
    stamp.write_text(todays_stamp() + "\n")
    start = tmp_path / "start"
    start.touch()
    command = (f"source {shlex.quote(str(SETUP))} && echo PYTHONDONTWRITEBYTECODE=$PYTHONDONTWRITEBYTECODE "
               f"&& $PY day1/0_torch_dist.py --nproc 2")
    result = read_only(venv, command, over=[(stamp, venv / ".course-requirements")],
                       env={"VENV": str(venv), "PYTHONDONTWRITEBYTECODE": None}, timeout=300)
    assert "==>" not in result.stdout  # neither "creating" nor "installing"
    assert "PYTHONDONTWRITEBYTECODE=1" in result.stdout
    assert result.stdout.count("mean = 1.5") == 2
    assert "note:" not in result.stderr and "error:" not in result.stderr
    written = run(["find", venv, "-newer", start, "-print", "-quit"]).stdout
    assert written == "", f"written into the shared venv: {written}"


def test_an_outdated_read_only_venv_that_meets_the_requirements_goes_on_with_one_line(tmp_path):
    """The requirement files changed since the trainer's set-up (another stamp), but every requirement is
    still met: one line saying so and what the trainer runs; exit 0, nothing installed."""
    venv = this_venv()
    stamp = tmp_path / "stamp"
    stamp.write_text("0000000000000000\n")
    result = read_only(venv, f"bash {shlex.quote(str(SETUP))}", over=[(stamp, venv / ".course-requirements")],
                       env={"VENV": str(venv)}, timeout=60)
    assert "==>" not in result.stdout
    line = one_line(result.stderr)
    assert line.startswith(f"note: the shared venv {venv} (read-only for you)")
    assert f"VENV={venv} ./quickstart.sh" in line


def test_an_outdated_read_only_venv_that_lacks_a_requirement_stops_with_one_line(tmp_path):
    """A requirement the shared venv does not meet: one line naming it and what the trainer must run; exit 1
    before anything else (no pip: the venv is not ours to change)."""
    venv = this_venv()
    requirements = tmp_path / "requirements-test.txt"
    requirements.write_text((REPO / "requirements-test.txt").read_text() + "no-such-course-package>=1\n")
    result = read_only(venv, f"bash {shlex.quote(str(SETUP))}",
                       over=[(requirements, REPO / "requirements-test.txt")],
                       env={"VENV": str(venv)}, check=False, timeout=60)
    assert result.returncode == 1
    assert result.stdout == ""
    line = one_line(result.stderr)
    assert line.startswith(f"error: the shared venv {venv} (read-only for you) is out of date")
    assert "lacks no-such-course-package>=1 (not installed)" in line
    assert f"VENV={venv} ./quickstart.sh" in line


# ------------------------------------------------------------------ (c) a venv on top of the site's PyTorch

def wheel_of_installed(name: str, into: Path) -> Path:
    """A wheel rebuilt from an installed pure-Python distribution's files (its RECORD), for pip --no-index."""
    dist = importlib.metadata.distribution(name)
    files = [f for f in dist.files
             if not str(f).startswith("..") and "__pycache__" not in f.parts
             and f.name not in {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json"}]
    info = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    wheel = into / f"{info[:-len('.dist-info')]}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(wheel, "w") as zf:
        for f in files:
            data = Path(dist.locate_file(f)).read_bytes()
            zf.writestr(str(f), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{f},sha256={digest},{len(data)}")
        zf.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
    return wheel


@pytest.fixture(scope="module")
def site_module(tmp_path_factory):
    """A site's PyTorch module, simulated: a prefix of packages that the base interpreter sees and a venv sees
    only when made with --system-site-packages (the user site of PYTHONUSERBASE=prefix): this venv's
    packages (the real torch among them) linked, without websocket-client and pip.  And a directory with
    websocket-client's wheel, the one requirement the new venv then has to install (and setuptools').
    Returns the variables that "load" the module, and the wheels' directory."""
    venv = this_venv()
    site_packages = Path(next(p for p in sys.path if p.startswith(str(venv)) and p.endswith("site-packages")))
    root = tmp_path_factory.mktemp("site")
    prefix, wheels = root / "pytorch-module", root / "wheels"
    module = prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    module.mkdir(parents=True)
    wheels.mkdir()
    left_out = ("websocket", "pip", "__pycache__")
    for entry in site_packages.iterdir():
        if entry.suffix != ".pth" and not entry.name.startswith(left_out):
            (module / entry.name).symlink_to(entry)
    wheel_of_installed("websocket-client", wheels)
    # a new venv of Python < 3.12 comes with an old setuptools that hides the module's; torch wants a newer one
    wheel_of_installed("setuptools", wheels)
    return {"PYTHONUSERBASE": str(prefix), "PYTHONNOUSERSITE": None}, wheels


def pip_offline(wheels: Path, log: Path) -> dict:
    """pip's own settings (environment variables) for a set-up that may install only from `wheels`."""
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "PIP_LOG": str(log)}


@pytest.mark.slow
def test_a_venv_on_the_sites_torch_installs_only_what_is_missing(site_module, tmp_path):
    """COURSE_SYSTEM_TORCH=1 with the module loaded: pip keeps the module's torch (no second torch in the
    venv, none fetched), installs the one missing requirement, and a lesson runs on the module's torch.
    Without the module, the set-up stops with one line."""
    module, wheels = site_module
    venv, log = tmp_path / "venv", tmp_path / "pip.log"
    env = {"VENV": str(venv), "COURSE_SYSTEM_TORCH": "1", "PYTHON": BASE_PYTHON, **module,
           **pip_offline(wheels, log)}
    result = run(["bash", SETUP], env=env, timeout=300)
    version = importlib.metadata.version("torch")
    assert f"==> creating the virtual environment {venv} on top of the site's torch {version}" in result.stdout
    assert f"torch {version} stays the site's" in result.stdout
    assert "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()
    site_packages = next(venv.glob("lib/python*/site-packages"))
    assert (site_packages / "websocket").is_dir()
    assert not (site_packages / "torch").exists() and not list(site_packages.glob("torch-*"))
    pip_said = log.read_text()
    assert f"Requirement already satisfied: torch=={version} in {module['PYTHONUSERBASE']}" in pip_said
    installed = re.search(r"Successfully installed (.*)", pip_said).group(1).split()
    assert sorted(name.rsplit("-", 1)[0] for name in installed) == ["setuptools", "websocket-client"], installed
    assert not [line for line in pip_said.splitlines() if "torch-" in line and ".whl" in line], \
        "pip looked for a torch wheel"
    size = run(["du", "-sm", venv]).stdout.split()[0]
    assert int(size) < 200, f"the venv takes {size} MB"

    lesson = run([venv / "bin" / "python", "day1/0_torch_dist.py", "--nproc", "2"], env=module, timeout=120)
    assert lesson.stdout.count("mean = 1.5") == 2

    # The module not loaded in a later shell: the venv records that it needs one.
    find_torch = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
    if run([BASE_PYTHON, "-c", find_torch], check=False).returncode == 0:
        later = run(["bash", SETUP], env={"VENV": str(venv)}, check=False, timeout=60)
        assert later.returncode == 1
        assert "cannot import torch" in one_line(later.stderr) and "module load" in later.stderr


def stub_torch(where: Path, version: str, metadata: bool = True) -> Path:
    """A site module whose torch is a stub of `version` (enough for the version check; nothing imports it)."""
    (where / "torch").mkdir(parents=True)
    (where / "torch" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    if metadata:
        info = where / f"torch-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return where


@pytest.mark.parametrize("metadata", [True, False], ids=["too-old", "no-metadata"])
def test_a_site_torch_that_does_not_fit_stops_before_anything_is_made(tmp_path, metadata):
    """A torch older than requirements.txt allows (or one pip cannot see, which pip would install again):
    one line naming what was found and what to do, exit 1, no venv, pip never started."""
    module = stub_torch(tmp_path / "module", "2.1.0", metadata)
    venv = tmp_path / "new" / "venv"
    log = tmp_path / "pip.log"
    result = run(["bash", SETUP], env={"VENV": str(venv), "COURSE_SYSTEM_TORCH": "1", "PYTHONPATH": str(module),
                                       "PYTHON": BASE_PYTHON, **pip_offline(tmp_path, log)},
                 check=False, timeout=60)
    assert result.returncode == 1
    assert result.stdout == ""
    line = one_line(result.stderr)
    if metadata:
        assert "the site's torch 2.1.0" in line and "torch>=2.4" in line and "load a newer PyTorch module" in line
    else:
        assert "the site's torch 2.1.0" in line and "no package metadata" in line
    assert "COURSE_SYSTEM_TORCH unset" in line
    assert not (tmp_path / "new").exists()
    assert not log.exists()


def test_the_site_torch_option_refuses_a_venv_with_its_own_packages(tmp_path):
    """COURSE_SYSTEM_TORCH=1 for a venv made without it: one line, exit 1, the venv untouched."""
    venv = tmp_path / "venv"
    run([BASE_PYTHON, "-m", "venv", "--without-pip", venv])
    result = run(["bash", SETUP], env={"VENV": str(venv), "COURSE_SYSTEM_TORCH": "1"}, check=False, timeout=60)
    assert result.returncode == 1
    assert "COURSE_SYSTEM_TORCH applies when a venv is made" in one_line(result.stderr)
    assert not (venv / ".course-requirements").exists()


# ----------------------------------------------------------------- the system packages of run_tests.sh

ALL = ["slurm-wlm", "munge", "chromium", "iproute2", "util-linux", "procps", "dataset-fashion-mnist",
       "python3-venv"]


@pytest.fixture
def fake_system(tmp_path):
    """A PATH of bash and a few tools, with fakes of dpkg-query (says installed what FAKE_INSTALLED names),
    apt-get (logs its arguments; `install` fails until `update` ran, as on a fresh machine), id and sudo."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("bash", "grep", "mktemp", "rm", "tail", "touch"):
        (bin_ / tool).symlink_to(run(["bash", "-c", f"command -v {tool}"]).stdout.strip())
    calls = tmp_path / "apt-calls"
    fakes = {
        "dpkg-query": 'for p in "${@:3}"; do case " $FAKE_INSTALLED " in *" $p "*) echo "$p installed" ;;'
                      ' *) echo "$p not-installed" ;; esac; done',
        "apt-get": f'echo "$*" >> {calls}; [ "$1" = update ] && touch {tmp_path}/updated;'
                   f' [ "$1" = update ] || [ -e {tmp_path}/updated ]',
        "id": 'echo "$FAKE_UID"',
        "sudo": "exit 1",
    }
    for name, body in fakes.items():
        (bin_ / name).write_text(f"#!{(bin_ / 'bash').resolve()}\n{body}\n")
        (bin_ / name).chmod(0o755)

    def packages(action, installed, uid=0):
        return run([bin_ / "bash", PACKAGES, action], check=False, timeout=30,
                   env={"PATH": str(bin_), "FAKE_INSTALLED": " ".join(installed), "FAKE_UID": str(uid)})

    packages.calls = calls
    return packages


def test_only_the_missing_system_packages_are_named_and_installed(fake_system):
    """dpkg says two packages are missing (and nothing on PATH provides them): `missing` names those two;
    `install` as root runs apt-get for exactly those, with `apt-get update` after a first failure."""
    present = [p for p in ALL if p not in ("slurm-wlm", "chromium")]
    assert fake_system("missing", present).stdout == "slurm-wlm chromium\n"
    done = fake_system("install", present)
    assert done.returncode == 0, done.stderr
    assert "==> installing the system packages the tests use: slurm-wlm chromium" in done.stdout
    want = "install -y -q --no-install-recommends slurm-wlm chromium"
    assert fake_system.calls.read_text().splitlines() == [want, "update -q", want]


def test_nothing_missing_costs_no_apt_get_and_no_root_installs_nothing(fake_system):
    """A second run (all present) calls no apt-get; without root (and no password-less sudo) nothing is
    installed and the exit code says so (2)."""
    assert fake_system("missing", ALL).stdout == "\n"
    assert fake_system("install", ALL).returncode == 0
    assert not fake_system.calls.exists()
    done = fake_system("install", ALL[1:], uid=1000)
    assert done.returncode == 2
    assert not fake_system.calls.exists()


def as_non_root() -> list:
    """The command prefix that runs something as a user who is not root: root sees itself as uid 65534 in a
    new user namespace (with its own files still readable, unlike a real user's view of /root)."""
    if os.geteuid() != 0:
        return []
    namespaces_or_skip("user")
    return ["unshare", "--user"]


def test_without_root_run_tests_ends_with_the_skipped_count_and_the_command(tmp_path):
    """./run_tests.sh as a user without root or sudo: the Slurm tests skip, and the last line counts them and
    gives the command that runs them; pytest's exit code is kept (5 when nothing was collected)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sudo").write_text("#!/bin/sh\nexit 1\n")
    (fake / "sudo").chmod(0o755)
    # a pytest of its own: not this run's CI strictness (a skip would fail) nor its xdist worker's variables
    # (and this venv, wherever it is: not a new one in the checkout)
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "CI": None, "TEST_WORKERS": "0", "VENV": str(this_venv()),
           **{name: None for name in os.environ if name.startswith(("PYTEST_", "COURSE_SKIP_REPORT"))}}
    result = run([*as_non_root(), REPO / "run_tests.sh", "tests/test_slurm_cluster.py", "-k", "sinfo or srun_runs"],
                 env=env, check=False, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    last = result.stdout.splitlines()[-1]
    assert last.startswith("run_tests: 2 tests skipped for missing system packages or root (2 need root"), last
    assert last.endswith("./run_tests.sh") and "sudo " in last, last

    nothing = run([*as_non_root(), REPO / "run_tests.sh", "tests/test_setup.py", "-k", "no_such_test"], env=env,
                  check=False, timeout=120)
    assert nothing.returncode == 5, nothing.stdout + nothing.stderr
    assert "run_tests:" not in nothing.stdout
