"""Every command the guides give (docs/trainers/*.md, docs/learners/*.md and README.md) works as written, or
says why no test can run it; and every allocation they show is the course's one model (docs/lessons.toml).

Each shell code block is split into commands, and each command is, by its kind:
- run here: `python -m course.sizing ...`;
- checked here as far as it goes without a cluster: a lesson command (`python dayN/...py ARGS`, `torchrun ...`,
  `srun ... python ...`) is parsed by the lesson's own parser (an option the lesson lacks, such as lesson 0's
  `--quick`, fails), and its ranks must fit the allocation of the lesson's day (`--nproc 4` where a learner
  holds 2 GPUs fails); `slurm/submit.sh ...` and `scripts/readiness_check.sh ...` run with `--dry-run`
  (NAME and mycluster stand for a GPU profile);
- run by the test named in ELSEWHERE (the set-up, the data, TensorBoard, ...): that test file must exist and
  name the command;
- plain shell (cd, export, echo, ...), which the course does not own;
- or it must stand in a block marked before its fence with `<!-- cluster-only: reason -->` (needs a real
  cluster: salloc, srun in a job, sinfo, ssh to a login node, ...), `<!-- manual: reason -->` (an
  interactive server or a second terminal) or `<!-- excerpt: reason -->` (text of a file or a synopsis,
  not commands to type). A salloc or sbatch line anywhere in docs/ must ask for an allocation of the model.
An unmarked command of none of these kinds fails the test: a new command in a guide needs a test or a reason.
Inline commands (`slurm/submit.sh ...`, `python dayN/...` in backticks) get the same parse and dry-run checks.
"""
import contextlib
import io
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, REPO
from course.sizing import day_allocations, lessons, table

GUIDES = [*sorted((REPO / "docs" / "trainers").glob("*.md")), *sorted((REPO / "docs" / "learners").glob("*.md")),
          REPO / "README.md"]
ALL_DOCS = [*sorted(p for p in (REPO / "docs").rglob("*.md") if "_generated" not in p.parts), REPO / "README.md"]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
MARK = re.compile(r"^\s*<!-- (cluster-only|manual|excerpt): (\S.*?) -->\s*$")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
ALLOCATIONS = [a for allocs in day_allocations().values() for a in allocs]
DAY_OF = {Path(e["script"]).name: e["day"] for e in lessons()}
CPU_ONLY_LESSONS = {"0_torch_dist.py"}  # gloo on the CPU whatever the node has: any number of ranks

# Commands other tests run, by their first words: the test file must exist and contain the key.
ELSEWHERE = {
    "./quickstart.sh": ("tests/test_setup.py", "quickstart.sh"),
    "scripts/setup_env.sh": ("tests/test_setup.py", "setup_env.sh"),
    "./run_tests.sh": ("tests/test_setup.py", "run_tests.sh"),
    "python data_tools/prepare_data.py": ("tests/test_data_tools.py", "prepare_data.py"),
    "python data_tools/create_mnist_h5.py": ("tests/test_create_mnist_h5.py", "create_mnist_h5"),
    "python -m course.tensorboard_private": ("tests/test_private_tensorboard.py", "course.tensorboard_private"),
    "python -m course.fit": ("tests/test_fit.py", "course.fit"),  # every command of will-it-fit.md, run as written
    "python -m torch.distributed.flight_recorder.fr_trace": ("tests/test_day3_hangs.py", "fr_trace"),
    "python scripts/lesson_diffs.py": ("tests/test_lesson_diffs.py", "lesson_diffs.py"),
    "./day2/multinode_setup_and_run.sh": ("tests/test_day2_slurm.py", "multinode_setup_and_run.sh"),
    "tensorboard": ("tests/tensorboard_server.py", '"--logdir"'),  # the server, started for real
    "git clone": ("tests/test_shared_install.py", "git clone"),  # the shared install's recipe, as written
    "git bundle create": ("tests/test_shared_install.py", "git bundle create"),
    "python templates/train_ddp.py": ("tests/test_templates.py", "page_commands"),  # parsed there, and run
    "python templates/train_fsdp.py": ("tests/test_templates.py", "page_commands"),
    "python templates/parity_check.py": ("tests/test_templates.py", "page_commands"),
    "torchrun --standalone --nproc_per_node=2 templates/train_ddp.py":
        ("tests/test_templates.py", "torch.distributed.run"),
}
# Plain shell and coreutils: what the course does not own and no test of the course needs to run.
SHELL = {"cd", "export", "echo", "mkdir", "umask", "source", "hostname", "exit", "diff", "grep", "sort", "kill",
         "cp", "chmod", "python3", "tail", "}"}
