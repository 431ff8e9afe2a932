"""pytest plugin for tests/test_tiers.py: after collection, writes to $COURSE_QUICK_MARKS one JSON object per
collected test marked quick: its id, the lesson id it names, and the names of all its markers.

    COURSE_QUICK_MARKS=FILE python -m pytest -p quick_marks --collect-only -q -m quick
"""
import json
import os


def quick_tests(items) -> list:
    """One record per item marked quick: its id, the lesson id it names, the names of all its markers (also what
    tests/conftest.py keeps of a session's own collection)."""
    return [{"test": item.nodeid, "quick": list(item.get_closest_marker("quick").args),
             "markers": sorted({m.name for m in item.iter_markers()})}
            for item in items if item.get_closest_marker("quick")]


def pytest_collection_finish(session):
    with open(os.environ["COURSE_QUICK_MARKS"], "w") as out:
        json.dump(quick_tests(session.items), out)
