"""Lesson 17, exercise 3: two ranks all_reduce tensors of different sizes (4 and 5 numbers).

    TORCH_DISTRIBUTED_DEBUG=DETAIL python solutions/17_detail.py
"""
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=5))  # DIST: join
    start = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(4 + rank))  # DIST: 4 numbers on rank 0, 5 on rank 1
    except RuntimeError as e:
        print(f"[rank {rank}] after {time.perf_counter() - start:.2f} s: {' '.join(str(e).split())[:400]}",
              flush=True)
        sys.exit(1)


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(rank_main, args=(free,), nprocs=2)
