"""Reading and running the exercises' solutions (solutions/<notebook>.md), for the checks in
tests/test_solutions_day1.py, _day2.py, _day3.py and _day4.py (tests/test_solutions.py checks that every exercise has one).

A check runs the commands of its section's first ```bash block, as written there (`python` is this
interpreter, `torchrun` is `python -m torch.distributed.run`, with `--standalone` added when a command names
no rendezvous, `runs/...` is a temporary directory, `VAR=value` prefixes are the command's environment), and
checks what the solution says the learner should see.  A number that comes out of training (a loss, an accuracy)
is read from the output and compared with what the solution states within a tolerance, never as the digits
one torch build prints; an exercise that edits a lesson finds the place by a marker (`edit_source`), and stops
with the marker's name when the lesson no longer has it, rather than run the lesson unedited.
"""
import json
import re
import shlex
import subprocess
from pathlib import Path

from conftest import PYTHON, REPO, run

SOLUTIONS = REPO / "solutions"
NOTEBOOK_SOURCES = REPO / "notebooks" / "src"


# ------------------------------------------------------------------------------------------ reading solutions

def exercises_in_notebook(name) -> int:
    """How many numbered items the notebook's "Try it yourself" section has."""
    text = (NOTEBOOK_SOURCES / f"{name}.py").read_text()
    if "## Try it yourself" not in text:
        return 0
    section = text.split("## Try it yourself", 1)[1].split("# %%", 1)[0]
    return len(re.findall(r"^# (?:\d+\.|-) ", section, re.M))  # numbered items, or bullets


def sections(name) -> dict:
    """{exercise number: its section's text} of solutions/<name>.md."""
    text = (SOLUTIONS / f"{name}.md").read_text()
    parts = re.split(r"^## (\d+)\. .*$", text, flags=re.M)
    return {int(n): body for n, body in zip(parts[1::2], parts[2::2])}


def commands(name, n) -> list:
    """The command lines of the first ```bash block of exercise n."""
    block = re.search(r"```bash\n(.*?)```", sections(name)[n], re.S)
    assert block, f"solutions/{name}.md, exercise {n}: no ```bash block"
    return [l.split("  #")[0].strip() for l in block.group(1).splitlines() if l.strip()]


def refusals(name, n) -> list:
    """The one-line refusals (`python dayD/<name>.py: error: ...`) that exercise n's section quotes."""
    script = next(REPO.glob(f"day*/{name}.py")).relative_to(REPO)
    return re.findall(rf"^python {re.escape(str(script))}: error: .*$", sections(name)[n], re.M)


def argv(line, tmp) -> tuple:
    """(argv, environment changes) for a solution's command line."""
    words = shlex.split(line)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    words = [str(tmp / w[len("runs/"):]) if w.startswith("runs/") else w for w in words]
    if words[0] == "python":
        words[0] = PYTHON
    elif words[0] == "torchrun":
        rest = words[1:]
        if not any(w.startswith(("--standalone", "--master_port", "--rdzv")) for w in rest):
            rest = ["--standalone", *rest]
        words = [PYTHON, "-m", "torch.distributed.run", *rest]
    return words, env


def run_once(tmp):
    """ran(line, check=True): a solution's command line run once in `tmp` (runs/ -> it), its CompletedProcess,
    the same one again for the same line (a run that several exercises compare with); ran.tmp: `tmp`."""
    done = {}

    def ran(line, check=True):
        if line not in done:
            cmd, env = argv(line, tmp)
            done[line] = run(cmd, env=env, check=check)
        return done[line]

    ran.tmp = tmp
    return ran


def run_solution(name, n, tmp, line=0, env=None, **kw) -> subprocess.CompletedProcess:
    cmd, own = argv(commands(name, n)[line], tmp)
    return run(cmd, env={**own, **(env or {})}, **kw)


def run_edited(line, tmp, path, source, check=True) -> subprocess.CompletedProcess:
    """Run a solution's command `line` on an edited copy of a lesson, as the solution's edit makes it: `source`
    written to tmp/`path` (the path the command names, e.g. "day3/14_without_no_sync.py"), with the course's
    packages importable as from the repository root."""
    copy = tmp / path
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(source)
    # a command that does not name the copy would run something else, the unedited lesson perhaps
    line = edit_source(line, rf"(?<!\S){re.escape(path)}(?!\S)", lambda _: str(copy), f"the command {line!r}")
    cmd, env = argv(line, tmp)
    return run(cmd, env={**env, "PYTHONPATH": str(REPO)}, check=check)


def edit_source(text, pattern, replacement, what, count=1) -> str:
    """`text` (a lesson's source, a solution's command or script) with the regex `pattern` (re.M) replaced as
    re.subn replaces it: `replacement` is a template (\\1, \\g<name>) or a function of the match (`lambda _: s`
    for text taken as it is).  The pattern is a marker: identifiers and calls, whitespace as \\s*, not a whole
    line as typed, so that reformatting the lesson keeps it.  It must match `count` times: a lesson without
    the marker stops the check here, with `what` (the lesson) and the marker, instead of running unedited."""
    edited, n = re.subn(pattern, replacement, text, flags=re.M)
    assert n == count, (f"{what}: the marker `{pattern}` matches {n} time(s), not {count}: the lesson (or the "
                        f"solution) changed there; find the place again and update the marker")
    return edited


def numbers(text, pattern, what) -> tuple:
    """The floats that the groups of the regex `pattern` (re.M) match in `text`, a run's output or a
    solution's page; `what` names the run in the failure."""
    found = re.search(pattern, text, re.M)
    assert found, f"{what}: nothing matches {pattern!r} in\n{text[-4000:]}"
    return tuple(float(g) for g in found.groups())


def metrics(run_dir) -> dict:
    return json.loads((Path(run_dir) / "metrics.json").read_text())


def weights(path):
    from course.training.output import load_weights

    return load_weights(path)


# ------------------------------------------------------------------------------------------ every exercise has one

CHECKED = {}  # (notebook, exercise) -> test function name, filled by @solution


def solution(name, n):
    def mark(fn):
        CHECKED[(name, n)] = fn.__name__
        return fn
    return mark


def notebooks_with_exercises() -> list:
    return sorted(p.stem for p in NOTEBOOK_SOURCES.glob("*.py") if exercises_in_notebook(p.stem))
