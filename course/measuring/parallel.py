"""Day 4's bookkeeping: the collectives a step issued (counted by torch's CommDebugMode, with the bytes and
the group of each: SentCollectives), what they cost a step per mesh dimension (costs), what each rank holds of
the parameters that were cut (its pieces, against the whole), and where a mesh's ranks run."""
import collections
import contextlib
import math
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from course.measuring.hardware import clock
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


class SentCollectives(CommDebugMode):
    """torch's CommDebugMode (`collectives` reads its counts: use it where CommDebugMode was), which also keeps
    what each collective sent and on which group: `.sent`, [(kind, group name, elements, dtype)] in order.
    kind: "all_reduce", "all_gather", "reduce_scatter" (or the op's own name for any other collective); the
    tensor is S as nccl-tests defines it, the call's largest (all_reduce: the tensor; all_gather: the gathered
    one; reduce_scatter: the one scattered).  DTensor's collectives (_c10d_functional.*, tensor parallelism)
    name their group last; FSDP2's (c10d.*) pass the ProcessGroup first, boxed.  Seen here (torch 2.14.1,
    gloo): under bf16 autocast TP's forward all_reduces are bf16 and its backward ones fp32 (the gradient of
    the column-wise layers' fp32 input, made whole after autocast's cast back)."""

    KINDS = ("all_reduce", "all_gather", "reduce_scatter")

    def __init__(self):
        super().__init__()
        self.sent = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = sum(self.comm_counts.values())
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if sum(self.comm_counts.values()) > before:  # CommDebugMode counted a collective
            flat = [a for a in (*args, *(kwargs or {}).values()) for a in (a if isinstance(a, (list, tuple)) else [a])]
            op = func._overloadpacket.__name__  # all_reduce, allreduce_, _allgather_base_, reduce_scatter_tensor...
            kind = next((k for k in self.KINDS if k.replace("_", "") in op.replace("_", "")), op)
            boxed = [a for a in flat if isinstance(a, torch.ScriptObject)]
            group = dist.ProcessGroup.unbox(boxed[0]).group_name if boxed else [a for a in flat if isinstance(a, str)][-1]
            whole = max((t for t in flat if isinstance(t, torch.Tensor)), key=torch.Tensor.numel)
            self.sent.append((kind, group, whole.numel(), whole.dtype))
        return out


def by_dimension(sent: list, mesh) -> list:
    """A step's collectives (SentCollectives.sent) by the mesh dimension whose group they ran on, one entry per
    kind and tensor: [{"dim", "group" (this rank's group along dim: its global ranks), "op", "numel", "dtype",
    "calls"}], by the mesh's order of dimensions, then in the order they were first sent.  Only all_reduce,
    all_gather and reduce_scatter on a group of one of the mesh's dimensions: lessons 19 and 20's forward and
    backward passes send no other."""
    names = {mesh.get_group(d).group_name: d for d in mesh.mesh_dim_names}
    counted = collections.Counter((names[group], kind, numel, dtype) for kind, group, numel, dtype in sent
                                  if group in names and kind in SentCollectives.KINDS)
    ranks = {d: dist.get_process_group_ranks(mesh.get_group(d)) for d in mesh.mesh_dim_names}  # this rank's
    return sorted(({"dim": dim, "group": ranks[dim], "op": kind, "numel": numel, "dtype": dtype, "calls": n}
                   for (dim, kind, numel, dtype), n in counted.items()), key=lambda c: mesh.mesh_dim_names.index(c["dim"]))


def check_mesh(args, world_size: int) -> None:
    """One clear line, before any rank starts, when --inner does not divide the ranks into rows (lesson 20),
    or the heads (the tokens, with --sequence-parallel) do not divide among a row's tensor-parallel ranks, or
    --sequence-parallel is asked of a layout without tensor parallelism."""
    from course.launching.cli import CourseError
    from course.models import check_tensor_parallel

    if world_size % args.inner:
        sizes = ", ".join(str(n) for n in range(1, world_size + 1) if world_size % n == 0)
        raise CourseError(f"--inner {args.inner} does not divide the {world_size} ranks into rows (the mesh is "
                          f"ranks / inner x inner); use --inner {sizes}, or a world size that is a multiple of "
                          f"{args.inner}")
    if args.layout == "fsdp-tp":
        check_tensor_parallel(args, args.inner)
    elif args.sequence_parallel:
        raise CourseError(f"--sequence-parallel cuts tensor parallelism's activations along the tokens; --layout "
                          f"{args.layout} has no tensor parallelism: use --layout fsdp-tp")


