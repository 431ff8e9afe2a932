"""Lesson 15: sharding with FSDP2: each rank holds 1/W of the parameters, gradients and optimizer state.

    python day3/15_fsdp2.py --nproc 2 --quick
    torchrun --nproc_per_node=4 day3/15_fsdp2.py --reshard-after-forward false
    srun --ntasks=4 python day3/15_fsdp2.py --precision bf16
    python day3/15_fsdp2.py --nproc 2 --quick --precision fp16 --overflow-at 3

Lesson 13's loop, with DDP replaced by FSDP2 (`torch.distributed.fsdp.fully_shard`):
- DDP keeps a full replica on every rank: all parameters, all gradients, all of the optimizer's state.  That
  replica, not the batch, is what stops a model from training once it outgrows one GPU.
- `fully_shard` on each transformer block, then on the root (embedding, position, final norm, head), on an
  explicit device mesh (`init_device_mesh`: "cpu" with gloo, "cuda" with NCCL).  Each parameter becomes a
  DTensor sharded on dim 0: rank r stores the r-th of W chunks of its rows (`p.to_local()`; as torch.chunk
  cuts them, rank 0's chunk is the largest), and so do its gradient and its momentum buffer, because the
  optimizer only ever sees the shards.
- Built on the meta device, so that no rank ever holds the whole model: under `torch.device("meta")` every
  parameter gets its shape but no memory, `fully_shard` shards these empty parameters, and
  `model.to_empty(device=...)` allocates this rank's shards alone, not yet initialized.  Their initial
  weights must be lesson 13's (the same seed) for the two lessons to train the same thing, and
  `reset_parameters()` on the shards does not give them: each rank would draw its rows from its own random
  generator, not the rows an unsharded model gets (torch's DTensor random numbers coordinate the ranks on
  CUDA-like devices only, and differ from the CPU's there).  So every rank makes the model again on the
  CPU, one part at a time (embedding, position, block 0, block 1, ...) in the order the ViT's constructor
  makes them, under the same seed, keeps its own rows of each part and drops the rest
  (course/training/sharded_init.py): at most one block is whole at a time, nothing is sent, and the weights are
  lesson 13's bit for bit.  Large models are often started from a seed checkpoint instead: written once by
  one process with enough CPU memory, then read with DCP (lesson 16), each rank reading only its rows.
- Forward: before a block runs, its shards are all_gathered into whole parameters; after it, they are freed
  again (`reshard_after_forward=True`, ZeRO-3) or kept until backward (`False`, ZeRO-2: no second all_gather
  in backward, but the whole model's parameters held between forward and backward).  The root's parameters
  are kept after forward either way (backward needs them first).  Backward: each block's gradients are
  reduce_scattered, so every rank receives the average of its own rows only.
- The same global batches give the same weights as lesson 13's DDP (up to float rounding: the sums run in
  another order), and the gradient clip works on DTensors: clip_grad_norm_ all_reduces the shards' norms.
- `--precision bf16` or `fp16`: FSDP's MixedPrecisionPolicy all_gathers the parameters in that dtype (half
  the bytes sent) and computes every layer in it (unlike lesson 13's autocast, layer norms too); the
  shards, their gradients and the optimizer's state stay fp32.  The gradients are reduce_scattered in fp32
  (`--reduce-dtype`, default fp32, as FSDP2 training usually does: the sum over W ranks keeps fp32's
  precision); `--reduce-dtype bf16` halves those bytes too, and rounds the sums to bf16.  gloo in torch
  2.14.1 runs all_gather and reduce_scatter on bf16 tensors and all_gather on fp16 ones (older releases had
  no bf16 in gloo).  Measured at width 32 after 4 steps: bf16 ends 5.2e-4 (relative) from fp32's weights,
  5.5e-4 with `--reduce-dtype bf16`.
  The logits are cast to fp32 for the loss (a policy's output_dtype would cast every block's output, not
  only the model's).
- fp16 needs lesson 13's GradScaler, and it works on shards: `unscale_` finds inf/NaN in this rank's shards
  only, but for DTensor gradients torch all_reduces that finding (the max over the mesh) before `step`, so
  every rank skips the same step and halves the same scale.  `--overflow-at 3` puts an inf into rank 1's
  shard alone (the other shards stay finite): both ranks print step 3 as skipped.
- SGD with momentum, as in lesson 13, so that the two lessons train the same thing: its state is one tensor
  per parameter; Adam's is two, which makes the replica 4 copies of the parameters instead of 3 (exercise 3).
- `--memory-budget-mb`: the bytes per rank of parameters, gradients and optimizer state, computed from the
  model's shapes before any rank starts, under DDP and under FSDP2; the run stops if FSDP2 does not fit.
  The default model (width 128, depth 4) needs 6.2 MB per rank under DDP: over the default budget of 4 MB,
  a stand-in for one GPU's memory (x1000 for a real one), while FSDP2 over 2 ranks needs 3.1 MB.
- At the end model.pt needs the whole weights, but only rank 0 writes it: get_model_state_dict with
  full_state_dict and cpu_offload all_gathers one tensor at a time and keeps it, on the CPU, on rank 0
  alone (the other ranks get an empty dict): no device holds more than one whole tensor beside its shards.
- Every rank measures its step 3 (course/measuring/memory.py's StepPeak, as lesson 13 does for DDP): the bytes it
  holds as the step's forward begins (its shards) and the most it holds during it (the gathered blocks,
  the whole gradients before their reduce_scatter, the activations): on a GPU from
  torch.cuda.max_memory_allocated, on the CPU from the live tensors.
--batch-size is per rank.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line (sharding too).
"""
import math
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from course.launching import cli
from course.launching.launch import backend_for, launch, setup_device
from course.measuring import memory
from course.measuring.profiling import add_profile_args, maybe_profile
from course.models import add_vit_args, check_vit_args, model_from_args
from course.training.evaluate import evaluate
from course.training.output import plot_curves, rank_print, save_weights, write_json
from course.training.precision import DTYPES, check_precision
from course.training.sharded_init import init_vit_shards
from data_tools.datasets import InMemoryMNIST, batches, require