# What needs a real cluster, or a person: only in a marked block.
CLUSTER = {"salloc", "sbatch", "srun", "scancel", "squeue", "sstat", "seff", "sinfo", "sacctmgr", "module", "ssh"}


def blocks(path: Path):
    """(line number, mark or None, [(line number, command text)]) for every shell code block of a Markdown file;
    continuation lines joined, comments and blank lines left out."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if re.match(r"^\s*```\s*$", lines[j]))
        if fence.group(2) in SHELL_LANGUAGES:
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            mark = MARK.match(before)
            commands, pending, start = [], "", 0
            for number in range(i + 1, end):
                text = lines[number].strip()
                if not pending:
                    start = number + 1
                if text.startswith("#") and not pending:
                    continue
                pending += " " + text
                if pending.endswith("\\"):
                    pending = pending[:-1]
                    continue
                command = strip_comment(pending.strip())
                if command:
                    commands.append((start, command))
                pending = ""
            yield i + 1, (mark.group(1), mark.group(2)) if mark else None, commands
        i = end + 1


def strip_comment(text: str) -> str:
    """The command without a trailing `# comment` (a # after a space, outside quotes)."""
    quote = None
    for k, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or text[k - 1] in " \t"):
            return text[:k].rstrip()
    return text


def words_of(command: str) -> list:
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


def segments(command: str) -> list:
    """The simple commands of a line (split at &&, ||, ;, |), each without leading VAR=value assignments, and
    the assignments: [(env dict, words)]."""
    found, current = [], []
    for word in words_of(command) + ["&&"]:
        if word in ("&&", "||", ";", "|"):
            env = {}
            while current and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", current[0]):
                name, _, value = current.pop(0).partition("=")
                if "$(" in value:  # VAR=$(command ...): all of it is the value
                    value, current = " ".join([value, *current]), []
                env[name] = value
            if current or env:
                found.append((env, current))
            current = []
        else:
            current.append(word)
    return found


LESSON_SCRIPT = re.compile(r"^(day\d/[\w-]+\.py)$")


def number(word: str):
    return int(word) if word.isdigit() else None


def lesson_call(words: list):
    """(script, args, launcher, ranks per node or None, ranks in all or None) of a lesson command, or None."""
    if not words:
        return None
    if words[0] in ("python", "python3", ".venv/bin/python") and len(words) > 1 and LESSON_SCRIPT.match(words[1]):
        args = words[2:]
        nproc = next((number(args[k + 1]) for k, w in enumerate(args[:-1]) if w == "--nproc"), None)
        if "7_mnist_ddp_pt_timing" in words[1] and args and args[0].isdigit():  # lesson 7's world sizes
            sizes = args[:next((k for k, a in enumerate(args) if a.startswith("-")), len(args))]
            nproc = max(int(a) for a in sizes if a.isdigit())
        return words[1], args, "python", nproc, nproc
    if words[0] == "torchrun":
        k = next((k for k, w in enumerate(words) if LESSON_SCRIPT.match(w)), None)
        if k is None:
            return None
        per_node = next((number(w.split("=")[1]) for w in words[:k] if w.startswith("--nproc_per_node=")), None)
        nnodes = next((number(w.split("=")[1]) for w in words[:k] if w.startswith("--nnodes=")), 1) or 1
        return words[k], words[k + 1:], "torchrun", per_node, per_node and per_node * nnodes
    if words[0] == "srun" and "python" in words:
        k = words.index("python")
        if k + 1 < len(words) and LESSON_SCRIPT.match(words[k + 1]):
            ntasks = next((number(w.split("=")[1]) for w in words[:k] if w.startswith("--ntasks=")), None)
            return words[k + 1], words[k + 2:], "srun", None, ntasks
    return None


