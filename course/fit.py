r"""Will it fit?  Memory per rank of a model under each way of splitting it, estimated in one CPU process that
allocates nothing, and the layout to choose on a cluster of a given shape.

    python -m course.fit --model vit --width 32 --depth 4 --heads 4 --gpus-per-node 2 --nodes 2 --gpu-memory 1
    python -m course.fit --model gpt --layers 32 --width 4096 --heads 32 --hidden 14336 --vocab 128256 \
        --seq 4096 --global-batch 64 --gpus-per-node 8 --nodes 8 --gpu-memory 80 --optimizer adamw --precision bf16
    python -m course.fit --model gpt --layers 4 --width 256 --heads 8 --vocab 1000 --seq 128 --layout fsdp tp

How: the real model's training step runs, two or three times, as one rank of the whole cluster would run it,
with no memory behind any tensor and no other rank:
- torch's FakeTensorMode (torch._subclasses.fake_tensor) makes every tensor a "fake" one: shape, dtype and
  strides, no data; every operator computes only its output's shape;
- torch's "fake" process group (torch.testing._internal.distributed.fake_pg, `init_process_group("fake",
  store=FakeStore(), rank=0, world_size=W)`) is rank 0 of W ranks whose collectives return at once: DDP,
  fully_shard, parallelize_module and init_device_mesh run as they do on a cluster, on W ranks' shapes;
- the lessons' own tracker measures a step (course/measuring/memory.py's StepPeak and LiveTensors, the same
  code that measures lessons 13, 15 and 19-23; the second step, the third under DDP: MEASURED_STEP): the
  bytes held when the step begins (parameters, gradients, optimizer state, the batch, DDP's buckets) and the
  most held above that during it (activations, gathered parameters, gradients before their reduce_scatter,
  temporaries).  A fake tensor's storage has its
  real size in bytes, so the counts are the bytes a real run's tensors would have.
Each layout is set up as its lesson sets it up: DDP as lesson 13, FSDP2 as lesson 15 (each block, then the
root), TP as lesson 19 (its plan on every block: tensor_parallel_plan below), FSDP2 x TP and HSDP as
lesson 20, sequence parallelism (tp-sp) with the block plan of lessons 19 and 20's --sequence-parallel
(`sequence_parallel_plan` below; the ViT's tokens gathered again before the final norm, which the lessons
keep cut).  The GPT (--model gpt) is day 5's (course/gpt.py, laid out as Hugging Face's Llama); its
tensor-parallel plans are lesson 22's (`gpt_plans`: tp-sp is lesson 22's fsdp-tp where there are several
data-parallel rows, tp the same cut without sequence parallelism), its pipeline stages cut as lesson 21 cuts
the ViT.  Day 5's lessons call `for_lesson` before any rank starts and print its estimate beside the memory
they measure.
Pipelines: the fake process group's send and recv carry nothing, so each PipelineStage is given the shapes
it receives and sends (torch 2.14.1 then skips the exchange of shapes between stages, which a fake group
cannot carry), and torch's own schedule (GPipe or 1F1B) runs on the first stage (which holds the most
micro-batches) and on the last (which holds the output layer), each as its own fake rank; the larger counts.
Two places where a fake run would differ from a real one are made to behave as on a cluster: the Meta
kernel of `_c10d_functional.wait_tensor` returns a new tensor where the real one returns its input (TP's
all_reduces; `_WaitReturnsItsInput`), and the fake group's point-to-point works hold no tensors where gloo's
and NCCL's hold them until dropped (`_works_hold_their_tensors`).  With both, the estimates equal the lessons'
measurements of the same step to the byte, but for the lessons' loader's labels and lesson 23's masked loss
(its count of response tokens, 4 bytes; tests/test_fit.py).
What is not counted: the CUDA context (hundreds of MB per GPU), NCCL's buffers, the caching allocator's
fragmentation and slack, cuBLAS workspaces, and anything that is not a tensor.  --headroom keeps that much of
each GPU free (default 10%).
"""
import argparse
import contextlib
import datetime
import json
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# DTensor warns when it makes a tensor whole over two mesh dimensions with one collective each (the gradient
# norm of FSDP2 x TP, as lesson 20 says): expected, and nothing is sent here
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

from course.launching.cli import CourseError, Parser, non_negative_float, positive_int
from course.measuring.memory import MB

GiB = 2 ** 30
LAYOUTS = ("ddp", "fsdp", "hsdp", "tp", "tp-sp", "pp")
WHAT = {"ddp": "DDP: a whole replica on every rank (lesson 13)",
        "fsdp": "FSDP2 over all ranks (lesson 15)",
        "hsdp": "HSDP: FSDP2 inside a node, replicas across nodes (lesson 20)",
        "tp": "TP inside a node (lesson 19), FSDP2 across the TP groups (lesson 20)",
        "tp-sp": "TP with sequence parallelism inside a node, FSDP2 across",
        "pp": "a pipeline of stages across nodes (lesson 21), each stage FSDP2-sharded over its data-parallel ranks"}
PREFERENCE = ("ddp", "hsdp", "fsdp", "tp", "tp-sp", "pp")  # fewest and cheapest collectives first

FAKE_TIMEOUT = datetime.timedelta(minutes=5)  # the fake group's collectives return at once: nothing waits


