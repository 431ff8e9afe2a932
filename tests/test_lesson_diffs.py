"""scripts/lesson_diffs.py: the diff between a lesson and the one it builds on stays small (the diff is the
lesson).  Cheap: standard library only, no torch, no lesson is run."""
import importlib.util
import re
import sys

from conftest import REPO, run

SCRIPT = REPO / "scripts" / "lesson_diffs.py"
LIMIT = 80
DOCS = REPO / "docs" / "learners" / "running-lessons.md"


def load():
    spec = importlib.util.spec_from_file_location("lesson_diffs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_pair_stays_within_its_limit_and_the_learners_page_shows_the_table():
    proc = run([sys.executable, SCRIPT, "--check", LIMIT], check=False, timeout=60)
    table = {m[1]: int(m[2]) for m in re.finditer(r"^(\d+ -> \d+)\s+\d+\s+\d+\s+(\d+)\s", proc.stdout, re.M)}
    assert len(table) >= 15, proc.stdout
    limits = {f"{a} -> {b}": max(LIMIT, n) for (a, b), (n, _) in load().LARGER.items()}  # the script's own
    over = {pair: n for pair, n in table.items() if n > limits.get(pair, LIMIT)}
    assert not over and proc.returncode == 0, f"pairs over {LIMIT} changed lines: {over}\n{proc.stderr}"
    # the learners' page shows the script's table as it is now
    shown = DOCS.read_text().split("<!-- lesson_diffs: the output of python scripts/lesson_diffs.py -->\n```text\n")[1]
    assert shown.split("```")[0] == proc.stdout.split("every pair")[0], "run scripts/lesson_diffs.py and paste its table"


def test_a_pair_over_the_limit_is_named_and_exits_1():
    proc = run([sys.executable, SCRIPT, "--check", 50], check=False, timeout=60)  # 10 -> 11 changes 80 lines
    assert proc.returncode == 1 and proc.stderr.startswith("over 50 changed lines: ") and "10 -> 11 (" in proc.stderr


def test_docstrings_and_blank_lines_do_not_count_comments_do(tmp_path):
    lesson_diffs = load()
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text('"""Lesson A."""\nimport os\n\n\ndef f():\n    """Says what."""\n    return 1\n')
    b.write_text('"""Lesson B,\n\nlonger."""\nimport os\n\ndef f():\n    """Says more,\n    much more."""\n'
                 '    return 2  # why\n')
    assert lesson_diffs.count(a, b) == (1, 1)  # only `return 1` -> `return 2  # why`


def test_help_says_what_is_counted_and_bad_input_is_one_line():
    out = run([sys.executable, SCRIPT, "--help"], timeout=60).stdout
    assert "docstring" in out and "--check N" in out
    proc = run([sys.executable, SCRIPT, "--check", "-1"], check=False, timeout=60)
    assert proc.returncode == 2 and "must be 0 or more" in proc.stderr


LESSONS = [p for day in ("day1", "day2", "day3", "day4", "day5") for p in sorted((REPO / day).glob("[0-9]*.py"))] + \
    [REPO / "day1" / "test-profile.py"]
TAG = re.compile(r"# (DDP|DIST):")
DISTRIBUTED = re.compile(r"\bdist\.(?!destroy_process_group|get_backend|ReduceOp)\w+\(|\bDDP\(|DistributedSampler\(|"
                         r"cuda\.set_device\(")


def test_every_distributed_line_is_tagged_and_every_lesson_says_what_the_tags_mean():
    """`grep -E "# (DDP|DIST):"` is a true view of the distributed lines: each such line carries a tag, or the
    comment line right above it does (a tag on a long statement's first line covers the statement)."""
    untagged = []
    for path in LESSONS:
        lines = path.read_text().splitlines()
        assert any(line.startswith("Tags") and "`# DDP:`" in line and "`# DIST:`" in line for line in lines), path
        doc_end = next(i for i, line in enumerate(lines) if i and line.strip().endswith('"""'))
        for i, line in enumerate(lines[doc_end + 1:], doc_end + 1):
            code = line.split("#")[0]
            if DISTRIBUTED.search(code) and not (TAG.search(line) or TAG.search(lines[i - 1])):
                untagged.append(f"{path.relative_to(REPO)}:{i + 1}: {line.strip()}")
    assert not untagged, "\n".join(untagged)


def strings_a_learner_reads(path) -> list:
    """Docstrings and string literals (f-strings' text included) of a file: what it prints and explains."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append(node.value)
    return found


def test_no_test_vocabulary_in_what_the_lessons_print_or_explain():
    words = re.compile(r"\b(the|our|course's) tests?\b|\bbound\b|\btolerance\b", re.I)
    files = LESSONS + [REPO / "course" / f"{name}.py" for name in ("measuring/timing", "training/curves",
                       "training/replicas", "training/coverage", "checkpoints/files", "measuring/profiling")]
    found = [f"{path.relative_to(REPO)}: {m.group(0)!r} in {text[:80]!r}" for path in files
             for text in strings_a_learner_reads(path) for m in [words.search(text)] if m]
    assert not found, "\n".join(found)


# the torch API each lesson teaches, called in the lesson's own code (never only behind a course/ helper)
TAUGHT = {
    "day3/15_fsdp2.py": {"fully_shard", "init_device_mesh"},
    "day3/16_distributed_checkpoint.py": {"save", "load"},  # dcp.save / dcp.load (or async_save)
    "day4/19_tensor_parallel.py": {"parallelize_module", "ColwiseParallel", "RowwiseParallel", "init_device_mesh"},
    "day4/20_device_mesh_2d.py": {"parallelize_module", "fully_shard", "init_device_mesh"},
    "day4/21_pipeline_parallel.py": {"PipelineStage", "step"},  # the stage, and the schedule's step
    "day5/22_gpt_pretraining.py": {"fully_shard", "parallelize_module", "SequenceParallel", "PrepareModuleInput",
                                   "cross_entropy"},
}


def called_names(path) -> set:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def test_each_lesson_calls_the_torch_api_it_teaches():
    for lesson, api in TAUGHT.items():
        missing = api - called_names(REPO / lesson)
        assert not missing, f"{lesson} does not call {sorted(missing)} itself"
