"""What gradient accumulation and activation checkpointing save, counted while lesson 14 trains.

    meter = accumulation.Meter(model, device, checkpointed)  # after DDP(...), before the first forward
    with meter.forward():                      # around every micro-batch's forward pass
        loss = ...
    meter.step()                               # after every optimizer step
    metrics = meter.summary(steps, samples)    # rank 0: into metrics.json, and one line printed

Two counts:
- all_reduce: a DDP communication hook that counts each bucket DDP hands to it (calls, bytes) and then does
  exactly what DDP does without a hook (divide by the world size, all_reduce the sum).  A round is one
  backward pass's buckets, the last of which DDP marks `is_last()`.  Under `no_sync()` DDP calls no hook at
  all: nothing is sent.
- the bytes kept for backward during one micro-batch's forward pass: every tensor autograd saves passes
  through `torch.autograd.graph.saved_tensors_hooks`; each distinct storage is counted once, the model's own
  parameters not at all (they are there anyway).  A checkpointed block saves nothing through these hooks
  (checkpoint installs its own, innermost, and keeps only the block's input to run it again in backward), so
  its input is counted where the block starts.  Counted on the first forward pass only: the same shapes give
  the same bytes every time.  What a step holds at its peak is measured apart (course/measuring/memory.py's
  StepPeak): the whole run's CUDA peak would be mostly the dataset held on the GPU and the evaluation.
And the time of an optimizer step: the median of the intervals between consecutive steps (an interval that
spans an evaluation of the test set is far longer than the others, and the median ignores it).
"""
import contextlib
import math
import statistics

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from course.measuring.hardware import clock


def _storage(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class Meter:
    def __init__(self, model, device, checkpointed: bool, blocks=None):
        """`model`: the DDP-wrapped model (its hook is registered here, before any backward pass), or a plain
        one (nothing sent: only the bytes kept for backward are counted); `checkpointed`: whether `blocks`
        (default: the model's .blocks) run under checkpoint."""
        self.device, self.checkpointed = device, checkpointed
        self.comm = {"calls": 0, "rounds": 0, "bytes": 0}
        if hasattr(model, "register_comm_hook"):
            model.register_comm_hook(self.comm, _counting_allreduce)
        self.parameters = {_storage(p)[0] for p in model.parameters()}
        self.saved, self.counted, self.counting, self.times = {}, False, False, []
        for block in blocks if blocks is not None else getattr(model, "module", model).blocks:
            block.register_forward_pre_hook(self._block_input)

    def _keep(self, t: torch.Tensor) -> None:
        ptr, size = _storage(t)
        if ptr not in self.parameters:
            self.saved[ptr] = size

    def _pack(self, t):
        self._keep(t)
        return t

    def _block_input(self, block, inputs):
        # a checkpointed block's forward runs inside checkpoint, whose own hooks hide what it saves: what it
        # keeps is its input.  Without checkpoint the block's first layer norm saves that same storage.
        if self.counting and self.checkpointed and torch.is_grad_enabled():
            self._keep(inputs[0])

    @contextlib.contextmanager
    def forward(self):
        """Count what the first forward pass saves for backward; later passes run untouched."""
        if self.counted:
            yield
            return
        self.counting = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            self.counting, self.counted = False, True

    def step(self) -> None:
        self.times.append(clock(self.device))  # on a GPU once its work is done, not only queued

    def summary(self, steps: int, samples_per_step: int) -> dict:
        """The counts as metrics.json keys: per optimizer step and per sample of the global batch."""
        c = self.comm
        return {"allreduce_calls": c["calls"], "allreduce_rounds": c["rounds"], "allreduce_bytes": c["bytes"],
               "allreduce_calls_per_step": c["calls"] / steps, "allreduce_rounds_per_step": c["rounds"] / steps,
               "allreduce_bytes_per_step": c["bytes"] / steps,
               "allreduce_bytes_per_sample": c["bytes"] / (steps * samples_per_step),
               "saved_for_backward_bytes": sum(self.saved.values()),
               "step_seconds": statistics.median(b - a for a, b in zip(self.times, self.times[1:]))
               if len(self.times) > 1 else None}


def _counting_allreduce(state: dict, bucket):
    """DDP's communication hook: count this bucket, then all_reduce it as DDP does by default."""
    buffer = bucket.buffer()
    state["calls"] += 1
    state["bytes"] += buffer.numel() * buffer.element_size()
    state["rounds"] += bucket.is_last()
    return allreduce_hook(None, bucket)


def describe(m: dict, accumulate: int, checkpointing: bool) -> str:
    """One line: what one optimizer step sent, and what one micro-batch kept for backward."""
    timing = f"; {m['step_seconds'] * 1000:.1f} ms per optimizer step" if m["step_seconds"] is not None else ""
    return (f"all_reduce per optimizer step: {m['allreduce_rounds_per_step']:g} round(s) of "
            f"{m['allreduce_calls_per_step']:g} bucket(s), {m['allreduce_bytes_per_step'] / 1024:.1f} KB "
            f"= {m['allreduce_bytes_per_sample']:.1f} bytes per sample ({accumulate} micro-batch(es)); "
            f"kept for backward per micro-batch: {m['saved_for_backward_bytes'] / 2 ** 20:.3f} MB "
            f"(activation checkpointing {'on' if checkpointing else 'off'}){timing}")


def check_args(args) -> None:
    """One clear line, before any rank starts, if one optimizer step needs more batches than a rank's shard
    holds (it would never step)."""
    from course.launching.cli import CourseError
    from course.measuring.memory import world_size_of

    samples = args.train_samples or 60_000  # --quick has set train_samples already (cli.parse)
    world_size = world_size_of(args)
    shard = math.ceil(samples / world_size)
    batches = math.ceil(shard / args.batch_size)
    if args.accumulate > batches:
        raise CourseError(f"--accumulate {args.accumulate}: each rank's shard of {samples} samples holds only "
                          f"{batches} batches of {args.batch_size} ({world_size} ranks), fewer than one "
                          f"optimizer step needs; lower --accumulate or --batch-size, or train on more samples")
