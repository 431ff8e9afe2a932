"""Lesson 22: pre-training a small GPT, offline: tokens, packed sequences, next-token loss, tokens/s and MFU.

    python day5/22_gpt_pretraining.py --nproc 2 --quick                   # FSDP2 over 2 ranks
    python day5/22_gpt_pretraining.py --nproc 4 --quick --layout fsdp-tp  # FSDP2 x TP, sequence parallel, 2 x 2
    srun --nodes=2 --ntasks-per-node=2 python day5/22_gpt_pretraining.py --layout fsdp-tp
    python day5/22_gpt_pretraining.py --nproc 2 --checkpoint-every 50 --resume if-any  # preemptible: stop, resume

Lesson 20's loop, on a language model instead of a ViT.  What changes:
- The data is text that every Python has, so nothing is downloaded (data_tools/text.py): by default Python's
  own documentation topics (`help()`'s texts: 79 documents, ~467 000 bytes), or --corpus python-stdlib (the
  standard library's sources, ~11 MB), or your files (--text-dir).  A token is a byte (a vocabulary of 256);
  byte 0 ends each document.  The documents are laid end to end and cut into rows of --seq-len + 1 tokens;
  a row's first --seq-len tokens are the input, its last --seq-len (shifted by one) the targets.  A DataLoader over a
  DistributedSampler hands each data-parallel replica its rows, as for images.
- The model (course/gpt.py, GPT) is decoder-only, laid out and named as Hugging Face's Llama: causal
  self-attention with rotary positions, a gated MLP, RMSNorm.  Its output is a score for every vocabulary
  entry at every position, and the loss is the cross-entropy of each position's next token, averaged over all
  the batch's tokens: every token is a training example.
- Two layouts, built on the meta device (no rank holds the whole model to train it; lesson 20):
  fsdp: `fully_shard` each decoder block, then the rest, over all ranks (lesson 15); every rank its own rows.
  fsdp-tp: a (dp, tp) mesh of rows of --inner ranks; in each row torchtitan's plan for Llama with sequence
  parallelism (lesson 19): the embedding's rows cut by vocabulary (RowwiseParallel) and its output cut along
  the tokens; the norms on a piece of the tokens (SequenceParallel); before attention and before the MLP one
  all_gather of the tokens (PrepareModuleInput), q, k, v and the MLP's gate and up cut by output
  (ColwiseParallel: whole heads per rank), o and down by input (RowwiseParallel) ending in a reduce_scatter
  back to a piece of the tokens; the head cut by vocabulary, its logits gathered whole.  FSDP2 shards all of it
  across the rows.  Every parameter is then on the (dp, tp) mesh and torch's clip_grad_norm_ works.
  On one process (--nproc 1) the model is built whole: the reference every layout must train alike.
- Throughput in tokens: tokens/s per rank (all tokens a step trained, over the step's time and the ranks) and
  MFU as torchtitan computes it: tokens/s per rank x FLOPs per token / the device's peak, where FLOPs per token
  = 6 x the parameters outside the embedding + 12 x depth x width x seq-len (attention's two matmuls, forward
  and backward, counted over the whole sequence, as if no position were masked: a causal kernel computes about
  half of it).  The peak is a GPU's datasheet bf16 number, on a CPU a matmul
  timed here (course/measuring/throughput.py, model_peak_flops; also for fp32 on a GPU, whose peak is not the
  datasheet's bf16 one): an MFU on the CPU is not comparable with a GPU's.
- The loss of each step, the held-out loss, tokens/s in TensorBoard (--run-dir/tensorboard); at the end the
  weights gathered whole (get_model_state_dict, as lesson 20 does), and rank 0 builds the model whole from them
  (the only time a rank does), writes them (model.pt, and hf/ in Hugging Face's format: config.json and
  model.safetensors, which `transformers` and lesson 23 load) and samples text
  from them: --prompt, continued by --sample-tokens bytes, each drawn from the model's next-token
  probabilities (with --temperature).
- Checkpoints and preemption (lessons 12 and 16, composed): SIGUSR1 (what `sbatch --signal=B:USR1@120` sends
  before the time limit, passed on by srun or the launcher) or SIGTERM (a preemption) only sets a flag; one
  all_reduce after every step, with the loss, tells every rank, and all stop after the same step.  Then a DCP
  checkpoint (every rank its own shards, lesson 16's published directories with every file's sha256) of the
  model, AdamW's moments, the schedule's step and the position in the text, and exit 0; --checkpoint-every
  saves one every so many steps as well, and at the end.  --resume goes on from the newest intact one, at any
  world size and either layout (DCP reshards): at the same ranks and layout the weights end bit for bit as
  without the stop.  A signal during the last step changes nothing: the run ends as usual, results written.
  slurm/22_gpt_pretraining.sh requeues the job when the signal came.
- Memory before the queue: before any rank starts, day 4's "will it fit?" (course/fit.py) runs this model's
  step, in this layout with this batch, on fake tensors (nothing allocated) and prints rank 0's bytes; the
  line with the measured step at the end gives the two side by side.
--batch-size is rows per data-parallel replica; the global batch is replicas x --batch-size rows of --seq-len
tokens.  AdamW with a linear warm-up (--warmup-steps) then a constant --lr; gradients clipped to norm 1.
Tags: `# DDP:` what makes training data-parallel; `# DIST:` any other torch.distributed line.
"""
import logging
import signal
import sys
import time
import warnings
from datetime import timedelta
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/
from course.launching.requires import require  # noqa: E402
require(__file__)  # before torch: a torch or package this lesson lacks is one line, not an ImportError

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.checkpoint import checkpoint
from torch.utils.tensorboard import SummaryWriter

