"""Lesson 0: processes, ranks, a process group and one all_reduce, on the CPU with gloo.

    python day1/0_torch_dist.py                         # spawns 4 processes itself
    python day1/0_torch_dist.py --nproc 2
    torchrun --nproc_per_node=4 day1/0_torch_dist.py    # torchrun starts the processes
    srun --ntasks=4 python day1/0_torch_dist.py         # Slurm starts them

Data parallelism needs N processes that can talk.  Each process has a rank (0 .. N-1); together they form a
process group; a collective such as all_reduce combines one tensor from every rank and gives every rank the
result.  Here each rank holds the number `rank + 1` and all_reduce(SUM) / N gives each of them the mean.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/
from course.launching.requires import require  # noqa: E402
require(__file__)  # before torch: a torch or package this lesson lacks is one line, not an ImportError

import torch
import torch.distributed as dist

from course.launching import cli
from course.launching.launch import launch
from course.training.output import rank_print


def worker(info, args):
    # DIST: every process joins the same group; MASTER_ADDR/MASTER_PORT say where rank 0 listens
    dist.init_process_group("gloo", rank=info.rank, world_size=info.world_size,
                            timeout=timedelta(seconds=args.timeout))
    value = torch.tensor([float(info.rank + 1)])
    rank_print(info.rank, f"of {info.world_size}: my value is {value.item():g}")
    dist.all_reduce(value, op=dist.ReduceOp.SUM)  # DIST: after this, every rank holds the same sum
    mean = value.item() / info.world_size
    rank_print(info.rank, f"all_reduce(SUM) = {value.item():g}, mean = {mean:g}")
    dist.destroy_process_group()


def build_parser():
    p = cli.parser(__doc__, "day1/0_torch_dist.py", data=False, outputs=False, nproc_default=4)
    p.add_argument("--timeout", type=cli.positive_float, default=120.0,
                   help="seconds a rank waits for the others")
    return p


if __name__ == "__main__":
    cli.main(lambda args: launch(worker, args), build_parser())
