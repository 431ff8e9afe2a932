"""Lesson 22's throughput plumbing: the peak FLOP/s that MFU divides by (torchtitan's datasheet numbers for a bf16
run on a known GPU, a matmul timed otherwise)."""
import re

import torch

from course.measuring.hardware import timed


# Datasheet peaks, dense bf16 tensor-core FLOP/s (no sparsity), as torchtitan's MFU divides by them
# (torchtitan/tools/utils.py, get_peak_flops), with the vendors' datasheet values for GH200, H200 NVL, L40S and A10;
# the first name found as a word in torch.cuda.get_device_name() wins.  An MI250X is two devices to torch (two
# GCDs): the peak is one GCD's.
DATASHEET_BF16 = (("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("GH200", 989e12),
                  ("H200 NVL", 835e12), ("H200", 989e12), ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12),
                  ("A10", 125e12), ("MI300X", 1307e12), ("MI250X", 191.5e12))


def model_peak_flops(device, dtype) -> tuple:
    """(FLOP/s, where the number comes from) for MFU: a bf16 run on a GPU named in DATASHEET_BF16 takes its
    datasheet's dense bf16 peak, as torchtitan does; elsewhere (a CPU, an unlisted GPU, or fp32, whose peak is
    another and lower one) a square matmul in the run's dtype is timed by every rank, lesson 18's measured peak
    (an MFU against it reads higher than one against a datasheet)."""
    if device.type == "cuda" and dtype == torch.bfloat16:
        name = torch.cuda.get_device_name(device)
        for key, flops in DATASHEET_BF16:
            if re.search(rf"\b{key}\b", name):
                return flops, f"the {key} datasheet's dense bf16 peak"
    side = 8192 if device.type == "cuda" else 1024
    a = torch.randn(side, side, device=device, dtype=dtype)
    seconds = timed(lambda: a @ a, 3, device)[0]  # as lesson 18 times it: every rank, the slowest rank's time
    dtype_name = str(dtype).removeprefix("torch.")
    return 2 * side ** 3 / seconds, f"a {side} x {side} {dtype_name} matmul timed on this {device.type}"
