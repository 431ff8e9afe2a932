"""What has run on what: docs/trainers/ran-on.md, made from the test suite's records in docs/records/.

    python scripts/ran_on.py            write the page from the records
    python scripts/ran_on.py --check    exit 1 if the page is not what the records give

A record is written by a whole run of the test suite with every test passed
(`COURSE_RUN_RECORD=docs/records/NAME.json ./run_tests.sh -p tests.ran_on`, tests/ran_on.py): the machine,
Python, torch, the date, and per lesson the ways it was started in tests that passed.  Nothing here is
typed by hand: a machine that has no record has not run the suite.
"""
import json
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "docs" / "records"
PAGE = REPO / "docs" / "trainers" / "ran-on.md"
COLUMNS = [("own launcher", "own launcher `--nproc`"), ("torchrun", "torchrun"),
           ("Slurm (2 nodes)", "Slurm job, 2 nodes")]


def worlds(sizes: list) -> str:
    shown = [str(s) for s in sizes if s]
    return (", ".join(shown) + (" rank" if shown == ["1"] else " ranks")) if shown else "yes"


def render() -> str:
    catalog = tomllib.loads((REPO / "docs" / "lessons.toml").read_text())["lesson"]
    lines = ["# What has run on what", "",
             "Made by `python scripts/ran_on.py` from the records in `docs/records/`, each written by one whole "
             "run of the test suite in which every test passed (`COURSE_RUN_RECORD=docs/records/NAME.json "
             "./run_tests.sh -p tests.ran_on`). A lesson counts as run one way when a test that passed "
             "started it that way; the world sizes are those the tests' commands named (\"yes\": the "
             "lesson's default, or the Slurm job's own), including commands a test expects the lesson to "
             "refuse in one line (lesson 19's 3 ranks for 4 heads is one). A machine or a GPU with no record here has not run "
             "the course's tests: the [readiness check](cluster.md) is how a site checks its own GPUs and "
             "nodes before a workshop.", ""]
    records = sorted(RECORDS.glob("*.json"))
    if not records:
        lines += ["No record yet.", ""]
    for path in records:
        r = json.loads(path.read_text())
        m = r["machine"]
        gpus = ", ".join(m["gpus"]) if m["gpus"] else "no GPU"
        lines += [f"## {path.stem}", "",
                  f"{m['cpu']}, {m['cores']} cores, {gpus}; {m['os']}; Python {m['python']}, torch {m['torch']}; "
                  f"{r['tests_passed']} tests collected, all passed or skipped; `{r['command']}`, {r['date']}.",
                  ""]
        devices = sorted({key.rsplit(", ", 1)[1] for e in r["lessons"].values() for key in e})
        header = ["lesson"] + [f"{title} ({d})" for d in devices for _, title in COLUMNS]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for lesson in catalog:
            entry = r["lessons"].get(str(lesson["id"]), {})
            cells = [f"{lesson['id']}. {lesson['title']}"]
            for d in devices:
                for how, _ in COLUMNS:
                    cells.append(worlds(entry[f"{how}, {d}"]) if f"{how}, {d}" in entry else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv[1:]:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(REPO)} is not what the records give: run python scripts/ran_on.py",
                  file=sys.stderr)
            sys.exit(1)
    else:
        PAGE.write_text(text)
        print(f"wrote {PAGE.relative_to(REPO)}")
