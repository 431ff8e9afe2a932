"""Lesson 23: fine-tuning a Hugging Face model: its weights in and out, sharded, the prompt masked out of the loss.

    python day5/22_gpt_pretraining.py --quick                  # writes runs/22_gpt_pretraining/hf
    python day5/23_hf_finetuning.py --nproc 2 --quick          # fine-tunes it on 2 ranks
    srun --nodes=2 --ntasks-per-node=2 python day5/23_hf_finetuning.py --model-dir /shared/models/NAME

Lesson 22's loop, on weights somebody else trained.  What changes:
- The model comes from a Hugging Face model directory (--model-dir: config.json and *.safetensors, as
  `transformers`' save_pretrained writes it; lesson 22 writes one into its run dir's hf/, the default unless
  $COURSE_MODEL_DIR names a model staged for the class).  The model is
  built on the meta device from config.json's sizes (course/checkpoints/hf.py), sharded with fully_shard (lesson 15),
  given memory for its shards (to_empty), and then each rank reads its own rows of each tensor straight from
  the safetensors file: torch.distributed.checkpoint's HuggingFaceStorageReader with dcp.load fills the
  sharded state dict that get_model_state_dict gives.  No rank holds the whole model, before or after.
- The data are prompt/response pairs (data_tools/instructions.py: a question about a section of Python's
  documentation, and that section's first sentence), one pair a row, padded.  The loss counts only the
  response's tokens: the target of every prompt position and of the padding is -100, which F.cross_entropy
  skips.  The mean must be over the response tokens of the whole global batch, which differ in number from
  rank to rank: each rank's sum is divided by the global count (one all_reduce) and multiplied by the
  replicas, because FSDP2 averages the gradients over the replicas; one process divides by its own count.
  A mean per rank would weigh a rank's short responses more, and the layouts would train different models.
- Before training, the model as loaded is evaluated on the held-out pairs under torch.no_grad().  The root
  module's parameters stay gathered after that forward (FSDP2 reshards the root after backward, and no_grad
  has none), so `model.parameters()` would hand the optimizer the gathered tensors, not the shards: the
  optimizer would update copies that the next all_gather overwrites, and nothing warns.  `model.reshard()`
  puts the shards back first (--skip-reshard leaves it out, to see the drift).
- At the end each rank writes its shards as safetensors (HuggingFaceStorageWriter, save_distributed=True), and
  rank 0 joins them into one file per tensor group with an index (enable_consolidation=True): a directory
  `transformers` loads (AutoModelForCausalLM.from_pretrained), with config.json and SHA256SUMS.
- A sample: the fine-tuned model answers a held-out question, byte by byte (the most likely byte each time),
  every rank running the same sharded forward.
- Memory before the queue, as in lesson 22: course/fit.py estimates rank 0's bytes in this model and layout
  before any rank starts; the line with the measured step at the end gives the two side by side.
--batch-size is rows (pairs) per rank.  AdamW with a constant --lr; gradients clipped to norm 1.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import shutil
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
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from course import fit
from course.checkpoints import hf
from course.gpt import GPT
from course.launching import cli
from course.launching.launch import backend_for, launch, mesh_timeouts, setup_device
from course.measuring import hardware, memory
from course.training.output import plot_curves, rank_print, write_json
from data_tools import instructions
from data_tools.text import END, decode, encode


def masked_loss(logits, targets, replicas: int, device):
    """The mean next-token loss over the response tokens of the whole global batch (see the docstring):
    (my sum x replicas) / (all replicas' count), which FSDP2's average of the gradients over the replicas
    turns into (everyone's sum) / (everyone's count).  Returns (the loss to backward, the global mean)."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=instructions.IGNORE,
                            reduction="sum")  # the prompt's and the padding's targets are skipped
    count = (targets != instructions.IGNORE).sum().to(device, torch.float32)
    summed = torch.stack([total.detach(), count])
    dist.all_reduce(summed)  # DIST: every rank's sum and count of response tokens
    return total * replicas / summed[1], summed[0] / summed[1]


