"""Lesson 18's plumbing: a call timed back to back as nccl-tests times it (reported as the slowest rank's
time, where nccl-tests reports the ranks' average by default), and the bytes this machine's network
interfaces have sent (the kernel's counters); `clock`, the course's clock for anything that runs on a GPU
(day 4's training steps, lesson 21's pipeline, lesson 14's steps, lesson 7's all_reduce, the readiness
check's); and the sizes of the collectives' sweep on each device (`sweep_sizes`)."""
import time
from pathlib import Path

import torch
import torch.distributed as dist

NET_DEV = Path("/proc/net/dev")
CPU_SIZES_MIB = (0.25, 1.0, 4.0, 16.0)  # gloo over loopback: ~1.2 GB/s from 16 MiB on (DESIGN.md, 12)
GPU_TOP_MIB = 1024  # NCCL over NVLink or InfiniBand still gains bus bandwidth well past 16 MiB


def sweep_sizes(device, asked=None) -> list:
    """The sizes S in MiB of a bandwidth sweep (lesson 18's --sizes-mib, course/readiness.py's largest):
    `asked` if given; else on the CPU CPU_SIZES_MIB (a few seconds, the CPU tests stay fast), and on a GPU
    the same x 4 each on to GPU_TOP_MIB, 0.25 to 1024 MiB: NCCL's bus bandwidth over NVLink and InfiniBand
    keeps growing past 16 MiB (nccl-tests' own sweeps go on to GiBs)."""
    if asked:
        return list(asked)
    sizes = list(CPU_SIZES_MIB)
    while device.type == "cuda" and sizes[-1] < GPU_TOP_MIB:
        sizes.append(sizes[-1] * 4)
    return sizes


