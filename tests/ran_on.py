"""pytest plugin: what the suite ran on what, for docs/trainers/ran-on.md.

    COURSE_RUN_RECORD=docs/records/NAME.json ./run_tests.sh -p tests.ran_on ...

Every process a test starts (seen through Python's audit hook for subprocess.Popen) whose command names a
lesson is classified: which lesson, started how (its own launcher `--nproc`,
torchrun, or a Slurm job on the test cluster's two nodes), with how many ranks, on the CPU (gloo) or on GPUs.
A record counts for a lesson only if the test that started it passed.  At the end of a session in which
every test passed, the record is written: the machine (CPU, cores, GPUs), Python, torch, the date, and per
lesson the launchers and world sizes that passed.  scripts/ran_on.py renders the committed records into the
page; tests/test_ran_on.py checks the page is that rendering, and that a record is made as described.
"""
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

# the lesson's id (as docs/lessons.toml has it) from a path: day1/6_mnist_ddp_pt.py, day1/test-profile.py,
# data_tools/create_mnist_h5.py; from a launcher (slurm/15_fsdp2.sh); from multinode_setup_and_run.sh's argument
LESSON = re.compile(r"(?:^|/)(?:day\d/(\d+)_\w+|day1/(test-profile)|data_tools/(create_mnist_h5))\.py$")
LAUNCHER_SCRIPT = re.compile(r"(?:^|/)slurm/(\d+_\w+|test-profile|create_mnist_h5)\.sh$")
SLURM_LESSON = re.compile(r"^(\d+)_[a-z]\w*\.py$")  # multinode_setup_and_run.sh 10_mnist_ddp_pt_multinode.py
SUBMITTED = re.compile(r"^(\d+)(?:_\w+)?$|^(test-profile|create_mnist_h5)$")  # slurm/submit.sh NAME
REPO = Path(__file__).resolve().parents[1]


def lesson_id(match) -> str:
    """'6', 'test-profile' or 'create_mnist_h5' from a match of one of the patterns above."""
    found = next(g for g in match.groups() if g)
    return found.split("_", 1)[0] if found[0].isdigit() else found

_current = None   # the test now running (this worker)
_seen = {}        # nodeid -> set of (lesson, how, world, device)
_failed = []
_enabled = bool(os.environ.get("COURSE_RUN_RECORD"))


def words(argv: list) -> list:
    """The command's words; an argument holding a whole command line (`bash -c "..."`, `sbatch --wrap "..."`,
    a string run through a shell) split as the shell would."""
    out = []
    for a in map(str, argv):
        try:
            out += shlex.split(a) if any(c.isspace() for c in a) else [a]
        except ValueError:  # unbalanced quotes: not a command line
            out.append(a)
    return out


def classify(argv: list, env: dict = None) -> set:
    """{(lesson number, how, world size or None, device)} named by one command line."""
    args = words(argv)
    env = os.environ if env is None else env
    device = "cpu" if env.get("CUDA_VISIBLE_DEVICES", None) == "" or "--device" in args and \
        args[args.index("--device") + 1] == "cpu" else "gpu"
    found = set()
    names = [Path(a).name for a in args]
    if "submit.sh" in names[:2]:  # slurm/submit.sh NAME [--site ...] [-- lesson args]: a launcher submitted
        rest = args[names.index("submit.sh") + 1:]
        options = rest[:rest.index("--")] if "--" in rest else rest  # submit.sh's own, not the lesson's
        m = SUBMITTED.match(rest[0]) if rest else None
        exists = bool(m) and any(any((REPO / "slurm").glob(f"{rest[0]}{tail}")) for tail in (".sh", "_*.sh"))
        if m and exists and "--dry-run" not in options:  # a launcher that exists (not a test of a bad name)
            found.add((lesson_id(m), "Slurm (2 nodes)", None, device))
        return found
    if names and names[0] in ("sbatch", "salloc", "srun"):
        texts = list(args)
        for a in args[1:]:  # a job script the test wrote (not the course's own): the lessons its commands name
            if a.endswith(".sh") and os.path.isfile(a) and REPO not in Path(a).resolve().parents:
                texts += Path(a).read_text(errors="replace").split()
        for a in texts:
            m = LAUNCHER_SCRIPT.search(a) or LESSON.search(a) or SLURM_LESSON.search(a)
            if m:
                found.add((lesson_id(m), "Slurm (2 nodes)", None, device))
        return found
    lessons = [LESSON.search(a) for a in args]
    if not any(lessons):
        return found
    number = lesson_id(next(m for m in lessons if m))
    if "torch.distributed.run" in args or "torchrun" in names:
        world = next((int(a.split("=", 1)[1]) for a in args if a.startswith("--nproc_per_node=")), None)
        found.add((number, "torchrun", world, device))
    else:
        world = int(args[args.index("--nproc") + 1]) if "--nproc" in args and \
            args[args.index("--nproc") + 1].isdigit() else None
        found.add((number, "own launcher", world, device))
    return found


def note(argv, env=None):
    if _enabled and _current is not None:
        _seen.setdefault(_current, set()).update(classify(argv, env))


def _audit(event, args):
    if event == "subprocess.Popen":
        _, argv, _, env = args
        note(argv if isinstance(argv, (list, tuple)) else [argv], env)


if _enabled:
    sys.addaudithook(_audit)


def pytest_runtest_protocol(item, nextitem):
    global _current
    _current = item.nodeid


def pytest_runtest_logreport(report):
    if report.failed:
        _failed.append(report.nodeid)


def worker_record(seen: dict, failed: list) -> str:
    """A worker's record of its tests that passed, as JSON (the world size None where none was given)."""
    return json.dumps({k: sorted(v, key=lambda x: tuple(str(f) for f in x)) for k, v in seen.items()
                       if k not in failed})


def merge(seen: dict, record: str) -> None:
    """A worker's record added to `seen`."""
    for nodeid, found in json.loads(record).items():
        seen.setdefault(nodeid, set()).update(tuple(x) for x in found)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: without xdist there are no workers
def pytest_testnodedown(node, error):
    """xdist: a worker's record comes back in its workeroutput."""
    record = getattr(node, "workeroutput", {}).get("course_ran_on")
    if record:
        merge(_seen, record)


def pytest_sessionfinish(session, exitstatus):
    if not _enabled:
        return
    if hasattr(session.config, "workerinput"):  # an xdist worker: hand its record to the controller
        session.config.workeroutput["course_ran_on"] = worker_record(_seen, _failed)
        return
    if exitstatus != 0 or _failed:
        print(f"\nran_on: {len(_failed)} test(s) failed: no record written", file=sys.stderr)
        return
    lessons = {}
    for nodeid, found in _seen.items():
        for number, how, world, device in found:
            entry = lessons.setdefault(str(number), {})
            entry.setdefault(f"{how}, {device}", set()).add(world or 0)
    record = {"machine": machine(), "date": datetime.date.today().isoformat(),
              "command": "./run_tests.sh -p tests.ran_on", "tests_passed": session.testscollected,
              "lessons": {n: {k: sorted(v) for k, v in sorted(e.items())}
                          for n, e in sorted(lessons.items(), key=lambda kv: (not kv[0].isdigit(), kv[0].zfill(4)))}}
    path = Path(os.environ["COURSE_RUN_RECORD"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    print(f"\nran_on: wrote {path}", file=sys.stderr)


def machine() -> dict:
    import torch

    cpu = platform.processor() or ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        gpus = [g.strip() for g in out.stdout.splitlines() if g.strip()] if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "gpus": gpus, "python": platform.python_version(),
            "torch": torch.__version__, "os": platform.platform(terse=True)}
