"""The two tiers (docs/contributors/tests.md, "Two tiers"): every lesson of the catalog has a test marked
`quick("ID")` that proves its central claim, so that `./run_tests.sh --quick` covers every lesson; and every
reference run of tests/reference_runs.py is one command a learner could type, read by some test."""
import ast
import re

from conftest import REPO
from test_docs_catalog import catalog

TESTS = REPO / "tests"


def quick_marks() -> dict:
    """{lesson id: ["file::test", ...]} from every `pytest.mark.quick("ID")` in the test files, as decorators
    or in a parameter's marks."""
    found = {}
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        for test in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")):
            for node in (n for d in test.decorator_list for n in ast.walk(d)):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.mark.quick":
                    assert len(node.args) == 1 and isinstance(node.args[0], ast.Constant), \
                        f"{path.name}::{test.name}: quick takes the lesson's id, e.g. quick(\"4\")"
                    found.setdefault(node.args[0].value, []).append(f"{path.name}::{test.name}")
    return found


def test_every_lesson_has_a_quick_test_of_its_central_claim():
    ids = {lesson["id"] for lesson in catalog()}
    marks = quick_marks()
    assert not ids - set(marks), f"lessons without a test marked quick(ID): {sorted(ids - set(marks))}"
    assert not set(marks) - ids, f"quick(ID) names no lesson of docs/lessons.toml: {sorted(set(marks) - ids)}"


def test_every_reference_run_is_read_by_a_test():
    """A name nobody asks for is a run nobody needs; a name asked for that is not in the catalogue fails at
    its first use anyway."""
    from reference_runs import RUNS

    text = "\n".join(p.read_text() for p in TESTS.glob("test_*.py"))
    prefixes = set(re.findall(r'Runs\(catalogue, "([^"]+)"\)', text)) | {"17: "}  # the hangs' own lookup
    unread = [name for name in RUNS
              if f'"{name}"' not in text and not any(name.startswith(p) for p in prefixes)
              and not re.search(r'catalogue\(f"' + re.escape(name.split(":")[0]), text)]
    assert not unread, unread