def clock(device) -> float:
    """time.perf_counter() once `device` has finished the work queued on it.  A CUDA call returns as soon as
    its kernels are queued: the host's clock alone times the queueing, not the GPU, once the GPU is the
    slower of the two (a step's time, and the utilization from it, come out too good).  On a CUDA device
    torch.cuda.synchronize(device) waits for every kernel of every stream on it first; on the CPU the work is
    done when the call returns: the clock alone, at no other cost."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed(call, iters: int, device) -> tuple:
    """(seconds, bytes) per call: one untimed call first (the first pays for connections, buffers, kernel
    choice), then `iters` calls back to back, started together on every rank (a barrier), ended when the
    device has finished them; the slowest rank's seconds (a collective ends for all when it ends for the
    last: nccl-tests' `-a 3`; its default, `-a 1`, averages the ranks' times), and the bytes this machine's
    network interfaces sent meanwhile (`sent_since`).  Every rank calls it."""
    call()
    clock(device)  # the untimed call has finished
    before = sent_bytes()
    dist.barrier()  # every rank of this machine has read the counters before any rank sends
    start = clock(device)
    for _ in range(iters):
        call()
    seconds = torch.tensor([(clock(device) - start) / iters], device=device)
    dist.barrier()  # ... and every rank has sent everything before any reads them again
    sent = sent_since(before) / iters
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item(), sent


def sent_bytes() -> dict:
    """{interface: bytes sent so far} for every network interface of this machine's network namespace,
    loopback included (/proc/net/dev's transmit counters): what gloo's TCP connections put on the wire,
    headers and any other program's traffic included.  sent_since compares two reads interface by interface,
    over the interfaces present at both: one added or removed in between (a container's, a VPN's) would
    otherwise add or take away its whole count.  NCCL's NVLink, shared-memory and InfiniBand transfers
    bypass these counters.  Empty where the file does not exist (not Linux)."""
    if not NET_DEV.exists():
        return {}
    sent = {}
    for line in NET_DEV.read_text().splitlines()[2:]:
        name, counters = line.split(":", 1)
        sent[name.strip()] = int(counters.split()[8])
    return sent


def sent_since(before: dict) -> int:
    """The bytes sent since `before` (a sent_bytes()), summed over the interfaces present at both reads."""
    now = sent_bytes()
    return sum(now[name] - before[name] for name in now.keys() & before.keys())


def one_rank(rows: list) -> bool:
    """Whether the collectives were measured on one rank: 2(n-1)/n = (n-1)/n = 0, nothing is sent."""
    return not any(r["factor"] for r in rows)


def collectives_table(rows: list) -> None:
    """The collectives measured, one line each: time, algorithm and bus bandwidth, the bytes this machine
    sent per rank against the bus formula's (the algbw, busbw and formula's bytes are added to each row)."""
    if one_rank(rows):
        print("collectives: one rank, nothing to send (start 2 or more to measure them)", flush=True)
    else:
        print(f"{'collective':<15}{'MiB':>8}{'ms':>9}{'algbw GB/s':>12}{'busbw GB/s':>12}{'sent MB/rank':>14}"
              f"{'formula MB':>12}{'sent/formula':>14}", flush=True)
    for r in rows:
        r["algbw_gbps"] = r["bytes"] / r["seconds"] / 1e9  # nccl-tests: S / t
        r["busbw_gbps"] = r["algbw_gbps"] * r["factor"]  # what each rank's link carries per second
        r["formula_per_rank"] = r["bytes"] * r["factor"]  # the bytes each rank sends (ring)
        ratio = f"{r['sent'] / r['formula_per_rank']:.3f}" if r["sent"] and r["formula_per_rank"] else "n/a"
        if r["factor"]:
            print(f"{r['op']:<15}{r['bytes'] / 2 ** 20:>8.2f}{r['seconds'] * 1e3:>9.2f}{r['algbw_gbps']:>12.3f}"
                  f"{r['busbw_gbps']:>12.3f}{r['sent'] / 1e6:>14.3f}{r['formula_per_rank'] / 1e6:>12.3f}"
                  f"{ratio:>14}", flush=True)
    if not one_rank(rows) and not any(r["sent"] for r in rows):
        print("sent: n/a (no bytes through this machine's network interfaces: NCCL's NVLink, shared-memory and "
              "InfiniBand transfers bypass the kernel's counters)", flush=True)


def all_reduce_seconds(rows: list, nbytes: float) -> tuple:
    """(seconds, how): what an all_reduce of `nbytes` takes, from the all_reduces measured: interpolated
    between the two sizes around it; below the smallest size measured, that size's time (a smaller message
    takes at most about as long: small messages pay a fixed latency, not their bytes); above the largest,
    at the largest's algorithm bandwidth.  `how` says which, for the printed line."""
    measured = sorted((r["bytes"], r["seconds"]) for r in rows if r["op"] == "all_reduce")
    mib = lambda n: f"{n / 2 ** 20:g} MiB"
    below = [m for m in measured if m[0] <= nbytes]
    above = [m for m in measured if m[0] >= nbytes]
    if below and above:
        (s0, t0), (s1, t1) = below[-1], above[0]
        seconds = t0 if s1 == s0 else t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0)
        how = f"the all_reduce measured at {mib(s0)}" if s1 == s0 else \
            f"between the all_reduces measured at {mib(s0)} and {mib(s1)}"
        return seconds, how
    if above:  # smaller than every size measured
        return above[0][1], f"at most the all_reduce measured at {mib(above[0][0])}, the smallest measured"
    s, t = below[-1]
    return nbytes / (s / t), f"at the bandwidth of the all_reduce measured at {mib(s)}, the largest measured"


def report(rows: list, flops: int, formula: float, peak: float, hfu: float, gradient_bytes: int,
           step_seconds: float) -> None:
    """Rank 0's tables: the collectives, the FLOPs counted against the rule of thumb, the hardware FLOPs
    utilization (the FLOPs executed over the measured matmul peak: not MFU, which takes the formula's FLOPs
    over the datasheet's peak), and what DDP's all_reduce of the gradients costs alone at the measured
    bandwidth: the most it can add to a step, as DDP overlaps it with the backward pass."""
    collectives_table(rows)
    print(f"step 1's FLOPs on this rank, counted by torch: {flops / 1e9:.3f} GFLOP; 6 x parameters x tokens + "
          f"12 x depth x tokens x width x tokens: {formula / 1e9:.3f} GFLOP (counted / formula: "
          f"{flops / formula:.3f})", flush=True)
    print(f"matmul peak {peak / 1e9:.1f} GFLOP/s; training steps reached {hfu * peak / 1e9:.1f} GFLOP/s: HFU vs "
          f"measured peak {hfu:.3f}", flush=True)
    if one_rank(rows):
        print(f"DDP on one rank sends nothing; a training step took {step_seconds * 1e3:.1f} ms", flush=True)
        return
    seconds, how = all_reduce_seconds(rows, gradient_bytes)
    print(f"DDP all_reduces {gradient_bytes / 1e6:.3f} MB of gradients per step: {how}, about "
          f"{seconds * 1e3:.1f} ms alone, at most that of a training step's {step_seconds * 1e3:.1f} ms (DDP "
          f"overlaps it with the backward pass)", flush=True)
