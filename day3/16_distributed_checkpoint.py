"""Lesson 16: distributed checkpoints: every rank saves its own shards, in parallel, and a run resumes at
another world size.

    python day3/16_distributed_checkpoint.py --nproc 4 --quick --max-steps 20 --checkpoint-every 10
    python day3/16_distributed_checkpoint.py --nproc 2 --batch-size 128 --quick --max-steps 40 --resume  (4 -> 2)
    torchrun --nproc_per_node=4 day3/16_distributed_checkpoint.py --async-save --checkpoint-every 5
    python day3/16_distributed_checkpoint.py --nproc 2 --quick --max-steps 20 --async-save process
    python day3/16_distributed_checkpoint.py --export model.pt    (one process: one ordinary file)

Lesson 15's FSDP2 loop, with checkpoints that fit it:
- Lesson 12's checkpoint is enough when every rank holds the whole model (DDP): rank 0 alone writes one
  torch.save file and every rank loads all of it.  Under FSDP2 no rank holds the whole model: gathering it
  on rank 0 needs the memory sharding saved, and one writer is slow for a model of many GB.  Sharded
  checkpoints (torch.distributed.checkpoint, DCP) let every rank write its own shards at once, and let a
  run resume on another number of ranks.
- Save: get_state_dict(model, optimizer) gives this rank's shards (DTensors) keyed by parameter name, the
  optimizer's momentum by the same names; dcp.save writes each rank's shards to its own file
  (__RANK_0.distcp) and rank 0 writes .metadata last: which rows of which tensor are in which file.
- Published atomically: every rank writes into a temporary directory, and hashes (sha256) the file it
  wrote; once all have finished, rank 0 writes complete.json (the position in training, every file's size
  and digest, and a digest of its own content), then renames the directory to step-NNNNNNNNN.  A crash, a
  kill or a full disk leaves a temporary directory or a file shorter than complete.json says: resuming
  skips it, says so, and takes the newest complete one (course/checkpoints/dcp.py).
- Verified before use: bytes changed in place (a failing disk, a bad copy) keep the sizes, and neither
  DCP's files nor torch.load carry or check a checksum.  So each rank hashes its share of the newest
  checkpoint's files (every W-th by name) and compares with complete.json; one all_reduce of the verdicts
  tells every rank, before any rank loads, whether all files are intact.  A damaged checkpoint is named
  (which file) and skipped, and the next newest is tried; with none left, rank 0 says so in one line and
  the run ends (exit code 1) before any rank loads.
- Resume (--resume, at any world size): each rank builds the model and optimizer as usual (its shards for
  W ranks), dcp.load reads the rows its shards need from whichever files hold them (resharding: saved by 4
  ranks, loaded by 2, or the other way round), set_state_dict puts them in place.  The same global batches
  follow: keep world size x --batch-size equal (the run stops with the --batch-size to use otherwise).
  The weights then equal the uninterrupted run's up to float rounding: other W, other order of sums.
  --resume if-any resumes when there is a checkpoint and starts a new run when there is none (a job that
  may be submitted again); a checkpoint already at --max-steps leaves nothing to train (one line, exit 0).
  Under fp16, GradScaler's state (the loss scale and its count of good steps) is recorded in complete.json
  beside the position in training, and restored with it.
- --async-save [thread|process]: dcp.async_save (torch 2.14.1) first copies ("stages") this rank's shards
  to CPU memory, and returns once the copy is done (the process executor's first save also broadcasts
  from rank 0 where its processes meet); everything else, dcp.save itself with its planning
  collectives (which rank writes what) and the writes, runs in its executor while training goes on: a
  background thread (the default), or with `process` a process of its own per rank, started at the first
  save (seconds: a fresh Python importing torch) and kept for the later ones; it has its own gloo process
  group, and the staged copy travels to it through shared memory (a second copy, made in the
  background).  The thread shares the interpreter (the GIL) with the training loop; the process does not.
  The lesson's saves use a gloo process group of their own (collectives of the saver must not mix with the
  training loop's; gloo because the saver works on the CPU copy, also under NCCL), and wait for the
  previous save before the next.  The stall, the time the training loop waits for a save, is measured for
  every kind, and split into the wait for the previous save, the copy (timed in ckpt.Writer's stage(),
  which async_save calls) and the rest of the call.
- --export PATH: one process, no process group: the newest checkpoint whose files all match their digests
  (checked here, all of them); dcp.load(no_dist=True) assembles the whole tensors from all
  ranks' files into the plain ViT's state dict, saved as one ordinary file for inference
  (torch.load(PATH, weights_only=True); format_utils.dcp_to_torch_save does the same for everything).
--batch-size is per rank.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line (sharding and
checkpoints included).
"""
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/
from course.launching.requires import require  # noqa: E402
require(__file__)  # before torch: a torch or package this lesson lacks is one line, not an ImportError

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from course.checkpoints import dcp as ckpt
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
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")  # fp16 only; off, it passes through
    directory, position = args.checkpoint_dir, {"step": 0, "epoch": 0, "batches_done": 0}
    chosen = [None, None, []]  # DIST: rank 0 lists the checkpoints and names this run's temporary directories
    if rank == 0:
        chosen = [None, str(os.getpid()), ckpt.published(directory, lambda m: rank_print(0, m)) if args.resume else []]
        ckpt.remove_unfinished(directory)
    dist.broadcast_object_list(chosen, src=0)  # DIST: every rank tries the same checkpoints, newest first
    for path, saved in chosen[2]:  # saved: its complete.json, with every file's sha256
        intact = torch.tensor(float(ckpt.share_intact(path, saved, rank, world_size)), device=device)  # my share
        dist.all_reduce(intact, op=dist.ReduceOp.MIN)  # DIST: every rank learns the verdict before any rank loads
        if intact.item():
            chosen[0] = path  # the newest checkpoint whose every file is intact
            break
    ckpt.require_intact(chosen, args.resume, directory, rank)  # --resume and none intact: one line, the end
    if chosen[0] is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)  # DIST: this rank's shards, keyed by name
        dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=chosen[0])  # DIST: its rows, any W
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)  # DIST: in place
        position = {k: saved[k] for k in position}
        scaler.load_state_dict(saved.get("scaler", {}))  # fp16: the loss scale reached (disabled: does nothing)
        rank_print(rank, f"resumed from {chosen[0]} (saved by {saved['world_size']} ranks): step {saved['step']}")
    saver = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout)) if args.async_save else None  # DIST: the saver's group
    saves = ckpt.Saves(rank, args.keep, chosen)

    def checkpoint(epoch, batches_done):
        saves.begin()  # the clock starts; an async save still running: wait for it (rank 0 publishes it)
        model_sd, optim_sd = get_state_dict(model, optimizer)  # DIST: this rank's shards, keyed by name
        state, tmp = {"model": model_sd, "optimizer": optim_sd}, ckpt.temporary(directory, step, chosen[1])
        info = {**ckpt.settings(args, world_size), "step": step, "epoch": epoch, "batches_done": batches_done,
                "scaler": scaler.state_dict()}  # fp16: the loss scale and its count of good steps, in complete.json
        if args.async_save:  # DIST: copies the shards to CPU memory, returns; saves in a thread or a process
            kind = dcp.state_dict_saver.AsyncCheckpointerType(args.async_save)  # over `saver`, planning included
            saves.started(dcp.async_save(state, storage_writer=ckpt.Writer(tmp), process_group=saver,
                                         async_checkpointer_type=kind), tmp, info)
        else:  # DIST: each rank its own file, at once, and its sha256 (ckpt.Writer); rank 0 .metadata last
            saves.started(dcp.save(state, storage_writer=ckpt.Writer(tmp)), tmp, info)  # rank 0 then publishes

    # DDP: rank r gets every W-th index of the epoch's shuffled order; padded so all shards are equal
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    if args.loader == "dataloader":  # the loop to write for your own dataset
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    else:  # the same batches, each gathered from the in-memory tensors at once (data_tools/datasets.py)
        loader = batches(train_set, sampler, args.batch_size)
    prof = maybe_profile(args, rank, device)  # --profile: lesson 5's traces and TensorBoard scalars
    losses, norms, skipped, step, start = [], [], [], position["step"], time.perf_counter()
    for epoch in range(position["epoch"], args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        done = position["batches_done"] if epoch == position["epoch"] else 0  # global batches already trained
        for i, (x, y) in enumerate(loader):
            if i < done:  # resumed mid-epoch: skip the global batches already trained on
                continue
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
            saves.poll()  # rank 0: an async save that has finished is published
            if step % args.checkpoint_every == 0 and step != args.max_steps:
                checkpoint(epoch, i + 1)
            if step == args.max_steps:
                break
        accuracy, test_loss, counted = evaluate(model, test_set, rank, world_size)  # every rank: it gathers
        prof.epoch(epoch, accuracy, test_loss)
        if rank == 0:
            rank_print(rank, f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {accuracy:.4f} "
                             f"({counted} test images, each counted once)")
        if step == args.max_steps:
            break
    per_epoch = -(-len(sampler) // args.batch_size)
    checkpoint(epoch + (i + 1 == per_epoch), (i + 1) % per_epoch)  # at the end, always
    saves.wait()
    seconds = time.perf_counter() - start
    prof.close()
    rank_print(rank, f"steps {position['step'] + 1} to {step} ({step - position['step']} steps) in {seconds:.1f} s "
                     f"(this rank's shard: {len(sampler)} samples per epoch)")
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
            "lesson": "16_distributed_checkpoint", "dataset": args.dataset, "model": args.model,
            "precision": args.precision, "world_size": world_size, "backend": dist.get_backend(),
            "batch_size": args.batch_size, "global_batch_size": global_batch, "lr": args.lr,
            "epochs": args.epochs, "steps": step, "skipped_steps": skipped, "planned": args.planned,
            "reshard_after_forward": args.reshard_after_forward, "per_rank_bytes": per_rank,
            "samples_seen": samples, "train_seconds": seconds, "samples_per_second": samples / seconds,
            "test_accuracy": accuracy, "test_loss": test_loss, "loss_per_step": losses,
            "grad_norm_per_step": torch.stack(norms).tolist(), "first_step": position["step"],
            "resumed_from": chosen[0] and str(chosen[0]), "async_save": args.async_save,
            **saves.metrics()})
        save_weights(run / "model.pt", full)
        plot_curves(run / "loss.png", {f"{args.precision}, {world_size} ranks": (range(position["step"] + 1, step + 1), losses)},
                    "step", "training loss (mean over ranks)", f"{args.model}, global batch {global_batch}")
        memory.report(per_rank, args.planned, args.memory_budget_mb)
        saves.report(args.async_save)
        print(f"{world_size} ranks x batch {args.batch_size} = global batch {global_batch}, {args.precision}: "
              f"test accuracy {accuracy:.4f}; outputs in {run}", flush=True)
    dist.destroy_process_group()


def build_parser():
    p = cli.add_loader(cli.add_distributed(cli.parser(__doc__, "day3/16_distributed_checkpoint.py", nproc_default=2)))
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
    return ckpt.add_args(memory.add_budget_arg(add_profile_args(add_vit_args(p, width=128)), default_mb=4.0))


def main(args):
    if args.export:  # one process, no ranks: the newest intact checkpoint as one ordinary file
        return ckpt.export(args)
    require(args.dataset, args.data_dir), check_vit_args(args), check_precision(args)
    memory.check_plan(args, model_from_args)
    ckpt.check(args, memory.world_size_of(args))  # --resume: a complete checkpoint of this model and batch
    launch(worker, args)


if __name__ == "__main__":
    cli.main(main, build_parser())