def kind_of(env: dict, words: list) -> str:
    if not words:
        return "shell"  # an assignment alone: PORT=$(...)
    first, line = words[0], " ".join(words)
    if words[:3] == ["python", "-m", "course.sizing"]:
        return "run"
    if lesson_call(words):
        return "lesson"
    if first in ("slurm/submit.sh", "scripts/readiness_check.sh"):
        return "dry-run"
    if any(line == key or line.startswith(key + " ") for key in ELSEWHERE):
        return "elsewhere"
    if first in SHELL or first == "python" and words[1:2] == ["-X"]:
        return "shell"
    if first in CLUSTER:
        return "cluster"
    return "unknown"


def guide_commands():
    """[(file:line, mark, env, words)] of every command in the guides' shell blocks."""
    found = []
    for path in GUIDES:
        for _, mark, commands in blocks(path):
            for number, command in commands:
                for env, words in segments(command):
                    found.append((f"{path.relative_to(REPO)}:{number}", mark, env, words))
    return found


COMMANDS = guide_commands()


# ---------------------------------------------------------------------------------------------- the walk

def test_every_command_of_the_guides_is_tested_or_marked():
    unmarked, unknown = [], []
    for where, mark, env, words in COMMANDS:
        kind = kind_of(env, words)
        if kind == "unknown" and mark is None:
            unknown.append(f"{where}: {' '.join(words)}")
        elif kind == "cluster" and mark is None:
            unmarked.append(f"{where}: {' '.join(words)}")
    assert not unknown, ("commands no test runs: add a check to tests/test_docs_commands.py, or mark the block "
                         "<!-- cluster-only: reason -->, <!-- manual: reason --> or <!-- excerpt: reason -->:\n"
                         + "\n".join(unknown))
    assert not unmarked, "cluster commands in unmarked blocks (mark them <!-- cluster-only: reason -->):\n" + \
        "\n".join(unmarked)


def test_the_walk_finds_the_commands_and_every_mark_has_a_reason():
    kinds = {kind_of(env, words) for _, _, env, words in COMMANDS}
    assert {"lesson", "dry-run", "elsewhere", "shell", "cluster"} <= kinds, kinds
    assert len(COMMANDS) > 100
    for path in GUIDES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip().startswith("<!-- cluster-only") or line.strip().startswith("<!-- manual"):
                assert MARK.match(line), f"{path}:{number}: a mark needs a reason: {line}"


@pytest.mark.parametrize("key", sorted(ELSEWHERE))
def test_the_tests_named_for_a_command_exist_and_run_it(key):
    test, word = ELSEWHERE[key]
    assert word in (REPO / test).read_text(), f"{test} does not run {key}"


