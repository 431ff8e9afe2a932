"""Lesson 21: pipeline parallelism: the model cut between its blocks into stages, the batch into micro-batches.

    python day4/21_pipeline_parallel.py --nproc 2 --quick
    torchrun --nproc_per_node=4 day4/21_pipeline_parallel.py --quick --schedule 1f1b --microbatches 8
    srun --ntasks=4 python day4/21_pipeline_parallel.py --schedule interleaved-1f1b --depth 8

Lesson 19's loop with tensor parallelism replaced by pipeline parallelism (PP):
- Tensor parallelism (lesson 19) cuts every layer and adds up the ranks' parts at every layer.  A pipeline
  cuts the model between layers: rank r holds stage r, a run of consecutive blocks (the first stage also
  the patch embedding, the last the norm and the head: `plan` in the worker), and sends only its output
  activations to the next stage's rank and, in the backward
  pass, their gradients back: point to point, one tensor [micro-batch, tokens, width] each way per micro-
  batch and stage boundary.  So it also serves over the slower links between nodes.
- Each rank builds only its stages (`Stage`, course/models.py: the ViT's forward over the parts it holds),
  from the ViT's parts drawn one at a time in order under the same seed: the stages together start from one
  process's weights at that seed, and no rank holds the whole model while training (evaluation gathers it,
  below).  Each becomes a torch `PipelineStage`,
  which sends its outputs to stage i + 1's rank and receives their gradients.  What it wraps is the stage with
  two marks around it (course/measuring/parallel.py, `StageBook.wrap`: timing only, and --stage-ms).
- While the last stage works on the whole batch the first stage could only wait: the batch is cut into m
  micro-batches (--microbatches), numbered from 0, so that stage 0 computes micro-batch 1 while stage 1
  computes micro-batch 0.  torch.distributed.pipelining runs them in an order, the schedule (--schedule):
  GPipe: every micro-batch's forward, then every backward; a stage holds the activations of all m.
  1F1B: after a warm-up of p - r forwards on rank r, a backward after each forward: at most p micro-batches'
  activations held, the same waiting time; torch requires m >= p.  Interleaved 1F1B: 2 stages per rank (rank r holds stages r and
  r + p, each half the blocks): the waiting shrinks, the sends double.  torch 2.14.1's zero-bubble schedules
  (which split each backward in two) are not run here: docs/learners/model-parallel.md says why.
- The bubble: with p stages and m micro-batches of equal compute time, each rank waits (p - 1) / (m + p - 1)
  of a step (interleaved: (p - 1) / (2m + p - 1)).  --stage-ms f makes each stage's compute take f ms in the
  forward and 2f in the backward per micro-batch (a sleep: course/measuring/parallel.py), so that the measured
  waiting can be compared with the formula: 1 - the seconds rank 0's stages computed (their forward and
  backward chunks, simulated and real compute) / the seconds its schedule's steps took.  The sends, the
  schedule's own Python, the last stage's loss and the gradients' division by m count as waiting.
- The loss: `loss_fn` is one micro-batch's mean cross entropy; the schedule adds up the m micro-batches'
  gradients and divides by m (`scale_grads=True`, its default): the gradient of the batch's mean loss, as
  one process computes it.  The last stage's `step` returns the batch's logits (its loss is printed).  In
  the first step torch also runs an extra forward and backward pass through the stages to learn the shapes
  of the activations and their gradients (stage 0 on the first micro-batch, each later stage on an empty
  tensor of the shape the one before reports: only shapes travel), and allocates its receive buffers once:
  every later micro-batch must have that shape, so an epoch's last, smaller batch is skipped.  Neither step 1 nor
  step 3 (whose memory is measured: the tracking slows the compute down) is timed.
- The gradient clip: each rank holds only its stages' gradients: their squared norms are added up over the
  ranks (one all_reduce), and every rank scales its own by the same factor.
- Evaluation and model.pt: every rank gathers the stages' weights (course/measuring/parallel.py, `whole_model`) and
  evaluates the whole ViT, small here; a model too large for one process would be evaluated through the
  pipeline (`schedule.eval`) and saved with lesson 16's DCP.
- Each rank prints its node, its stages and what they hold, and step 3's memory (measured as in lessons 13
  and 15); the last step's chunks, every rank's, go to metrics.json ("timeline") for the notebook's picture.
--batch-size is the whole batch, cut into --microbatches micro-batches; every rank loads the same batches
(stage 0 uses the images, the last stage the labels).
The stage split and torch's PipelineStage are this lesson's idea: both are written here rather than in a
helper.
Tags: `# DDP:` what makes training data-parallel (none here); `# DIST:` any other torch.distributed line.
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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from course.launching import cli
from course.launching.launch import backend_for, launch, setup_device
from course.measuring import hardware, memory, parallel
from course.measuring.profiling import add_profile_args, maybe_profile
from course.models import Stage, add_vit_args, check_pipeline, check_vit_args, vit_parts
from course.training.evaluate import evaluate
from course.training.output import plot_curves, rank_print, save_weights, write_json
from course.training.precision import DTYPES, check_precision
from data_tools.datasets import InMemoryMNIST, batches, require

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


def worker(info, args):
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
    require(args.dataset, args.data_dir)
    train_set = InMemoryMNIST(args.dataset, "train", args.data_dir, device, limit=args.train_samples or 0)
    test_set = InMemoryMNIST(args.dataset, "test", args.data_dir, device)

    # The split: p stages of consecutive blocks (interleaved: 2p, rank r holds stages r and r + p, a loop)
    per_rank = 2 if args.schedule == "interleaved-1f1b" else 1
    n_stages, ids = per_rank * world_size, [rank + i * world_size for i in range(per_rank)]  # mine: stage r of p
    per = args.depth // n_stages
    plan = [[f"blocks.{b}" for b in range(s * per, (s + 1) * per)] for s in range(n_stages)]
    plan[0], plan[-1] = ["embed", "position"] + plan[0], plan[-1] + ["norm", "head"]  # small next to a block
    torch.manual_seed(args.seed)  # the ViT's parts drawn one at a time, in order: together one process's weights
    mine = {s: {} for s in ids}
    for name, part in vit_parts(args.patch, args.width, args.depth, args.heads):  # one block held at a time
        for s in ids:
            if name in plan[s]:
                mine[s][name] = part
    model = torch.nn.ModuleList(Stage(mine[s]) for s in ids).to(device)  # my stages only: no rank holds them all
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dtype = DTYPES[args.precision]
    peak = memory.StepPeak(model, optimizer, device)  # step 3's bytes: held as it begins, most during it
    book = parallel.StageBook(device, args.stage_ms / per_rank)  # not torch: times the chunks, adds --stage-ms
    pipes = [PipelineStage(book.wrap(stage, i), stage_index=i, num_stages=n_stages, device=device)  # DIST: its
             for stage, i in zip(model, ids)]  # sends and receives, to the ranks of stages i - 1 and i + 1
    schedule = SCHEDULES[args.schedule](pipes if len(pipes) > 1 else pipes[0], args.microbatches,
                                        loss_fn=F.cross_entropy, scale_grads=True)  # DIST: the order; loss: mean
    clock = parallel.PipelineClock(book, untimed=(1, peak.at))  # not torch: each step's seconds and compute

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
            if len(y) < args.batch_size:  # the epoch's last, smaller batch: every micro-batch must have one shape
                break
            begun = hardware.clock(device)  # on a GPU once its queued work is done: the step's own kernels
            optimizer.zero_grad()
            with clock.step(step + 1):  # not timed: step 1 (it also learns the shapes), step 3 (memory measured)
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    logits = schedule.step(*([x] if 0 in ids else []),  # DIST: stage 0 takes the images, the
                                           **({"target": y} if n_stages - 1 in ids else {}))  # last the labels
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) ** 2  # my stages'
            dist.all_reduce(norm)  # DIST: the squared norms of all stages add up
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), args.clip_grad_norm, norm.sqrt())
            optimizer.step()
            step_seconds += (hardware.clock(device) - begun) if step else 0.0  # step 1 is counted: not timed
            loss = F.cross_entropy(logits.float(), y) if logits is not None else torch.zeros((), device=device)  # the last stage's
            losses.append(loss.detach())
            norms.append(norm.sqrt().detach())
            step += 1
            prof.step(loss, len(y))
            if step == args.max_steps:
                break
        full, whole = parallel.whole_model(model, args, device)  # DIST: every rank's stages, on every rank
        accuracy, test_loss, counted = evaluate(whole, test_set)  # every rank all of it, the whole model
        prof.epoch(epoch, accuracy, test_loss)
        if rank == 0:
            rank_print(rank, f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {accuracy:.4f} "
                             f"({counted} test images, each counted once)")
        if step == args.max_steps:
            break
    seconds = time.perf_counter() - start
    prof.close()
    rank_print(rank, f"{step} steps in {seconds:.1f} s (every rank: {len(sampler)} samples per epoch); {peak}")
    pipeline, spans = clock.report(rank, world_size, args, ids, model, [plan[i] for i in ids])  # DIST: rank 0: the bubble

    losses = torch.stack(losses)
    dist.broadcast(losses, src=world_size - 1)  # DIST: the last stage's losses, to every rank (once, at the end)
    losses = losses.tolist()  # the same on every rank
    if rank == 0:  # DIST: one process writes the outputs
        global_batch = args.batch_size  # every rank computes on the whole batch
        samples = min(step * global_batch, args.epochs * len(sampler))
        run = args.run_dir
        write_json(run / "metrics.json", {
            "lesson": "21_pipeline_parallel", "dataset": args.dataset, "model": args.model,
            "precision": args.precision, "world_size": world_size, "backend": dist.get_backend(),
            "batch_size": args.batch_size, "global_batch_size": global_batch, "lr": args.lr,
            "epochs": args.epochs, "steps": step, "pipeline": pipeline, "timeline": spans, "step_seconds": step_seconds / max(step - 1, 1),
            "samples_seen": samples, "train_seconds": seconds, "samples_per_second": samples / seconds,
            "test_accuracy": accuracy, "test_loss": test_loss, "loss_per_step": losses,
            "grad_norm_per_step": torch.stack(norms).tolist(), "memory": peak.result()})
        save_weights(run / "model.pt", full)
        plot_curves(run / "loss.png", {f"{args.precision}, {world_size} ranks": (range(1, step + 1), losses)},
                    "step", "training loss (the same on every rank)", f"{args.model}, global batch {global_batch}")
        print(f"{world_size} pipeline ranks, {n_stages} stages, batch {global_batch} in {args.microbatches} micro-batches, "
              f"{args.schedule}, {args.precision}: test accuracy {accuracy:.4f}; outputs in {run}", flush=True)
    dist.destroy_process_group()


def build_parser():
    p = cli.add_loader(cli.add_distributed(cli.parser(__doc__, "day4/21_pipeline_parallel.py", nproc_default=2)))
    p.add_argument("--precision", default="fp32", choices=("bf16", "fp32"),
                   help="the dtype of autocast's matrix products (fp16 would need lesson 13's GradScaler)")
    p.add_argument("--clip-grad-norm", type=cli.positive_float, default=1.0,
                   help="clip the gradients' total norm to this")
    return parallel.add_pipeline_args(add_profile_args(add_vit_args(p)), SCHEDULES)


if __name__ == "__main__":
    cli.main(lambda args: (require(args.dataset, args.data_dir), check_vit_args(args), check_precision(args),
                           check_pipeline(args, memory.world_size_of(args)), launch(worker, args)), build_parser())
