"""Lesson 20: two dimensions: a mesh of rows and columns, data parallel across the rows, a model split inside each.

    python day4/20_device_mesh_2d.py --nproc 4 --quick                  # FSDP2 x TP on a 2 x 2 mesh
    python day4/20_device_mesh_2d.py --nproc 4 --quick --layout hsdp    # HSDP on a 2 x 2 mesh
    srun --nodes=2 --ntasks-per-node=2 python day4/20_device_mesh_2d.py

Lesson 19's loop on a 2-D device mesh: W ranks in W/I rows of I (--inner) consecutive ranks.  torchrun and
srun number the ranks node by node, so with --inner the ranks per node a row is one node: the row is the
dimension whose collectives run most often, the columns the one that can take a slower link.  Two layouts:
- fsdp-tp (`("dp", "tp")`): each row is a lesson-19 tensor-parallel group (`parallelize_module` with
  lesson 19's plan on `mesh["tp"]`), and FSDP2 (lesson 15) shards every block and the rest over the
  columns (`fully_shard` on `mesh["dp"]`): TP's 4 all_reduces per block of activations stay inside a node, FSDP2's all_gathers of
  the parameters and reduce_scatters of the gradients go across.  The ranks of a row take the same batch (they compute one
  model together); the W/I rows take different ones: the global batch is W/I x --batch-size.  Rank r holds
  1/W of each matrix TP cuts (1/I by TP, of which 1/(W/I) by FSDP2), and 1/(W/I) of the rest.
- hsdp (`("replicate", "shard")`): no TP; `fully_shard` given the whole 2-D mesh is hybrid sharding: the
  parameters are sharded over the I ranks of a row (all_gather, reduce_scatter inside the node) and the rows
  are replicas of each other (one all_reduce of each gradient shard across the nodes per step).  Every rank
  takes its own batch: the global batch is W x --batch-size.  Each rank holds 1/I of every parameter.
- Built on the meta device, as lessons 15 and 19 build: the plan and `fully_shard` cut parameters that have
  no memory yet, `to_empty` allocates this rank's pieces, and each rank fills them with lesson 18's initial
  weights at the same seed, made on the CPU one block at a time (course/training/sharded_init.py): no rank
  ever holds the whole model, and nothing is sent.
- Every parameter is now a DTensor, on one of two meshes under fsdp-tp (the (dp, tp) mesh for what TP cut,
  the dp mesh for the rest): clip_grad_norm_ cannot add norms across meshes, so the lesson adds each mesh's
  squared norm itself and scales each mesh's gradients with clip_grads_with_norm_.
- fsdp-tp `--sequence-parallel`: lesson 19's sequence-parallel plan, written again here.  It puts the rest
  (embedding, position, norms, head) on the "tp" mesh as Replicate DTensors, so FSDP2 then puts every
  parameter on the (dp, tp) mesh, as HSDP's are all on its 2-D mesh: with one mesh, torch's clip_grad_norm_
  alone (the lesson chooses by the meshes it finds: metrics.json's parameter_meshes).  Measured here (2 vCPU,
  width 32, depth 2, 4 heads, 2 x 2 mesh, batch 16 a row, fp32): step 3's peak 0.699-0.701 MB per rank
  against 0.735-0.737 MB without it; after 4 steps 3.6e-8 to 3.8e-8 (relative) from one process's weights,
  as without it.
- Before training, every rank's host name is gathered and the mesh's rows printed with their nodes: a row
  that spans two nodes puts TP's (or the shards') collectives on the slower link.
- After training, lesson 19's pricing on both dimensions: each collective step 1 sent is sent again on its
  own group, `mesh.get_group(dim)` (this rank's row, "tp" or "shard", or its column, "dp" or "replicate"),
  with the tensor step 1 sent, timed, and priced per step (time per call x calls per step) for each
  dimension, inside one node or across nodes (from the host names gathered before).  FSDP2 x TP: the rows'
  all_reduces of activations [batch, tokens, width]; the columns' all_gathers of each unit's parameters
  (the column's flat shards together) and reduce_scatters of its gradients (the same size).  HSDP: the rows'
  all_gathers and reduce_scatters, the columns' all_reduce of each unit's gradient shard.  Each dimension's
  time alone is the most it adds to a step: on a GPU FSDP2 runs its all_gathers, reduce_scatters and
  HSDP's all_reduces on CUDA streams of their own beside the compute; TP's all_reduces sit between two
  layers, which wait for them.
- init_device_mesh creates a process group for every row and every column, and takes no timeout: a hang in
  one would wait torch's default (30 minutes with gloo, 10 with NCCL).  `backend_override` gives each
  dimension's groups options that carry --timeout (course/launching/devices.py, `mesh_timeouts`).
- Both layouts train what one process trains with the global batch (notebook 20 compares the weights).  Evaluation runs
  the whole test set on every rank (a row's ranks must run the same forward).
--inner must divide the world size; under fsdp-tp, --heads must divide among the --inner ranks (and with
--sequence-parallel, which needs fsdp-tp, the tokens too).
Lesson 19's plans are written again here (each lesson stands alone), and the clip follows the meshes the
plans make.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import logging
import sys
import time
import warnings
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
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from course.launching import cli
from course.launching.launch import backend_for, launch, mesh_timeouts, setup_device
from course.measuring import hardware, memory, parallel
from course.measuring.profiling import add_profile_args, maybe_profile
from course.models import add_vit_args, check_vit_args, model_from_args
from course.training.evaluate import evaluate
from course.training.output import plot_curves, rank_print, save_weights, write_json
from course.training.precision import DTYPES, check_precision
from course.training.sharded_init import init_vit_shards
from data_tools.datasets import InMemoryMNIST, batches, require

# under CommDebugMode (step 1) the model's output is a view, which FSDP2 warns about once per rank: harmless here
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
# DTensor warns (once per mesh, on each rank) when it makes a tensor whole over both mesh dimensions with one
# collective per dimension (the gradient norm, the weights for model.pt): expected here, cheap at this size
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


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


def clip_grad_norm(params: list, max_norm: float):
    """torch's clip_grad_norm_ for parameters on several meshes: each mesh's norm (a DTensor, made whole),
    the total of their squares, then each mesh's gradients scaled by the same factor."""
    on = {}
    for p in params:
        on.setdefault(p.device_mesh, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in ps]).full_tensor() for ps in on.values()]  # DIST
    total = torch.linalg.vector_norm(torch.stack(norms))
    for ps in on.values():  # the factor, a plain 0-dim tensor, multiplies each mesh's DTensor gradients
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


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
    names = ("dp", "tp") if args.layout == "fsdp-tp" else ("replicate", "shard")
    mesh = init_device_mesh(device.type, (world_size // args.inner, args.inner), mesh_dim_names=names,  # DIST
                            backend_override=mesh_timeouts(names, args.timeout))  # DIST: its groups' --timeout
    hosts = parallel.mesh_hosts(rank, mesh)  # DIST: every rank's node: the groups that span nodes
    plan = {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),  # DIST: attention: my heads, then a partial sum
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}  # DIST: the MLP: my hidden features, a sum
    if args.sequence_parallel:  # DIST: between those layers, the activations cut along the tokens (dim 1)
        plan = {"norm1": SequenceParallel(), "qkv": ColwiseParallel(input_layouts=Shard(1)),  # DIST: all_gather
                "proj": RowwiseParallel(output_layouts=Shard(1)), "norm2": SequenceParallel(),  # DIST: reduce_scatter
                "mlp.0": ColwiseParallel(input_layouts=Shard(1)), "mlp.2": RowwiseParallel(output_layouts=Shard(1))}
    if args.layout == "fsdp-tp":  # DIST: TP inside a row (lesson 19's plan), FSDP2 across the rows
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)  # DIST: lesson 19's cut, in a row
        shard_on, replicas, replica = mesh["dp"], mesh["dp"].size(), mesh["dp"].get_local_rank()
    else:  # DIST: HSDP: fully_shard on the 2-D mesh shards inside a row and replicates across the rows
        shard_on, replicas, replica = mesh, world_size, rank
    if args.sequence_parallel:  # DIST: block 0 takes my tokens, the final norm keeps them cut; the rest Replicate
        parallelize_module(model, mesh["tp"], {"norm": SequenceParallel(), "blocks.0": PrepareModuleInput(
            input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True)})
        distribute_module(model, mesh["tp"], input_fn=lambda _, x, mesh: DTensor.from_local(x[0], mesh, [Replicate()]),
                          output_fn=lambda _, logits, mesh: logits.full_tensor())  # DIST: images in, logits out
    for block in model.blocks:
        fully_shard(block, mesh=shard_on)  # DIST: lesson 15's sharding, over a dimension of the mesh
    fully_shard(model, mesh=shard_on)
    model.to_empty(device=device)  # DIST: memory for this rank's pieces only, not yet initialized
    init_vit_shards(model, args, args.seed)  # DIST: lesson 18's initial weights, made block by block: my pieces
    meshes = {p.device_mesh for p in model.parameters()}  # DIST: the meshes the parameters are cut on
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dtype = DTYPES[args.precision]
    peak = memory.StepPeak(model, optimizer, device)  # step 3's bytes: held as it begins, most during it

    sampler = DistributedSampler(train_set, num_replicas=replicas, rank=replica,  # DDP: a share per replica
                                 shuffle=True, seed=args.seed)
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
                loss.backward()  # DIST: TP's all_reduces; FSDP2's all_gathers and reduce_scatters
            comms = parallel.collectives(counting) if step == 0 else comms  # forward and backward, by name
            sent = parallel.by_dimension(counting.sent, mesh) if step == 0 else sent  # kind, tensor, group, calls
            if len(meshes) == 1:  # DIST: HSDP, or --sequence-parallel: torch's clip, on one mesh
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm).full_tensor()
            else:  # DIST: fsdp-tp without it: a norm per mesh, added up
                norm = clip_grad_norm(list(model.parameters()), args.clip_grad_norm)  # DIST: all ranks' gradients
            optimizer.step()
            step_seconds += (hardware.clock(device) - begun) if step else 0.0  # step 1 is counted: not timed
            losses.append(loss.detach())
            norms.append(norm.detach())  # the same norm on every rank
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
    rank_print(rank, f"{step} steps in {seconds:.1f} s (this replica: {len(sampler)} samples per epoch); {peak}")
    rows = priced(device, mesh, sent, iters=5)  # DIST: step 1's collectives again, each on its own group
    per_rank = parallel.report(rank, model, optimizer, rows, comms, args, step_seconds / max(step - 1, 1), hosts)  # DIST

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # DIST
    losses = torch.stack(losses)
    dist.all_reduce(losses)  # DIST: the loss of each global batch, averaged over ranks (a row's are equal)
    losses = (losses / world_size).tolist()
    if rank == 0:  # DIST: one process writes the outputs
        global_batch = replicas * args.batch_size  # one batch per data-parallel replica
        samples = min(step * global_batch, args.epochs * len(sampler))
        run = args.run_dir
        write_json(run / "metrics.json", {
            "lesson": "20_device_mesh_2d", "layout": args.layout, "mesh": hosts, "dataset": args.dataset, "model": args.model,
            "sequence_parallel": args.sequence_parallel,
            "precision": args.precision, "world_size": world_size, "backend": dist.get_backend(),
            "batch_size": args.batch_size, "global_batch_size": global_batch, "lr": args.lr,
            "epochs": args.epochs, "steps": step, "parameter_meshes": len(meshes),
            "collectives_priced": rows, "collectives_per_dimension": parallel.per_dimension(rows),
            "collectives_step_1": comms, "per_rank_bytes": per_rank, "step_seconds": step_seconds / max(step - 1, 1),
            "samples_seen": samples, "train_seconds": seconds, "samples_per_second": samples / seconds,
            "test_accuracy": accuracy, "test_loss": test_loss, "loss_per_step": losses,
            "grad_norm_per_step": torch.stack(norms).tolist(), "memory": peak.result()})
        save_weights(run / "model.pt", full)
        plot_curves(run / "loss.png", {f"{args.precision}, {world_size} ranks": (range(1, step + 1), losses)},
                    "step", "training loss (the same on every rank)", f"{args.model}, global batch {global_batch}")
        print(f"{args.layout} on a {replicas if args.layout == 'fsdp-tp' else world_size // args.inner} x "
              f"{args.inner} mesh, global batch {global_batch}, {args.precision}: test accuracy {accuracy:.4f}; "
              f"outputs in {run}", flush=True)
    dist.destroy_process_group()


def build_parser():
    p = cli.add_loader(cli.add_distributed(cli.parser(__doc__, "day4/20_device_mesh_2d.py", nproc_default=4,
                                                           batch_help="per data-parallel replica")))
    p.add_argument("--precision", default="fp32", choices=("bf16", "fp32"),
                   help="the dtype of autocast's matrix products (fp16 would need lesson 13's GradScaler)")
    p.add_argument("--layout", default="fsdp-tp", choices=("fsdp-tp", "hsdp"),
                   help="fsdp-tp: TP inside each row, FSDP2 across; hsdp: sharded inside each row, replicated across")
    p.add_argument("--inner", type=cli.positive_int, default=2,
                   help="ranks per row of the mesh (consecutive ranks: one node's, or part of it)")
    p.add_argument("--clip-grad-norm", type=cli.positive_float, default=1.0,
                   help="clip the gradients' total norm to this")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="also cut the activations between the TP layers along the tokens (the norms, the residual)")
    return add_profile_args(add_vit_args(p))


if __name__ == "__main__":
    cli.main(lambda args: (require(args.dataset, args.data_dir), check_vit_args(args), check_precision(args),
                           parallel.check_mesh(args, memory.world_size_of(args)), launch(worker, args)), build_parser())