from course.launching import cli
from course.launching.launch import backend_for, launch, mesh_timeouts, setup_device
from course.checkpoints import dcp as ckpt
from course.checkpoints import hf
from course import fit
from course.gpt import GPT, add_gpt_args, check_gpt_args, gpt_parts, gpt_sizes
from course.measuring import hardware, memory, parallel, throughput
from course.training.output import plot_curves, rank_print, save_weights, write_json
from course.training.precision import DTYPES
from course.training.sharded_init import init_shards
from data_tools import text

# fsdp-tp: the head's logits, gathered whole by its plan, are a view, which FSDP2 warns about once per rank; the
# loop makes new tensors from them (flatten, float), never writes into them: harmless here
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
# DTensor warns (once per mesh, on each rank) when it makes a tensor whole over both mesh dimensions with one
# collective per dimension (the gradient norm, the weights gathered at the end): expected here, cheap at this size
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

# What a checkpoint must agree on to be resumed: the model's sizes, and the run (the same rows in the same order,
# the same schedule); the layout and the world size may change (DCP reshards)
CHECKPOINT_KEYS = (("width", "depth", "heads", "hidden", "seq_len"),
                   ("corpus", "text_dir", "lr", "warmup_steps", "seed", "precision"))
stop_signal = None  # set by on_stop_signal, read after every step (lesson 12)


def on_stop_signal(signum, frame):
    global stop_signal
    stop_signal = signum  # only a flag: we may be inside a collective here; the loop stops after the step


signal.signal(signal.SIGUSR1, on_stop_signal)  # from the start: by default SIGUSR1 kills a rank still importing

BLOCK_PLAN = {  # DIST: torchtitan's tensor-parallel plan for a Llama block, with sequence parallelism
    "input_layernorm": SequenceParallel(),  # DIST: the norm on this rank's piece of the tokens
    # DIST: before attention, one all_gather of the tokens (q, k and v all read them)
    "self_attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),  # DIST: my heads' rows
    "self_attn.v_proj": ColwiseParallel(),  # DIST: and of v
    "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),  # DIST: partial sums -> reduce_scatter on tokens
    "post_attention_layernorm": SequenceParallel(),  # DIST: the second norm, on my piece of the tokens
    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),  # DIST: all_gather
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),  # DIST: my hidden features
    "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),  # DIST: partial sums -> reduce_scatter on tokens
}
OUTER_PLAN = {  # DIST: the embedding, the final norm and the head
    "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),  # DIST: vocab rows
    "model.norm": SequenceParallel(),  # DIST: the final norm, on my piece of the tokens
    "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),  # DIST: vocab cut, logits whole
}


