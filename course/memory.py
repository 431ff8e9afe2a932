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
    """The world size a run will have, known before any rank starts: torchrun's, the srun step's (not the
    job's SLURM_NTASKS: a batch script's own shell or a one-task step with --nproc N starts N ranks), or
    --nproc (course/launch.py)."""
    from course.launch import world_size

    return world_size(args)


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
    return {"parameters": sum(p.numel() for p in model.parameters()), "states": states_per_parameter,
            "ddp": copies * full, "fsdp": copies * sharded, "world_size": world_size}


def budget_verdict(planned: dict, budget_mb: float) -> str:
    """One line: what DDP and FSDP2 need per rank against the budget, and which fits."""
    ddp, fsdp, w = planned["ddp"] / MB, planned["fsdp"] / MB, planned["world_size"]
    fits = lambda mb: "fits" if mb <= budget_mb else "does not fit"
    return (f"per-rank budget {budget_mb:g} MB: DDP's full replica needs {ddp:.2f} MB ({fits(ddp)}); "
            f"FSDP2 over {w} rank{'s' * (w > 1)} needs {fsdp:.2f} MB ({fits(fsdp)})")


def gather(rank: int, model, optimizer, after_forward: dict) -> list:
    """What this rank holds (printed with its rank), and every rank's counts on every rank (a collective:
    all ranks call it).  FSDP2 keeps the root module's gathered parameters after a forward pass, and with
    reshard_after_forward=False every block's too, until a backward frees them; evaluation's forward has no
    backward: `reshard()` on every sharded module frees them first, so that the count is the shards."""
    import torch.distributed as dist

    from course.output import rank_print

    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    holds = dict(held(model, optimizer), after_forward=after_forward["peak"])
    rank_print(rank, "holds " + ", ".join(f"{k.replace('_', ' ')} {v / MB:.3f} MB" for k, v in holds.items()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, holds)
    return everyone


def add_budget_arg(p, default_mb: float):
    p.add_argument("--memory-budget-mb", type=float, default=default_mb,
                   help="MB per rank for parameters, gradients and optimizer state: the run stops before "
                        "it starts if FSDP2 needs more (0: no budget)")
    return p


def check_plan(args, model_from_args) -> None:
    """DDP's and FSDP2's bytes per rank from the model's shapes (args.planned), before any rank starts; one
    clear line if even FSDP2 does not fit the budget, or if the model has no blocks to shard."""
    from course.cli import CourseError

    if args.model != "vit":
        raise CourseError(f"--model {args.model}: lesson 15 shards the ViT block by block (model.blocks); "
                          f"use --model vit")
    if args.memory_budget_mb < 0:
        raise CourseError(f"--memory-budget-mb {args.memory_budget_mb:g}: must be 0 (no budget) or more")
    args.planned = plan(lambda: model_from_args(args, args.seed), world_size_of(args))
    if args.memory_budget_mb and args.planned["fsdp"] > args.memory_budget_mb * MB:
        raise CourseError(budget_verdict(args.planned, args.memory_budget_mb) + "; use more ranks, a smaller "
                          "--width or --depth, or a larger --memory-budget-mb")


def report(per_rank: list, planned: dict, budget_mb: float) -> None:
    """Rank 0's summary: what each rank holds against DDP's full replica, and the budget's verdict.  Every
    number is stored on exactly one rank under FSDP2, so all ranks' bytes together are what one DDP rank
    holds, whatever the optimizer (the plan made before the run assumed SGD's one state per parameter)."""
    w, ddp = len(per_rank), sum(r["total"] for r in per_rank)
    most = max(r["total"] for r in per_rank)
    print(f"parameters + gradients + optimizer state per rank: FSDP2 {most / MB:.3f} MB on the fullest of {w} "
          f"ranks, DDP's full replica {ddp / MB:.3f} MB: {most / ddp:.3f} of DDP's (1/{w} = {1 / w:.3f})")
    held = ", ".join(f"{r['after_forward'] / MB:.3f}" for r in per_rank)
    whole = sum(r["parameters"] for r in per_rank)
    print(f"parameter MB held from forward to backward, per rank: {held} (whole model: {whole / MB:.3f} MB)")
    if budget_mb:
        fits = "within it" if most <= budget_mb * MB else "over it"
        print(f"{budget_verdict(planned, budget_mb)}; measured on the fullest rank: {most / MB:.2f} MB, {fits}",
              flush=True)
