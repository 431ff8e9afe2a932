"""docs/lessons.toml, the lesson catalog, against the repository and the documents made from it.

- every lesson script (day1/ to day5/, data_tools/create_mnist_h5.py) has exactly one entry, and every entry
  names a script, notebook and launcher that exist;
- the instructor guide's timetables list each day's lessons with the catalog's titles and minutes, their
  clock times add up, and the per-day sums the guide quotes are the catalog's;
- the one-day cut keeps some lessons and assigns the others as reading, each exactly once;
- the README's course map lists every lesson's title, linked to its script;
- every lesson's instructor kit (teaching and exercise minutes, the exercises set in class, key points, a
  check question and its answer) is complete, names only exercises its notebook has, and the guide shows it
  as the catalog has it; every day's timetable has a feedback slot; the learners' set-up page exists and
  the README and the guide link it.
No torch import: reading text only.
"""
import re
try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11: the same parser from PyPI
    import tomli as tomllib
from pathlib import Path

import pytest

from solutions_check import exercises_in_notebook

REPO = Path(__file__).resolve().parents[1]
CATALOG = REPO / "docs" / "lessons.toml"
GUIDE = REPO / "docs" / "trainers" / "instructor-guide.md"
README = REPO / "README.md"
SETUP_PAGE = REPO / "docs" / "learners" / "before-the-workshop.md"
KIT_FIELDS = ("teaching_minutes", "exercise_minutes", "in_class", "key_points", "check_question", "check_answer")
ROW = re.compile(r"^\| (\d\d):(\d\d) \| (.+?) \| (\d+) \|$")


def catalog(path=CATALOG):
    return tomllib.loads(path.read_text())["lesson"]


def lesson_scripts(repo=REPO):
    scripts = sorted(p.relative_to(repo).as_posix() for day in ("day1", "day2", "day3", "day4", "day5") for p in (repo / day).glob("*.py"))
    return scripts + ["data_tools/create_mnist_h5.py"]


def section(text, heading):
    """The text under a Markdown heading, up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index("\n" + heading + "\n") + len(heading) + 2
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, start)
    return text[start:end.start() if end else len(text)]


def timetable(text):
    """[(minute of the day, block, minutes)] of the first timetable in text, and the lessons' sum it quotes."""
    rows = [(int(h) * 60 + int(m), block, int(n)) for h, m, block, n in
            (ROW.match(line).groups() for line in text.splitlines() if ROW.match(line))]
    quoted = re.search(r"^Lessons: (\d+) minutes; the day runs (\d\d:\d\d)-(\d\d:\d\d)\.", text, re.M)
    assert rows and quoted, "a timetable needs rows '| HH:MM | block | minutes |' and a line 'Lessons: N minutes; ...'"
    return rows, quoted


def lesson_rows(rows, by_id):
    """{lesson id: (title, minutes)} of the rows that are lessons ('lesson ID: TITLE')."""
    found = {}
    for _, block, minutes in rows:
        match = re.fullmatch(r"lesson (\S+): (.+)", block)
        if match:
            assert match[1] in by_id, f"the timetable names lesson {match[1]}, which the catalog does not have"
            assert match[1] not in found, f"lesson {match[1]} appears twice in one timetable"
            found[match[1]] = (match[2], minutes)
    return found


def check_timetable(text, by_id, lessons):
    rows, quoted = timetable(text)
    for (start, block, minutes), (next_start, _, _) in zip(rows, rows[1:]):
        assert start + minutes == next_start, f"'{block}' starts at {start // 60:02d}:{start % 60:02d} and lasts " \
                                              f"{minutes} min, but the next block does not start then"
    found = lesson_rows(rows, by_id)
    assert set(found) == set(lessons)
    for lesson_id, (title, minutes) in found.items():
        assert (title, minutes) == (by_id[lesson_id]["title"], by_id[lesson_id]["minutes"]), lesson_id
    total = sum(by_id[i]["minutes"] for i in lessons)
    end = rows[-1][0] + rows[-1][2]
    assert int(quoted[1]) == total, f"the guide quotes {quoted[1]} minutes of lessons, the catalog sums to {total}"
    assert (quoted[2], quoted[3]) == (f"{rows[0][0] // 60:02d}:{rows[0][0] % 60:02d}", f"{end // 60:02d}:{end % 60:02d}")
    return found


