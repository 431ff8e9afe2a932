"""Lesson 19: tensor parallelism: every layer's matrices cut over the ranks, all ranks on the same batch.

    python day4/19_tensor_parallel.py --nproc 2 --quick
    torchrun --nproc_per_node=4 day4/19_tensor_parallel.py --quick
    srun --ntasks=4 python day4/19_tensor_parallel.py

Lesson 18's loop with DDP replaced by tensor parallelism (TP):
- DDP and FSDP2 split the batch: each rank computes the whole model on its share of the samples.  TP splits
  the model's layers instead: each of the T ranks holds 1/T of every attention and MLP matrix, computes
  1/T of each layer's output for the whole batch, and the ranks add their partial results up with
  all_reduces inside the forward and backward passes.  All ranks take the same batches (a sampler over one
  replica), so T ranks train what one process with that batch trains, up to float32 rounding.
- A device mesh of T ranks in a row, named "tp" (`init_device_mesh`), and `parallelize_module` on each
  block with the plan written in the worker, Megatron-LM's pairs: qkv and mlp.0 column-wise (rank r keeps
  the r-th of T pieces of their output rows, weight and bias, and computes that part of their output from
  the whole input, without communicating; qkv's rows are ordered head by head (course/models.py, Block), so
  a piece is whole heads and attention runs on them locally), proj and mlp.2 row-wise (the matching input
  columns, the bias whole; their output is a partial sum, all_reduced).  The parameters they cut become
  DTensors: `p.to_local()` is this rank's piece, `p.placements` says how it was cut (Shard(0):
  rows, Shard(1): columns, Replicate(): whole, as the row-wise layers' biases).  The embedding, the layer
  norms and the head stay plain tensors, whole on every rank, computed the same on every rank (but see
  --sequence-parallel below).
- Built on the meta device, as lesson 15 builds: no rank ever holds the whole model.  `parallelize_module`
  cuts parameters that have shapes but no memory, `model.to_empty(device=...)` allocates this rank's pieces
  (and the uncut parameters, whole), and every rank fills them with lesson 18's initial weights at the same
  seed, made on the CPU one block at a time (course/training/sharded_init.py, as in lesson 15): each rank
  keeps its own pieces, nothing is sent, and at most one block is ever whole.
- Per block and step: 2 all_reduces in forward (the row-wise outputs) and 2 in backward (the gradients of
  the column-wise layers' inputs), each the size of the block's activations, [batch, tokens, width]:
  torch's CommDebugMode counts them in step 1 (course/measuring/parallel.py's SentCollectives, which also
  keeps each one's group and tensor: under bf16 autocast the forward ones are bf16, the backward ones fp32,
  the column-wise layers' input gradients made whole after autocast's cast).  After training the lesson
  prices them where they ran: each sent again on the mesh's "tp" group (`mesh.get_group("tp")`) with the
  tensor step 1 sent, timed as lesson 18 times its sweep (the slowest rank's seconds per call), x the
  calls per step; every rank's node is gathered once, and rank 0 says whether the group spans nodes.
  DDP sends the gradients once per step, whatever the batch, and overlaps them with the backward pass;
  TP sends activations 4 times per block, more with a larger batch, and each sits between two layers,
  which wait for it: it needs a fast link, the GPUs of one node (NVLink), and is kept inside a node.
- `--sequence-parallel` (Megatron-LM's sequence parallelism, written as torch's TP tutorial and torchtitan
  write it): plain TP leaves every rank the whole activations between the cut layers (the layer norms'
  inputs and outputs, the residual stream).  With it they stay cut along the tokens (dim 1): each rank
  keeps 1/T of the tokens there.  The plan: the norms `SequenceParallel()` (their weights whole, Replicate
  DTensors; each rank normalizes its own tokens), the column-wise layers `input_layouts=Shard(1)` (an
  all_gather of the tokens before them), the row-wise ones `output_layouts=Shard(1)` (a reduce_scatter onto
  the tokens instead of the all_reduce: the same bytes, as an all_reduce is a reduce_scatter then an
  all_gather).  Around the blocks: block 0's input cut by `PrepareModuleInput` (Replicate to Shard(1): each
  rank keeps its tokens, nothing is sent), the final norm's `SequenceParallel()` keeping them cut (the mean
  over the tokens then adds the ranks' parts: one small all_reduce), and `distribute_module` for the rest:
  the embedding, the position and the head become Replicate DTensors, the images come in as a Replicate
  DTensor and the logits leave whole.  Every parameter is then a DTensor on the "tp" mesh.  Measured here
  (2 vCPU, width 32, depth 2, 4 heads, batch 32, fp32, T = 2): step 3's peak 1.307 MB per rank against
  1.403 MB without it, the weights after 4 steps 3e-8 (relative) from one process's.
- The gradient clip: clip_grad_norm_ refuses a list that mixes DTensors with plain tensors.  Under
  `implicit_replication()` DTensor takes the plain tensors as whole (Replicate) DTensors, and the norm is
  the one one process computes: the cut gradients' squares are summed over the ranks.  It is a DTensor,
  the same on every rank (`full_tensor()`).  With --sequence-parallel there are no plain tensors left and
  `implicit_replication()` changes nothing (lesson 20 clips such a model with clip_grad_norm_ alone).
- Evaluation runs the whole test set on every rank: every rank must run the same forward (its all_reduces
  add up the ranks' pieces of the same samples).
- Each rank holds exactly 1/T of the cut parameters (and of their gradients and momentum), counted from
  their local pieces, and the whole of the rest; step 3's memory is measured as in lessons 13 and 15.
- model.pt: the whole weights, gathered as in lesson 15 (rank 0 keeps them).
- fp16 is not offered: its GradScaler stops with an error on gradients that mix DTensors and plain tensors
  (torch 2.14.1); bf16 needs no scaler.
--batch-size is the global batch: every rank computes on all of it.  --heads must divide among the ranks,
and with --sequence-parallel so must the tokens ((28 / --patch)^2).
This lesson's diff against lesson 18 is longer than most: the plan (with its sequence-parallel variant, and
the meta-device build it cuts) and the collectives sent again on the "tp" group (`priced`) are its ideas,
written here rather than behind a helper.
Tags: `# DDP:` what makes training data-parallel (none here); `# DIST:` any other torch.distributed line.
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from course.launching import cli
from course.launching.launch import backend_for, launch, setup_device
from course.measuring import hardware, memory, parallel
from course.measuring.profiling import add_profile_args, maybe_profile
from course.models import add_vit_args, check_tensor_parallel, check_vit_args, model_from_args
from course.training import replicas
from course.training.evaluate import evaluate
from course.training.output import plot_curves, rank_print, save_weights, write_json
from course.training.precision import DTYPES, check_precision
from course.training.sharded_init import init_vit_shards
from data_tools.datasets import InMemoryMNIST, batches, require


def priced(device, mesh, sent: list, iters: int) -> list:
    """Every rank: each collective step 1 sent (its kind, tensor and mesh dimension: parallel.by_dimension),
    sent again on this rank's group along that dimension with that tensor, timed as lesson 18 times its sweep:
    what it costs where the training runs it, not over all ranks at sizes the training never sends."""
    rows = []
    for c in sent:
        group = mesh.get_group(c["dim"])  # DIST: this rank's group along the dimension (its row, or column)
        whole = torch.ones(c["numel"], dtype=c["dtype"], device=device)  # S, as step 1 sent it
        piece = torch.ones(whole.numel() // group.size(), dtype=c["dtype"], device=device)  # one rank's part of S
        call = {"all_reduce": lambda: dist.all_reduce(whole, group=group),  # DIST: the group's sum, on all of it
                "all_gather": lambda: dist.all_gather_single(whole, piece, group=group),  # DIST: the n pieces
                "reduce_scatter": lambda: dist.reduce_scatter_single(piece, whole, group=group)}[c["op"]]  # DIST
        seconds, _ = hardware.timed(call, iters, device)  # DIST: the slowest rank's seconds per call
        rows.append(dict(c, dtype=str(c["dtype"]).removeprefix("torch."), bytes=whole.nbytes, ranks=group.size(),
                         seconds=seconds))
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

    with torch.device("meta"):  # DIST: shapes only, no memory: no rank ever builds the whole model
        model = model_from_args(args, args.seed)
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("tp",))  # DIST: T ranks share each layer
    hosts = parallel.mesh_hosts(rank, mesh)  # DIST: every rank's node: the groups that span nodes
    plan = {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),  # DIST: attention: my heads, then a partial sum
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}  # DIST: the MLP: my hidden features, a sum
    if args.sequence_parallel:  # DIST: between those layers, the activations cut along the tokens (dim 1)
        plan = {"norm1": SequenceParallel(), "qkv": ColwiseParallel(input_layouts=Shard(1)),  # DIST: all_gather
                "proj": RowwiseParallel(output_layouts=Shard(1)), "norm2": SequenceParallel(),  # DIST: reduce_scatter
                "mlp.0": ColwiseParallel(input_layouts=Shard(1)), "mlp.2": RowwiseParallel(output_layouts=Shard(1))}
    for block in model.blocks:  # DIST: each block's matrices cut into T pieces; each rank keeps its own
        parallelize_module(block, mesh, plan)
    if args.sequence_parallel:  # DIST: block 0 takes my tokens, the final norm keeps them cut; the rest Replicate
        parallelize_module(model, mesh, {"norm": SequenceParallel(), "blocks.0": PrepareModuleInput(
            input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True)})
        distribute_module(model, mesh, input_fn=lambda _, x, mesh: DTensor.from_local(x[0], mesh, [Replicate()]),
                          output_fn=lambda _, logits, mesh: logits.full_tensor())  # DIST: images in, logits out
    model.to_empty(device=device)  # DIST: memory for my pieces and the uncut parameters, not yet initialized
    init_vit_shards(model, args, args.seed)  # DIST: lesson 18's initial weights, made block by block: my pieces
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dtype = DTYPES[args.precision]
    peak = memory.StepPeak(model, optimizer, device)  # step 3's bytes: held as it begins, most during it

    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed)  # DIST: same for all
    if args.loader == "dataloader":  # the loop to write for your own dataset
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    else:  # the same batches, each gathered from the in-memory tensors at once (data_tools/datasets.py)
        loader = batches(train_set, sampler, args.batch_size)
    prof = maybe_profile(args, rank, device)  # --profile: lesson 5's traces and TensorBoard scalars
    losses, norms, step_seconds, step, start = [], [], 0.0, 0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for x, y in loader:
            begun = hardware.clock(device)  # on a GPU once its queued work is done: the step's own kernels
            counting = parallel.SentCollectives() if step == 0 else nullcontext()  # DIST: CommDebugMode, + tensors
            with counting:  # step 1 only: torch counts what its forward and backward passes do
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    loss = F.cross_entropy(model(x), y)  # the logits are 16-bit, the loss fp32
                optimizer.zero_grad()
                loss.backward()  # DIST: an all_reduce of each column-wise layer's input gradient
            comms = parallel.collectives(counting) if step == 0 else comms  # forward and backward, by name
            sent = parallel.by_dimension(counting.sent, mesh) if step == 0 else sent  # kind, tensor, group, calls
            with implicit_replication():  # DIST: clip_grad_norm_ takes the plain tensors as Replicate DTensors
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)  # DIST: all ranks'
            optimizer.step()
            step_seconds += (hardware.clock(device) - begun) if step else 0.0  # step 1 is counted: not timed
            losses.append(loss.detach())
            norms.append(norm.full_tensor().detach())  # DIST: the same norm on every rank
            step += 1
            prof.step(loss, len(y))
            if step == args.max_steps:
                break
        accuracy, test_loss, counted = evaluate(model, test_set)  # every rank all of it: the same forward
        prof.epoch(epoch, accuracy, test_loss)
        if rank == 0:
            rank_print(rank, f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {accuracy:.4f} "
                             f"({counted} test images, each counted once)")
        if step == args.max_steps:
            break
    seconds = time.perf_counter() - start
    prof.close()
    rank_print(rank, f"{step} steps in {seconds:.1f} s (every rank: {len(sampler)} samples per epoch); {peak}")
    rows = priced(device, mesh, sent, iters=5)  # DIST: step 1's collectives again, each on its own group
    per_rank = parallel.report(rank, model, optimizer, rows, comms, args, step_seconds / max(step - 1, 1), hosts)  # DIST

    identical = replicas.identical_on_all_ranks(parallel.uncut(model))  # DIST: the uncut parameters, equal?
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # DIST
    losses = torch.stack(losses)
    losses = losses.tolist()  # the same on every rank
    if rank == 0:  # DIST: one process writes the outputs
        global_batch = args.batch_size  # every rank computes on the whole batch
        samples = min(step * global_batch, args.epochs * len(sampler))
        run = args.run_dir
        write_json(run / "metrics.json", {
            "lesson": "19_tensor_parallel", "dataset": args.dataset, "model": args.model,
            "sequence_parallel": args.sequence_parallel,
            "precision": args.precision, "world_size": world_size, "backend": dist.get_backend(),
            "batch_size": args.batch_size, "global_batch_size": global_batch, "lr": args.lr,
            "epochs": args.epochs, "steps": step, "identical_weights": identical, "mesh": hosts,
            "collectives_priced": rows, "collectives_per_dimension": parallel.per_dimension(rows),
            "collectives_step_1": comms, "per_rank_bytes": per_rank, "step_seconds": step_seconds / max(step - 1, 1),
            "samples_seen": samples, "train_seconds": seconds, "samples_per_second": samples / seconds,
            "test_accuracy": accuracy, "test_loss": test_loss, "loss_per_step": losses,
            "grad_norm_per_step": torch.stack(norms).tolist(), "memory": peak.result()})
        save_weights(run / "model.pt", full)
        plot_curves(run / "loss.png", {f"{args.precision}, {world_size} ranks": (range(1, step + 1), losses)},
                    "step", "training loss (the same on every rank)", f"{args.model}, global batch {global_batch}")
        print(f"{world_size} tensor-parallel ranks, batch {global_batch} on every rank, {args.precision}: "
              f"test accuracy {accuracy:.4f}; replicated weights identical on all ranks: "
              f"{identical}; outputs in {run}", flush=True)
    dist.destroy_process_group()


def build_parser():
    p = cli.add_loader(cli.add_distributed(cli.parser(__doc__, "day4/19_tensor_parallel.py", nproc_default=2)))
    p.add_argument("--precision", default="fp32", choices=("bf16", "fp32"),
                   help="the dtype of autocast's matrix products (fp16 would need lesson 13's GradScaler)")
    p.add_argument("--clip-grad-norm", type=cli.positive_float, default=1.0,
                   help="clip the gradients' total norm to this")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="also cut the activations between the TP layers along the tokens (the norms, the residual)")
    return add_profile_args(add_vit_args(p))


if __name__ == "__main__":
    cli.main(lambda args: (require(args.dataset, args.data_dir), check_vit_args(args), check_precision(args),
                           check_tensor_parallel(args, memory.world_size_of(args)), launch(worker, args)), build_parser())
