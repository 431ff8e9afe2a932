"""The two tiers (docs/contributors/tests.md, "Two tiers"): every lesson of the catalog has a collected test
marked `quick("ID")` that proves its central claim, none of which needs the test Slurm, a browser or a GPU,
so that `./run_tests.sh --quick` covers every lesson anywhere.  (That every reference run is read by some
test is checked at the end of a whole run in CI: tests/conftest.py, pytest_sessionfinish.)"""
import json

from conftest import PYTHON, QUICK_COLLECTED, run
from test_docs_catalog import catalog


def collected_quick_tests(config, tmp_path) -> list:
    """What pytest itself collects as quick: parametrized ones and markers as applied.  This session's own
    collection where it collected the whole suite (tests/conftest.py), else a collection of its own
    (tests/quick_marks.py)."""
    if QUICK_COLLECTED in config.stash:
        return config.stash[QUICK_COLLECTED]
    out = tmp_path / "quick.json"
    run([PYTHON, "-m", "pytest", "-p", "quick_marks", "--collect-only", "-q", "-m", "quick", "-p", "no:xdist",
         "-p", "no:cacheprovider", "tests"], env={"COURSE_QUICK_MARKS": str(out), "COURSE_RECORD_DURATIONS": "0"},
        timeout=300)
    return json.loads(out.read_text())


def test_every_lesson_has_a_quick_test_of_its_central_claim_that_runs_anywhere(pytestconfig, tmp_path):
    ids, quick = {lesson["id"] for lesson in catalog()}, collected_quick_tests(pytestconfig, tmp_path)
    named = {}
    for test in quick:
        assert len(test["quick"]) == 1, f"{test['test']}: quick takes the lesson's id, e.g. quick(\"4\")"
        named.setdefault(test["quick"][0], []).append(test["test"])
        needs = set(test["markers"]) & {"slurm", "browser", "gpu"}
        assert not needs, f"{test['test']} is quick but needs {sorted(needs)}: the quick tier runs anywhere"
    assert not ids - set(named), f"lessons without a test marked quick(ID): {sorted(ids - set(named))}"
    ids_or_templates = ids | {"templates"}  # templates/ (tests/test_templates.py): no lesson, a quick test too
    assert not set(named) - ids_or_templates, \
        f"quick(ID) names no lesson of docs/lessons.toml: {sorted(set(named) - ids_or_templates)}"
