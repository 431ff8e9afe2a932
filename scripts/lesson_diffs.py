"""How much each lesson changes against the lesson it builds on: the diff between them is the lesson.

    python scripts/lesson_diffs.py              # a table: pair, lines added, lines removed, changed
    python scripts/lesson_diffs.py --check 80   # exit 1, naming the pairs that change more than 80 lines
                                                # (or than their own limit: LARGER, below)

What is counted: the lines `diff -u` would mark with + or - between the two files, after removing, from
both, every docstring (module, class and function docstrings: they explain, the code is the lesson) and
every blank line.  Comments count: a learner reads them in the diff.  A changed line counts twice (once
removed, once added), as in `git diff --stat`.  Needs only the standard library (no torch).
"""
import argparse
import ast
import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (earlier lesson, later lesson): each later lesson is read as a diff against the earlier one
PAIRS = [(0, 1), (2, 3), (3, 4), (4, 5), (4, 6), (6, 7), (6, 8), (6, 10), (10, 11), (10, 12), (6, 13), (13, 14), (13, 15), (15, 16), (6, 17), (13, 18), (18, 19), (19, 20), (19, 21), (20, 22), (22, 23)]
# pairs whose idea needs more than --check's lines, written in the lesson rather than hidden behind a helper
# (the later lesson's docstring says why): (earlier, later): (its limit, why)
LARGER = {
    (19, 21): (120, "the stage split and torch's PipelineStage are the lesson: both written in it (and lesson 19's "
                    "TP build, meta device and sequence parallelism, goes)"),
    (18, 19): (135, "the TP plan (with its sequence-parallel variant and the meta-device build) and the collectives "
                    "priced on the mesh's own group (the calls) are the lesson: both written in it"),
    (19, 20): (90, "lesson 19's plans written again (lessons stand alone), and the clip that follows the meshes"),
    (20, 22): (390, "a new day: text in place of images, a language model's loss, tokens/s and MFU, sampling, "
                  "the plan for a whole Llama (embedding, head, sequence parallelism) and lessons 12 and 16's "
                  "stop signals and DCP checkpoints, composed, all change at once"),
    (22, 23): (370, "lesson 22's loop on weights read from and written to a Hugging Face directory, on masked "
                  "prompt/response pairs: most of the removed lines are lesson 22's TP plans, throughput and "
                  "checkpoints going"),
}


def lesson_file(number: int) -> Path:
    found = sorted(ROOT.glob(f"day*/{number}_*.py"))
    if len(found) != 1:
        raise SystemExit(f"lesson_diffs.py: error: expected one file day*/{number}_*.py, found {len(found)}")
    return found[0]


def docstring_lines(source: str) -> set:
    """1-based numbers of the lines that belong to a module, class or function docstring."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_lines(path: Path) -> list:
    source = path.read_text()
    skip = docstring_lines(source)
    return [line.rstrip() for number, line in enumerate(source.splitlines(), 1)
            if number not in skip and line.strip()]


def count(before: Path, after: Path) -> tuple:
    """(lines removed, lines added) between the code lines of two files."""
    removed = added = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, code_lines(before), code_lines(after),
                                                       autojunk=False).get_opcodes():
        if tag != "equal":
            removed += i2 - i1
            added += j2 - j1
    return removed, added


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/lesson_diffs.py", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", type=int, metavar="N", default=None,
                   help="exit 1 if a pair changes more than N lines (removed + added)")
    args = p.parse_args(argv)
    if args.check is not None and args.check < 0:
        p.error(f"--check {args.check}: must be 0 or more")
    rows = []
    for a, b in PAIRS:
        fa, fb = lesson_file(a), lesson_file(b)
        removed, added = count(fa, fb)
        rows.append((f"{a} -> {b}", fa.relative_to(ROOT), fb.relative_to(ROOT), removed, added, removed + added))
    print(f"{'pair':<9} {'removed':>7} {'added':>6} {'changed':>7}  files")
    for pair, fa, fb, removed, added, changed in rows:
        print(f"{pair:<9} {removed:>7} {added:>6} {changed:>7}  {fa} -> {fb}")
    for (a, b), (limit, why) in LARGER.items():
        print(f"{a} -> {b}: at most {limit} changed lines: {why}")
    if args.check is not None:
        limits = {f"{a} -> {b}": max(args.check, n) for (a, b), (n, _) in LARGER.items()}
        over = [(pair, changed) for pair, _, _, _, _, changed in rows if changed > limits.get(pair, args.check)]
        if over:
            print(f"over {args.check} changed lines: " + ", ".join(f"{pair} ({n})" for pair, n in over),
                  file=sys.stderr)
            return 1
        print(f"every pair changes at most {args.check} lines, or its own limit above")
    return 0


if __name__ == "__main__":
    sys.exit(main())
