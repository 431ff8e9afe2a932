"""Day 4's bookkeeping: the collectives a step issued (counted by torch's CommDebugMode), what each rank
holds of the parameters that were cut (its pieces, against the whole), and where a mesh's ranks run."""
import collections
import contextlib
import math
import os
import socket
import time

import torch
import torch.distributed as dist

from course.measuring.hardware import all_reduce_seconds, clock, collectives_table, one_rank
from course.measuring.memory import MB, held, nbytes, reshard
from course.training.output import rank_print


# what CommDebugMode calls the process-group collectives FSDP2 issues itself (DTensor's are c10d_functional.*)
FSDP_OPS = {"_allgather_base_": "all_gather (FSDP2)", "_reduce_scatter_base_": "reduce_scatter (FSDP2)",
            "allreduce_": "all_reduce (FSDP2)"}


def collectives(counting) -> dict:
    """{"forward": {"all_reduce": 8}, "backward": {...}}: a CommDebugMode's counts over the whole model, by
    phase and by the collective's name (c10d_functional.all_reduce -> all_reduce: tensor parallelism's;
    c10d._allgather_base_ -> all_gather (FSDP2))."""
    def name(op) -> str:
        short = str(op).split(".")[-1]
        return FSDP_OPS.get(short, short) if str(op).startswith("c10d.") else short

    return {phase: {name(op): n for op, n in ops.items()} for phase, ops in counting.comm_module_counts["Global"].items()}


def check_mesh(args, world_size: int) -> None:
    """One clear line, before any rank starts, when --inner does not divide the ranks into rows (lesson 20),
    or the heads do not divide among a row's tensor-parallel ranks."""
    from course.launching.cli import CourseError
    from course.models import check_tensor_parallel

    if world_size % args.inner:
        sizes = ", ".join(str(n) for n in range(1, world_size + 1) if world_size % n == 0)
        raise CourseError(f"--inner {args.inner} does not divide the {world_size} ranks into rows (the mesh is "
                          f"ranks / inner x inner); use --inner {sizes}, or a world size that is a multiple of "
                          f"{args.inner}")
    if args.layout == "fsdp-tp":
        check_tensor_parallel(args, args.inner)


def node() -> str:
    """This rank's node: Slurm's name for it in a job step, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def mesh_hosts(rank: int, mesh) -> dict:
    """Every rank's node (a collective: all ranks call it): Slurm's name for it in a job step, else the host
    name; rank 0 prints the mesh's rows with their nodes.
    {"dims": names, "rows": [[ranks]], "hosts": [node of rank r], "rows_in_one_node": bool}."""
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, node())
    rows = mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist()
    inside = all(len({hosts[r] for r in row}) == 1 for row in rows)
    if rank == 0:
        said = "; ".join(f"{row} on {', '.join(sorted({hosts[r] for r in row}))}" for row in rows)
        print(f"mesh {' x '.join(map(str, mesh.mesh.shape))} ({', '.join(mesh.mesh_dim_names)}): rows (the "
              f"'{mesh.mesh_dim_names[-1]}' groups) {said}: "
              + ("each row inside one node" if inside else "a row spans nodes: its collectives cross the slower "
                 "link (give --inner the ranks per node)"), flush=True)
    return {"dims": list(mesh.mesh_dim_names), "rows": rows, "hosts": hosts, "rows_in_one_node": inside}


def describe(comms: dict, blocks: int) -> str:
    """One line: each phase's collectives, in all and per block."""
    return "; ".join(f"{phase}: " + (", ".join(f"{n} {op} ({n / blocks:g} per block)" for op, n in ops.items())
                                     or "none") for phase, ops in comms.items())


def cut_parameters(model) -> list:
    """The parameters tensor parallelism or FSDP2 cut into pieces (DTensors with a Shard placement over more
    than one rank); a row-wise layer's bias is a DTensor too, but whole on every rank (Replicate) under TP
    alone, as is a parameter sharded over a mesh dimension of one rank."""
    return [p for p in model.parameters() if hasattr(p, "placements") and pieces(p) > 1]


def cuts(placement) -> bool:
    """Shard(dim), or the _StridedShard(dim) FSDP2 places over a dimension TP sharded first."""
    return getattr(placement, "dim", None) is not None


def pieces(p) -> int:
    """Into how many pieces a DTensor's placements cut it: the product of the mesh's sizes over the
    dimensions it is sharded on (a 2-D mesh with Shard on both: rows x columns)."""
    return math.prod(p.device_mesh.size(d) for d, pl in enumerate(p.placements) if cuts(pl))