def notebook_name(entry):
    return entry["notebook"].removeprefix("notebooks/").removesuffix(".ipynb")


def exercise_list(numbers):
    """'exercise 3', 'exercises 1 and 2', 'exercises 1, 2 and 3'."""
    words = [str(n) for n in numbers]
    return f"exercise {words[0]}" if len(words) == 1 else f"exercises {', '.join(words[:-1])} and {words[-1]}"


def kit(entry, exercises):
    """The instructor kit of one lesson as the guide shows it, made from its catalog entry and the number of
    exercises its notebook has."""
    homework = [n for n in range(1, exercises + 1) if n not in entry["in_class"]]
    if not exercises:
        plan = "hands-on. The notebook has no exercises: learners run the lesson themselves."
    else:
        plan = (f"exercises. **In class:** {exercise_list(entry['in_class'])} of the notebook's \"Try it yourself\"; "
                + (f"**homework:** {exercise_list(homework)}." if homework else "no homework."))
    points = "\n".join(f"- {point}" for point in entry["key_points"])
    return (f"**Time:** {entry['teaching_minutes']} min teaching, {entry['exercise_minutes']} min {plan}\n\n"
            f"Key points:\n\n{points}\n\n**Check question:** {entry['check_question']}\n\n"
            f"**Answer:** {entry['check_answer']}\n")


def check_kit(entry, exercises):
    """One entry's kit is complete and consistent with its minutes and its notebook's exercises."""
    name = f"lesson {entry['id']}"
    missing = [field for field in KIT_FIELDS if field not in entry]
    assert not missing, f"{name}: missing {', '.join(missing)}"
    assert entry["teaching_minutes"] > 0 and entry["exercise_minutes"] > 0, name
    assert entry["teaching_minutes"] + entry["exercise_minutes"] == entry["minutes"], \
        f"{name}: teaching_minutes + exercise_minutes = {entry['teaching_minutes'] + entry['exercise_minutes']}, " \
        f"minutes = {entry['minutes']}"
    in_class = entry["in_class"]
    assert in_class == sorted(set(in_class)), f"{name}: in_class must list each exercise once, in order"
    assert set(in_class) <= set(range(1, exercises + 1)), \
        f"{name}: in_class {in_class}, but {entry['notebook']} has {exercises} exercises (notebooks/src/" \
        f"{notebook_name(entry)}.py, \"Try it yourself\")"
    assert bool(in_class) == bool(exercises), f"{name}: set at least one of the notebook's exercises in class"
    assert 2 <= len(entry["key_points"]) <= 4, f"{name}: 2-4 key points"
    assert all(point.endswith(".") for point in entry["key_points"]), f"{name}: key points are sentences"
    assert entry["check_question"].endswith("?") and entry["check_answer"], name


def lesson_section(text, entry):
    """The guide's section of one lesson: '### Lesson N: TITLE (M min)' or '### ID: TITLE (M min)'."""
    heading = next((line for line in text.splitlines()
                    if line.startswith("### ") and line.endswith(f": {entry['title']} ({entry['minutes']} min)")), None)
    assert heading, f"the guide has no section for lesson {entry['id']}"
    return section(text, heading)


def test_every_lesson_script_has_exactly_one_entry():
    scripts = [entry["script"] for entry in catalog()]
    assert sorted(scripts) == sorted(lesson_scripts()), "one catalog entry per lesson script, no more"
    assert len(set(scripts)) == len(scripts)
    ids = [entry["id"] for entry in catalog()]
    assert len(set(ids)) == len(ids)


