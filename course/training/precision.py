"""Day 3's precision flag: the dtypes of `--precision`, and its check before any rank starts; lesson 13's
--compile: its check and the warm-up that compiles before training.

Asking autocast for a dtype the device cannot compute in does not fail: autocast warns and runs in fp32
(CPU builds before torch 2.2 had no fp16 autocast).  A run that says fp16 and computes in fp32 would teach the
wrong thing, so the lesson stops with one line instead.  GPUs before compute capability 8.0 (V100, T4) pass
autocast's own bf16 check: torch.cuda.is_bf16_supported() counts emulation as support, and finds it by making
a bf16 tensor on the current GPU, cuda:0 in a rank that has not set its own yet.  Emulated bf16 runs slower
than fp32, and inductor skips compiling bf16 graphs there (compile_fx's _check_triton_bf16_support), so
--compile would run eager.  The check reads the capability of each rank's own GPU instead, which allocates
nothing on any GPU.
"""
import os
import warnings

import torch

from course.launching.cli import CourseError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def device_type(args) -> str:
    """The device type every rank will compute on (course/launching/devices.py's choice, before any rank starts)."""
    return "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"


def check_precision(args) -> None:
    """One clear line, before any rank starts, if autocast cannot compute in --precision on this device, or if
    --compile meets a DDP bucket smaller than torch.compile's DDP graph splitting allows."""
    if getattr(args, "overflow_at", None) is not None:  # the rank of the test overflow must be one of the run's
        from course.launching.environment import world_size

        ranks = world_size(args)
        if args.overflow_rank >= ranks:
            raise CourseError(f"--overflow-rank {args.overflow_rank}: this run has {ranks} rank(s), 0 to {ranks - 1}; "
                              f"choose one of them")
    first = torch.distributed._DEFAULT_FIRST_BUCKET_BYTES / 2**20  # DDP's first bucket (its "MB" are MiB): 1
    if getattr(args, "compile", False) and args.bucket_cap_mb < first:
        raise CourseError(f"--compile with --bucket-cap-mb {args.bucket_cap_mb:g}: compiled DDP splits the graph "
                          f"at buckets of at least DDP's first bucket ({first:g} MB); use --bucket-cap-mb "
                          f"{first:g} or more")
    device = device_type(args)
    if args.precision == "fp32" or (device == "cuda" and not torch.cuda.is_available()):
        return  # --device cuda without a GPU: course/launching/devices.py's setup_device says so in its own words
    if device == "cuda" and args.precision == "bf16":
        return check_native_bf16(args)
    problems = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.autocast(device, dtype=DTYPES[args.precision])
        except RuntimeError as e:  # an autocast that refuses the dtype outright instead of warning
            problems.append(str(e).splitlines()[0])
    problems += [str(w.message).splitlines()[0] for w in caught if "autocast" in str(w.message).lower()]
    if problems:
        other = "fp16" if args.precision == "bf16" else "bf16"
        raise CourseError(f"--precision {args.precision}: this {device} has no {args.precision} autocast "
                          f"({problems[0]}); use --precision {other} or fp32")


def rank_gpus(args) -> list:
    """The GPUs (as this process numbers them) that the ranks started from here compute on: those of the ranks
    `--nproc N` will start, or this rank's own under torchrun and srun (course/launching/devices.py's choice)."""
    from course.launching.devices import gpu_index, layout_from_environment
    from course.launching.environment import detect_launcher

    if detect_launcher(args) == "self":
        return list(range(min(args.nproc, torch.cuda.device_count())))
    local_world_size, launcher = layout_from_environment()
    local_rank = int(os.environ["LOCAL_RANK"] if launcher == "torchrun" else os.environ.get("SLURM_LOCALID", 0))
    return [gpu_index(local_rank, local_world_size, launcher)]


def check_native_bf16(args) -> None:
    """One line if a rank's GPU computes bf16 only by emulation (compute capability below 8.0)."""
    for index in rank_gpus(args):
        major, minor = torch.cuda.get_device_capability(index)  # the device's properties: nothing allocated
        if major < 8:
            raise CourseError(f"--precision bf16: GPU {index} ({torch.cuda.get_device_name(index)}) has compute "
                              f"capability {major}.{minor}; GPUs compute bf16 natively from 8.0 (Ampere) on, "
                              f"below that torch emulates it, slower than fp32, and --compile would run eager; "
                              f"use --precision fp16 where the lesson offers it, else fp32")


def warm_up(model, train_set, args, dtype) -> None:
    """--compile: run the compiled model's first forward and backward before training, so that the lesson's
    clock measures training, not compiling.  Every rank calls it (backward all_reduces through DDP).

    One batch of the training set's shape, under the autocast the loop uses (dynamo compiles for that
    autocast state), forward and backward, then the gradients are thrown away: no optimizer step, so the
    weights, the momentum and the data order are those of the uncompiled run.  A later batch of another shape
    (an epoch's short last batch) compiles once more, inside the timing.  Rank 0 prints how long it took."""
    import time

    import torch.distributed as dist
    import torch.nn.functional as F

    from course.training.output import rank_print

    start = time.perf_counter()
    x, y = train_set[list(range(args.batch_size))]
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    if dist.get_rank() == 0:
        rank_print(0, f"compiled the forward and backward pass in {time.perf_counter() - start:.1f} s (before "
                      f"training, not in its timing); TORCH_LOGS=ddp_graphs shows where DDP split the graph")
