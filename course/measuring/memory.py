"""What a rank holds, in bytes, counted from the tensors themselves (day 3).

A sharded parameter (lesson 15, FSDP2) is a DTensor: a view of the whole tensor whose `to_local()` is the
piece this rank stores.  Counting `to_local()` gives what the rank really holds; counting the DTensor itself
would give the whole tensor.  The same counts work for DDP's plain tensors, where every rank holds all of it.

Before any rank starts, `plan` tells from the model's shapes alone (built on the `meta` device: no memory)
what a rank will hold under DDP and under FSDP2 at a world size, so that a per-rank budget is checked before
anything runs.  FSDP2 splits dim 0 of every parameter as `torch.chunk` does: rank 0 gets ceil(rows / W) rows,
the most of any rank, so rank 0's bytes are the ones to compare with a budget.

Measured, not counted: `StepPeak` watches one training step (the third: the first like every later one)
from its first forward to its `optimizer.step()`, and reports what this rank held when the step began and
the most it held during it.
- On a GPU: `torch.cuda.memory_allocated` when the step begins, `torch.cuda.reset_peak_memory_stats` there
  and `torch.cuda.max_memory_allocated` when it ends: everything the caching allocator handed out, the
  dataset held on the GPU and cuBLAS's workspaces included.
- On the CPU: the bytes of live tensor storages, tracked by a `TorchDispatchMode` (`LiveTensors`) during the
  step alone.  It sees every operator call of the rank's own thread, autograd's backward included, and
  counts each storage once: a storage an operator returns that it was not given is new (+ its bytes); one it
  is given and has not seen was held before the step if it outlives the step (DDP's gradient buckets), and
  was the step's own if it dies within it (a buffer made in a thread it does not watch); a storage's death
  (a weak reference's callback) takes its bytes off; `UntypedStorage.resize_`, which FSDP2 uses to allocate and free its gathered
  parameters and which is no operator call, is wrapped during the step.  The parameters, gradients,
  buffers and optimizer state are registered when the step begins.  What it does not see: tensors no
  operator of the step touches (the dataset: the step uses a batch of it), allocations inside gloo's own
  threads, and memory that is not a tensor (the interpreter, libraries, the allocator's slack).
Why not torch's own tools: `torch.distributed._tools.mem_tracker.MemTracker` raises NotImplementedError
when the root module runs forward a second time inside one tracker, which is what gradient accumulation
(lesson 14) does in every step, and it updates every tracked module's statistics after every operator; the
profiler's memory events (`profile_memory=True`) count only allocations made while it records (freeing a
tensor allocated before does not count) and record every operator's event besides.
"""
import itertools
import math
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MB = 2 ** 20


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank stores: a DTensor's local shard, or a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def nbytes(t) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def held(model, optimizer) -> dict:
    """Bytes this rank holds in parameters, their gradients and the optimizer's state (e.g. SGD's momentum)."""
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    out = {"parameters": sum(nbytes(p) for p in params),
           "gradients": sum(nbytes(p.grad) for p in params if p.grad is not None),
           "optimizer_state": sum(nbytes(v) for v in state)}
    out["total"] = sum(out.values())
    return out


def watch_after_forward(model) -> dict:
    """Record, after each forward pass, the bytes of parameters the rank still holds until backward: with
    FSDP2 a module left unsharded after its forward (reshard_after_forward=False, and always the root) holds
    its whole parameters, a resharded one only its shard.  Returns a dict whose "peak" is the largest seen."""
    seen = {"peak": 0}

    def hook(module, inputs, output):  # registered after fully_shard's own hooks: runs after any reshard
        if module.training:
            seen["peak"] = max(seen["peak"], sum(nbytes(p) for p in module.parameters()))

    model.register_forward_hook(hook)
    return seen