@dataclass(frozen=True)
class Spec:
    """The model, the batch and the training recipe."""
    model: str = "vit"  # "vit" (course/models.py) or "gpt" (course/gpt.py)
    width: int = 64
    depth: int = 4
    heads: int = 4
    patch: int = 7  # vit
    vocab: int = 0  # gpt
    seq: int = 0  # gpt
    hidden: int = 0  # gpt: the MLP's hidden features
    optimizer: str = "sgd"  # "sgd" (momentum, the lessons') or "adamw"
    precision: str = "fp32"  # "bf16": compute in bf16 (FSDP2's MixedPrecisionPolicy, else autocast); fp32 weights
    autocast: bool = False  # bf16 through autocast alone, under FSDP2 too (day 5's lessons): parameters stay fp32
    checkpointed: bool = False  # every block's activations recomputed in backward (lesson 14's checkpointing)


@dataclass(frozen=True)
class Layout:
    """How the W = nodes x gpus_per_node ranks split the work: dp data-parallel replicas (or shards), tp ranks
    per TP group, pp pipeline stages; batch: samples per data-parallel replica and step."""
    name: str
    world: int
    batch: int
    tp: int = 1
    pp: int = 1
    inner: int = 1  # hsdp: ranks that shard (one node)
    shard_one_row: bool = False  # tp, tp-sp: FSDP2 over the dp dimension even when it is 1 (lesson 22's fsdp-tp)
    microbatches: int = 1
    schedule: str = "1f1b"

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)


# ------------------------------------------------------------------------------------------------- the models

def _block_class():
    from course.models import Block

    class SeqBlock(Block):
        """course/models.py's Block with the same parameters and computation, its sizes taken from qkv's output
        (so that its input may be a rank's piece of the sequence: sequence parallelism), causal if `causal`."""
        causal = False

        def forward(self, x):
            qkv = self.qkv(self.norm1(x))
            b, t = qkv.shape[:2]
            q, k, v = qkv.view(b, t, -1, 3, self.head_width).permute(3, 0, 2, 1, 4)
            attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
            x = x + self.proj(attended.transpose(1, 2).reshape(b, t, -1))
            return x + self.mlp(self.norm2(x))

    return SeqBlock


def build(spec: Spec) -> nn.Module:
    from course.gpt import GPT
    from course.models import ViT

    if spec.model == "gpt":
        return GPT(vocab=spec.vocab, width=spec.width, depth=spec.depth, heads=spec.heads, hidden=spec.hidden)
    return ViT(spec.patch, spec.width, spec.depth, spec.heads)


def blocks_of(model: nn.Module) -> list:
    """The model's transformer blocks: the ViT's (or a pipeline stage's) `blocks`, the GPT's `model.layers`."""
    blocks = model.blocks if hasattr(model, "blocks") else model.model.layers
    return list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)


