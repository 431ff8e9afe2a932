"""Every "Try it yourself" item of a notebook has a solution section in solutions/<notebook>.md, in the same
order, and every solution section has a check: one per exercise, in tests/test_solutions_day1.py (lessons
0-8), _day2.py (9-12 and create_mnist_h5), _day3.py (13-17), _day4.py (18-21) and _day5.py (22), five files so that the
test workers can run them side by side.  Each check runs the section's commands as written
(tests/solutions_check.py) and checks what the solution says the learner should see.  Solutions that need a
GPU node or a real cluster are skipped with that reason.  Quick sizes throughout; the costly ones are marked
slow.
"""
import test_solutions_day1  # noqa: F401  (their checks register themselves in CHECKED)
import test_solutions_day2  # noqa: F401
import test_solutions_day3  # noqa: F401
import test_solutions_day4  # noqa: F401
import test_solutions_day5  # noqa: F401
from solutions_check import CHECKED, SOLUTIONS, exercises_in_notebook, notebooks_with_exercises, sections


def test_every_exercise_has_a_solution_with_a_check():
    for name in notebooks_with_exercises():
        assert (SOLUTIONS / f"{name}.md").is_file(), f"solutions/{name}.md is missing"
        have = sorted(sections(name))
        assert have == list(range(1, exercises_in_notebook(name) + 1)), \
            f"solutions/{name}.md has sections {have} for {exercises_in_notebook(name)} exercises"
        for n in have:
            assert (name, n) in CHECKED, f"no check for solutions/{name}.md exercise {n}"
            assert "```bash" in sections(name)[n], f"solutions/{name}.md exercise {n}: no command"
    assert set(CHECKED) == {(name, n) for name in notebooks_with_exercises() for n in sections(name)}
    assert {p.stem for p in SOLUTIONS.glob("*.md")} - {"README"} == set(notebooks_with_exercises())


def test_the_exercise_count_reads_a_notebook_source():
    assert exercises_in_notebook("0_torch_dist") == 3
    assert exercises_in_notebook("test-profile") == 0