def node() -> str:
    """This rank's node: Slurm's name for it in a job step, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def mesh_hosts(rank: int, mesh) -> dict:
    """Every rank's node (a collective: all ranks call it): Slurm's name for it in a job step, else the host
    name; rank 0 prints the mesh's rows with their nodes.
    {"dims": names, "rows": [[ranks]], "hosts": [node of rank r], "rows_in_one_node": bool,
     "spans_nodes": {dim: whether a group along it (a row, a column) has ranks on more than one node}}."""
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, node())
    rows = mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist()
    inside = all(len({hosts[r] for r in row}) == 1 for row in rows)
    groups = {dim: mesh.mesh.movedim(d, -1).reshape(-1, mesh.mesh.shape[d]).tolist()
              for d, dim in enumerate(mesh.mesh_dim_names)}
    spans = {dim: any(len({hosts[r] for r in group}) > 1 for group in along) for dim, along in groups.items()}
    if rank == 0:
        said = "; ".join(f"{row} on {', '.join(sorted({hosts[r] for r in row}))}" for row in rows)
        print(f"mesh {' x '.join(map(str, mesh.mesh.shape))} ({', '.join(mesh.mesh_dim_names)}): rows (the "
              f"'{mesh.mesh_dim_names[-1]}' groups) {said}: "
              + ("each row inside one node" if inside else "a row spans nodes: its collectives cross the slower "
                 "link (give --inner the ranks per node)"), flush=True)
    return {"dims": list(mesh.mesh_dim_names), "rows": rows, "hosts": hosts, "rows_in_one_node": inside,
            "spans_nodes": spans}


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
    """The parameters tensor parallelism left whole (the embedding, the norms, the head, the row-wise layers'
    biases), plain tensors or Replicate DTensors (their local tensors): every rank computes the same updates
    for them, so they must stay equal on every rank."""
    return [p.to_local() if hasattr(p, "placements") else p for p in model.parameters()
            if not hasattr(p, "placements") or pieces(p) == 1]


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
    cut = (f"of the cut parameters {mine / MB:.3f} of {whole / MB:.3f} MB ({mine / whole:.4f})" if whole else
           "no parameter is cut (one rank holds every piece)")
    rank_print(rank, f"holds {holds['total'] / MB:.3f} MB of parameters, gradients and optimizer state; {cut}")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, holds)
    return everyone


def costs(priced: list, hosts: dict, step_seconds: float) -> None:
    """Rank 0's table of step 1's collectives, each sent again on its own group at its own size (lessons 19 and
    20's `priced` rows, completed here with busbw, the group's link and the seconds per step; the group printed
    is rank 0's, the others along the dimension run beside it), then one line:
    what each mesh dimension's collectives cost a step, time per call x calls per step, each group alone.
    busbw: nccl-tests' (algbw x 2(n-1)/n for all_reduce, (n-1)/n for the others, n the group's ranks).  A
    group's link: across nodes if any group along its dimension has ranks on two nodes (mesh_hosts)."""
    if not priced:
        print("the step sent no collective to price (groups of one rank send nothing)", flush=True)
        return
    for r in priced:
        n = r["ranks"]
        r["busbw_gbps"] = r["bytes"] / r["seconds"] / 1e9 * (2 if r["op"] == "all_reduce" else 1) * (n - 1) / n
        r["inter_node"], r["seconds_per_step"] = hosts["spans_nodes"][r["dim"]], r["calls"] * r["seconds"]
    print(f"{'dimension':<11}{'group of rank 0':<17}{'link':<15}{'collective':<16}{'dtype':<10}{'kB':>9}{'calls/step':>11}"
          f"{'ms/call':>9}{'busbw GB/s':>12}{'ms/step':>9}", flush=True)
    for r in priced:
        print(f"{r['dim']:<11}{str(r['group']):<17}{'across nodes' if r['inter_node'] else 'inside a node':<15}"
              f"{r['op']:<16}{r['dtype']:<10}{r['bytes'] / 1e3:>9.1f}{r['calls']:>11}{r['seconds'] * 1e3:>9.3f}"
              f"{r['busbw_gbps']:>12.3f}{r['seconds_per_step'] * 1e3:>9.2f}", flush=True)
    said = [f"'{dim}' ({d['ranks']} ranks, {'across nodes' if d['inter_node'] else 'inside one node'}): "
            f"{d['calls']} calls, {d['bytes'] / 1e6:.3f} MB, {d['seconds'] * 1e3:.1f} ms"
            for dim, d in per_dimension(priced).items()]
    print(f"per step, each dimension's collectives alone (ms per call x calls per step: the most they add to a step "
          f"if nothing runs beside them): {'; '.join(said)}; a training step took {step_seconds * 1e3:.1f} ms",
          flush=True)