def test_entries_are_complete_and_their_paths_exist():
    for entry in catalog():
        assert entry["day"] in (1, 2, 3, 4, 5), entry["id"]
        assert entry["title"] and entry["idea"] and entry["minutes"] > 0, entry["id"]
        assert 2 <= len(entry["objectives"]) <= 4, entry["id"]
        assert all(o.startswith("After this lesson you can ") for o in entry["objectives"]), entry["id"]
        for key in ("script", "notebook", "launcher"):
            assert (REPO / entry[key]).is_file(), f"lesson {entry['id']}: {key} {entry[key]} does not exist"


def test_entries_are_in_course_order():
    ids = [entry["id"] for entry in catalog()]
    numbered = [int(i) for i in ids if i.isdigit()]
    assert numbered == sorted(numbered) == list(range(len(numbered)))
    assert ids.index("test-profile") == ids.index("8") + 1
    assert [entry["day"] for entry in catalog()] == sorted(entry["day"] for entry in catalog())


def test_the_guide_timetables_match_the_catalog():
    text, by_id = GUIDE.read_text(), {entry["id"]: entry for entry in catalog()}
    for day in sorted({entry["day"] for entry in catalog()}):
        heading = next(line for line in text.splitlines() if line.startswith(f"### Day {day}"))
        check_timetable(section(text, heading), by_id, [i for i, e in by_id.items() if e["day"] == day])


def test_the_one_day_cut_keeps_or_assigns_every_lesson_once():
    text, by_id = GUIDE.read_text(), {entry["id"]: entry for entry in catalog()}
    one_day = section(text, "### One day")
    kept = lesson_rows(timetable(one_day)[0], by_id)
    check_timetable(one_day, by_id, list(kept))
    reading = re.findall(r"^- lesson (\S+): ", one_day, re.M)
    assert len(reading) == len(set(reading))
    assert set(kept) | set(reading) == set(by_id) and not set(kept) & set(reading)


@pytest.mark.parametrize("heading, whole_days", [("### Two days", [1]), ("### Three days", [1, 2])])
def test_the_two_and_three_day_cuts_keep_or_assign_every_lesson_once(heading, whole_days):
    """The README promises two to four days: each shorter workshop takes some days of the four whole (and
    says which, with a link), has a timetable of its own for its last day, and assigns every other lesson as
    reading, once."""
    text, by_id = GUIDE.read_text(), {entry["id"]: entry for entry in catalog()}
    cut = section(text, heading)
    kept = check_timetable(cut, by_id, [i for i in lesson_rows(timetable(cut)[0], by_id)])
    whole = {i for i, e in by_id.items() if e["day"] in whole_days}
    for day in whole_days:
        title = next(line for line in text.splitlines() if line.startswith(f"### Day {day}: "))[4:]
        assert f"[{title}](#" in cut, f"'{heading}' does not say it takes '{title}' whole"
    reading = re.findall(r"^- lesson (\S+): ", cut, re.M)
    assert len(reading) == len(set(reading)), reading
    assert not set(kept) & whole and not (set(kept) | whole) & set(reading)
    assert set(kept) | whole | set(reading) == set(by_id), set(by_id) - set(kept) - whole - set(reading)


def test_the_guide_quotes_every_objective_and_minutes():
    text = GUIDE.read_text()
    for entry in catalog():
        assert f": {entry['title']} ({entry['minutes']} min)" in text, entry["id"]
        for objective in entry["objectives"]:
            assert objective in text, f"lesson {entry['id']}: objective missing from the guide: {objective}"


def test_every_lesson_has_a_complete_instructor_kit():
    for entry in catalog():
        check_kit(entry, exercises_in_notebook(notebook_name(entry)))


def test_the_guide_shows_every_lesson_kit_as_the_catalog_has_it():
    text = GUIDE.read_text()
    for entry in catalog():
        expected = kit(entry, exercises_in_notebook(notebook_name(entry)))
        assert expected in lesson_section(text, entry), \
            f"lesson {entry['id']}: the guide's section does not show the catalog's kit; it should read:\n{expected}"