def worker(info, args):
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
    require(args.dataset, args.data_dir)
    train_set = InMemoryMNIST(args.dataset, "train", args.data_dir, device, limit=args.train_samples or 0)
    test_set = InMemoryMNIST(args.dataset, "test", args.data_dir, device)

    with torch.device("meta"):  # DIST: shapes only, no memory: no rank ever builds the whole model
        model = model_from_args(args, args.seed)
    mesh = init_device_mesh(device.type, (world_size,))  # DIST: the ranks that share the model, in a row
    dtype = DTYPES[args.precision]
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=DTYPES[args.reduce_dtype])  # DIST: fp32 sums by default
    for block in model.blocks:  # DIST: one unit per block: gathered just before it runs, freed after
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=args.reshard_after_forward == "true")
    fully_shard(model, mesh=mesh, mp_policy=policy)  # DIST: the root: what no block owns, and the hooks
    model.to_empty(device=device)  # DIST: memory for this rank's shards only, not yet initialized
    init_vit_shards(model, args, args.seed)  # DIST: lesson 13's initial weights, made block by block: my rows
    after_forward = memory.watch_after_forward(model)  # parameter bytes held from forward to backward
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    peak = memory.StepPeak(model, optimizer, device)  # step 3's bytes: held as it begins, most during it
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")  # fp16 only; off, it passes through

    # DDP: rank r gets every W-th index of the epoch's shuffled order; padded so all shards are equal
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    if args.loader == "dataloader":  # the loop to write for your own dataset
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    else:  # the same batches, each gathered from the in-memory tensors at once (data_tools/datasets.py)
        loader = batches(train_set, sampler, args.batch_size)
    prof = maybe_profile(args, rank, device)  # --profile: lesson 5's traces and TensorBoard scalars
    losses, norms, skipped, step, start = [], [], [], 0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        for x, y in loader:
            loss = F.cross_entropy(model(x).float(), y)  # DIST: each block all_gathered as it runs; fp32 loss
            optimizer.zero_grad()
            scaler.scale(loss).backward()  # DDP: each block's gradients reduce_scattered: my rows' average
            mine = (step + 1, rank) == (args.overflow_at, args.overflow_rank)
            if mine:  # an inf in this rank's shard alone: the other ranks' shards stay finite
                model.blocks[0].qkv.weight.grad.to_local()[0, 0] = math.inf
            scaler.unscale_(optimizer)  # the true gradients, so that clipping sees their real norm
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            scale = scaler.get_scale()
            scaler.step(optimizer)  # updates this rank's shards; skipped on every rank if any rank's had inf/NaN
            scaler.update()  # halves the scale after a skipped step, doubles it after 2000 good ones
            if scaler.get_scale() < scale:
                skipped.append(step + 1)
                rank_print(rank, f"step {step + 1} skipped (inf/NaN gradients; an inf put in my shard: {mine}); "
                                 f"loss scale {scale:g} -> {scaler.get_scale():g}")
            losses.append(loss.detach())
            norms.append(norm.full_tensor().detach())  # DIST: a DTensor holding the same norm on every rank
            step += 1
            prof.step(loss, world_size * len(y))
            if step == args.max_steps:
                break
        accuracy, test_loss, counted = evaluate(model, test_set, rank, world_size)  # every rank: it gathers
        prof.epoch(epoch, accuracy, test_loss)
        if rank == 0:
            rank_print(rank, f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {accuracy:.4f} "
                             f"({counted} test images, each counted once)")
        if step == args.max_steps:
            break
    seconds = time.perf_counter() - start
    prof.close()
    rank_print(rank, f"{step} steps in {seconds:.1f} s (this rank's shard: {len(sampler)} samples per epoch); {peak}")
    per_rank = memory.gather(rank, model, optimizer, after_forward)  # DIST: what every rank holds, in bytes
    # DIST: the whole weights for model.pt, all_gathered one tensor at a time, kept by rank 0 alone on the CPU
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    losses = torch.stack(losses)
    dist.all_reduce(losses)  # DIST: the loss of each global batch, averaged over ranks (one call at the end)
    losses = (losses / world_size).tolist()
    if rank == 0:  # DIST: one process writes the outputs
        global_batch = world_size * args.batch_size
        samples = min(step * global_batch, args.epochs * world_size * len(sampler))
        run = args.run_dir
        write_json(run / "metrics.json", {
            "lesson": "15_fsdp2", "dataset": args.dataset, "model": args.model,
            "precision": args.precision, "world_size": world_size, "backend": dist.get_backend(),
            "batch_size": args.batch_size, "global_batch_size": global_batch, "lr": args.lr,
            "epochs": args.epochs, "steps": step, "skipped_steps": skipped, "planned": args.planned,
            "reshard_after_forward": args.reshard_after_forward, "per_rank_bytes": per_rank,
            "samples_seen": samples, "train_seconds": seconds, "samples_per_second": samples / seconds,
            "test_accuracy": accuracy, "test_loss": test_loss, "loss_per_step": losses,
            "grad_norm_per_step": torch.stack(norms).tolist(), "memory": peak.result()})
        save_weights(run / "model.pt", full)
        plot_curves(run / "loss.png", {f"{args.precision}, {world_size} ranks": (range(1, step + 1), losses)},
                    "step", "training loss (mean over ranks)", f"{args.model}, global batch {global_batch}")
        memory.report(per_rank, args.planned, args.memory_budget_mb)
        print(f"{world_size} ranks x batch {args.batch_size} = global batch {global_batch}, {args.precision}: "
              f"test accuracy {accuracy:.4f}; outputs in {run}", flush=True)
    dist.destroy_process_group()


