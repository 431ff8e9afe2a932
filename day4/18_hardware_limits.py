"""Lesson 18: what the hardware allows: the bandwidth of the collectives and the FLOPs of a training step.

    python day4/18_hardware_limits.py --nproc 2 --quick
    torchrun --nproc_per_node=4 day4/18_hardware_limits.py --quick --precision bf16
    srun --ntasks=4 python day4/18_hardware_limits.py --sizes-mib 1 16 64

Lesson 13's loop (DDP, fp32 by default), measured against what the machine can do, before day 4 splits
the model itself (lesson 19): each way of splitting trades memory per rank for bytes sent between ranks,
and the bandwidth and FLOPs measured here say what those bytes cost against a step's arithmetic.
- Before training, every rank runs all_reduce, all_gather and reduce_scatter on float32 tensors of
  --sizes-mib MiB (not given: 0.25 to 16 on the CPU, on to 1024 on GPUs, whose NVLink and InfiniBand are not
  yet full at 16; course/measuring/hardware.py's sweep_sizes), timed back to back after a warm-up call as
  nccl-tests times them; t is the slowest rank's seconds per call (nccl-tests reports the ranks' average
  by default, its `-a 1`; `-a 3` reports the slowest).  With S the size of the whole tensor (all_reduce:
  the tensor each rank holds; all_gather and reduce_scatter: the gathered one) and n ranks: algorithm
  bandwidth algbw = S / t, and bus bandwidth busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for the
  other two.  busbw is the bytes each rank must send per second with the best algorithm (a ring:
  all_reduce = reduce_scatter + all_gather, each sending (n-1)/n of S), so it can be compared with the
  link's speed and across world sizes; it grows with S until the link is full, and small messages pay a
  fixed latency instead.
- With gloo the bytes really sent are counted too: the kernel's counters of this machine's network
  interfaces (loopback included, course/measuring/hardware.py) before and after the calls, divided among the
  ranks of this machine, against the bus formula's bytes per rank.  Measured here (torch 2.14.1, gloo):
  all_reduce and all_gather send what the formula says; gloo's reduce_scatter sends twice as much, as
  much as an all_reduce: torch's gloo backend runs reduce_scatter_tensor as an all_reduce of a copy of the
  input, of which each rank keeps its piece (NCCL's is a true reduce_scatter).  NCCL's NVLink and
  InfiniBand traffic bypasses these counters.
- The matrix-multiply peak: the FLOP/s of a square matmul in the run's precision on this rank's device,
  measured (2 n^3 FLOPs in t seconds): the most a training step could get from this device.
- Step 1's FLOPs, counted by torch (`torch.utils.flop_counter.FlopCounterMode`: every matmul and
  convolution of the forward and backward passes, 2 x m x n x k each), against the rule of thumb for
  transformers: 6 x parameters x tokens (2 per parameter and token forward, 4 backward) plus the
  attention's 12 x depth x tokens per image x width per token.  torch 2.14.1's counter has no formula for
  the CPU's attention kernel (aten._scaled_dot_product_flash_attention_for_cpu): the lesson gives it the
  GPU kernels' formulas, torch's own `sdpa_flop_count` and `sdpa_backward_flop_count`.
- Hardware FLOPs utilization against the measured peak (HFU): the counted FLOPs per step (the FLOPs
  executed, recomputation included) x steps / the training steps' seconds / the measured matmul peak: the
  fraction of this device's matmul speed training achieves.  Model FLOPs utilization (MFU), as torchtitan
  defines it (torchtitan/tools/utils.py), divides the model's analytic FLOPs (the 6 x parameters x tokens
  formula plus the attention's, no recomputation) by the datasheet's peak instead, usually lower than HFU for the same run (a
  datasheet peak is above any measured one).  Each step is timed by course/measuring/hardware.py's clock:
  on a GPU the host's clock read after torch.cuda.synchronize, once the GPU has finished (a CUDA call
  returns when its kernels are queued: without it the time to queue them, not to run them).  And DDP's
  gradient all_reduce per step (the parameters' bytes), timed from the all_reduces measured at the sizes
  around it: what it costs when it runs alone.  DDP overlaps it with the backward pass (a bucket's
  all_reduce starts while earlier layers still compute), so this is the most communication can add to a
  step, not what it adds.
--batch-size is per rank.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/
from course.launching.requires import require  # noqa: E402
require(__file__)  # before torch: a torch or package this lesson lacks is one line, not an ImportError

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from course.launching import cli
from course.launching.launch import backend_for, launch, setup_device
from course.measuring import hardware, memory
from course.measuring.profiling import add_profile_args, maybe_profile
from course.models import add_vit_args, check_vit_args, model_from_args
from course.training import replicas
from course.training.evaluate import evaluate
from course.training.output import plot_curves, rank_print, save_weights, write_json
from course.training.precision import DTYPES, check_precision
from data_tools.datasets import InMemoryMNIST, batches, require


CPU_ATTENTION = {  # torch 2.14.1 counts no FLOPs for the CPU's attention kernel: its GPU kernels' formulas
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *_, **__: sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *_, **__: sdpa_backward_flop_count(g, q, k, v)}


def bandwidth(device, n: int, local_ranks: int, sizes_mib: list, iters: int) -> list:
    """Every rank: each collective at each size, timed; its algorithm and bus bandwidth (nccl-tests'
    definitions), and the bytes this machine's interfaces sent per call and rank against the formula's."""
    rows = []
    for op, factor in (("all_reduce", 2 * (n - 1) / n), ("all_gather", (n - 1) / n), ("reduce_scatter", (n - 1) / n)):
        for mib in sizes_mib:
            whole = torch.ones(int(mib * 2 ** 20) // (4 * n) * n, device=device)  # S: divisible among n ranks
            piece = torch.ones(whole.numel() // n, device=device)  # one rank's part of S
            call = {"all_reduce": lambda: dist.all_reduce(whole),  # DIST: every rank gets the sum of all
                    "all_gather": lambda: dist.all_gather_single(whole, piece),  # DIST: the n pieces
                    "reduce_scatter": lambda: dist.reduce_scatter_single(piece, whole)}[op]  # DIST: my piece's sum
            seconds, sent = hardware.timed(call, iters, device)  # DIST: the slowest rank's; this machine's bytes
            rows.append(dict(op=op, bytes=whole.nbytes, seconds=seconds, factor=factor, sent=sent / local_ranks))
    return rows


def worker(info, args):
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
    require(args.dataset, args.data_dir)
    train_set = InMemoryMNIST(args.dataset, "train", args.data_dir, device, limit=args.train_samples or 0)
    test_set = InMemoryMNIST(args.dataset, "test", args.data_dir, device)

    rows = bandwidth(device, world_size, info.local_world_size, hardware.sweep_sizes(device, args.sizes_mib), iters=5)
    model = model_from_args(args, args.seed + rank).to(device)
    # DDP: broadcasts rank 0's weights at wrap time, then all_reduces gradient buckets during backward
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dtype = DTYPES[args.precision]
    side = 8192 if device.type == "cuda" else 1024  # the matmul peak: 2 n^3 FLOPs in t seconds
    a = torch.randn(side, side, device=device, dtype=dtype)
    peak_flops = 2 * side ** 3 / hardware.timed(lambda: a @ a, 3, device)[0]  # this device's FLOP/s
    peak = memory.StepPeak(model, optimizer, device)  # step 3's bytes: held as it begins, most during it

    # DDP: rank r gets every W-th index of the epoch's shuffled order; padded so all shards are equal
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    if args.loader == "dataloader":  # the loop to write for your own dataset
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    else:  # the same batches, each gathered from the in-memory tensors at once (data_tools/datasets.py)
        loader = batches(train_set, sampler, args.batch_size)
    prof = maybe_profile(args, rank, device)  # --profile: lesson 5's traces and TensorBoard scalars
    losses, norms, step_seconds, step, start = [], [], 0.0, 0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        for x, y in loader:
            begun = hardware.clock(device)  # on a GPU once its queued work is done: the step's own kernels
            counting = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) if step == 0 else nullcontext()
            with counting:  # step 1 only: torch counts what its forward and backward passes do
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    loss = F.cross_entropy(model(x), y)  # the logits are 16-bit, the loss fp32
                optimizer.zero_grad()
                loss.backward()  # DDP: the gradients, averaged over ranks
            flops = counting.get_total_flops() if step == 0 else flops  # this rank's, forward and backward
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            optimizer.step()
            step_seconds += (hardware.clock(device) - begun) if step else 0.0  # step 1 is counted: not timed
            losses.append(loss.detach())
            norms.append(norm.detach())
            step += 1
            prof.step(loss, world_size * len(y))
            if step == args.max_steps:
                break
        accuracy, test_loss, counted = evaluate(model.module, test_set, rank, world_size)
        prof.epoch(epoch, accuracy, test_loss)
        if rank == 0:
            rank_print(rank, f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {accuracy:.4f} "
                             f"({counted} test images, each counted once)")
        if step == args.max_steps:
            break
    seconds = time.perf_counter() - start
    hfu = flops * (step - 1) / step_seconds / peak_flops if step > 1 else 0.0  # the timed steps' FLOP/s / the peak
    prof.close()
    rank_print(rank, f"{step} steps in {seconds:.1f} s (this rank's shard: {len(sampler)} samples per epoch), "
                     f"matmul peak {peak_flops / 1e9:.1f} GFLOP/s, HFU vs measured peak {hfu:.3f}; {peak}")

    identical = replicas.identical_on_all_ranks(model.parameters())  # DIST: all_gathers every rank's weights
    losses = torch.stack(losses)
    dist.all_reduce(losses)  # DIST: the loss of each global batch, averaged over ranks (one call at the end)
    losses = (losses / world_size).tolist()
    if rank == 0:  # DIST: one process writes the outputs
        global_batch = world_size * args.batch_size
        params, tokens = sum(p.numel() for p in model.parameters()), (28 // args.patch) ** 2
        formula = (6 * params + 12 * args.depth * tokens * args.width) * tokens * args.batch_size  # per rank
        samples = min(step * global_batch, args.epochs * world_size * len(sampler))
        run = args.run_dir
        hardware.report(rows, flops, formula, peak_flops, hfu, 4 * params, step_seconds / max(step - 1, 1))
        write_json(run / "metrics.json", {
            "lesson": "18_hardware_limits", "dataset": args.dataset, "model": args.model,
            "precision": args.precision, "world_size": world_size, "backend": dist.get_backend(),
            "batch_size": args.batch_size, "global_batch_size": global_batch, "lr": args.lr,
            "epochs": args.epochs, "steps": step, "collectives": rows, "identical_weights": identical,
            "flops_per_step": flops, "flops_formula": formula, "matmul_peak_flops": peak_flops, "hfu": hfu,
            "samples_seen": samples, "train_seconds": seconds, "samples_per_second": samples / seconds,
            "test_accuracy": accuracy, "test_loss": test_loss, "loss_per_step": losses,
            "grad_norm_per_step": torch.stack(norms).tolist(), "memory": peak.result()})
        save_weights(run / "model.pt", model)
        plot_curves(run / "loss.png", {f"{args.precision}, {world_size} ranks": (range(1, step + 1), losses)},
                    "step", "training loss (mean over ranks)", f"{args.model}, global batch {global_batch}")
        print(f"{world_size} ranks x batch {args.batch_size} = global batch {global_batch}, {args.precision}: "
              f"test accuracy {accuracy:.4f}; replicated weights identical on all ranks: "
              f"{identical}; outputs in {run}", flush=True)
    dist.destroy_process_group()


def build_parser():
    p = cli.add_loader(cli.add_distributed(cli.parser(__doc__, "day4/18_hardware_limits.py", nproc_default=2)))
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0,
                   help="DDP's gradient bucket size in MB")
    p.add_argument("--precision", default="fp32", choices=("bf16", "fp32"),
                   help="the dtype of autocast's matrix products (fp16 would need lesson 13's GradScaler)")
    p.add_argument("--sizes-mib", type=cli.positive_float, nargs="+", help="sizes S, MiB; not given: 0.25 1 4 16, on GPUs on to 1024")
    p.add_argument("--clip-grad-norm", type=cli.positive_float, default=1.0,
                   help="clip the gradients' total norm to this")
    return add_profile_args(add_vit_args(p))


if __name__ == "__main__":
    cli.main(lambda args: (require(args.dataset, args.data_dir), check_vit_args(args), check_precision(args),
                           launch(worker, args)), build_parser())