def test_every_timetable_has_a_feedback_slot_and_the_guide_a_helper_ratio():
    text = GUIDE.read_text()
    days = [line for line in text.splitlines() if line.startswith("### Day ")] + \
        ["### One day", "### Two days", "### Three days"]
    for heading in days:
        blocks = [block for _, block, _ in timetable(section(text, heading))[0]]
        assert any(block.startswith("feedback") for block in blocks), f"'{heading}' has no feedback slot"
    assert "one helper per 8-10 learners" in section(text, "## Timetables")


def test_the_learners_setup_page_exists_and_is_linked():
    assert SETUP_PAGE.is_file()
    page = SETUP_PAGE.read_text()
    for topic in ("ssh", "browser", "account", "help"):
        assert topic in page.lower(), f"{SETUP_PAGE.name} says nothing about: {topic}"
    assert "(docs/learners/before-the-workshop.md)" in section(README.read_text(), "## Documentation")
    assert "(../learners/before-the-workshop.md)" in section(GUIDE.read_text(), "## Before the workshop")


def test_the_readme_course_map_lists_every_lesson():
    course_map = section(README.read_text(), "## Course map")
    for entry in catalog():
        assert f"[{entry['title']}]({entry['script']})" in course_map, \
            f"the README's course map lacks lesson {entry['id']} ({entry['title']})"


def test_the_checks_fail_on_a_broken_catalog(tmp_path):
    """The checks above catch a missing entry, a duplicate, a wrong path and a timetable out of step."""
    text = CATALOG.read_text()
    entries = text.split("[[lesson]]")
    dropped = tmp_path / "dropped.toml"
    dropped.write_text("[[lesson]]".join(entries[:-1]))
    assert sorted(e["script"] for e in catalog(dropped)) != sorted(lesson_scripts())
    doubled = tmp_path / "doubled.toml"
    doubled.write_text(text + "[[lesson]]" + entries[1])
    assert len({e["script"] for e in catalog(doubled)}) < len(catalog(doubled))

    by_id = {entry["id"]: entry for entry in catalog()}
    day1 = section(GUIDE.read_text(), next(line for line in GUIDE.read_text().splitlines()
                                            if line.startswith("### Day 1")))
    longer = {**by_id, "0": {**by_id["0"], "minutes": by_id["0"]["minutes"] + 5}}
    with pytest.raises(AssertionError):
        check_timetable(day1, longer, [i for i, e in by_id.items() if e["day"] == 1])
    with pytest.raises(AssertionError):
        check_timetable(day1, by_id, [i for i, e in by_id.items() if e["day"] == 1 and i != "3"])
    shifted = day1.replace("| 09:50 |", "| 09:55 |", 1)
    assert shifted != day1
    with pytest.raises(AssertionError):
        check_timetable(shifted, by_id, [i for i, e in by_id.items() if e["day"] == 1])


def test_the_kit_checks_fail_on_a_broken_kit():
    """A split that does not add up, an exercise the notebook lacks, a kit field missing, and a key point the
    guide does not show are each caught."""
    entry = next(e for e in catalog() if e["id"] == "4")
    exercises = exercises_in_notebook(notebook_name(entry))
    check_kit(entry, exercises)
    broken = [{**entry, "teaching_minutes": entry["teaching_minutes"] + 5},
              {**entry, "in_class": [*entry["in_class"], exercises + 1]},
              {**entry, "in_class": []},
              {key: value for key, value in entry.items() if key != "check_answer"}]
    for bad in broken:
        with pytest.raises(AssertionError):
            check_kit(bad, exercises)
    guide = lesson_section(GUIDE.read_text(), entry)
    assert kit(entry, exercises) in guide
    changed = {**entry, "key_points": [*entry["key_points"][:-1], entry["key_points"][-1] + " And more."]}
    assert kit(changed, exercises) not in guide
    assert kit(entry, exercises + 1) not in guide  # an exercise added to the notebook: the homework changes