def per_dimension(priced: list) -> dict:
    """{dim: {"ranks", "inter_node", "calls", "bytes", "seconds"}}: each mesh dimension's collectives in a step
    (from the rows `costs` completed), their bytes (S of every call) and seconds, alone."""
    dims = {}
    for r in priced:
        d = dims.setdefault(r["dim"], {"ranks": r["ranks"], "inter_node": r["inter_node"], "calls": 0, "bytes": 0,
                                       "seconds": 0.0})
        d["calls"], d["bytes"] = d["calls"] + r["calls"], d["bytes"] + r["calls"] * r["bytes"]
        d["seconds"] += r["seconds_per_step"]
    return dims


def report(rank: int, model, optimizer, priced: list, comms: dict, args, step_seconds: float, hosts: dict) -> list:
    """Every rank: what it holds (held_by_rank, a collective); rank 0 then prints step 1's collectives, what
    each costs on its own group at its own size and what each mesh dimension's cost a step (`costs`), and how
    much of the cut parameters each rank holds.  Returns every rank's bytes."""
    per_rank = held_by_rank(rank, model, optimizer)
    if rank == 0:
        tokens = (28 // args.patch) ** 2
        count = sum(n for ops in comms.values() for op, n in ops.items() if op == "all_reduce")
        said = f"collectives in step 1, {describe(comms, args.depth)}"
        if count == 4 * args.depth:  # plain TP's 2 + 2 per block: each adds up the ranks' parts of an activation
            said += f"; each all_reduce adds up one activation [batch {args.batch_size}, {tokens} tokens, width {args.width}]"
        print(said, flush=True)
        costs(priced, hosts, step_seconds)
        if not per_rank[0]["cut_whole"]:  # one rank: its mesh cuts nothing
            print(f"no parameter is cut on one rank: {per_rank[0]['total'] / MB:.3f} MB of parameters, gradients "
                  f"and optimizer state", flush=True)
            return per_rank
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


class _Mark(torch.autograd.Function):
    """The identity, which calls `forward_mark()` as the forward pass goes through it and `backward_mark()` as
    the backward pass does."""

    @staticmethod
    def forward(ctx, x, forward_mark, backward_mark):
        ctx.backward_mark = backward_mark
        forward_mark()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.backward_mark()
        return grad, None, None


class _TimedStage(torch.nn.Module):
    """A stage's module, followed by the simulated compute, between two marks that tell the book where each
    chunk's forward and backward pass begin and end (StageBook.wrap)."""

    def __init__(self, stage, index: int, book: "StageBook"):
        super().__init__()
        self.stage, self.index, self.book = stage, index, book

    def forward(self, x):
        self.book.begin(self.index, "F")
        if x.requires_grad:  # a later stage's received activations: its backward ends with their gradient
            x = _Mark.apply(x, lambda: None, self.book.touch)
        y = self.stage(x)
        if self.book.seconds:  # --stage-ms: f seconds forward (now), 2f backward
            y = _Wait.apply(y, self.book.seconds)
        return _Mark.apply(y, self.book.end, lambda: self.book.begin(self.index, "B"))


class StageBook:
    """This rank's book of its pipeline stages' compute (lesson 21), kept by composition: `wrap(stage, i)` is
    the module to hand torch's PipelineStage: the stage, then --stage-ms of simulated compute per micro-batch
    (f ms forward, 2f backward, a sleep: the same on every stage and every machine, and on a CPU it leaves the
    cores to the other ranks), between marks.  A forward chunk runs from the wrapper's call to the end of the
    simulated compute; a backward chunk from the gradient's arrival at the stage's output to the last of its
    parameters' gradients (and, after the first stage, its input's gradient).  The schedule waits for the
    other stages' sends outside the chunks; also outside: the last stage's loss, the gradients' division by m,
    posting the sends, cutting the batch and merging the outputs.  On a GPU each mark waits for the queued
    kernels (hardware.clock), so that their time counts, not only their launch.
    `.busy`: the seconds the chunks took; `.spans`: the last 4096 chunks as (stage, "F" or "B", micro-batch,
    start, end), in seconds of the wall clock (time.time(): the same clock on every process of a machine, and
    within the clocks' synchronization across nodes); micro-batches are counted in the order each stage's
    chunks run, from 0 at each step (GPipe's and 1F1B's order, and interleaved 1F1B's within a stage)."""

    def __init__(self, device, stage_ms: float):
        self.device, self.seconds = device, stage_ms / 1e3
        self.busy, self.spans, self.open, self.counts = 0.0, collections.deque(maxlen=4096), None, {}

    def wrap(self, stage, index: int) -> torch.nn.Module:
        for p in stage.parameters():  # the backward chunk ends with the last gradient accumulated
            p.register_post_accumulate_grad_hook(lambda _: self.touch())
        return _TimedStage(stage, index, self)

    def begin(self, index: int, kind: str) -> None:
        self.close()
        now = clock(self.device)
        chunk = self.counts.get((index, kind), 0)
        self.counts[(index, kind)] = chunk + 1
        self.open = [index, kind, chunk, now, time.time(), now]  # ..., begun, on the wall clock, last mark

    def touch(self) -> None:
        if self.open is not None:
            self.open[5] = clock(self.device)

    def end(self) -> None:
        self.touch()
        self.close()

    def close(self) -> None:
        """Books the open chunk up to its last mark (a backward chunk is closed by whatever comes next)."""
        if self.open is None:
            return
        index, kind, chunk, begun, wall, last = self.open
        self.open, took = None, last - begun
        self.busy += took
        self.spans.append((index, kind, chunk, wall, wall + took))

    def new_step(self) -> None:
        self.close()
        self.counts.clear()


class PipelineClock:
    """This rank's book of its pipeline's steps (lesson 21): `with clock.step(n):` around the schedule's step
    n (from 1) adds the step's seconds and the seconds this rank's stages computed in it (the StageBook's
    `.busy`), except in the steps `untimed`: the first, in which torch also runs an extra forward and backward
    pass through the stages to learn the activations' shapes, and the one whose memory StepPeak measures (its
    tracking of every tensor slows the compute down, unevenly over the stages)."""

    def __init__(self, book: StageBook, untimed: tuple = (1,)):
        self.book, self.untimed, self.seconds, self.busy, self.steps, self.since = book, untimed, 0.0, 0.0, 0, 0.0
        self.per_step = []  # [step, seconds, of which computed] of each timed step
        self.device = book.device

    @contextlib.contextmanager
    def step(self, n: int):
        self.book.new_step()
        begun, computed, self.since = clock(self.device), self.book.busy, time.time()
        yield
        self.book.close()
        if n not in self.untimed:  # on a GPU once the step's kernels are done (hardware.clock), as its chunks
            seconds, busy = clock(self.device) - begun, self.book.busy - computed
            self.seconds, self.busy, self.steps = self.seconds + seconds, self.busy + busy, self.steps + 1
            self.per_step.append([n, seconds, busy])

    def report(self, rank: int, ranks: int, args, ids: list, stages, parts: list) -> tuple:
        """Every rank (a collective): prints its node, its stages and the parameters they hold; returns (the
        bubble, the last step's timeline), and rank 0 prints the bubble.
        The bubble: the fraction of the timed steps this rank waited, measured against the formula.
        Measured, in the median timed step: 1 - (the seconds its stages computed, forward and backward) / (the
        step's seconds).
        Formula, for p ranks and m micro-batches of equal compute time (GPipe and 1F1B): (p - 1) / (m + p - 1);
        interleaved, v stages per rank each with 1/v of the work: (p - 1) / (v m + p - 1).  Of the compute,
        m x 3f a step was simulated (--stage-ms f), the rest real.  The timeline: every rank's chunks of the
        last step, on rank 0, as [rank, stage, kind, micro-batch, start, end] in seconds from the earliest."""
        p, m, v = ranks, args.microbatches, len(ids)
        held = sum(nbytes(t) for t in stages.parameters()) / MB
        parts = "; ".join(", ".join(names) for names in parts)
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
        mine = [[rank, stage, kind, chunk, a, b] for stage, kind, chunk, a, b in self.book.spans if a >= self.since]
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
