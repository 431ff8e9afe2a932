"""How many nodes a class needs at once, day by day, and the allocation each learner asks for: the size of the
reservation to ask the centre for, and the salloc lines to hand out.

    python -m course.sizing --learners 30 --gpus-per-node 4
    python -m course.sizing --learners 30 --cpus-per-node 128        # a CPU-only cluster (gloo)
    python -m course.sizing --table                                  # each day's allocations, as the guides show them

The model is docs/lessons.toml: every lesson has `ranks` and `nodes`, what a learner runs it with in class
(one GPU per rank; on a CPU-only cluster CPUS_PER_RANK cores per rank), ranks / nodes on each node. The same
numbers are each launcher's #SBATCH --nodes and --ntasks-per-node, which slurm/submit.sh takes as its
defaults (one GPU per rank), and the salloc lines of the guides (tests/test_docs_commands.py checks both).
A day's allocations are the largest shapes among its lessons: day 1 one node of 4 ranks, day 2 two nodes of
2, day 3 one node of 4, day 4 one node of 4 (lessons 18, 19) and then two nodes of 2 (lessons 20, 21).
Learners share a node when their allocations fit on it together (salloc's --ntasks-per-node and
--gpus-per-node ask for part of a node); `--exclusive` sites give each allocation whole nodes.  A node with
fewer GPUs (or cores) than a lesson's ranks per node runs that many ranks there: the commands then take
`--nproc G` instead of 4.
"""
import argparse
import math
import sys
from pathlib import Path
from typing import NamedTuple

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11: the same parser from PyPI
    import tomli as tomllib

CATALOG = Path(__file__).resolve().parents[1] / "docs" / "lessons.toml"
CPUS_PER_RANK = 2


class Allocation(NamedTuple):
    """What one learner (or pair) holds: `nodes` nodes with `per_node` ranks (GPUs) on each, for `lessons`."""
    day: int
    nodes: int
    per_node: int
    lessons: tuple  # in course order
    own: str  # the first of them whose own shape this is: its launcher's #SBATCH lines ask for exactly this

    def fitted(self, slots: int) -> int:
        """Ranks per node on nodes that hold `slots` ranks (GPUs, or cores / CPUS_PER_RANK)."""
        return min(self.per_node, slots) if slots else self.per_node

    def salloc(self, slots: int = 0, gpus: bool = True) -> str:
        """The salloc line of this allocation (without --reservation, --time and the site's options)."""
        per_node = self.fitted(slots)
        resource = f"--gpus-per-node={per_node}" if gpus else f"--cpus-per-task={CPUS_PER_RANK}"
        return f"salloc --nodes={self.nodes} --ntasks-per-node={per_node} {resource}"

    def interactive(self) -> str:
        """The same allocation with the site profile's options: submit.sh --interactive with a lesson of it."""
        return f"slurm/submit.sh --interactive {self.own} --site NAME"


def lessons(path: Path = CATALOG) -> list:
    """The catalog's entries: id, day, ranks, nodes, launcher, ..."""
    entries = tomllib.loads(Path(path).read_text())["lesson"]
    for entry in entries:
        if entry["ranks"] < 1 or entry["nodes"] < 1 or entry["ranks"] % entry["nodes"]:
            raise ValueError(f"{path}, lesson {entry['id']}: ranks {entry['ranks']} on {entry['nodes']} nodes: "
                             "at least 1 each, the same number of ranks on every node")
    return entries


def per_node(entry: dict) -> int:
    return entry["ranks"] // entry["nodes"]


def day_allocations(entries: list = None) -> dict:
    """{day: [Allocation]}: per day, the largest shapes (nodes, ranks per node) of its lessons, none covered by
    another; each lesson goes to the first allocation of its own number of nodes, else the first that holds it."""
    entries = lessons() if entries is None else entries
    days = {}
    for day in sorted({e["day"] for e in entries}):
        todays = [e for e in entries if e["day"] == day]
        shapes = {}
        for e in todays:
            shapes[e["nodes"]] = max(shapes.get(e["nodes"], 0), per_node(e))
        kept = sorted((n, p) for n, p in shapes.items()
                      if not any((n2, p2) != (n, p) and n2 >= n and p2 >= p for n2, p2 in shapes.items()))
        members = {shape: [] for shape in kept}
        for e in todays:
            own = [s for s in kept if s[0] == e["nodes"] and s[1] >= per_node(e)]
            holds = [s for s in kept if s[0] >= e["nodes"] and s[1] >= per_node(e)]
            members[(own or holds)[0]].append(e)
        days[day] = []
        for shape in kept:
            own = next(e["id"] for e in members[shape] if (e["nodes"], per_node(e)) == shape)
            days[day].append(Allocation(day, shape[0], shape[1], tuple(e["id"] for e in members[shape]), own))
    return days


