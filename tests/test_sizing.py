"""The reservation's size (course/sizing.py): nodes per day for a class, from the ranks each day's lessons run."""
from conftest import PYTHON, run
from course.sizing import nodes_per_day


def nodes(**kw):
    return {day: n for day, (n, _) in nodes_per_day(**kw).items()}


def test_a_class_of_30_on_nodes_of_4_gpus():
    # day 1: 2 ranks each, 2 learners per node; day 2: 1 GPU on each of 2 nodes, 4 learners per node pair;
    # days 3 and 4: 4 ranks each, a node each; lesson 20: 2 ranks on each of 2 nodes, 2 learners per node pair
    assert nodes(learners=30, gpus_per_node=4) == {1: 15, 2: 16, 3: 30, 4: 30}
    assert nodes(learners=30, gpus_per_node=4, pairs=True) == {1: 15, 2: 16, 3: 15, 4: 16}
    assert nodes(learners=30, gpus_per_node=4, exclusive=True) == {1: 30, 2: 60, 3: 30, 4: 60}


def test_two_gpus_per_node_put_day_3_on_two_nodes_and_day_4_too_and_cpu_clusters_count_cores():
    # day 4 keeps tensor parallelism inside a node (2 ranks on a node of 2 GPUs); lesson 20 fills 2 such nodes
    assert nodes(learners=5, gpus_per_node=2) == {1: 5, 2: 6, 3: 10, 4: 10}
    assert nodes(learners=30, cpus_per_node=128) == {1: 1, 2: 2, 3: 2, 4: 2}  # 64 ranks of 2 cores per node


def test_the_command_prints_the_table_and_the_reservation():
    out = run([PYTHON, "-m", "course.sizing", "--learners", "30", "--gpus-per-node", "4"]).stdout
    assert "  day 3:  30 nodes at once" in out and "reserve 30 nodes for the hands-on hours" in out
