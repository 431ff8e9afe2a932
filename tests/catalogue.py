"""The catalogue of reference runs: every configuration that several tests read is launched once per test
session, the way a learner launches it, and every test reads what it wrote.

A reference run is a lesson, the launcher that starts it (its own `--nproc N`, or torchrun), its world size
and its arguments (tests/reference_runs.py names them).  The first test that asks for one runs it, in a fresh
interpreter started by that launcher, into a directory that every pytest-xdist worker of the session shares;
a worker that asks while another runs it waits for it (a file lock), and then reads the same outputs.  A
failed run is recorded too: every test that reads it fails with its output, and it is not run again.

    def test_something(catalogue):
        ran = catalogue("3: 40 steps, 2 ranks, torchrun")  # runs once per session, then read from disk
        assert "..." in ran.stdout
        weights = load_weights(ran.run_dir / "model.pt")

A test that must see a launch of its own (a signal, a crash, a timing against another run made beside it)
runs it itself with conftest.run() and says why.
"""
import fcntl
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import PYTHON, REPO, run


ASKED = "asked.txt"  # the names tests asked for, one a line, in the shared directory


@dataclass(frozen=True)
class Ref:
    """One reference run.  args may hold "{run_dir}", this run's own directory, and "{needs}", the directory of
    the reference run named `needs` (run first, or read, as any test's request).  launcher "self":
    `python SCRIPT ARGS` (the lesson's own launcher; ARGS say --nproc N, or the lesson's default holds);
    "torchrun": `torchrun --standalone --nproc_per_node=NPROC SCRIPT ARGS` (nproc is torchrun's; the plan()
    helper of reference_runs.py builds --nproc from it for the lesson's own launcher)."""
    script: str
    args: tuple = ()
    launcher: str = "self"
    nproc: int = 1
    timeout: int = 300
    returncode: int = 0  # what the run must exit with; None: the tests judge it (a hang's repro fails)
    needs: str = ""  # the reference run whose outputs this one reads ("{needs}" in args)

    def command(self, run_dir: Path, needs: Path = None) -> list:
        args = [str(a).format(run_dir=run_dir, needs=needs) for a in self.args]
        script = REPO / self.script
        if self.launcher == "self":
            return [PYTHON, script, *args]
        if self.launcher == "torchrun":
            return [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}",
                    script, *args]
        raise ValueError(f"{self.script}: launcher {self.launcher!r} is neither 'self' nor 'torchrun'")


@dataclass(frozen=True)
class Ran:
    """What a reference run left: its directory (its outputs) and what it printed."""
    name: str
    run_dir: Path
    cmd: list
    returncode: int
    stdout: str
    stderr: str
    seconds: float


class Catalogue:
    def __init__(self, root: Path, runs: dict):
        self.root, self.runs = root, runs
        root.mkdir(parents=True, exist_ok=True)

    def __call__(self, name: str) -> Ran:
        ref = self.runs[name]
        needs = self(ref.needs).run_dir if ref.needs else None  # before this run's lock: no two locks held
        slug = "".join(c if c.isalnum() else "-" for c in name).strip("-")
        run_dir, result = self.root / slug, self.root / f"{slug}.json"
        with open(self.root / ASKED, "a") as asked:  # for the end of a whole run: every run was read (conftest)
            asked.write(name + "\n")
        with open(self.root / f"{slug}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when this process ends, too: a crashed runner frees it
            if not result.exists():
                self._run(name, ref, run_dir, result, needs)
        ran = Ran(name=name, run_dir=run_dir, **json.loads(result.read_text()))
        if ran.returncode is None or (ref.returncode is not None and ran.returncode != ref.returncode):
            how = "did not end" if ran.returncode is None else f"exited {ran.returncode}, not {ref.returncode}"
            raise AssertionError(f"reference run {name!r}: {' '.join(ran.cmd)} {how}\n--- stdout\n{ran.stdout}"
                                 f"\n--- stderr\n{ran.stderr}")
        return ran

    @staticmethod
    def _run(name: str, ref: Ref, run_dir: Path, result: Path, needs: Path = None) -> None:
        shutil.rmtree(run_dir, ignore_errors=True)  # a runner that crashed may have left it
        cmd = ref.command(run_dir, needs)
        start = time.monotonic()
        try:
            proc = run(cmd, check=False, timeout=ref.timeout)
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as expired:  # recorded too: the next reader fails at once
            text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
            code, out = None, text(expired.output)
            err = text(expired.stderr) + f"\n(ended after its timeout of {ref.timeout} s)"
        record = {"cmd": [str(c) for c in cmd], "returncode": code, "stdout": out, "stderr": err,
                  "seconds": round(time.monotonic() - start, 2)}
        partial = result.with_suffix(".partial")
        partial.write_text(json.dumps(record))
        os.replace(partial, result)  # the others read a whole record or none


def unread(root: Path, runs: dict) -> list:
    """The reference runs no test of the session asked for."""
    try:
        asked = set((root / ASKED).read_text().splitlines())
    except OSError:
        asked = set()
    return sorted(set(runs) - asked)


def shared_root(config, tmp_path_factory) -> Path:
    """A directory every pytest-xdist worker of this session sees: the parent of the workers' own base
    temporary directories (pytest-N/popen-gwK), or this process's own without xdist.  A worker is told by its
    config (workerinput), not by PYTEST_XDIST_WORKER, which a pytest started inside a test inherits."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if hasattr(config, "workerinput") else base) / "reference-runs"


class Runs:
    """A test module's reference runs by its own short names, each launched (or read) when a test first asks
    for it: runs[short] -> (run_dir, stdout) of catalogue(prefix + short)."""

    def __init__(self, catalogue: Catalogue, prefix: str):
        self.catalogue, self.prefix = catalogue, prefix

    def __getitem__(self, short: str) -> tuple:
        ran = self.catalogue(self.prefix + short)
        return ran.run_dir, ran.stdout