def _storages(t: torch.Tensor) -> list:
    """The storages a tensor's bytes live in: a DTensor's (or another wrapper's) inner tensors' storages."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        inner = [getattr(t, name) for name in t.__tensor_flatten__()[0]]
        return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]
    if t.device.type == "meta" or t.layout != torch.strided:
        return []
    return [t.untyped_storage()]


class LiveTensors(TorchDispatchMode):
    """While active: the bytes of live tensor storages this thread's operators hold (the module's docstring
    says what it sees).  `before`: the bytes held when it began (registered with `hold`, or first seen as an
    operator's input and still alive at the end); `peak_above`: the most bytes live at once above `before`.
    A storage first seen as an input that dies before the end was made where the tracker does not look
    (gloo's reduce_scatter on CPU tensors allocates its buffers in gloo's own threads): it counts as made
    during the step, for as long as it was seen alive."""

    def __init__(self):
        super().__init__()
        self.before = self.above = 0  # above: live bytes now minus `before` as known so far
        self._bytes = {}  # id(storage) -> [a weak reference whose callback subtracts, the bytes counted, token]
        self._unknown = {}  # first seen as an input during the step, alive: token -> bytes
        self._died = {}  # those that died during the step: token -> bytes
        self._peaks = {}  # frozenset of _unknown's tokens alive -> the largest `above` while they were
        self._tokens = itertools.count()  # a storage's id may be reused once it dies; a token is not
        self._resize = None

    def hold(self, *tensors) -> None:
        for t in tensors:
            for st in _storages(t):
                self._see(st, held=True, registered=True)

    def _see(self, st, held: bool, registered: bool = False) -> None:
        key = id(st)
        entry = self._bytes.get(key)
        if entry is None:
            n, token = st.nbytes(), next(self._tokens)
            self._bytes[key] = [weakref.ref(st, lambda _, key=key: self._freed(key)), n, token]
            if held:  # live before the step and now: `above` stays
                self.before += n
                if not registered:
                    self._unknown[token] = n
                    self._mark()
            else:
                self._grow(n)
        elif entry[1] != st.nbytes():  # an operator resized it (out= arguments, resize_)
            n = st.nbytes()
            self._grow(n - entry[1])
            entry[1] = n

    def _mark(self) -> None:
        alive = frozenset(self._unknown)
        self._peaks[alive] = max(self._peaks.get(alive, self.above), self.above)

    def _grow(self, n: int) -> None:
        self.above += n
        self._mark()

    def _freed(self, key) -> None:
        entry = self._bytes.pop(key, None)
        if entry is None:
            return
        if entry[2] in self._unknown:  # the step's own after all: not held before
            self._died[entry[2]] = self._unknown.pop(entry[2])
            self.before -= entry[1]
        else:
            self.above -= entry[1]

    @property
    def peak_above(self) -> int:
        return max((above + sum(self._died.get(k, 0) for k in alive) for alive, above in self._peaks.items()),
                   default=0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_leaves

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its local operators, which come back here
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._see(st, held=True)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._see(st, held=False)
        return out

    def __enter__(self):
        original = self._resize = torch.UntypedStorage.resize_

        def resize_(st, size):  # FSDP2 allocates and frees its gathered parameters so, outside any operator
            self._see(st, held=True)
            original(st, size)
            self._see(st, held=False)
            return st

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        self._bytes.clear()  # the weak references go: the counts stay as they are now
        return super().__exit__(*exc)


class StepPeak:
    """Measures one training step of this rank, the `at`-th, from its model's first forward in training to its
    `optimizer.step()`.  The default, the third, is the first step like every later one: the first creates the
    optimizer's state (SGD's momentum) and FSDP2's lazy initialization; in the second's forward DDP allocates
    its gradient buckets anew, in the order the gradients arrived in the first backward.  Gradient
    accumulation's micro-batches all belong to the step they accumulate for.  Begun by a forward pre-hook that runs before FSDP2's
    own (which gathers the root's parameters), ended by the optimizer's step post-hook.  A compiled model's
    kernels on the CPU run outside the operators `LiveTensors` sees: there it is not measured."""

    def __init__(self, model, optimizer, device, at: int = 3):
        self.model, self.optimizer, self.device, self.at = model, optimizer, device, at
        self.steps, self.tracker, self.measured = 0, None, None
        modules = model.modules() if isinstance(model, torch.nn.Module) else ()
        compiled = hasattr(model, "_orig_mod") or any(  # torch.compile's wrapper, or a part's module.compile()
            getattr(m, "_compiled_call_impl", None) is not None for m in modules)
        self.unmeasurable = "torch.compile's CPU kernels" if compiled and device.type != "cuda" else ""
        # a pipeline rank's stages (lesson 21) are an nn.ModuleList, never called itself: its first stage begins a step
        begins = model[0] if isinstance(model, torch.nn.ModuleList) else model
        begins.register_forward_pre_hook(self._begin, prepend=True)
        optimizer.register_step_post_hook(self._end)

    def _begin(self, module, inputs) -> None:
        if (self.tracker is not None or self.measured or self.unmeasurable or self.steps + 1 != self.at
                or not (module.training and torch.is_grad_enabled())):
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.tracker = torch.cuda.memory_allocated(self.device)
            return
        tracker = LiveTensors()
        params = list(self.model.parameters())
        state = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        tracker.hold(*params, *(p.grad for p in params if p.grad is not None), *self.model.buffers(), *state)
        self.tracker = tracker.__enter__()

    def _end(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        if self.tracker is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            before = self.tracker
            above = torch.cuda.max_memory_allocated(self.device) - before
        else:
            self.tracker.__exit__(None, None, None)
            before, above = self.tracker.before, self.tracker.peak_above
        self.tracker, self.measured = None, {"before": before, "above": above}

    def how(self) -> str:
        return "torch.cuda.max_memory_allocated" if self.device.type == "cuda" else "live tensors on the CPU"

    def result(self) -> dict:
        """For metrics.json: the bytes held when the step began, the most above that during it, their sum."""
        m = self.measured
        return {"measured_step": self.at if m else None, "how": self.how() if m else None,
                "held_before_bytes": m and m["before"], "peak_above_bytes": m and m["above"],
                "peak_bytes": m and m["before"] + m["above"]}

    def __str__(self) -> str:
        if self.measured is None:
            why = self.unmeasurable or f"the run took fewer than {self.at} steps"
            return f"memory of step {self.at} not measured ({why})"
        r = self.result()
        return (f"step {self.at}'s memory, measured ({r['how']}): {r['held_before_bytes'] / MB:.3f} MB held when it "
                f"began, at most {r['peak_above_bytes'] / MB:.3f} MB more during it: peak {r['peak_bytes'] / MB:.3f} MB")


def world_size_of(args) -> int:
    """The world size a run will have, known before any rank starts: torchrun's, the srun step's (not the
    job's SLURM_NTASKS: a batch script's own shell or a one-task step with --nproc N starts N ranks), or
    --nproc (course/launching/launch.py)."""
    from course.launching.environment import world_size

    return world_size(args)


def plan(model_fn, world_size: int, states_per_parameter: int = 1) -> dict:
    """Bytes rank 0 will hold under DDP (a full replica) and under FSDP2 over `world_size` ranks: parameters,
    gradients (same size) and `states_per_parameter` optimizer tensors of the same size (1: SGD's momentum;
    2: Adam's two moments).  `model_fn()` builds the model; it is built on the meta device."""
    with torch.device("meta"):
        model = model_fn()
    full = sharded = 0
    for p in model.parameters():
        rows = p.shape[0] if p.dim() else 1
        per_row = p.numel() // rows if rows else 0
        full += p.numel() * p.element_size()
        sharded += math.ceil(rows / world_size) * per_row * p.element_size()
    copies = 2 + states_per_parameter
    return {"parameters": sum(p.numel() for p in model.parameters()), "states": states_per_parameter,
            "ddp": copies * full, "fsdp": copies * sharded, "world_size": world_size}


def budget_verdict(planned: dict, budget_mb: float) -> str:
    """One line: what DDP and FSDP2 need per rank against the budget, and which fits."""
    ddp, fsdp, w = planned["ddp"] / MB, planned["fsdp"] / MB, planned["world_size"]
    fits = lambda mb: "fits" if mb <= budget_mb else "does not fit"
    return (f"per-rank budget {budget_mb:g} MB: DDP's full replica needs {ddp:.2f} MB ({fits(ddp)}); "
            f"FSDP2 over {w} rank{'s' * (w > 1)} needs {fsdp:.2f} MB ({fits(fsdp)})")


def reshard(model) -> None:
    """`reshard()` on every FSDP2 module of `model`: frees the whole parameters FSDP2 keeps gathered after a
    forward pass without a backward (the root's always; every block's with reshard_after_forward=False)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def gather(rank: int, model, optimizer, after_forward: dict) -> list:
    """What this rank holds (printed with its rank), and every rank's counts on every rank (a collective:
    all ranks call it).  FSDP2 keeps the root module's gathered parameters after a forward pass, and with
    reshard_after_forward=False every block's too, until a backward frees them; evaluation's forward has no
    backward: `reshard()` on every sharded module frees them first, so that the count is the shards."""
    import torch.distributed as dist

    from course.training.output import rank_print

    reshard(model)
    holds = dict(held(model, optimizer), after_forward=after_forward["peak"])
    rank_print(rank, "holds " + ", ".join(f"{k.replace('_', ' ')} {v / MB:.3f} MB" for k, v in holds.items()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, holds)
    return everyone


def add_budget_arg(p, default_mb: float):
    p.add_argument("--memory-budget-mb", type=float, default=default_mb,
                   help="MB per rank for parameters, gradients and optimizer state: the run stops before "
                        "it starts if FSDP2 needs more (0: no budget)")
    return p


def check_plan(args, model_from_args) -> None:
    """DDP's and FSDP2's bytes per rank from the model's shapes (args.planned), before any rank starts; one
    clear line if even FSDP2 does not fit the budget, or if the model has no blocks to shard."""
    from course.launching.cli import CourseError

    if args.model != "vit":
        raise CourseError(f"--model {args.model}: lesson 15 shards the ViT block by block (model.blocks); "
                          f"use --model vit")
    if args.memory_budget_mb < 0:
        raise CourseError(f"--memory-budget-mb {args.memory_budget_mb:g}: must be 0 (no budget) or more")
    args.planned = plan(lambda: model_from_args(args, args.seed), world_size_of(args))
    if args.memory_budget_mb and args.planned["fsdp"] > args.memory_budget_mb * MB:
        raise CourseError(budget_verdict(args.planned, args.memory_budget_mb) + "; use more ranks, a smaller "
                          "--width or --depth, or a larger --memory-budget-mb")


def report(per_rank: list, planned: dict, budget_mb: float) -> None:
    """Rank 0's summary: what each rank holds against DDP's full replica, and the budget's verdict.  Every
    number is stored on exactly one rank under FSDP2, so all ranks' bytes together are what one DDP rank
    holds, whatever the optimizer (the plan made before the run assumed SGD's one state per parameter)."""
    w, ddp = len(per_rank), sum(r["total"] for r in per_rank)
    most = max(r["total"] for r in per_rank)
    print(f"parameters + gradients + optimizer state per rank: FSDP2 {most / MB:.3f} MB on the fullest of {w} "
          f"ranks, DDP's full replica {ddp / MB:.3f} MB: {most / ddp:.3f} of DDP's (1/{w} = {1 / w:.3f})")
    held = ", ".join(f"{r['after_forward'] / MB:.3f}" for r in per_rank)
    whole = sum(r["parameters"] for r in per_rank)
    print(f"parameter MB held from forward to backward, per rank: {held} (whole model: {whole / MB:.3f} MB)")
    if budget_mb:
        fits = "within it" if most <= budget_mb * MB else "over it"
        print(f"{budget_verdict(planned, budget_mb)}; measured on the fullest rank: {most / MB:.2f} MB, {fits}",
              flush=True)
