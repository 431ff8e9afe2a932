"""course/ is grouped by what its modules are for (course/__init__.py), and its imports go one way: no module
imports, at any depth of its code (lazy imports inside functions count), one that imports it back."""
from pathlib import Path

from conftest import REPO
from test_requires import imports_of

COURSE = REPO / "course"
# what each part of course/ may import of the rest (course/__init__.py says the same in words)
MAY_IMPORT = {
    "launching": set(),
    "models": {"launching"},
    "gpt": {"launching"},  # day 5's model, apart from models.py (course/gpt.py says why)
    "training": {"launching", "models"},
    "checkpoints": {"launching", "models", "training"},
    "measuring": {"launching", "models", "training"},
}
COMMANDS = {"day1_sequence", "fit", "readiness", "sizing", "tensorboard_private"}  # run by trainers and learners


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def graph() -> dict:
    """{module: the course modules it imports}, read by tests/test_requires.py's imports_of."""
    return {module_name(p): {module_name(f) for f in imports_of(p)[1] if f.is_relative_to(COURSE) and f.is_file()}
            for p in COURSE.rglob("*.py") if p.name != "__init__.py"}


def part(module: str) -> str:
    return module.split(".")[1]


def test_every_module_is_in_a_part_of_its_purpose():
    parts = {part(m) for m in graph()}
    assert parts <= set(MAY_IMPORT) | COMMANDS, parts - set(MAY_IMPORT) - COMMANDS
    for package in set(MAY_IMPORT) - {"models", "gpt"}:
        assert (COURSE / package / "__init__.py").read_text().startswith('"""'), package  # says what it holds


def test_the_parts_import_each_other_one_way_only():
    wrong = [f"{m} imports {t}" for m, targets in graph().items() if part(m) in MAY_IMPORT
             for t in targets if part(t) != part(m) and part(t) not in MAY_IMPORT[part(m)]]
    assert not wrong, "\n".join(wrong)


def test_no_module_of_course_imports_one_that_imports_it_back():
    imports, cycles = graph(), []

    def visit(module, path):
        for target in sorted(imports.get(module, ())):
            if target == path[0]:
                cycles.append(" -> ".join(path + [target]))
            elif target not in path:
                visit(target, path + [target])

    for start in sorted(imports):
        visit(start, [start])
    assert not cycles, "\n".join(cycles)
    assert imports["course.measuring.profiling"] >= {"course.measuring.monitor"}  # the graph is read at all