def llama_hidden(width: int) -> int:
    """The GPT's default MLP width: Llama's 8/3 x width, rounded up to a multiple of 4 (172 at width 64: course/gpt.py's
    default)."""
    return -(-2 * width // 3) * 4


def parameter_count(spec: Spec) -> int:
    """The parameters, counted from the shapes (the meta device: no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build(spec).parameters())


def batch_of(spec: Spec, n: int):
    """A batch of n samples as the training step gets it: images and labels, or tokens and next tokens."""
    if spec.model == "gpt":
        return torch.randint(0, spec.vocab, (n, spec.seq)), torch.randint(0, spec.vocab, (n, spec.seq))
    return torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))


def loss_of(logits, y):
    return nn.functional.cross_entropy(logits.float().flatten(0, -2), y.flatten())


# ---------------------------------------------------------------------------------------- the layouts' plans

def tensor_parallel_plan() -> dict:
    """The plan lesson 19 (day4/19_tensor_parallel.py) writes in its worker and lesson 20 reuses, for one
    Block: Megatron-LM's pairs, qkv and mlp.0 column-wise (Shard(0): whole heads for qkv), proj and mlp.2
    row-wise (their output a partial sum, all_reduced).  Kept in step with the lesson by hand."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}


def gpt_plans(sequence: bool) -> tuple:
    """(the plan of a GPT block, the plan of the rest) as lesson 22 (day5/22_gpt_pretraining.py) writes them
    (BLOCK_PLAN and OUTER_PLAN: torchtitan's for a Llama block) with sequence parallelism (`sequence`: tp-sp,
    lesson 22's fsdp-tp); without it, the same cut with the activations whole between the TP layers.  Kept in
    step with the lesson by hand: tests/test_fit.py compares the bytes lesson 22 measures with the
    sequence-parallel pair's (the pair without it has no lesson to be compared with)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    cut = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
           "self_attn.v_proj": ColwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
           "mlp.up_proj": ColwiseParallel()}
    if not sequence:
        return ({**cut, "self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()},
                {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                 "lm_head": ColwiseParallel(output_layouts=Replicate())})
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return ({**cut, "input_layernorm": SequenceParallel(), "self_attn": gather,
             "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)), "post_attention_layernorm": SequenceParallel(),
             "mlp": gather, "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))},
            {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
             "model.norm": SequenceParallel(),
             "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})


def sequence_parallel_plan() -> dict:
    """lesson 19's plan (tensor_parallel_plan above) with sequence parallelism: between the TP
    layers the activations stay cut along the sequence (dim 1), so the layer norms and the residual stream
    hold 1/T of them; the column-wise layers all_gather their input's sequence, the row-wise ones
    reduce_scatter their output onto it (the same bytes as lesson 19's all_reduce)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {"norm1": SequenceParallel(), "qkv": ColwiseParallel(input_layouts=Shard(1)),
            "proj": RowwiseParallel(output_layouts=Shard(1)), "norm2": SequenceParallel(),
            "mlp.0": ColwiseParallel(input_layouts=Shard(1)), "mlp.2": RowwiseParallel(output_layouts=Shard(1))}


def _ddp(model, world: int):
    """lesson 13's DDP, made to run on fake tensors: its check that every rank has the same parameter shapes
    reads their data (none here: skipped, all ranks build the same model), its default hook's all_reduce is
    replaced by the same in-place division without a result to wait for (the fake group's work carries none),
    and its buckets are not rebuilt in step 2 (the same buckets, rebuilt in another order: a real rank frees
    the old ones first).  Its gradient buckets, one flat copy of the gradients, are the reducer's own."""
    import torch.nn.parallel.distributed as ddp_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    check, ddp_module._verify_param_shape_across_processes = ddp_module._verify_param_shape_across_processes, \
        lambda *a, **k: None
    try:
        model = DDP(model)
    finally:
        ddp_module._verify_param_shape_across_processes = check

    def averaged(state, bucket):
        done = torch.futures.Future()
        done.set_result(bucket.buffer().div_(world))
        return done

    model.register_comm_hook(None, averaged)

    class Reducer:  # the C++ reducer, all but _rebuild_buckets
        def __init__(self, reducer):
            self._reducer = reducer

        def __getattr__(self, name):
            return getattr(self._reducer, name)

        def _rebuild_buckets(self):
            return False

    model.reducer = Reducer(model.reducer)
    return model


def _parallelize(model, spec: Spec, layout: Layout):
    """The model of one rank, split as the layout's lesson splits it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    dtype = torch.bfloat16 if spec.precision == "bf16" and not spec.autocast else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if layout.name == "one":  # one process: the model whole, nothing wrapped
        return model
    if layout.name == "fsdp":  # lesson 15: all ranks in a row
        shard_on = init_device_mesh("cpu", (layout.world,))
    elif layout.name == "hsdp":  # lesson 20's hsdp: replicas across the rows, shards inside one (a node)
        shard_on = init_device_mesh("cpu", (layout.world // layout.inner, layout.inner),
                                    mesh_dim_names=("replicate", "shard"))
    else:  # lesson 19 (dp 1) and lesson 20's fsdp-tp: TP inside a row (a node), FSDP2 across the rows
        mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
        shard_on, tp_mesh = (mesh["dp"] if layout.dp > 1 or layout.shard_one_row else None), mesh["tp"]
    if layout.name in ("tp", "tp-sp") and spec.model == "gpt":  # lesson 22's plans
        block_plan, outer_plan = gpt_plans(layout.name == "tp-sp")
        for block in blocks_of(model):
            parallelize_module(block, tp_mesh, block_plan)
        parallelize_module(model, tp_mesh, outer_plan)
    elif layout.name in ("tp", "tp-sp"):
        sequence = layout.name == "tp-sp"
        block_class = _block_class()
        for block in model.blocks:
            if sequence and type(block) is not block_class:
                block.__class__ = block_class  # the ViT's Block: the same computation, sizes from qkv's output
            parallelize_module(block, tp_mesh, sequence_parallel_plan() if sequence else tensor_parallel_plan())
        if sequence:  # the residual stream cut along the sequence from the first block to the final norm
            parallelize_module(model, tp_mesh, {
                "blocks.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                               use_local_output=True),
                "norm": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                           use_local_output=True)})
    if shard_on is not None:
        for block in blocks_of(model):
            fully_shard(block, mesh=shard_on, mp_policy=policy)
        fully_shard(model, mesh=shard_on, mp_policy=policy)
    return model


# ------------------------------------------------------------------------------------------ one fake run

def _optimizer(spec: Spec, params):
    if spec.optimizer == "adamw":
        # fused: one kernel updating the state in place; foreach, the default on GPUs, also makes a temporary
        # square root of the second moments (torch/optim/adam.py, _multi_tensor_adam), one more copy of the
        # state for the length of optimizer.step(); on fake DTensors its sharding propagation also takes minutes
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _pipeline_stage(spec: Spec, layout: Layout, stage: int) -> nn.Module:
    """Stage `stage` of `layout.pp` (course/models.py's pipeline_plan for the ViT: consecutive blocks, the first
    also the embedding, the last also the norm and the head; the GPT cut the same way)."""
    from course.models import Stage, pipeline_plan

    model = build(spec)
    plan = pipeline_plan(spec.depth, layout.pp)[stage]
    if spec.model == "vit":
        return Stage({name: model.get_submodule(name) if name != "position" else model.position for name in plan})

    class GPTStage(nn.Module):  # course/gpt.py's GPT, cut as lesson 21 cuts the ViT
        def __init__(self):
            super().__init__()
            self.first, self.last = stage == 0, stage == layout.pp - 1
            if self.first:
                self.embed_tokens = model.model.embed_tokens
            self.blocks = nn.ModuleList(model.model.layers[int(n.split(".")[1])] for n in plan
                                        if n.startswith("blocks."))
            if self.last:
                self.norm, self.lm_head = model.model.norm, model.lm_head

        def forward(self, x):
            if self.first:
                x = self.embed_tokens(x)
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.norm(x)) if self.last else x

    return GPTStage()


class _WaitReturnsItsInput(TorchDispatchMode):
    """`_c10d_functional.wait_tensor` returns the tensor it waits for (the real kernel); under FakeTensorMode its
    Meta kernel returns a new one (torch/distributed/_functional_collectives.py, `_wait_tensor_meta`:
    `torch.empty_like(self)`), which would count every all_reduce of TP's activations twice for a moment.
    Entered above FakeTensorMode, below the tracker."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return args[0]
        return func(*args, **(kwargs or {}))


# The step measured: the lessons measure their third (StepPeak's default), the first like every later one under
# DDP, which allocates its gradient buckets anew in the second step's forward.  Without DDP the second step is
# already like every later one (the first makes the optimizer's state, FSDP2's lazy initialization, the
# pipeline's buffers): measured here to save a third of the time, and equal to the third (tests/test_fit.py).
MEASURED_STEP = {True: 3, False: 2}


def _checkpointed(model: nn.Module, spec: Spec) -> nn.Module:
    """Lesson 14's activation checkpointing on every block, as day 5's lessons wrap it (--checkpoint-activations)."""
    if spec.checkpointed:
        from functools import partial

        from torch.utils.checkpoint import checkpoint

        for block in blocks_of(model):
            block.forward = partial(checkpoint, block.forward, use_reentrant=False)
    return model


def _run(spec: Spec, layout: Layout) -> dict:
    """One fake rank (rank 0): training steps as the layout's lesson runs them, the last measured by
    course/measuring/memory.py's StepPeak.  The lessons' gradient clip is left out: it runs after the backward
    pass has freed the activations and adds a few scalars, and on fake DTensors it takes a tenth of the time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from course.measuring import memory

    cpu = torch.device("cpu")
    if layout.name != "ddp":  # split on the meta device, as lesson 15 does: shapes, no memory
        with torch.device("meta"):
            model = build(spec)
        _checkpointed(model, spec)
        model = _parallelize(model, spec, layout)
    with FakeTensorMode(allow_non_fake_inputs=True), _WaitReturnsItsInput():  # meta parameters become fake ones
        model = _ddp(_checkpointed(build(spec), spec), layout.world) if layout.name == "ddp" else \
            model.to_empty(device=cpu)
        optimizer = _optimizer(spec, model.parameters())
        peak = memory.StepPeak(model, optimizer, cpu, at=MEASURED_STEP[layout.name == "ddp"])
        autocast = spec.precision == "bf16" and (spec.autocast or layout.name in ("ddp", "one") or
                                                 layout.name in ("tp", "tp-sp") and layout.dp == 1)
        for _ in range(peak.at):
            x, y = batch_of(spec, layout.batch)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(x)
                loss = loss_of(logits, y)
            if spec.model == "vit":  # the ViT lessons: F.cross_entropy(model(x), y), the logits freed with it;
                del logits  # day 5's keep `logits` to the step's end (as `outputs.logits` in Hugging Face's loops)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        result = peak.result()
        result.update(memory.held(model, optimizer))
    return result


class _HoldingWork:
    """A fake send's or receive's work, holding its tensors until it is dropped, as gloo's and NCCL's works do
    (the fake group's hold none: a stage's output would be freed a micro-batch earlier than on a cluster)."""

    def __init__(self, work, tensors):
        self._work, self._tensors = work, tensors

    def wait(self, *args, **kwargs):
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def _works_hold_their_tensors():
    from torch.distributed.pipelining import schedules

    batch_p2p = schedules._batch_p2p

    def holding(p2p_ops, desc=None):
        return [_HoldingWork(w, [op.tensor for op in p2p_ops]) for w in batch_p2p(p2p_ops, desc)]

    schedules._batch_p2p = holding
    try:
        yield
    finally:
        schedules._batch_p2p = batch_p2p


def _run_pipeline(spec: Spec, layout: Layout, stage: int) -> dict:
    """One fake rank of pipeline stage `stage`: torch's own schedule (lesson 21) on a fake process group.  The
    fake group's send and recv do nothing, so each PipelineStage is given its input's and output's shapes
    (torch 2.14.1 then skips its shape inference, which would need the neighbours' messages); stages are
    FSDP2-sharded over the data-parallel ranks when there are several (as torchtitan composes them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from course.measuring import memory

    cpu = torch.device("cpu")
    mesh = init_device_mesh("cpu", (layout.pp, layout.dp), mesh_dim_names=("pp", "dp"))
    with torch.device("meta"):
        module = _pipeline_stage(spec, layout, stage)
    _checkpointed(module, spec)
    if layout.dp > 1:
        dtype = torch.bfloat16 if spec.precision == "bf16" and not spec.autocast else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in blocks_of(module):
            fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
        fully_shard(module, mesh=mesh["dp"], mp_policy=policy)
    micro = layout.batch // layout.microbatches
    autocast = spec.precision == "bf16" and (layout.dp == 1 or spec.autocast)
    with FakeTensorMode(allow_non_fake_inputs=True), _WaitReturnsItsInput(), _works_hold_their_tensors():
        module = module.to_empty(device=cpu)
        x, y = batch_of(spec, layout.batch)
        tokens = spec.seq if spec.model == "gpt" else (28 // spec.patch) ** 2
        dtype = torch.bfloat16 if spec.precision == "bf16" else torch.float32
        # what a stage sends on: under autocast the residual stream stays fp32 (the embeddings and the residual
        # additions are not cast), under FSDP2's bf16 policy the parameters and so the whole stream are bf16
        hidden = torch.empty(micro, tokens, spec.width, dtype=dtype if layout.dp > 1 and not spec.autocast
                             else torch.float32)
        first, last = stage == 0, stage == layout.pp - 1
        example_in = x[:micro] if first else hidden
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            example_out = module(example_in)
        if layout.dp > 1:
            module.reshard()
        pipe = PipelineStage(module, stage, layout.pp, cpu, input_args=example_in, output_args=example_out,
                             output_grads=None if last else torch.empty_like(example_out),
                             input_grads=None if first else torch.empty_like(example_in),
                             group=mesh["pp"].get_group())
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[layout.schedule](
            pipe, layout.microbatches, loss_fn=loss_of, scale_grads=True)
        optimizer = _optimizer(spec, module.parameters())
        peak = memory.StepPeak(nn.ModuleList([module]), optimizer, cpu, at=MEASURED_STEP[False])  # lesson 21's way
        for _ in range(peak.at):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                schedule.step(*([x] if first else []), **({"target": y} if last else {}))
            optimizer.step()
        result = peak.result()
        result.update(memory.held(module, optimizer))
    return result


@dataclass
class Estimate:
    layout: Layout
    bytes: dict  # parameters, gradients, optimizer_state, held_before, peak_above, peak, activations
    seconds: float
    note: str = ""
    stages: dict = None  # pipeline: StepPeak's result (and held()) for each stage estimated


def estimate(spec: Spec, layout: Layout) -> Estimate:
    """Rank 0's memory under `layout`, from a fake run on a fake process group of layout.world ranks."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    start = time.perf_counter()
    if dist.is_initialized():
        dist.destroy_process_group()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if layout.name == "pp":
                stages = {}
                for stage in sorted({0, layout.pp - 1}):  # the first holds the most micro-batches, the last the head
                    dist.init_process_group("fake", store=FakeStore(), rank=stage * layout.dp, world_size=layout.world,
                                            timeout=FAKE_TIMEOUT)
                    stages[stage] = _run_pipeline(spec, layout, stage)
                    dist.destroy_process_group()
                got = max(stages.values(), key=lambda r: r["peak_bytes"])
                note = (f"pipeline: torch's {layout.schedule} schedule run by the first and the last stage, each on "
                        f"its own (the fake process group's send and recv carry nothing: each stage is given the "
                        f"shapes it receives and sends); the table shows the larger")
            else:
                dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world, timeout=FAKE_TIMEOUT)
                got, note = _run(spec, layout), ""
                stages = {}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    b = {k: got[k] for k in ("parameters", "gradients", "optimizer_state")}
    b.update(held_before=got["held_before_bytes"], peak_above=got["peak_above_bytes"], peak=got["peak_bytes"])
    b["activations"] = b["peak"] - b["parameters"] - b["gradients"] - b["optimizer_state"]
    return Estimate(layout, b, time.perf_counter() - start, note, stages)


# ------------------------------------------------------------------------------------------ the cluster

def layouts(spec: Spec, nodes: int, per_node: int, global_batch: int, tp=None, pp=None,
            microbatches=None, schedule: str = "1f1b") -> dict:
    """{name: Layout or the one-line reason it cannot be run} for every layout on this cluster."""
    world = nodes * per_node
    out = {}

    def with_batch(name, dp, **kw):
        if global_batch < dp:
            return f"the global batch of {global_batch} is smaller than its {dp} data-parallel replicas"
        if global_batch % dp:
            return f"the global batch of {global_batch} does not split among its {dp} data-parallel replicas"
        return Layout(name, world, global_batch // dp, **kw)

    out["ddp"] = with_batch("ddp", world)
    out["fsdp"] = with_batch("fsdp", world)
    out["hsdp"] = (with_batch("hsdp", world, inner=per_node) if nodes > 1 else
                   "one node: HSDP's replicas across nodes would be FSDP2 itself")
    cut = {"heads": spec.heads, **({"MLP's hidden features": spec.hidden, "vocabulary's rows": spec.vocab}
                                   if spec.model == "gpt" else {})}  # what TP's ranks split evenly
    t = tp or max(d for d in range(1, per_node + 1) if per_node % d == 0 and all(n % d == 0 for n in cut.values()))
    tokens = spec.seq if spec.model == "gpt" else (28 // spec.patch) ** 2
    uneven = [f"the {n} {what}" for what, n in cut.items() if n % t]
    for name in ("tp", "tp-sp"):
        if t < 2:
            out[name] = f"TP needs at least 2 ranks a node whose number divides {' and '.join(f'the {n} {what}' for what, n in cut.items())}"
        elif per_node % t or uneven:
            out[name] = f"TP over {t} ranks: they must divide the {per_node} GPUs of a node and {' and '.join(uneven) or f'the {spec.heads} heads'}"
        elif name == "tp-sp" and tokens % t:
            out[name] = f"sequence parallelism over {t} ranks: the {tokens} tokens do not divide among them"
        else:
            out[name] = with_batch(name, world // t, tp=t)
    p = pp or (nodes if nodes > 1 else 2)
    if world % p:
        out["pp"] = f"{p} pipeline stages do not divide the {world} ranks"
    elif spec.depth % p:
        out["pp"] = f"the {spec.depth} blocks do not divide among {p} pipeline stages"
    else:
        layout = with_batch("pp", world // p, pp=p, schedule=schedule)
        if isinstance(layout, Layout):
            m = microbatches or min(layout.batch, max(p, 1))
            if layout.batch % m:
                layout = f"a replica's batch of {layout.batch} does not split into {m} micro-batches"
            elif schedule == "1f1b" and m < p:
                layout = f"1F1B needs at least {p} micro-batches (one per stage); a replica's batch is {layout.batch}"
            else:
                layout = replace(layout, microbatches=m)
        out["pp"] = layout
    return out


def recommend(estimates: dict, unrunnable: dict, budget: int) -> tuple:
    """(the layout to use or None, {rejected layout: one line why}).  Memory first; the global batch has
    already capped the data-parallel degree (unrunnable); then the first of PREFERENCE that fits."""
    fits = [n for n in PREFERENCE if n in estimates and estimates[n].bytes["peak"] <= budget]
    chosen = fits[0] if fits else None
    why = dict(unrunnable)
    for name, e in estimates.items():
        if name == chosen:
            continue
        if e.bytes["peak"] > budget:
            why[name] = f"does not fit: {e.bytes['peak'] / GiB:.2f} GiB a rank > {budget / GiB:.2f} GiB usable"
        else:
            why[name] = f"fits ({e.bytes['peak'] / GiB:.2f} GiB), but {chosen} fits too and " + REASON[chosen]
    return chosen, why


REASON = {"ddp": "communicates least (one all_reduce of the gradients a step) and is the simplest",
          "hsdp": "keeps its all_gathers and reduce_scatters inside a node, only gradient shards cross nodes",
          "fsdp": "needs no TP inside the layers (no activations sent four times per block)",
          "tp": "keeps whole activations between TP layers, with no extra sequence collectives to set up",
          "tp-sp": "needs no pipeline (no bubble, no point-to-point schedule)",
          "pp": ""}


# ------------------------------------------------------------------------------------------ the command

def split_of(layout: Layout) -> str:
    """How the layout's ranks are arranged, in words of its mesh."""
    if layout.name == "hsdp":
        return f"{layout.world // layout.inner} x shard {layout.inner}"
    if layout.name in ("tp", "tp-sp"):
        return f"dp {layout.dp} x tp {layout.tp}"
    if layout.name == "pp":
        return f"pp {layout.pp} x dp {layout.dp}, m {layout.microbatches}"
    return f"dp {layout.dp}"


def unit_of(estimates: dict) -> tuple:
    """GiB, or MiB for small models."""
    largest = max((e.bytes["peak"] for e in estimates.values()), default=0)
    return ("GiB", GiB) if largest >= GiB / 4 else ("MiB", 2 ** 20)


def table(estimates: dict) -> str:
    """Rank 0's bytes by layout: what it holds (parameters, gradients, optimizer state) and the rest of its
    peak (activations, gathered parameters, buffers, the batch), in GiB or, for small models, MiB."""
    unit, size = unit_of(estimates)
    rows = [f"{'layout':<6} {'ranks':>21} {'batch':>5} {'params':>9} {'grads':>9} {'optim':>9} {'activ.':>9} "
            f"{'peak':>9}  ({unit}; seconds to estimate)"]
    for name, e in estimates.items():
        b = e.bytes
        rows.append(f"{name:<6} {split_of(e.layout):>21} {e.layout.batch:>5} " + " ".join(
            f"{b[k] / size:>9.3f}" for k in ("parameters", "gradients", "optimizer_state", "activations", "peak"))
            + f"  {e.seconds:.1f} s")
    return "\n".join(rows)


def check(args) -> None:
    """Bad input as one clear line, before anything runs."""
    if args.model == "gpt":
        missing = [f"--{n}" for n in ("vocab", "seq") if not getattr(args, n)]
        if missing:
            raise CourseError(f"--model gpt needs {' and '.join(missing)} (the vocabulary and the sequence length)")
    elif args.vocab or args.seq or args.hidden:
        raise CourseError("--vocab, --seq and --hidden size day 5's GPT: use them with --model gpt")
    if args.width % args.heads:
        raise CourseError(f"--width {args.width} is not a multiple of --heads {args.heads}; choose a width such as "
                          f"{args.heads * max(1, round(args.width / args.heads))}")
    if args.model == "gpt" and (args.width // args.heads) % 2:
        raise CourseError(f"--width {args.width} over --heads {args.heads} is an odd width per head (rotary "
                          f"positions turn features in pairs); choose a width such as {args.heads * 16}")
    if args.tp and (args.gpus_per_node % args.tp or args.heads % args.tp):
        raise CourseError(f"--tp {args.tp}: the TP ranks of a node must divide its {args.gpus_per_node} GPUs "
                          f"(--gpus-per-node) and the {args.heads} heads")
    if args.tp and args.model == "gpt" and (spec_of(args).hidden % args.tp or args.vocab % args.tp):
        raise CourseError(f"--tp {args.tp}: the TP ranks must also divide the GPT's {spec_of(args).hidden} hidden "
                          f"features (--hidden) and its {args.vocab} vocabulary rows (--vocab)")
    if args.pp and (args.nodes * args.gpus_per_node) % args.pp:
        raise CourseError(f"--pp {args.pp} does not divide the {args.nodes * args.gpus_per_node} GPUs")
    if args.json is not None:
        from course.launching.cli import unwritable

        problem = unwritable(args.json.parent) or ("it is a directory" if args.json.is_dir() else None)
        if problem:
            raise CourseError(f"--json {args.json} cannot be written ({problem}); choose another file")
    if args.headroom >= 1:
        raise CourseError(f"--headroom {args.headroom:g}: a fraction of each GPU's memory kept free, below 1")
    if "all" not in args.layout:
        plans = layouts(spec_of(args), args.nodes, args.gpus_per_node, args.global_batch, args.tp, args.pp,
                        args.microbatches, args.schedule)
        for name in args.layout:
            if isinstance(plans[name], str):
                raise CourseError(f"--layout {name}: {plans[name]}")


def spec_of(args) -> Spec:
    hidden = (args.hidden or llama_hidden(args.width)) if args.model == "gpt" else 0
    return Spec(args.model, args.width, args.depth, args.heads, args.patch, args.vocab or 0, args.seq or 0, hidden,
                args.optimizer, args.precision, checkpointed=args.checkpoint_activations)


def build_parser() -> Parser:
    p = Parser(prog="python -m course.fit", description=__doc__.strip().split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="vit", choices=("vit", "gpt"),
                   help="vit: the course's ViT (course/models.py); gpt: day 5's GPT (course/gpt.py, Llama's "
                        "layout) sized by the flags")
    p.add_argument("--width", type=positive_int, default=64, help="token width (a multiple of --heads)")
    p.add_argument("--depth", "--layers", dest="depth", type=positive_int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads per block")
    p.add_argument("--patch", type=int, default=7, choices=(1, 2, 4, 7, 14), help="vit: patch size (7: 16 tokens)")
    p.add_argument("--vocab", type=positive_int, default=None, help="gpt: vocabulary size")
    p.add_argument("--seq", type=positive_int, default=None, help="gpt: sequence length (tokens per sample)")
    p.add_argument("--hidden", type=positive_int, default=None,
                   help="gpt: the MLP's hidden features (default: Llama's 8/3 x --width, rounded up to a multiple of 4)")
    p.add_argument("--global-batch", type=positive_int, default=64,
                   help="samples per step over all data-parallel replicas (caps the data-parallel degree)")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"),
                   help="sgd: momentum, one state tensor per parameter (the lessons'); adamw: two")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: compute in bf16 (FSDP2's MixedPrecisionPolicy, else autocast); weights stay fp32")
    p.add_argument("--gpus-per-node", type=positive_int, default=4, help="GPUs (ranks) per node")
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes")
    p.add_argument("--gpu-memory", type=_positive_number, default=80.0, help="GiB of memory per GPU")
    p.add_argument("--headroom", type=non_negative_float, default=0.1,
                   help="fraction of each GPU kept free for what is not counted (CUDA context, NCCL, fragmentation)")
    p.add_argument("--layout", nargs="+", default=["all"], choices=("all", *LAYOUTS),
                   help="the layouts to estimate (all: every one, and a recommendation)")
    p.add_argument("--json", type=Path, default=None, help="also write the estimates to this JSON file")
    p.add_argument("--tp", type=positive_int, default=None,
                   help="TP ranks per group (default: the most of a node's GPUs that divide the heads, and the "
                        "GPT's --hidden and --vocab)")
    p.add_argument("--pp", type=positive_int, default=None, help="pipeline stages (default: the nodes, at least 2)")
    p.add_argument("--microbatches", type=positive_int, default=None,
                   help="pipeline micro-batches per replica's batch (default: the stages, or the batch if smaller)")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"), help="pipeline schedule")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute every block's activations in backward (lesson 14) instead of keeping them")
    return p


def _positive_number(text: str) -> float:
    from course.launching.cli import positive_float

    value = positive_float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number")
    return value


def run(args) -> None:
    check(args)
    spec = spec_of(args)
    params = parameter_count(spec)
    world = args.nodes * args.gpus_per_node
    budget = int(args.gpu_memory * GiB * (1 - args.headroom))
    print(f"{spec.model}: {params:,} parameters ({params * 4 / GiB:.2f} GiB in fp32), {spec.optimizer}, "
          f"{spec.precision}{', every block checkpointed' if spec.checkpointed else ''}; global batch {args.global_batch}; {args.nodes} node(s) x {args.gpus_per_node} GPUs "
          f"of {args.gpu_memory:g} GiB ({budget / GiB:.2f} GiB usable a GPU, headroom {args.headroom:g})", flush=True)
    plans = layouts(spec, args.nodes, args.gpus_per_node, args.global_batch, args.tp, args.pp, args.microbatches,
                    args.schedule)
    if "all" not in args.layout:
        plans = {name: plan for name, plan in plans.items() if name in args.layout}
    estimates, unrunnable, start = {}, {}, time.perf_counter()
    for name, plan in plans.items():
        if isinstance(plan, str):
            unrunnable[name] = plan
            continue
        estimates[name] = estimate(spec, plan)
    print(f"\nmemory of rank 0 (of a pipeline's fuller end stage), estimated in {time.perf_counter() - start:.1f} s "
          f"with nothing allocated:")
    print(table(estimates))
    unit, size = unit_of(estimates)
    for e in estimates.values():
        if e.note:
            peaks = ", ".join(f"stage {k}: {v['peak_bytes'] / size:.3f}" for k, v in e.stages.items())
            print(f"{e.layout.name}: {e.note}; peak {unit} by stage: {peaks}")
    if args.json:
        args.json.write_text(json.dumps({"parameters": params, "budget_bytes": budget, "estimates": {
            name: {"layout": asdict(e.layout), "bytes": e.bytes, "seconds": e.seconds, "stages": e.stages}
            for name, e in estimates.items()}, "unrunnable": unrunnable}, indent=1))
    chosen, why = recommend(estimates, unrunnable, budget)
    print()
    print(f"use {chosen}: {WHAT[chosen]}" if chosen else
          "nothing fits: use more GPUs, fewer samples per replica, activation checkpointing, or a smaller model")
    for name in LAYOUTS:
        if name in why:
            print(f"  not {name}: {why[name]}")
    print("not counted: CUDA context (hundreds of MB a GPU), NCCL buffers, allocator fragmentation", flush=True)


def for_lesson(args, sizes: dict, vocab: int, layout: str, world: int, inner: int = 1) -> dict:
    """Memory before the queue, for day 5's lessons (22 and 23), called once the input is checked and before
    training: in the process that starts the ranks (the own launcher) or that is rank 0 (torchrun, srun: the
    other ranks wait for it to join), rank 0's bytes in the lesson's model (course/gpt.py's GPT of `sizes`,
    `vocab` rows) and layout ("fsdp", or lesson 22's "fsdp-tp" on rows of `inner`; one process when `world` is
    1) with its batch (args.batch_size rows of args.seq_len tokens per replica), AdamW, bf16 through autocast
    if asked, its blocks checkpointed if asked: printed in one line, and returned as StepPeak's result keys
    and the layout (for metrics.json and `against`).  None in the other ranks' processes, or where the
    estimate failed (its one line says why).  AdamW is torch's fused one, which updates in place; the lessons'
    default on a GPU, foreach, also makes temporaries of the state during optimizer.step(): a peak that falls
    there is above the estimate."""
    from course.launching.environment import detect_launcher

    launcher = detect_launcher(args)
    if launcher != "self" and os.environ.get("RANK" if launcher == "torchrun" else "SLURM_PROCID") != "0":
        return None
    spec = Spec("gpt", sizes["width"], sizes["depth"], sizes["heads"], vocab=vocab, seq=args.seq_len,
                hidden=sizes["hidden"], optimizer="adamw", precision=getattr(args, "precision", "fp32"), autocast=True,
                checkpointed=bool(getattr(args, "checkpoint_activations", False)))
    if world == 1:
        plan = Layout("one", 1, args.batch_size)
    elif layout == "fsdp-tp":
        plan = Layout("tp-sp", world, args.batch_size, tp=inner, shard_one_row=True)
    else:
        plan = Layout("fsdp", world, args.batch_size)
    e = _estimate_apart(spec, plan)  # nothing of a fake run (its groups, its threads) stays in this process
    if isinstance(e, str):
        print(f"memory of rank 0 not estimated ({e})", flush=True)
        return None
    b = e.bytes
    eager = " (run eagerly: what torch.compile changes is not estimated)" if getattr(args, "compile", False) else ""
    print(f"memory of rank 0, estimated before any rank starts (course/fit.py: this step on fake tensors, "
          f"{e.seconds:.1f} s): {b['held_before'] / MB:.3f} MB held as a step begins, at most "
          f"{b['peak_above'] / MB:.3f} MB more during it: peak {b['peak'] / MB:.3f} MB{eager}", flush=True)
    return {"held_before_bytes": b["held_before"], "peak_above_bytes": b["peak_above"], "peak_bytes": b["peak"],
            "layout": asdict(plan)}


def _estimate_apart(spec: Spec, layout: Layout):
    """estimate() in another process, so that this one is left as it was: it is about to become rank 0 (torchrun,
    srun, or the own launcher with one rank), whose real process groups must not meet the fake run's, or to fork
    the ranks (the own launcher), which it may only do while no thread of torch's has run here
    (course/launching/supervise.py).  A fork of this process where that is safe (torch is imported already: no
    second start), else (a GPU visible, torch's threads started) a fresh interpreter.  Returns an Estimate, or
    the reason it failed."""
    from course.launching.supervise import _why_not_fork

    if _why_not_fork() is not None:
        return _estimate_in_a_fresh_process(spec, layout)
    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: estimate, send the result, end without running this process's exit handlers
        code = 1
        try:
            os.close(read)
            try:
                e = estimate(spec, layout)
                said = {"bytes": e.bytes, "seconds": e.seconds}
                code = 0
            except Exception as error:  # noqa: BLE001 - any failure becomes the one line the parent prints
                said = {"error": f"{type(error).__name__}: {error}"}
            with os.fdopen(write, "w") as out:
                out.write(json.dumps(said))
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as got:
        text = got.read()
    os.waitpid(pid, 0)
    said = json.loads(text) if text else {"error": "the estimating process ended without a result"}
    return said["error"] if "error" in said else Estimate(layout, said["bytes"], said["seconds"])


def _estimate_in_a_fresh_process(spec: Spec, layout: Layout):
    """estimate() in a new Python process: an Estimate, or the reason it failed."""
    import subprocess

    code = ("import json, sys\nfrom dataclasses import asdict\nfrom course.fit import Layout, Spec, estimate\n"
            "given = json.loads(sys.stdin.read())\n"
            "e = estimate(Spec(**given['spec']), Layout(**given['layout']))\n"
            "print(json.dumps({'bytes': e.bytes, 'seconds': e.seconds}))\n")
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (repo, os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps({"spec": asdict(spec), "layout": asdict(layout)}),
                          capture_output=True, text=True, env=env)
    if done.returncode:
        return (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return Estimate(layout, got["bytes"], got["seconds"])


def against(estimated, peak, rank: int) -> str:
    """` (course/fit.py estimated X MB before the run: measured / estimated r)`, for rank 0's line that prints
    StepPeak's measurement (the estimate is rank 0's); empty on other ranks and where either is missing."""
    measured = peak.result()["peak_bytes"]
    if rank != 0 or not estimated or not measured:
        return ""
    return (f" (course/fit.py estimated {estimated['peak_bytes'] / MB:.3f} MB before the run: measured / estimated "
            f"{measured / estimated['peak_bytes']:.3f})")


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        run(args)
    except CourseError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
