"""Day 4's bookkeeping: the collectives a step issued (counted by torch's CommDebugMode), and what each rank
holds of the layers tensor parallelism cut (its pieces, against the whole)."""
import torch.distributed as dist

from course.hardware import all_reduce_seconds, collectives_table, one_rank
from course.memory import MB, held, nbytes
from course.output import rank_print


def collectives(counting) -> dict:
    """{"forward": {"all_reduce": 8}, "backward": {...}}: a CommDebugMode's counts over the whole model, by
    phase and by the collective's name (c10d_functional.all_reduce -> all_reduce)."""
    return {phase: {str(op).split(".")[-1]: n for op, n in ops.items()}
            for phase, ops in counting.comm_module_counts["Global"].items()}


def describe(comms: dict, blocks: int) -> str:
    """One line: each phase's collectives, in all and per block."""
    return "; ".join(f"{phase}: " + (", ".join(f"{n} {op} ({n / blocks:g} per block)" for op, n in ops.items())
                                     or "none") for phase, ops in comms.items())


def cut_parameters(model) -> list:
    """The parameters tensor parallelism cut into pieces (DTensors with a Shard placement); a row-wise
    layer's bias is a DTensor too, but whole on every rank (Replicate)."""
    return [p for p in model.parameters() if hasattr(p, "placements") and any(pl.is_shard() for pl in p.placements)]


def uncut(model) -> list:
    """The parameters tensor parallelism left whole and plain (the embedding, the norms, the head): every
    rank computes the same updates for them, so they must stay equal on every rank."""
    return [p for p in model.parameters() if not hasattr(p, "placements")]


def held_by_rank(rank: int, model, optimizer) -> list:
    """What this rank holds: its bytes of parameters, gradients and optimizer state, and of the cut
    parameters its pieces against their whole size (printed with its rank); every rank's, on every rank
    (a collective: all ranks call it)."""
    cut = cut_parameters(model)
    mine, whole = sum(nbytes(p) for p in cut), sum(p.numel() * p.element_size() for p in cut)
    holds = dict(held(model, optimizer), cut=mine, cut_whole=whole)
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
        said = (f"collectives in step 1, {describe(comms, args.depth)}; each all_reduce adds up one activation "
                f"[batch {args.batch_size}, {tokens} tokens, width {args.width}], {activation / 1e6:.3f} MB in "
                f"{args.precision}")
        if not one_rank(rows):
            seconds, how = all_reduce_seconds(rows, activation)
            said += (f": {how}, {count} x {seconds * 1e3:.2f} ms = {count * seconds * 1e3:.1f} ms of a "
                     f"training step's {step_seconds * 1e3:.1f} ms")
        print(said, flush=True)
        cut = max(r["cut"] for r in per_rank) / per_rank[0]["cut_whole"]
        print(f"each rank holds {cut:.4f} of the cut parameters (1/{len(per_rank)} = {1 / len(per_rank):.4f}) and "
              f"all of the others: {max(r['total'] for r in per_rank) / MB:.3f} MB of parameters, gradients and "
              f"optimizer state on the fullest rank", flush=True)
    return per_rank
