"""How many nodes a class needs at once, day by day: the size of the reservation to ask the centre for.

    python -m course.sizing --learners 30 --gpus-per-node 4
    python -m course.sizing --learners 30 --cpus-per-node 128        # a CPU-only cluster (gloo)

What each day's hands-on needs per learner, one rank per GPU (CPU-only: CPUS_PER_RANK cores per rank):
- day 1: lessons 0-8 run up to RANKS_DAY1 ranks on one node;
- day 2: the multi-node lessons need 2 nodes; a learner takes 1 GPU on each (`--gpus-per-node 1`, 2 ranks),
  or the class works in pairs, each pair one allocation of 2 nodes (2 ranks on each) used in turns;
- day 3: the FSDP2 and DCP lessons run RANKS_DAY3 ranks (lesson 16 resumes 4 -> 2), on one node or 2 x 2;
  in pairs, one allocation per pair;
- day 4: tensor parallelism runs RANKS_DAY4 ranks inside one node (its all_reduces need the node's fast
  link), 2 where a node holds fewer; lesson 20 a 2-D mesh of 2 rows x 2 ranks, a row on each of 2 nodes,
  and lesson 21 a pipeline of 4 stages, 2 on each of 2 nodes;
  the day needs the larger of the two; in pairs, one allocation per pair.
Learners share a node when their ranks fit on it together (`salloc --gpus-per-node 1` or `--ntasks 2` asks
for part of a node); `--exclusive` sites give each allocation whole nodes: then count one per learner.
"""
import argparse
import math
import sys

RANKS_DAY1 = 2   # --nproc 2: what the notebooks and the quick sequence use; 4 is enough to see scaling in 7
RANKS_DAY2 = 2   # one rank on each of 2 nodes, or 2 per node when a pair shares
RANKS_DAY3 = 4
RANKS_DAY4 = 4   # lesson 19 at --nproc 4 (4 heads: one each); 2 where a node holds fewer
ROW_DAY4 = 2     # lessons 20 and 21: ranks per node (a row of 20's mesh, 2 of 21's stages), on 2 nodes
CPUS_PER_RANK = 2


def nodes_per_day(learners: int, gpus_per_node: int = 0, cpus_per_node: int = 0, exclusive: bool = False,
                  pairs: bool = False) -> dict:
    """{day: (nodes, how)} for the whole class at once."""
    slots = gpus_per_node if gpus_per_node else max(1, cpus_per_node // CPUS_PER_RANK)  # ranks a node holds
    unit = "GPU" if gpus_per_node else f"{CPUS_PER_RANK} cores"

    def packed(ranks_per_learner: int, nodes_per_learner: int = 1, groups: int = learners) -> tuple:
        if exclusive:
            return groups * nodes_per_learner, f"whole nodes: {nodes_per_learner} per allocation"
        per_node = ranks_per_learner // nodes_per_learner  # ranks each allocation puts on each of its nodes
        if per_node > slots:
            raise ValueError(f"{ranks_per_learner} ranks over {nodes_per_learner} node(s) need {per_node} ranks "
                             f"per node; a node holds {slots}")
        together = slots // per_node  # allocations sharing one set of nodes
        return (math.ceil(groups / together) * nodes_per_learner,
                f"{together} allocation(s) of {per_node} rank(s) x {nodes_per_learner} node(s) share each node "
                f"(one rank per {unit})")

    day2_groups = math.ceil(learners / 2) if pairs else learners
    day2_ranks = 2 * RANKS_DAY2 if pairs else RANKS_DAY2
    day3_nodes = 1 if slots >= RANKS_DAY3 else 2
    by_pair = math.ceil(learners / 2) if pairs else learners
    day4 = [packed(RANKS_DAY4 if slots >= RANKS_DAY4 else 2, 1, by_pair),  # lesson 19, one node
            packed(2 * ROW_DAY4, 2, by_pair)]  # lessons 20 and 21, 2 ranks on each of 2 nodes
    return {1: packed(RANKS_DAY1), 2: packed(day2_ranks, 2, day2_groups), 3: packed(RANKS_DAY3, day3_nodes, by_pair),
            4: max(day4, key=lambda nodes_how: nodes_how[0])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m course.sizing", description=__doc__.split("\n\n")[0])
    p.add_argument("--learners", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: a CPU-only cluster)")
    p.add_argument("--cpus-per-node", type=int, default=0, help="cores per node (CPU-only clusters)")
    p.add_argument("--exclusive", action="store_true", help="the site gives every allocation whole nodes")
    p.add_argument("--pairs", action="store_true", help="days 2-4 in pairs: one allocation per pair, used in turns")
    args = p.parse_args(argv)
    if args.learners < 1 or (args.gpus_per_node < 1 and args.cpus_per_node < 1):
        p.error("give --learners (at least 1) and --gpus-per-node or --cpus-per-node")
    try:
        days = nodes_per_day(args.learners, args.gpus_per_node, args.cpus_per_node, args.exclusive, args.pairs)
    except ValueError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    node = f"{args.gpus_per_node} GPUs" if args.gpus_per_node else f"{args.cpus_per_node} cores"
    print(f"{args.learners} learners, nodes of {node}{', exclusive' if args.exclusive else ''}:")
    for day, (nodes, how) in days.items():
        print(f"  day {day}: {nodes:3d} nodes at once  ({how})")
    print(f"reserve {max(n for n, _ in days.values())} nodes for the hands-on hours, plus one for the trainer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
