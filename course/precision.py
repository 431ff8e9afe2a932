"""Day 3's precision flag: the dtypes of `--precision`, and its check before any rank starts.

Asking autocast for a dtype the device cannot compute in does not fail: autocast warns and runs in fp32
(CPU builds before torch 2.2 had no fp16 autocast; GPUs before Ampere have no bf16).  A run that says
fp16 and computes in fp32 would teach the wrong thing, so the lesson stops with one line instead.
"""
import warnings

import torch

from course.cli import CourseError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def device_type(args) -> str:
    """The device type every rank will compute on (course/devices.py's choice, made before any rank starts)."""
    return "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"


def check_precision(args) -> None:
    """One clear line, before any rank starts, if autocast cannot compute in --precision on this device."""
    device = device_type(args)
    if args.precision == "fp32" or (device == "cuda" and not torch.cuda.is_available()):
        return  # --device cuda without a GPU: course/devices.py's setup_device says so in its own words
    problems = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.autocast(device, dtype=DTYPES[args.precision])
        except RuntimeError as e:  # a CUDA GPU without bf16 raises instead of warning
            problems.append(str(e).splitlines()[0])
    problems += [str(w.message).splitlines()[0] for w in caught if "autocast" in str(w.message).lower()]
    if problems:
        other = "fp16" if args.precision == "bf16" else "bf16"
        raise CourseError(f"--precision {args.precision}: this {device} has no {args.precision} autocast "
                          f"({problems[0]}); use --precision {other} or fp32")