def nodes_per_day(learners: int, gpus_per_node: int = 0, cpus_per_node: int = 0, exclusive: bool = False,
                  pairs: bool = False, entries: list = None) -> dict:
    """{day: (nodes, how)} for the whole class at once: the largest of the day's allocations."""
    slots = gpus_per_node if gpus_per_node else max(1, cpus_per_node // CPUS_PER_RANK)  # ranks a node holds
    unit = "GPU" if gpus_per_node else f"{CPUS_PER_RANK} cores"

    def packed(alloc: Allocation) -> tuple:
        groups = math.ceil(learners / 2) if pairs and alloc.day > 1 else learners
        ranks = alloc.fitted(slots)
        shape = f"{groups} allocations of {alloc.nodes} node(s) x {ranks} rank(s), one rank per {unit}"
        if exclusive:
            return groups * alloc.nodes, f"{shape}, whole nodes each"
        together = slots // ranks  # allocations sharing one set of nodes
        return math.ceil(groups / together) * alloc.nodes, f"{shape}, {together} on each node"

    return {day: max((packed(a) for a in allocs), key=lambda nodes_how: nodes_how[0])
            for day, allocs in day_allocations(entries).items()}


def table(entries: list = None) -> str:
    """Each day's allocations as the guides show them (a Markdown table; tests/test_docs_commands.py compares)."""
    rows = ["| day | lessons | each learner holds | salloc (+ --reservation, --time and the site's options) "
            "| or, with the site profile |", "|---|---|---|---|---|"]
    for day, allocs in day_allocations(entries).items():
        for a in allocs:
            rows.append(f"| {day} | {', '.join(a.lessons)} | {a.nodes} node{'s' if a.nodes > 1 else ''} x "
                        f"{a.per_node} ranks (GPUs) | `{a.salloc()}` | `{a.interactive()}` |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m course.sizing", description=__doc__.split("\n\n")[0])
    p.add_argument("--learners", type=int, help="learners in the class")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: a CPU-only cluster)")
    p.add_argument("--cpus-per-node", type=int, default=0, help="cores per node (CPU-only clusters)")
    p.add_argument("--exclusive", action="store_true", help="the site gives every allocation whole nodes")
    p.add_argument("--pairs", action="store_true", help="days 2-4 in pairs: one allocation per pair, used in turns")
    p.add_argument("--table", action="store_true", help="print each day's allocations as the guides show them")
    args = p.parse_args(argv)
    if args.table:
        print(table())
        return 0
    if args.learners is None or args.learners < 1 or (args.gpus_per_node < 1 and args.cpus_per_node < 1):
        p.error("give --learners (at least 1) and --gpus-per-node or --cpus-per-node (or --table)")
    days = nodes_per_day(args.learners, args.gpus_per_node, args.cpus_per_node, args.exclusive, args.pairs)
    slots = args.gpus_per_node or max(1, args.cpus_per_node // CPUS_PER_RANK)
    node = f"{args.gpus_per_node} GPUs" if args.gpus_per_node else f"{args.cpus_per_node} cores"
    print(f"{args.learners} learners, nodes of {node}{', exclusive' if args.exclusive else ''}"
          f"{', days 2-4 in pairs' if args.pairs else ''}:")
    allocs = day_allocations()
    for day, (nodes, how) in days.items():
        print(f"  day {day}: {nodes:3d} nodes at once  ({how})")
        for a in allocs[day]:
            print(f"         lessons {', '.join(a.lessons)}: {a.salloc(slots, bool(args.gpus_per_node))}")
    print(f"reserve {max(n for n, _ in days.values())} nodes for the hands-on hours, plus one for the trainer")
    print("Each learner's salloc line also takes --reservation=<its name>, --time and the site's options;"
          " `slurm/submit.sh --interactive LESSON --site NAME` adds the profile's.")
    short = sorted({a.per_node for day in allocs.values() for a in day if a.fitted(slots) < a.per_node})
    if short:
        print(f"A node holds {slots} ranks: where the lessons run {max(short)} on a node, run them with"
              f" --nproc {slots} (torchrun --nproc_per_node={slots}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