def build_parser():
    p = cli.add_loader(cli.add_distributed(cli.parser(__doc__, "day3/15_fsdp2.py", nproc_default=2)))
    p.add_argument("--reshard-after-forward", default="true", choices=("true", "false"),
                   help="true: free a block's gathered parameters after its forward (ZeRO-3); false: keep them")
    p.add_argument("--precision", default="fp32", choices=sorted(DTYPES),
                   help="the dtype parameters are gathered and computed in; fp16 adds GradScaler")
    p.add_argument("--reduce-dtype", default="fp32", choices=sorted(DTYPES),
                   help="the dtype gradients are reduce_scattered in (bf16: half the bytes, sums rounded)")
    p.add_argument("--clip-grad-norm", type=cli.positive_float, default=1.0,
                   help="clip the gradients' total norm to this")
    p.add_argument("--overflow-at", type=cli.positive_int, default=None, metavar="STEP",
                   help="put an inf into one rank's gradient shard at this step, to watch every rank skip it (fp16)")
    p.add_argument("--overflow-rank", type=cli.non_negative_int, default=1, help="the rank of --overflow-at")
    return memory.add_budget_arg(add_profile_args(add_vit_args(p, width=128)), default_mb=4.0)


if __name__ == "__main__":
    cli.main(lambda args: (require(args.dataset, args.data_dir), check_vit_args(args), check_precision(args),
                           memory.check_plan(args, model_from_args), launch(worker, args)), build_parser())