def uncut(model) -> list:
    """The parameters tensor parallelism left whole and plain (the embedding, the norms, the head): every
    rank computes the same updates for them, so they must stay equal on every rank."""
    return [p for p in model.parameters() if not hasattr(p, "placements")]


def cut_bytes(model) -> dict:
    """This rank's bytes of the cut parameters ("cut"), their whole size ("cut_whole"), what their placements
    promise it ("cut_share": the sum of whole / pieces), and into how many pieces they are cut."""
    cut = cut_parameters(model)
    return {"cut": sum(nbytes(p) for p in cut), "cut_whole": sum(p.numel() * p.element_size() for p in cut),
            "cut_share": sum(p.numel() * p.element_size() / pieces(p) for p in cut),
            "pieces": sorted({pieces(p) for p in cut}), "whole_ones": len(list(model.parameters())) - len(cut)}


def held_by_rank(rank: int, model, optimizer) -> list:
    """What this rank holds: its bytes of parameters, gradients and optimizer state, and of the cut
    parameters its pieces against their whole size (printed with its rank); every rank's, on every rank
    (a collective: all ranks call it).  FSDP2 keeps the root's gathered parameters after evaluation's
    forward pass: `reshard()` frees them first (course/measuring/memory.py, gather), so that the count is the shards."""
    reshard(model)
    holds = dict(held(model, optimizer), **cut_bytes(model))
    mine, whole = holds["cut"], holds["cut_whole"]
    rank_print(rank, f"holds {holds['total'] / MB:.3f} MB of parameters, gradients and optimizer state; of the "
                     f"cut parameters {mine / MB:.3f} of {whole / MB:.3f} MB ({mine / whole:.4f})")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, holds)
    return everyone


