"""A small DDP training pipeline on dummy data, profiled into ./log: does profiling work here?

    python day1/test-profile.py --nproc 2
    tensorboard --logdir ./log --host 127.0.0.1                          # then open http://127.0.0.1:6006
    torchrun --nproc_per_node=2 day1/test-profile.py
    srun --ntasks=2 python day1/test-profile.py

No dataset: random images and labels, generated in memory.  In under a minute it checks the whole chain
before the real lessons: processes start and find each other, DDP synchronizes gradients, torch.profiler
writes one trace per rank (`rank{r}.<time>.pt.trace.json`), rank 0 writes TensorBoard scalars, and
`tensorboard --logdir ./log --host 127.0.0.1` shows them.  Lesson 5 explains what the traces show.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/
from course.launching.requires import require  # noqa: E402
require(__file__)  # before torch: a torch or package this lesson lacks is one line, not an ImportError

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from course.launching import cli
from course.launching.launch import backend_for, launch, setup_device
from course.measuring.profiling import clear_previous, view_hint
from course.models import build_model
from course.training.output import rank_print, writable_log_dir

WAIT, WARMUP, ACTIVE = 1, 1, 3  # the profiler schedule: skip 1 step, trace 1 and discard it, record 3


def worker(info, args):
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
    generator = torch.Generator().manual_seed(0)  # the same dummy dataset on every rank
    images = torch.randn(args.samples, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (args.samples,), generator=generator)
    dataset = TensorDataset(images, labels)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)  # DDP: shards
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = DDP(build_model("mlp", seed=0).to(device),  # DDP: same start, gradients averaged in backward
                device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if rank == 0:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        clear_previous(args.log_dir)  # TensorBoard would merge an earlier run's files with ours
    dist.barrier()  # DIST: nobody writes a trace before rank 0 has cleared the old ones
    writer = None
    if rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(args.log_dir))

    profiler = profile(
        activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else []),
        schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(args.log_dir), worker_name=f"rank{rank}"),
        record_shapes=True, profile_memory=True, with_stack=True)
    step, epoch, start = 0, 0, time.perf_counter()
    with profiler:
        while step < args.steps:
            sampler.set_epoch(epoch)
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                profiler.step()
                step += 1
                if writer is not None:
                    writer.add_scalar("train/loss_rank0", loss.item(), step)
                if step == args.steps:
                    break
            epoch += 1
    seconds = time.perf_counter() - start
    rank_print(rank, f"{step} steps in {seconds:.1f} s; trace of steps "
                     f"{WAIT + WARMUP + 1}-{WAIT + WARMUP + ACTIVE} in {args.log_dir}")
    dist.barrier()  # DIST: every rank's trace is written
    if rank == 0:
        writer.add_scalar("perf/samples_per_second", step * world_size * args.batch_size / seconds, 0)
        writer.close()
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=10), flush=True)
        traces = sorted(p.name for p in args.log_dir.glob("rank*.pt.trace.json"))
        print(f"{len(traces)} traces for {world_size} ranks: {', '.join(traces)}\n"
              f"{view_hint(args.log_dir, traces='rank*.pt.trace.json')}", flush=True)
    dist.destroy_process_group()


def build_parser():
    p = cli.add_distributed(cli.parser(__doc__, "day1/test-profile.py", data=False, outputs=False,
                                       nproc_default=2))
    p.add_argument("--steps", type=cli.positive_int, default=10,
                   help=f"training steps (at least {WAIT + WARMUP + ACTIVE}: the profiler's schedule)")
    p.add_argument("--batch-size", type=cli.positive_int, default=64, help="samples per step, per rank")
    p.add_argument("--samples", type=cli.positive_int, default=4096, help="size of the dummy dataset")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: one GPU per rank when CUDA is available, else the CPU")
    p.add_argument("--log-dir", type=Path, default=Path("log"), help="where traces and scalars go")
    return p


def main(args):
    if args.steps < WAIT + WARMUP + ACTIVE:
        raise cli.CourseError(f"--steps {args.steps} is too few: the profiler records steps "
                              f"{WAIT + WARMUP + 1}-{WAIT + WARMUP + ACTIVE}")
    writable_log_dir(args.log_dir)
    launch(worker, args)


if __name__ == "__main__":
    cli.main(main, build_parser())