def test_the_walk_would_fail_on_an_unmarked_cluster_command_or_an_unknown_one(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nsalloc --nodes=1 --ntasks-per-node=4 --gpus-per-node=4\nfrobnicate --now\n```\n\n"
                    "<!-- cluster-only: needs Slurm -->\n```bash\nsinfo\n```\n")
    found = [(mark, kind_of(env, words)) for _, mark, commands in blocks(page) for _, c in commands
             for env, words in segments(c)]
    assert found == [(None, "cluster"), (None, "unknown"), (("cluster-only", "needs Slurm"), "cluster")]


# ---------------------------------------------------------------------------------------------- lesson commands

PLACEHOLDERS = {"N", "W", "G", "T", "LESSON", "...", "JOBID", "PID", "NODE"}


def inline_commands(paths=GUIDES):
    """[(file, words)] of commands in backticks (over line breaks too) that the checks below can take: no
    placeholder (N, LESSON, ...)."""
    found = []
    for path in paths:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for span in re.findall(r"`([^`]+)`", text):
            words = words_of(" ".join(span.split()))
            if len(words) < 2 or words[-1] == "--site":  # a name, not a command line
                continue
            if (words[0] == "slurm/submit.sh" or words[:3] == ["python", "-m", "course.sizing"] or
                          lesson_call(words)) and \
                    not (PLACEHOLDERS & set(words)) and not any("<" in w for w in words):
                found.append((path.relative_to(REPO), words))
    return found


def lesson_commands():
    calls = [(where, lesson_call(words)) for where, _, _, words in COMMANDS if kind_of({}, words) == "lesson"]
    calls += [(str(where), lesson_call(words)) for where, words in inline_commands() if lesson_call(words)]
    return calls


def parse_only(script: str, args: list) -> tuple:
    """(exit code, stderr) of the lesson's own parsing of `args`, as `python script args` parses them, without
    running the lesson (course.launching.cli.main only parses)."""
    from as_main import run_as_main
    from course.launching import cli

    saved, err = cli.main, io.StringIO()
    cli.main = lambda run, p, argv=None: cli.parse(p, argv)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = run_as_main([str(REPO / script), *args])
    finally:
        cli.main = saved
    return code, err.getvalue()


def test_every_lesson_command_of_the_guides_parses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a run dir or log dir in the command is probed here, never in the repository
    failed = []
    for where, (script, args, _, _, _) in lesson_commands():
        code, err = parse_only(script, args)
        if code != 0:
            failed.append(f"{where}: {script} {' '.join(args)}: {err.strip()}")
    assert not failed, "\n".join(failed)


def test_every_lesson_command_fits_the_allocation_of_its_day():
    """One GPU per rank: `--nproc`, `--nproc_per_node` and `srun --ntasks` within what a learner holds on the
    lesson's day (a CPU run, `--backend gloo` or `--device cpu`, may start more)."""
    wrong = []
    for where, (script, args, launcher, per_node, total) in lesson_commands():
        if Path(script).name in CPU_ONLY_LESSONS or {"gloo", "cpu"} & set(args):
            continue
        day = DAY_OF[Path(script).name]
        allocs = [a for a in ALLOCATIONS if a.day == day]
        if per_node and per_node > max(a.per_node for a in allocs):
            wrong.append(f"{where}: {launcher} with {per_node} ranks on a node: day {day}'s allocations hold "
                         f"{max(a.per_node for a in allocs)}")
        if total and total > max(a.nodes * a.per_node for a in allocs):
            wrong.append(f"{where}: {launcher} with {total} ranks: day {day}'s allocations hold "
                         f"{max(a.nodes * a.per_node for a in allocs)}")
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------------------------------------- submit.sh

SITE_FOR = {"NAME": "generic-gpu", "mycluster": "generic-gpu"}
ACCOUNTS = {"perlmutter": "m1234_g", "jsc": "training2024"}


def dry_run(env: dict, words: list) -> subprocess.CompletedProcess:
    """The command with --dry-run (instead of --test-only), NAME and mycluster a GPU profile, an account where
    the profile needs one, and nothing else of this machine's environment."""
    words = [SITE_FOR.get(w, w) for w in words]
    own = words[:words.index("--")] if "--" in words else words
    rest = words[len(own):]
    own = [w for w in own if w not in ("--test-only", "--dry-run")] + ["--dry-run"]
    sites = [own[k + 1] for k, w in enumerate(own[:-1]) if w == "--site"] + \
        [w.split("=", 1)[1] for w in own if w.startswith("--site=")]
    if not sites:
        sites = [SITE_FOR.get(env.get("COURSE_SITE", "NAME"), env.get("COURSE_SITE", "NAME"))]
        own += ["--site", sites[0]]
    env = {k: v for k, v in env.items() if k != "COURSE_SITE"}
    env.setdefault("SITE_ACCOUNT", ACCOUNTS.get(sites[0], ""))
    return subprocess.run(["bash", str(REPO / own[0]), *own[1:], *rest], capture_output=True, text=True, cwd=REPO,
                          env={"PATH": "/usr/bin:/bin", **env}, timeout=60)


def submit_commands():
    calls = [(where, env, words) for where, mark, env, words in COMMANDS
             if kind_of(env, words) == "dry-run" and (mark or ("",))[0] != "excerpt"]
    calls += [(str(where), {}, words) for where, words in inline_commands() if words[0] == "slurm/submit.sh"]
    return calls


def test_every_submit_command_of_the_guides_makes_its_command():
    """Each submit.sh and readiness_check.sh command the guides give, with --dry-run: it is accepted, and the
    lesson arguments after -- parse with the lesson's parser (lesson 0 has no --quick)."""
    failed = []
    for where, env, words in submit_commands():
        done = dry_run(env, words)
        if done.returncode != 0 or not re.match(r"^(sbatch|salloc|srun) ", done.stdout):
            failed.append(f"{where}: {' '.join(words)}: {done.stdout}{done.stderr}".strip())
            continue
        shown = shlex.split(done.stdout)
        script = next((w for w in shown if w.endswith(".sh") and "/slurm/" in w and "lib" not in w), None)
        if shown[0] == "sbatch" and script and "--" in words:
            lesson = re.search(r"\bslurm/(\S+)\.sh$", script).group(1)
            files = [e["script"] for e in lessons() if Path(e["launcher"]).stem == lesson]
            if files and LESSON_SCRIPT.match(files[0]):
                code, err = parse_only(files[0], words[words.index("--") + 1:])
                if code != 0:
                    failed.append(f"{where}: {' '.join(words)}: the lesson refuses its arguments: {err.strip()}")
    assert not failed, "\n".join(failed)


def test_the_submit_check_fails_on_lesson_0_with_quick():
    """What the guide said the week before a workshop (`slurm/submit.sh N --site NAME -- --quick` for 0, 6
    and 10) fails the check above for lesson 0."""
    code, err = parse_only("day1/0_torch_dist.py", ["--quick"])
    assert code == 2 and "--quick" in err


# ---------------------------------------------------------------------------------------------- salloc and sbatch

def requested(words: list) -> dict:
    """nodes, per_node, gpus of a salloc/sbatch line (those it names)."""
    found, k = {}, 1
    while k < len(words):
        word, value = words[k], None
        if "=" in word:
            word, value = word.split("=", 1)
        elif k + 1 < len(words) and words[k] in ("--nodes", "-N", "--ntasks-per-node", "--gpus-per-node"):
            value, k = words[k + 1], k + 1
        key = {"--nodes": "nodes", "-N": "nodes", "--ntasks-per-node": "per_node", "--gpus-per-node": "gpus",
               "--gres": "gpus"}.get(word)
        if key and value:
            found[key] = int(re.sub(r"^gpu:(\w+:)?", "", value).split(":")[-1])
        k += 1
    return found


def allocation_lines(paths=ALL_DOCS):
    """[(file, words)] of every salloc or sbatch line in docs/ and the README, in code blocks and in backticks."""
    found = []
    for path in paths:
        for line in path.read_text().splitlines():
            for match in re.finditer(r"(?:^|`|\s)((?:salloc|sbatch) --[^`#\n]*)", line):
                words = words_of(match.group(1).replace("...", ""))
                if requested(words):
                    found.append((path.relative_to(REPO), words))
    return found


def fits(asked: dict) -> bool:
    return any(asked.get("nodes", a.nodes) == a.nodes and asked.get("per_node", a.per_node) == a.per_node and
               asked.get("gpus", asked.get("per_node", a.per_node)) == asked.get("per_node", a.per_node)
               for a in ALLOCATIONS)


def test_every_salloc_and_sbatch_line_of_the_docs_is_an_allocation_of_the_model():
    lines = allocation_lines()
    assert len(lines) >= 8
    wrong = [f"{where}: {' '.join(words)}" for where, words in lines if not fits(requested(words))]
    assert not wrong, ("salloc/sbatch lines that no lesson's ranks and nodes ask for (docs/lessons.toml; "
                       "`python -m course.sizing --table`):\n" + "\n".join(wrong))


def test_the_guides_show_the_allocation_table_sizing_prints():
    made = table()
    shown = 0
    for path in ALL_DOCS:
        text = path.read_text()
        for match in re.finditer(r"<!-- allocations: the output of python -m course.sizing --table -->\n"
                                 r"((?:\|.*\n)+)", text):
            assert match.group(1).strip() == made, f"{path}: run `python -m course.sizing --table` and paste it"
            shown += 1
    assert shown >= 2  # the instructor guide (the card to hand out) and running a lesson (the learners')


def test_the_model_check_fails_on_whole_nodes():
    """The salloc lines the guides had (2 whole nodes of 4 ranks for day 2) fail the check."""
    assert not fits(requested(words_of("salloc --nodes 2 --ntasks-per-node=4 --time=00:30:00")))
    assert not fits(requested(words_of("salloc --nodes=1 --ntasks-per-node=4 --gpus-per-node=2")))
    assert fits(requested(words_of("salloc --nodes=2 --ntasks-per-node=2 --gpus-per-node=2")))


def test_sizing_runs_as_the_guides_give_it():
    calls = [(where, words) for where, _, env, words in COMMANDS if kind_of(env, words) == "run"]
    calls += [(where, words) for where, words in inline_commands()
              if words[:3] == ["python", "-m", "course.sizing"] and words[3:]]  # with arguments: a command line
    assert len(calls) >= 3
    for where, words in calls:
        done = subprocess.run([PYTHON, *words[1:]], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert done.returncode == 0 and "day" in done.stdout, f"{where}: {done.stdout}{done.stderr}"
