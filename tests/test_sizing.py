"""One model of "ranks (GPUs) per learner": docs/lessons.toml's ranks and nodes of every lesson.

course/sizing.py sizes the reservation from it and prints each day's salloc line; every launcher's #SBATCH
--nodes/--ntasks-per-node are its numbers, and slurm/submit.sh asks for exactly them (one GPU per rank), in a
batch job and with --interactive. tests/test_docs_commands.py holds the guides to the same model.
"""
import re
import shlex
import subprocess

import pytest

from conftest import PYTHON, REPO, run
from course.sizing import day_allocations, lessons, nodes_per_day, per_node, table

SUBMIT = REPO / "slurm" / "submit.sh"


def nodes(**kw):
    return {day: n for day, (n, _) in nodes_per_day(**kw).items()}


def dry_run(*args, env=None):
    done = subprocess.run(["bash", str(SUBMIT), *args, "--dry-run"], capture_output=True, text=True, cwd=REPO,
                          env={"PATH": "/usr/bin:/bin", **(env or {})}, timeout=60)
    assert done.returncode == 0, done.stderr
    return shlex.split(done.stdout)


def test_each_day_has_the_allocations_its_lessons_need():
    shapes = {day: [(a.nodes, a.per_node, a.lessons) for a in allocs] for day, allocs in day_allocations().items()}
    assert shapes[1] == [(1, 4, ("0", "1", "2", "3", "4", "5", "6", "7", "8", "test-profile"))]
    assert shapes[2] == [(2, 2, ("9", "10", "create_mnist_h5", "11", "12"))]
    assert shapes[3] == [(1, 4, ("13", "14", "15", "16", "17"))]
    assert shapes[4] == [(1, 4, ("18", "19")), (2, 2, ("20", "21"))]  # tensor parallelism inside a node
    assert shapes[5] == [(2, 2, ("22", "23"))]  # a row of lesson 22's mesh per node; lesson 23 over both


def test_a_class_of_30_on_nodes_of_4_gpus():
    # days 1 and 3 and lessons 18-19: a node each; day 2 and lessons 20-21: 2 x 2 ranks, 2 learners per node pair
    assert nodes(learners=30, gpus_per_node=4) == {1: 30, 2: 30, 3: 30, 4: 30, 5: 30}
    assert nodes(learners=30, gpus_per_node=4, pairs=True) == {1: 30, 2: 16, 3: 15, 4: 16, 5: 16}
    assert nodes(learners=30, gpus_per_node=4, exclusive=True) == {1: 30, 2: 60, 3: 30, 4: 60, 5: 60}
    assert nodes(learners=30, gpus_per_node=8) == {1: 15, 2: 16, 3: 15, 4: 16, 5: 16}


def test_smaller_nodes_run_fewer_ranks_and_cpu_clusters_count_cores():
    assert nodes(learners=5, gpus_per_node=2) == {1: 5, 2: 10, 3: 5, 4: 10, 5: 10}  # 2 ranks per node, never more
    assert nodes(learners=30, cpus_per_node=128) == {1: 2, 2: 2, 3: 2, 4: 2, 5: 2}  # 64 ranks of 2 cores per node


def test_the_command_prints_the_reservation_and_each_days_salloc_line():
    out = run([PYTHON, "-m", "course.sizing", "--learners", "30", "--gpus-per-node", "4"]).stdout
    assert "  day 3:  30 nodes at once" in out and "reserve 30 nodes for the hands-on hours" in out
    assert "lessons 9, 10, create_mnist_h5, 11, 12: salloc --nodes=2 --ntasks-per-node=2 --gpus-per-node=2" in out
    small = run([PYTHON, "-m", "course.sizing", "--learners", "4", "--gpus-per-node", "2"]).stdout
    assert "salloc --nodes=1 --ntasks-per-node=2 --gpus-per-node=2" in small and "--nproc 2" in small
    cpu = run([PYTHON, "-m", "course.sizing", "--learners", "4", "--cpus-per-node", "16"]).stdout
    assert "salloc --nodes=1 --ntasks-per-node=4 --cpus-per-task=2" in cpu and "gpus" not in cpu
    assert run([PYTHON, "-m", "course.sizing", "--table"]).stdout.strip() == table()


def sbatch(launcher):
    return dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)", (REPO / launcher).read_text(), flags=re.M))


@pytest.mark.parametrize("entry", lessons(), ids=lambda e: e["id"])
def test_every_launcher_and_submit_ask_for_the_lessons_ranks_and_nodes(entry):
    """The launcher's #SBATCH lines (a plain sbatch) and submit.sh's request (with a GPU profile of 4 GPUs
    per node and a CPU-only one) are the catalog's ranks and nodes: one GPU per rank, no whole node."""
    options = sbatch(entry["launcher"])
    assert options["nodes"] == str(entry["nodes"]), entry["launcher"]
    if entry["ranks"] == 1:
        assert options.get("ntasks") == "1" and "ntasks-per-node" not in options
    else:
        assert options["ntasks-per-node"] == str(per_node(entry)), entry["launcher"]
    expected = {f"--nodes={entry['nodes']}", f"--gpus-per-node={per_node(entry)}"}
    if entry["ranks"] > 1:
        expected.add(f"--ntasks-per-node={per_node(entry)}")
    words = dry_run(entry["id"], "--site", "generic-gpu")
    assert expected <= set(words), (expected, words)
    cpu = dry_run(entry["id"], "--site", "cpu-only")
    assert f"--nodes={entry['nodes']}" in cpu and not any("gpu" in w for w in cpu[:-1])
    if entry["ranks"] > 1:
        assert f"--ntasks-per-node={per_node(entry)}" in cpu


@pytest.mark.parametrize("alloc", [a for allocs in day_allocations().values() for a in allocs],
                         ids=lambda a: f"day{a.day}-{a.own}")
def test_interactive_makes_each_days_allocation(alloc):
    """`slurm/submit.sh --interactive LESSON` (the table's line) asks for the salloc line of the table."""
    words = dry_run("--interactive", alloc.own, "--site", "generic-gpu")
    shape = set(alloc.salloc().split()[1:])
    if alloc.nodes > 1:  # salloc: its shell holds the nodes for day2/multinode_setup_and_run.sh
        assert words[0] == "salloc" and shape <= set(words), words
    else:  # one node: a one-task shell there, with the cores and GPUs of the node's ranks
        assert words[0] == "srun" and {"--nodes=1", f"--gpus-per-node={alloc.per_node}", "--pty", "--ntasks=1"} \
            <= set(words), words


def test_the_catalog_refuses_ranks_that_do_not_divide_among_the_nodes(tmp_path):
    catalog = tmp_path / "lessons.toml"
    catalog.write_text('[[lesson]]\nid = "x"\nday = 1\nranks = 3\nnodes = 2\n')
    with pytest.raises(ValueError, match="ranks 3 on 2 nodes"):
        lessons(catalog)
