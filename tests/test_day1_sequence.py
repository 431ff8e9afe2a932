"""The quick sequence (`./quickstart.sh`, `python -m course.day1_sequence`): what it starts, and how.

Running it whole takes minutes and is what quickstart.sh does; here: its plan, without starting anything.
"""
import pytest

from conftest import REPO, help_texts_of
from course.day1_sequence import plan


@pytest.fixture(scope="module")
def helps():
    return help_texts_of({script for script, *_ in plan(2, "cpu", quick=True)})


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_lesson_with_a_device_option_gets_the_planned_device(helps, device):
    """On a node with one GPU the data-parallel lessons run on the CPU (one GPU cannot hold two NCCL ranks):
    a lesson started without --device would pick the GPU for every rank and stop."""
    steps = plan(2, device, quick=True)
    for script, args, _, _ in steps:
        if "--device" in helps[script]:
            assert "--device" in args and args[args.index("--device") + 1] == device, (script, args)


def test_every_planned_option_exists(helps):
    steps = plan(2, "cpu", quick=True)
    for script, args, _, _ in steps:
        assert (REPO / script).is_file()
        for option in (a for a in args if a.startswith("--")):
            assert option in helps[script], (script, option)