def flops_per_token(model_params: int, embedding_params: int, args) -> int:
    """torchtitan's count: 6 FLOPs per parameter and token outside the embedding (2 forward, 4 backward), and
    attention's scores and weighted sum, 2 matmuls x 6 per head feature and position of the sequence."""
    return 6 * (model_params - embedding_params) + 12 * args.depth * args.width * args.seq_len


@torch.no_grad()
def held_out_loss(model, rows, args, device) -> float:
    """The mean next-token loss over the first --eval-rows held-out rows, on every rank the same rows: the
    ranks of a tensor-parallel row must run the same forward, and FSDP2's ranks the same number of them."""
    model.eval()
    total, count = torch.zeros((), device=device), 0
    end = min(len(rows), args.eval_rows)
    for start in range(0, end, args.batch_size):
        batch = [rows[i] for i in range(start, min(start + args.batch_size, end))]
        x, y = (torch.stack(t).to(device) for t in zip(*batch))
        logits = model(x)
        total += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
        count += y.numel()
    model.train()
    return (total / count).item()


@torch.no_grad()
def sample(model, args, device) -> str:
    """--sample-tokens bytes after --prompt, each drawn from the softmax of the last position's logits / the
    temperature, with a generator seeded by --seed: the same text every run of the same weights."""
    tokens = text.encode(args.prompt).to(device)[None]
    generator = torch.Generator(device=device).manual_seed(args.seed)
    for _ in range(args.sample_tokens):
        logits = model(tokens[:, -args.seq_len:])[0, -1].float()
        probs = torch.softmax(logits / args.temperature, dim=-1)
        tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)[None]], dim=1)
    return text.decode(tokens[0].tolist())