@torch.no_grad()
def held_out_loss(model, rows, args, device, replicas: int) -> float:
    """The masked loss over all held-out pairs, each rank a share of them; ranks of FSDP2 must run the same
    number of forwards, so the rows are dealt round-robin and a rank short of one runs an all-ignored row."""
    model.eval()
    total, count = torch.zeros(2, device=device), 0
    mine = list(range(dist.get_rank() % replicas, len(rows), replicas))  # DIST: my share of the rows
    for start in range(0, -(-len(rows) // replicas), args.batch_size):
        batch = [rows[i] for i in mine[start:start + args.batch_size]]
        if not batch:  # a forward all the same: FSDP2's all_gathers need every rank
            x, y = rows[0][0][None], torch.full_like(rows[0][1][None], instructions.IGNORE)
        else:
            x, y = (torch.stack(t) for t in zip(*batch))
        logits = model(x.to(device))
        total += torch.stack([F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten(),
                                              ignore_index=instructions.IGNORE, reduction="sum"),
                              (y != instructions.IGNORE).sum().to(device, torch.float32)])
    dist.all_reduce(total)  # DIST: every rank's sum and count
    model.train()
    return (total[0] / total[1]).item()


@torch.no_grad()
def answer(model, prompt: str, args, device) -> str:
    """The model's answer to `prompt`: --answer-tokens bytes, each the most likely next byte, until END.
    Every rank runs the same forwards on the same tokens (FSDP2 gathers each block for all of them)."""
    tokens = encode(prompt).to(device)[None]
    for _ in range(args.answer_tokens):
        following = model(tokens[:, -args.seq_len:])[0, -1].argmax()
        if following.item() == END:
            break
        tokens = torch.cat([tokens, following.view(1, 1)], dim=1)
    return decode(tokens[0, len(prompt.encode()):].tolist())


def worker(info, args):
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
    train_rows, held_rows, described = instructions.load(args.seq_len)
    sizes = hf.sizes_of(args.model_dir)  # config.json's sizes: what to build

    with torch.device("meta"):  # DIST: shapes only, no memory: no rank builds the whole model
        model = GPT(**sizes)
    params = sum(p.numel() for p in model.parameters())
    if world_size > 1:
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",),  # DIST
                                backend_override=mesh_timeouts(("dp",), args.timeout))  # DIST: its group's --timeout
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)  # DIST: lesson 15's sharding, a block a unit
        fully_shard(model, mesh=mesh)  # DIST: the rest: embedding, final norm, head
    model.to_empty(device=device)  # DIST: memory for this rank's pieces only, not yet filled
    state = get_model_state_dict(model)  # DIST: {Llama's name: my shard (a DTensor)}, the file's names
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(args.model_dir)))  # DIST: my rows from the file
    set_model_state_dict(model, state)  # DIST: into the model's shards
    replicas = world_size  # FSDP2: every rank a replica of the data

    before = held_out_loss(model, held_rows, args, device, replicas)  # a forward under no_grad...
    if world_size > 1 and not args.skip_reshard:
        model.reshard()  # DIST: ...leaves the root's parameters gathered: shards back before the optimizer sees them
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    peak = memory.StepPeak(model, optimizer, device)  # step 3's bytes: held as it begins, most during it
    sampler = DistributedSampler(train_rows, num_replicas=replicas, rank=rank,  # DDP: a share per replica
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(train_rows, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    writer = SummaryWriter(args.run_dir / "tensorboard") if rank == 0 else None
    if rank == 0:
        rank_print(rank, f"{args.model_dir}: {params:,} parameters; {described}; held-out loss as loaded "
                         f"{before:.4f}")
    losses, step, epoch, start = [], 0, 0, time.perf_counter()
    while step < args.max_steps:
        sampler.set_epoch(epoch)  # a new shuffle each pass over the pairs, the same on every rank
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x)  # [rows, tokens, vocabulary]
            loss, reported = masked_loss(logits, y, replicas, device)  # DIST: over the global batch's responses
            optimizer.zero_grad()
            loss.backward()  # DIST: FSDP2's all_gathers, and reduce_scatters averaging over the replicas
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DIST: the norm over every rank's pieces
            optimizer.step()
            losses.append(reported)
            step += 1
            if writer:
                writer.add_scalar("train/loss", reported.item(), step)
            if step == args.max_steps:
                break
        epoch += 1
    seconds = time.perf_counter() - start
    after = held_out_loss(model, held_rows, args, device, replicas)
    question = held_rows.items[0][0]
    said = answer(model, question, args, device)

    out = args.run_dir / "hf"
    partial = out.with_name("hf.partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()  # DIST: an older partial directory gone before anyone writes
    writer_ = HuggingFaceStorageWriter(str(partial), save_distributed=True,  # DIST: each rank writes its shards,
                                       enable_consolidation=True)  # DIST: rank 0 joins them into whole tensors
    dcp.save(get_model_state_dict(model), storage_writer=writer_)  # DIST: every rank, its own rows
    rank_print(rank, f"{step} steps in {seconds:.1f} s; {peak}{fit.against(args.estimate, peak, rank)}")
    if rank == 0:  # one process finishes the directory: the shards' copies out, config.json, digests, in place
        shutil.rmtree(partial / "sharded")
        hf.finish(partial, out, sizes, args.seq_len)
        losses = torch.stack(losses).tolist() if losses else []
        writer.add_scalar("heldout/loss", after, step)
        writer.add_text("answer", f"{question}{said}".replace("\n", "  \n"), step)
        writer.close()
        write_json(args.run_dir / "metrics.json", {
            "lesson": "23_hf_finetuning", "model_dir": str(args.model_dir), "world_size": world_size,
            "backend": dist.get_backend(), "replicas": replicas, "parameters": params, "seq_len": args.seq_len,
            "batch_size": args.batch_size, "global_batch_rows": replicas * args.batch_size, "lr": args.lr,
            "steps": step, "train_seconds": seconds, "loss_per_step": losses, "heldout_loss_before": before,
            "heldout_loss": after, "question": question, "answer": said, "resharded": not args.skip_reshard,
            "memory": peak.result(), "memory_estimate": args.estimate, "output": str(out)})
        if losses:
            plot_curves(args.run_dir / "loss.png", {f"{world_size} ranks": (range(1, step + 1), losses)},
                        "step", "loss over the response tokens (nats)", f"fine-tuning {params:,} parameters")
        print(f"held-out loss {before:.4f} as loaded, {after:.4f} after {step} steps\n{question}{said}\n"
              f"fine-tuned model (Hugging Face format) in {out}", flush=True)
    dist.destroy_process_group()


def build_parser():
    p = cli.add_distributed(cli.parser(__doc__, "day5/23_hf_finetuning.py", data=False, nproc_default=2))
    p.add_argument("--model-dir", type=Path, default=None,
                   help="a Hugging Face model directory (config.json, *.safetensors) of a Llama-layout model "
                        "(default: $COURSE_MODEL_DIR, a model staged for the class, or lesson 22's "
                        "runs/22_gpt_pretraining/hf)")
    p.add_argument("--seq-len", type=cli.positive_int, default=192, help="tokens (bytes) per row: one pair a row")
    p.add_argument("--batch-size", type=cli.positive_int, default=8, help="rows (pairs) per rank")
    p.add_argument("--lr", type=cli.positive_float, default=1e-3, help="AdamW's learning rate")
    p.add_argument("--max-steps", type=cli.non_negative_int, default=200,
                   help="training steps (0: load and save only)")
    p.add_argument("--skip-reshard", action="store_true",
                   help="the pitfall: no model.reshard() after the no_grad evaluation, so the optimizer gets the "
                        "gathered root parameters and training drifts")
    p.add_argument("--answer-tokens", type=cli.non_negative_int, default=120,
                   help="bytes of the answer sampled at the end")
    p.add_argument("--seed", type=int, default=0, help="the seed of the shuffling")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: one GPU per rank when CUDA is available, else the CPU")
    p.add_argument("--quick", action="store_true", help="laptop mode: 30 steps, a 60-byte answer")
    return p


def check(args) -> None:
    """Bad input as one line, before any rank starts: the model directory, its digests, the sizes."""
    args.model_dir = args.model_dir or hf.default_model_dir()
    hf.sizes_of(args.model_dir)  # config.json there, a Llama the course's GPT can be, safetensors files
    hf.verify_digests(args.model_dir)  # what the course (or the trainer) wrote is what is there
    instructions.load(args.seq_len)  # the pairs fit the rows
    if args.quick:
        args.max_steps, args.answer_tokens = min(args.max_steps, 30), min(args.answer_tokens, 60)


def estimate(args) -> None:
    """Memory before the queue: rank 0's bytes, estimated by course/fit.py in the process that starts rank 0."""
    sizes = hf.sizes_of(args.model_dir)
    args.estimate = fit.for_lesson(args, sizes, sizes["vocab"], "fsdp", memory.world_size_of(args))


if __name__ == "__main__":
    cli.main(lambda args: (check(args), estimate(args), launch(worker, args)), build_parser())
