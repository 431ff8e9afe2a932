"""The course's main job: every day-1 lesson in order, on the hardware present, then a short summary.

    python -m course.day1_sequence --quick      # what ./quickstart.sh runs: 88-94 s on a 2-core VM
    python -m course.day1_sequence              # full size (use a GPU node)

Each lesson runs as its own process with its own launcher, exactly as a learner would start it by hand.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def plan(nproc: int, device: str, quick: bool):
    """(script, arguments, run dir or None, what the lesson shows)."""
    q = ["--quick"] if quick else []
    d = ["--device", device]
    n = ["--nproc", str(nproc)]
    return [
        ("day1/0_torch_dist.py", n, None, "all_reduce on the CPU (gloo)"),
        ("day1/1_torch_dist_gpu.py", [], None, "all_reduce on GPUs (NCCL), or its CPU notice"),
        ("day1/2_mnist_training.py", q + d, "runs/2_mnist_training", "single-process baseline"),
        ("day1/3_mnist_distributed.py", q + d + n, "runs/3_mnist_distributed", "N copies: no parallelism"),
        ("day1/4_mnist_manual_ddp.py", q + d + n, "runs/4_mnist_manual_ddp", "manual DDP"),
        ("day1/5_mnist_manual_ddp_profile.py", q + d + n, None, "profiled into ./log_ddp"),
        ("day1/6_mnist_ddp_pt.py", q + d + n, "runs/6_mnist_ddp_pt", "torch DDP"),
        ("day1/7_mnist_ddp_pt_timing.py", q + d + [str(nproc), "--sweep"], "runs/7_mnist_ddp_pt_timing",
         "timing: world sizes 1..N"),
        ("day1/8_mnist_ddp_pt_lr.py", q + d + n, "runs/8_mnist_ddp_pt_lr", "LR scaling vs 1 process"),
        ("day1/test-profile.py", d + n, None, "small profile into ./log"),
    ]


def on_login_node() -> bool:
    """A node of a Slurm cluster outside any job: Slurm's controller answers (`sinfo`), and this process is not
    in an allocation.  Centres keep multi-process work off their login nodes, which are shared by everyone.
    A machine with Slurm's commands but no cluster of its own (a laptop, this course's CI) is not one."""
    if os.environ.get("SLURM_JOB_ID") or shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo", "--noheader", "--format=%P"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def hardware():
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        return min(gpus, 4), "cuda", f"{gpus} GPUs ({torch.cuda.get_device_name(0)})"
    cores = os.cpu_count() or 1
    # one GPU cannot hold two NCCL ranks: the data-parallel lessons then run on the CPU, lesson 1 on the GPU
    return 2, "cpu", f"{cores} CPU cores" + (", 1 GPU (used by lesson 1)" if gpus == 1 else ", no GPU")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m course.day1_sequence", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="each lesson's quick mode")
    p.add_argument("--nproc", type=int, default=None, help="ranks for the data-parallel lessons")
    p.add_argument("--here", action="store_true",
                   help="run on this node even if it is a Slurm login node (a few minutes of 2-4 processes)")
    args = p.parse_args(argv)
    if on_login_node() and not args.here:
        print("day-1 sequence: this is a login node of a Slurm cluster (sinfo answers, no job here): its lessons "
              "start several processes each, which login nodes are not for. Run it on a compute node: "
              "slurm/submit.sh --interactive --site NAME -- ./quickstart.sh (your site's profile: account, "
              "partition, reservation, GPUs), or srun --nodes 1 --ntasks 1 --cpus-per-task 4 ./quickstart.sh with "
              "your site's options; ./quickstart.sh --here runs it here anyway", file=sys.stderr)
        return 1
    nproc, device, what = hardware()
    nproc = args.nproc or nproc
    print(f"day-1 sequence{' (quick)' if args.quick else ''} on {what}: {nproc} ranks, device {device}\n",
          flush=True)

    rows, start = [], time.perf_counter()
    for script, lesson_args, run_dir, shows in plan(nproc, device, args.quick):
        cmd = [sys.executable, script, *lesson_args]
        print(f"$ python {' '.join(shlex.quote(c) for c in cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO)
        seconds = time.perf_counter() - t0
        result = "FAILED" if proc.returncode else "ok"
        if proc.returncode == 0 and run_dir and (REPO / run_dir / "metrics.json").exists():
            m = json.loads((REPO / run_dir / "metrics.json").read_text())
            if "test_accuracy" in m:
                result = f"test accuracy {m['test_accuracy']:.3f}"
        rows.append((script, shows, seconds, result, run_dir or ""))
        print(flush=True)
        if proc.returncode:
            break

    total = time.perf_counter() - start
    w1, w2 = (max(len(r[i]) for r in [("lesson", "shows"), *rows]) for i in (0, 1))
    print(f"{'lesson':{w1}} {'shows':{w2}} {'time':>7}  result")
    for script, shows, seconds, result, _ in rows:
        print(f"{script:{w1}} {shows:{w2}} {seconds:6.1f}s  {result}")
    print(f"\n{len(rows)} lessons in {total:.0f} s. Outputs: runs/<lesson>/ (metrics.json, loss.png, model.pt), "
          f"./log_ddp and ./log (profiles: tensorboard --logdir ./log_ddp --host 127.0.0.1)")
    return 1 if any(r[3] == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
