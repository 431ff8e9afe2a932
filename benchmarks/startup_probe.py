"""A lesson with nothing in it: start, init the process group, one barrier, exit.  Section 5 launches it.

    python benchmarks/startup_probe.py --nproc 2 --out t.json
    torchrun --standalone --nproc_per_node=2 benchmarks/startup_probe.py --out t.json

Rank 0 writes, per rank, the wall-clock times (time.time(), one clock for all processes on one machine) at
which the rank's Python started running this file, had imported torch, entered worker(), and had finished
init_process_group plus a first barrier.
"""
import time

STARTED = time.time()  # before any import: interpreter start-up is what the launcher's clock adds

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402,F401
import torch.distributed as dist  # noqa: E402

IMPORTED = time.time()

from course.launching.launch import launch  # noqa: E402


def worker(info, args):
    entered = time.time()
    dist.init_process_group("gloo", rank=info.rank, world_size=info.world_size, timeout=timedelta(seconds=120))
    dist.barrier()
    ready = time.time()
    mine = {"rank": info.rank, "launcher": info.launcher, "started": STARTED, "imported": IMPORTED,
            "entered": entered, "ready": ready}
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, mine)
    if info.rank == 0:
        Path(args.out).write_text(json.dumps(everyone))
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", required=True)
    launch(worker, p.parse_args())