def report(rank: int, model, optimizer, rows: list, comms: dict, args, step_seconds: float) -> list:
    """Every rank: what it holds (held_by_rank, a collective); rank 0 then prints the collectives measured
    before training, step 1's collectives and what they cost at the measured bandwidth, and how much of
    the cut parameters each rank holds.  Returns every rank's bytes."""
    per_rank = held_by_rank(rank, model, optimizer)
    if rank == 0:
        collectives_table(rows)
        tokens = (28 // args.patch) ** 2
        activation = args.batch_size * tokens * args.width * (4 if args.precision == "fp32" else 2)
        count = sum(n for ops in comms.values() for op, n in ops.items() if op == "all_reduce")
        said = f"collectives in step 1, {describe(comms, args.depth)}"
        if count:  # tensor parallelism's: each adds up the ranks' parts of one block's activations
            said += (f"; each all_reduce adds up one activation [batch {args.batch_size}, {tokens} tokens, width "
                     f"{args.width}], {activation / 1e6:.3f} MB in {args.precision}")
        if count and not one_rank(rows):
            seconds, how = all_reduce_seconds(rows, activation)
            said += (f": {how}, {count} x {seconds * 1e3:.2f} ms = {count * seconds * 1e3:.1f} ms of a "
                     f"training step's {step_seconds * 1e3:.1f} ms")
        print(said, flush=True)
        low, high = (f(r["cut"] for r in per_rank) / per_rank[0]["cut_whole"] for f in (min, max))
        n = per_rank[0]["pieces"]
        share = (f"1/{n[0]} = {1 / n[0]:.4f}" if len(n) == 1 else f"cut into {' or '.join(map(str, n))} pieces: "
                 f"{per_rank[0]['cut_share'] / per_rank[0]['cut_whole']:.4f}")
        print((f"each rank holds {high:.4f} of the cut parameters ({share})" if high == low else
               f"the ranks hold {low:.4f} to {high:.4f} of the cut parameters ({share} if every cut were even: a "
               f"dimension that does not divide among the ranks is cut as torch.chunk cuts it, unevenly)")
              + (" and all of the others" if per_rank[0]["whole_ones"] else ", and no parameter is whole")
              + f": {max(r['total'] for r in per_rank) / MB:.3f} MB of parameters, gradients and optimizer state "
                f"on the fullest rank", flush=True)
    return per_rank


# ------------------------------------------------------------------------------------- lesson 21: pipelines

class _Wait(torch.autograd.Function):
    """The identity, which sleeps `seconds` in the forward pass and twice that in the backward pass."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class SimulatedCompute(torch.nn.Module):
    """--stage-ms: a stage's compute made to take a fixed time per micro-batch, f ms forward and 2f backward
    (a backward pass computes two products per forward one), by sleeping: the same on every stage and
    every machine, and on a CPU it leaves the cores to the other ranks.  0: nothing added."""

    def __init__(self, ms: float):
        super().__init__()
        self.seconds = ms / 1e3

    def forward(self, x):
        return _Wait.apply(x, self.seconds) if self.seconds else x


def timed_stages(model, ids: list, stages: int, device, args, untimed: tuple = (1,)) -> tuple:
    """(a PipelineStage for each of this rank's stages `model[i]`, whose indices are `ids` of `stages`; a
    PipelineClock of them).  Each is torch's PipelineStage for the stage followed by the simulated compute of
    --stage-ms (SimulatedCompute, divided among a rank's stages: each rank computes the same in all), which
    also keeps the book of its compute: `.busy`, the seconds its forward and backward chunks took (the
    schedules wait for the other stages' sends outside the chunks; also outside: the last stage's loss in
    the forward pass, the gradients' division by m after the last backward, posting the sends, cutting the
    batch and merging the outputs; on a GPU the chunk's kernels are waited for, so that their time counts,
    not only their launch), and `.spans`, the last 4096 chunks as (stage, "F" or "B", micro-batch, start,
    end), in seconds of the wall clock (time.time(): the same clock on every process of a machine, and
    within the clocks' synchronization across nodes)."""
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        busy, spans = 0.0, None

        def _timed(self, kind, run, chunk, *args, **kwargs):
            # on a GPU once its queued work is done: NCCL's waits only order the GPU's streams, the host goes on
            begun, wall = clock(self.device), time.time()
            try:
                return run(chunk, *args, **kwargs)
            finally:
                took = clock(self.device) - begun
                self.busy += took
                self.spans = self.spans if self.spans is not None else collections.deque(maxlen=4096)
                self.spans.append((self.stage_index, kind, chunk, wall, wall + took))

        def forward_one_chunk(self, chunk, *args, **kwargs):
            return self._timed("F", super().forward_one_chunk, chunk, *args, **kwargs)

        def backward_one_chunk(self, chunk, *args, **kwargs):
            return self._timed("B", super().backward_one_chunk, chunk, *args, **kwargs)

    pipes = [TimedStage(torch.nn.Sequential(stage, SimulatedCompute(args.stage_ms / len(ids))), i, stages, device)
             for stage, i in zip(model, ids)]
    return pipes, PipelineClock(pipes, untimed)


class PipelineClock:
    """This rank's book of its pipeline's steps (lesson 21): `with clock.step(n):` around the schedule's step
    n (from 1) adds the step's seconds and the seconds this rank's stages computed in it (their `.busy`),
    except in the steps `untimed`: the first, in which torch also runs an extra forward and backward pass
    through the stages to learn the activations' shapes, and the one whose memory StepPeak measures (its tracking of every tensor slows
    the compute down, unevenly over the stages)."""

    def __init__(self, pipes: list, untimed: tuple = (1,)):
        self.pipes, self.untimed, self.seconds, self.busy, self.steps, self.since = pipes, untimed, 0.0, 0.0, 0, 0.0
        self.per_step = []  # [step, seconds, of which computed] of each timed step
        self.device = pipes[0].device if pipes else torch.device("cpu")

    @contextlib.contextmanager
    def step(self, n: int):
        begun, computed, self.since = clock(self.device), sum(p.busy for p in self.pipes), time.time()
        yield
        if n not in self.untimed:  # on a GPU once the step's kernels are done (hardware.clock), as its chunks
            seconds, busy = clock(self.device) - begun, sum(p.busy for p in self.pipes) - computed
            self.seconds, self.busy, self.steps = self.seconds + seconds, self.busy + busy, self.steps + 1
            self.per_step.append([n, seconds, busy])

    def report(self, rank: int, ranks: int, args, ids: list, stages) -> tuple:
        """Every rank (a collective): prints its node, its stages and the parameters they hold; returns (the
        bubble, the last step's timeline), and rank 0 prints the bubble.
        The bubble: the fraction of the timed steps this rank waited, measured against the formula.
        Measured, in the median timed step: 1 - (the seconds its stages computed, forward and backward) / (the
        step's seconds).
        Formula, for p ranks and m micro-batches of equal compute time (GPipe and 1F1B): (p - 1) / (m + p - 1);
        interleaved, v stages per rank each with 1/v of the work: (p - 1) / (v m + p - 1).  Of the compute,
        m x 3f a step was simulated (--stage-ms f), the rest real.  The timeline: every rank's chunks of the
        last step, on rank 0, as [rank, stage, kind, micro-batch, start, end] in seconds from the earliest."""
        from course.models import pipeline_plan

        p, m, v = ranks, args.microbatches, len(ids)
        held = sum(nbytes(t) for t in stages.parameters()) / MB
        parts = "; ".join(", ".join(pipeline_plan(args.depth, v * p)[i]) for i in ids)
        rank_print(rank, f"on {node()}, stage{'s' * (v > 1)} {', '.join(map(str, ids))} of {v * p} ({parts}): "
                         f"{held:.3f} MB of parameters")
        # the median timed step (the lower middle one of an even number): one slow step (another program, a
        # first use of something) moves it less than it moves the mean
        middle = sorted(self.per_step, key=lambda s: 1 - s[2] / s[1])[(len(self.per_step) - 1) // 2] \
            if self.per_step else [0, 0.0, 0.0]
        bubble = {"schedule": args.schedule, "ranks": p, "stages": v * p, "microbatches": m, "stages_per_rank": v,
                  "stage_ms": args.stage_ms, "timed_steps": self.steps, "median_step": middle[0],
                  "busy_seconds": middle[2], "seconds": middle[1],
                  "measured": 1 - middle[2] / middle[1] if middle[1] else float("nan"),
                  "formula": (p - 1) / (v * m + p - 1), "simulated_seconds": m * 3 * args.stage_ms / 1e3,
                  "per_step": self.per_step[-64:]}
        mine = [[rank, stage, kind, chunk, a, b] for pipe in self.pipes for stage, kind, chunk, a, b in
                (pipe.spans or []) if a >= self.since]
        every = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, every, dst=0)
        if rank:
            return bubble, []
        bubble_report(bubble, args.schedule)
        spans = sorted(span for spans in every for span in spans)
        zero = min((s[4] for s in spans), default=0.0)
        return bubble, [[*s[:4], s[4] - zero, s[5] - zero] for s in spans]


def whole_model(stages, args, device):
    """Every rank (a collective) sends its stages' weights to every other (their parameter names are the
    ViT's); each rank gets the whole model: the state dict, and the ViT built from it.  Lesson 21's ViT is
    small; a model too large for one process would be evaluated through the pipeline (`schedule.eval`)."""
    from course.models import model_from_args

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: t.detach().cpu() for stage in stages for k, t in stage.state_dict().items()})
    full = {k: t for part in parts for k, t in part.items()}
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # no weights drawn, the RNG left as it was
        model = model_from_args(args, args.seed)
    model.load_state_dict({k: t.to(device) for k, t in full.items()}, assign=True)
    return full, model


def add_pipeline_args(p, schedules):
    """Lesson 21's flags: the schedule, the micro-batches and the simulated stage time."""
    from course.launching.cli import non_negative_float, positive_int

    p.add_argument("--schedule", default="gpipe", choices=sorted(schedules), help="the order of the micro-batches")
    p.add_argument("--microbatches", type=positive_int, default=4, help="micro-batches per batch (m)")
    p.add_argument("--stage-ms", type=non_negative_float, default=0.0,
                   help="simulated compute per stage and micro-batch: f ms forward, 2f backward (0: none)")
    return p


def bubble_report(b: dict, schedule: str) -> None:
    """Rank 0: its compute and waiting over the timed steps, and the bubble against the formula."""
    p, m, v, steps = b["ranks"], b["microbatches"], b["stages_per_rank"], b["timed_steps"]
    if not steps:
        return
    per_step, busy = b["seconds"] * 1e3, b["busy_seconds"] * 1e3
    simulated = f" ({b['simulated_seconds'] * 1e3:.0f} ms of it simulated, --stage-ms {b['stage_ms']:g})" if b["stage_ms"] else ""
    print(f"{schedule}, p = {p} ranks, m = {m} micro-batches: the median of {steps} timed steps took {per_step:.1f} ms, in which rank 0's "
          f"stage{'s' * (v > 1)} computed {busy:.1f} ms{simulated}: bubble {b['measured']:.3f} measured, {b['formula']:.3f} "
          f"by the formula (p - 1) / ({'2m' if v == 2 else 'm'} + p - 1) = {p - 1}/{v * m + p - 1} "
          f"({b['measured'] / b['formula'] if b['formula'] else float('nan'):.2f}x)", flush=True)