def worker(info, args):
    rank, world_size = info.rank, info.world_size
    device = setup_device(args.device, info.local_rank)
    dist.init_process_group(backend_for(device, args.backend), rank=rank, world_size=world_size,  # DIST: join
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)  # DIST: NCCL connects on this GPU now
    signal.signal(signal.SIGTERM, on_stop_signal)  # after init: until here SIGTERM simply ends the process
    train_rows, held_rows, corpus = text.load(args.corpus, args.text_dir, args.seq_len)

    inner, mesh_nodes = (args.inner if args.layout == "fsdp-tp" and world_size > 1 else 1), None
    with torch.device("meta"):  # DIST: shapes only, no memory: no rank builds the whole model to train it
        model = GPT(**gpt_sizes(args))
    params = sum(p.numel() for p in model.parameters())  # the whole model's, counted before it is cut
    embedding = model.model.embed_tokens.weight.numel()
    if world_size == 1:  # the reference: one process, the model whole
        replicas, replica = 1, 0
    elif args.layout == "fsdp":
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",),  # DIST
                                backend_override=mesh_timeouts(("dp",), args.timeout))  # DIST: its group's --timeout
        replicas, replica = world_size, rank
    else:  # DIST: fsdp-tp: TP with sequence parallelism inside a row, FSDP2 across the rows
        mesh = init_device_mesh(device.type, (world_size // inner, inner), mesh_dim_names=("dp", "tp"),  # DIST
                                backend_override=mesh_timeouts(("dp", "tp"), args.timeout))
        mesh_nodes = parallel.mesh_hosts(rank, mesh)  # DIST: every rank's node: is each row inside one?
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], BLOCK_PLAN)  # DIST: each block cut inside the row
        parallelize_module(model, mesh["tp"], OUTER_PLAN)  # DIST: embedding, final norm, head
        replicas, replica = mesh["dp"].size(), mesh["dp"].get_local_rank()
    for layer in model.model.layers:
        if args.checkpoint_activations:  # lesson 14: each block keeps its input; backward runs its forward again
            layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)
        if args.compile:  # lesson 13: each block compiled alone (torchtitan's way), on its first forward
            layer.compile()
    if world_size > 1:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])  # DIST: lesson 15's sharding, a block a unit
        fully_shard(model, mesh=mesh["dp"])  # DIST: the rest: embedding, final norm, head
    model.to_empty(device=device)  # DIST: memory for this rank's pieces only, not yet initialized
    init_shards(model, gpt_parts(**gpt_sizes(args)), args.seed)  # DIST: the whole model's weights at --seed, my pieces
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
    dtype = DTYPES[args.precision]
    peak = memory.StepPeak(model, optimizer, device)  # step 3's bytes: held as it begins, most during it
    peak_flops, peak_from = throughput.model_peak_flops(device, dtype)
    per_token = flops_per_token(params, embedding, args)
    position = {"step": 0, "epoch": 0, "batches_done": 0, "losses": []}
    chosen = ckpt.newest_intact(args.checkpoint_dir, args.resume, rank, world_size, device)  # lesson 16's choice
    if chosen[0] is not None:
        saved = dict(chosen[2])[chosen[0]]  # its complete.json: the settings and the position
        model_sd, optim_sd = get_state_dict(model, optimizer)  # DIST: this rank's pieces, keyed by name
        dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=chosen[0])  # DIST: its rows, any layout
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)  # DIST: in place
        scheduler.load_state_dict(saved["scheduler"])  # the warm-up's step: the same learning rate next step
        position = {k: saved[k] for k in position}
        rank_print(rank, f"resumed from {chosen[0]} (saved by {saved['world_size']} ranks): step {saved['step']}")
    saves = ckpt.Saves(rank, args.keep, chosen)

    def save_checkpoint(epoch, batches_done):  # DIST: lesson 16's: every rank its own shards at once, rank 0 publishes
        saves.begin()
        model_sd, optim_sd = get_state_dict(model, optimizer)  # DIST: this rank's pieces, keyed by name
        tmp = ckpt.temporary(args.checkpoint_dir, step, chosen[1])
        info = {**ckpt.settings(args, world_size, CHECKPOINT_KEYS, replicas), "step": step, "epoch": epoch,
                "batches_done": batches_done, "scheduler": scheduler.state_dict(),
                "losses": position["losses"] + torch.stack(losses).tolist() if losses else position["losses"]}
        saves.started(dcp.save({"model": model_sd, "optimizer": optim_sd}, storage_writer=ckpt.Writer(tmp)), tmp, info)

    sampler = DistributedSampler(train_rows, num_replicas=replicas, rank=replica,  # DDP: a share per replica
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(train_rows, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    writer = SummaryWriter(args.run_dir / "tensorboard") if rank == 0 else None
    if rank == 0:
        rank_print(rank, f"{corpus}; {len(train_rows)} training rows of {args.seq_len} tokens; {params:,} parameters")
    global_tokens = replicas * args.batch_size * args.seq_len  # every replica a batch of rows
    first, epoch, done = position["step"], position["epoch"], position["batches_done"]
    losses, step_seconds, step, stopped, start = [], 0.0, first, False, time.perf_counter()
    while step < args.max_steps and not stopped:
        sampler.set_epoch(epoch)  # a new shuffle each pass over the text, the same on every rank
        for i, (x, y) in enumerate(loader):
            if i < done:  # resumed mid-pass: the same shuffle, less the batches already trained on
                continue
            begun = hardware.clock(device)
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(x)  # [rows, tokens, vocabulary]
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())  # every position's next token
            optimizer.zero_grad()
            loss.backward()  # DIST: FSDP2's all_gathers and reduce_scatters (and TP's, in a row)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DIST: the norm over every rank's pieces
            optimizer.step()
            scheduler.step()
            step_seconds += (hardware.clock(device) - begun) if step > first else 0.0  # a run's first step: untimed
            status = torch.stack([loss.detach(), torch.tensor(float(stop_signal is not None), device=device)])
            dist.all_reduce(status)  # DIST: one all_reduce a step: the losses and the stop requests, summed
            reported = status[0] / world_size  # the global batch's loss (a row's ranks agree)
            losses.append(reported)
            step += 1
            if writer:
                writer.add_scalar("train/loss", reported.item(), step)
                whole = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor when sharded
                writer.add_scalar("train/grad_norm", whole.item(), step)
            stopped = status[1].item() > 0 and step < args.max_steps  # DIST: a rank was asked: all stop here
            end = stopped or step == args.max_steps
            if stopped or (args.checkpoint_every and (end or step % args.checkpoint_every == 0)):
                save_checkpoint(epoch + (i + 1 == len(loader)), (i + 1) % len(loader))  # the position after this batch
            if end:
                break
        epoch, done = epoch + 1, 0
    saves.wait()  # DIST: rank 0 publishes the last checkpoint once every rank has written its part
    if stopped:  # a stopped run writes no results, only its checkpoint
        rank_print(rank, f"stopped after step {step} by a stop signal (SIGUSR1 or SIGTERM): checkpoint in "
                         f"{args.checkpoint_dir}; the same command with --resume goes on from it")
        dist.destroy_process_group()
        return
    seconds = time.perf_counter() - start
    held = held_out_loss(model, held_rows, args, device)
    timed_steps = max(step - first - 1, 1)
    tokens_per_second = global_tokens * (step - first - 1) / step_seconds / world_size if step > first + 1 else 0.0
    mfu = tokens_per_second * per_token / peak_flops
    losses = position["losses"] + (torch.stack(losses).tolist() if losses else [])
    rank_print(rank, f"{step - first} steps in {seconds:.1f} s; {peak}{fit.against(args.estimate, peak, rank)}")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # DIST
    if rank == 0:  # DIST: one process writes the outputs and samples from the whole model
        whole = GPT(**gpt_sizes(args))
        whole.load_state_dict(full)
        sampled = sample(whole.to(device), args, device)
        writer.add_scalar("train/tokens_per_second_per_rank", tokens_per_second, step)
        writer.add_scalar("heldout/loss", held, step)
        writer.add_text("sample", sampled.replace("\n", "  \n"), step)
        writer.close()
        run = args.run_dir
        write_json(run / "metrics.json", {
            "lesson": "22_gpt_pretraining", "layout": args.layout if world_size > 1 else "one process",
            "corpus": corpus, "world_size": world_size, "backend": dist.get_backend(), "inner": inner,
            "replicas": replicas, "mesh": mesh_nodes, "precision": args.precision, "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "global_batch_rows": replicas * args.batch_size, "tokens_per_step": global_tokens, "lr": args.lr,
            "parameters": params, "embedding_parameters": embedding, "flops_per_token": per_token,
            "steps": step, "train_seconds": seconds, "step_seconds": step_seconds / timed_steps,
            "tokens_per_second_per_rank": tokens_per_second, "peak_flops": peak_flops, "peak_flops_from": peak_from,
            "mfu": mfu, "loss_per_step": losses, "heldout_loss": held, "sample": sampled, "memory": peak.result(),
            "memory_estimate": args.estimate})
        save_weights(run / "model.pt", full)
        hf.save_whole(run / "hf", full, gpt_sizes(args), args.seq_len)  # Hugging Face's format: lesson 23 reads it
        plot_curves(run / "loss.png", {f"{args.layout if world_size > 1 else 'one process'}, {world_size} ranks":
                                       (range(1, step + 1), losses)},
                    "step", "next-token loss (nats)", f"GPT, {params:,} parameters, {global_tokens} tokens a step")
        print(f"held-out loss {held:.4f} nats per byte after {step} steps ({step * global_tokens:,} tokens); "
              f"{tokens_per_second:,.0f} tokens/s per rank, MFU {mfu:.4f} (peak: {peak_from})\n"
              f"sample: {sampled!r}\noutputs in {run}", flush=True)
    dist.destroy_process_group()


def build_parser():
    p = cli.add_distributed(cli.parser(__doc__, "day5/22_gpt_pretraining.py", data=False, nproc_default=2))
    p.add_argument("--corpus", default="python-docs", choices=text.CORPORA,
                   help="python-docs: Python's documentation topics; python-stdlib: the standard library's sources")
    p.add_argument("--text-dir", type=Path, default=None,
                   help="train on your own *.txt, *.md and *.rst files under this directory instead")
    p.add_argument("--layout", default="fsdp", choices=("fsdp", "fsdp-tp"),
                   help="fsdp: FSDP2 over all ranks; fsdp-tp: TP with sequence parallelism in each row of --inner "
                        "ranks, FSDP2 across the rows (one process: the model whole, either way)")
    p.add_argument("--inner", type=cli.positive_int, default=2, help="fsdp-tp: ranks per row (tensor parallel)")
    p.add_argument("--batch-size", type=cli.positive_int, default=16, help="rows per data-parallel replica")
    p.add_argument("--lr", type=cli.positive_float, default=3e-3, help="AdamW's learning rate after the warm-up")
    p.add_argument("--warmup-steps", type=cli.non_negative_int, default=20, help="steps of linear warm-up")
    p.add_argument("--max-steps", type=cli.positive_int, default=300, help="training steps")
    p.add_argument("--precision", default="fp32", choices=("bf16", "fp32"), help="the dtype of autocast's matmuls")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each block's activations in backward (lesson 14) instead of keeping them")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (lesson 13)")
    p.add_argument("--eval-rows", type=cli.positive_int, default=256, help="held-out rows for the held-out loss")
    p.add_argument("--prompt", default="The ", help="the text the sample at the end continues")
    p.add_argument("--sample-tokens", type=cli.non_negative_int, default=200, help="bytes to sample at the end")
    p.add_argument("--temperature", type=cli.positive_float, default=0.8, help="below 1: likelier bytes, more often")
    p.add_argument("--seed", type=int, default=0, help="one seed for weights, shuffling and sampling")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: one GPU per rank when CUDA is available, else the CPU")
    p.add_argument("--quick", action="store_true", help="laptop mode: 40 steps, a 60-byte sample")
    return ckpt.add_args(add_gpt_args(p), every=None, extras=False)  # lesson 16's --checkpoint-every, --resume


def check(args) -> None:
    """Bad sizes as one line, before any rank starts."""
    check_gpt_args(args)
    if not args.prompt:
        raise cli.CourseError("--prompt is empty: the sample at the end continues a text; give at least one character")
    text.load(args.corpus, args.text_dir, args.seq_len)  # the text is there, and long enough for one row
    if args.quick:
        args.max_steps, args.sample_tokens = min(args.max_steps, 40), min(args.sample_tokens, 60)
    world = memory.world_size_of(args)
    if world > 1 and world % args.inner:
        raise cli.CourseError(f"--inner {args.inner} does not divide the {world} ranks into rows of a mesh; use a "
                              f"divisor of {world}")
    if args.layout == "fsdp-tp" and world > 1:
        for what, n in (("--heads", args.heads), ("--hidden", args.hidden), ("--seq-len", args.seq_len),
                        ("the vocabulary", text.VOCAB)):
            if n % args.inner:
                raise cli.CourseError(f"{what} ({n}) does not divide among the --inner {args.inner} tensor-parallel "
                                      f"ranks of a row; choose sizes that {args.inner} divides, or another --inner")
    replicas = world // args.inner if args.layout == "fsdp-tp" and world > 1 else world
    ckpt.check(args, world, CHECKPOINT_KEYS, replicas)  # --resume: a complete checkpoint of this model and run


def estimate(args) -> None:
    """Memory before the queue: rank 0's bytes, estimated by course/fit.py in the process that starts rank 0."""
    world = memory.world_size_of(args)
    args.estimate = fit.for_lesson(args, gpt_sizes(args), text.VOCAB, args.layout, world,
                                   args.inner if args.layout == "fsdp-tp" else 1)


if __name__ == "__main__":
    cli.main(lambda args: (check(args), estimate(args), launch(worker, args)), build_parser())
