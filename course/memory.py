"""What a rank holds, in bytes, counted from the tensors themselves (day 3).

A sharded parameter (lesson 15, FSDP2) is a DTensor: a view of the whole tensor whose `to_local()` is the
piece this rank stores.  Counting `to_local()` gives what the rank really holds; counting the DTensor itself
would give the whole tensor.  The same counts work for DDP's plain tensors, where every rank holds all of it.

Before any rank starts, `plan` tells from the model's shapes alone (built on the `meta` device: no memory)
what a rank will hold under DDP and under FSDP2 at a world size, so that a per-rank budget is checked before
anything runs.  FSDP2 splits dim 0 of every parameter as `torch.chunk` does: rank 0 gets ceil(rows / W) rows,
the most of any rank, so rank 0's bytes are the ones to compare with a budget.
"""
import math
import os

import torch

MB = 2 ** 20


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank stores: a DTensor's local shard, or a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def nbytes(t) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def held(model, optimizer) -> dict:
    """Bytes this rank holds in parameters, their gradients and the optimizer's state (e.g. SGD's momentum)."""
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    out = {"parameters": sum(nbytes(p) for p in params),
           "gradients": sum(nbytes(p.grad) for p in params if p.grad is not None),
           "optimizer_state": sum(nbytes(v) for v in state)}
    out["total"] = sum(out.values())
    return out


def watch_after_forward(model) -> dict:
    """Record, after each forward pass, the bytes of parameters the rank still holds until backward: with
    FSDP2 a module left unsharded after its forward (reshard_after_forward=False, and always the root) holds
    its whole parameters, a resharded one only its shard.  Returns a dict whose "peak" is the largest seen."""
    seen = {"peak": 0}

    def hook(module, inputs, output):  # registered after fully_shard's own hooks: runs after any reshard
        if module.training:
            seen["peak"] = max(seen["peak"], sum(nbytes(p) for p in module.parameters()))

    model.register_forward_hook(hook)
    return seen


def world_size_of(args) -> int:
    """The world size a run will have, known before any rank starts: torchrun's, Slurm's, or --nproc."""
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(var):
            return int(os.environ[var])
    return args.nproc


def plan(model_fn, world_size: int, states_per_parameter: int = 1) -> dict:
    """Bytes rank 0 will hold under DDP (a full replica) and under FSDP2 over `world_size` ranks: parameters,
    gradients (same size) and `states_per_parameter` optimizer tensors of the same size (1: SGD's momentum;
    2: Adam's two moments).  `model_fn()` builds the model; it is built on the meta device."""
    with torch.device("meta"):
        model = model_fn()
    full = sharded = 0
    for p in model.parameters():
        rows = p.shape[0] if p.dim() else 1
        per_row = p.numel() // rows if rows else 0
        full += p.numel() * p.element_size()
        sharded += math.ceil(rows / world_size) * per_row * p.element_size()
    copies = 2 + states_per_parameter
    return {"parameters": sum(p.numel() for p in model.parameters()), "ddp": copies * full,
            "fsdp": copies * sharded, "world_size": world_size}


def budget_verdict(planned: dict, budget_mb: float) -> str:
    """One line: what DDP and FSDP2 need per rank against the budget, and which fits."""
    ddp, fsdp, w = planned["ddp"] / MB, planned["fsdp"] / MB, planned["world_size"]
    fits = lambda mb: "fits" if mb <= budget_mb else "does not fit"
    return (f"per-rank budget {budget_mb:g} MB: DDP's full replica needs {ddp:.2f} MB ({fits(ddp)}); "
            f"FSDP2 over {w} ranks needs {fsdp:.2f} MB ({fits(fsdp)})")


def gather(info: dict) -> list:
    """Every rank's dict, on every rank (a collective: all ranks call it)."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, info)
    return everyone
