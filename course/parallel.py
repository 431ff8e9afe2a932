"""Day 4's bookkeeping: the collectives a step issued (counted by torch's CommDebugMode), what each rank
holds of the parameters that were cut (its pieces, against the whole), and where a mesh's ranks run."""
import math
import os
import socket

import torch.distributed as dist

from course.hardware import all_reduce_seconds, collectives_table, one_rank
from course.memory import MB, held, nbytes
from course.output import rank_print


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
    from course.cli import CourseError
    from course.models import check_tensor_parallel

    if world_size % args.inner:
        sizes = ", ".join(str(n) for n in range(1, world_size + 1) if world_size % n == 0)
        raise CourseError(f"--inner {args.inner} does not divide the {world_size} ranks into rows (the mesh is "
                          f"ranks / inner x inner); use --inner {sizes}, or a world size that is a multiple of "
                          f"{args.inner}")
    if args.layout == "fsdp-tp":
        check_tensor_parallel(args, args.inner)


def mesh_hosts(rank: int, mesh) -> dict:
    """Every rank's node (a collective: all ranks call it): Slurm's name for it in a job step, else the host
    name; rank 0 prints the mesh's rows with their nodes.
    {"dims": names, "rows": [[ranks]], "hosts": [node of rank r], "rows_in_one_node": bool}."""
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
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
    forward pass: `reshard()` frees them first (course/memory.py, gather), so that the count is the shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
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
