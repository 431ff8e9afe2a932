"""course/measuring/memory.py's measurement of a training step (StepPeak, LiveTensors), in one process, no lesson.

- On the CPU, LiveTensors' peak of one step equals torch's own MemTracker's (torch.distributed._tools), byte for
  byte, with and without activation checkpointing (measured 2026-11-26: 14 848 896 and 6 099 840 bytes for the
  ViT at width 64, depth 4, batch 64), and it measures a step of two micro-batches, which MemTracker refuses.
- A buffer made where no operator of this thread is seen (another thread), used and freed during the step,
  counts as memory of the step, not as memory held before it; a storage that `resize_` grows (FSDP2's gathered
  parameters) counts by its new size.
- On a GPU, StepPeak reads the CUDA allocator's counters; with no GPU here, the counters are faked, so that the
  arithmetic (peak above = max_memory_allocated - memory_allocated when the step began) and the moments it
  reads them (the third step's first forward, its optimizer step) are checked.
"""
import functools
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from course.measuring.memory import LiveTensors, StepPeak
from course.models import ViT

CPU = torch.device("cpu")


def vit(checkpointed=False, width=64, depth=4):
    torch.manual_seed(0)
    model = ViT(7, width, depth, 4)
    if checkpointed:  # as lesson 14 does it
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def batch(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def train(model, optimizer, steps, n=64, micro_batches=1):
    data = [batch(n // micro_batches, i) for i in range(micro_batches)]
    for _ in range(steps):  # lesson 14's loop
        optimizer.zero_grad()
        for x, y in data:
            (F.cross_entropy(model(x), y) / micro_batches).backward()
        optimizer.step()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_peak_of_a_step_equals_torchs_mem_tracker(checkpointed):
    from torch.distributed._tools.mem_tracker import MemTracker

    model, optimizer = vit(checkpointed)
    x, y = batch(64)

    def step():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    step()
    reference = MemTracker()
    reference.track_external(model, optimizer, x, y)
    with reference:
        step()
    expected = reference.get_tracker_snapshot("peak")[CPU]["Total"]
    step()
    live = LiveTensors()
    params = list(model.parameters())
    live.hold(x, y, *params, *(p.grad for p in params),
              *(v for s in optimizer.state.values() for v in s.values()))
    with live:
        step()
    print(f"checkpointed={checkpointed}: {live.before} + {live.peak_above} bytes, MemTracker {expected}")
    assert live.before + live.peak_above == expected
    state = 3 * sum(p.numel() * 4 for p in params)  # parameters, gradients, momentum
    assert live.before == state + x.numel() * 4 + y.numel() * 8


def test_step_peak_measures_the_third_step_and_accumulation_keeps_the_memory_of_one_micro_batch():
    """K = 2 micro-batches of 32 hold about what one batch of 32 holds, far less than one batch of 64: the
    activations of a micro-batch are freed by its backward.  (MemTracker raises NotImplementedError at the
    second forward of a step.)"""
    measured = {}
    for name, n, k in (("64", 64, 1), ("2 x 32", 64, 2), ("32", 32, 1)):
        model, optimizer = vit()
        peak = StepPeak(model, optimizer, CPU)
        train(model, optimizer, 2, n, k)
        assert peak.result()["measured_step"] is None and "not measured" in str(peak)
        train(model, optimizer, 2, n, k)
        measured[name] = peak.result()
    print({name: m["peak_above_bytes"] for name, m in measured.items()})
    assert all(m["measured_step"] == 3 and m["how"] == "live tensors on the CPU" for m in measured.values())
    assert measured["2 x 32"]["peak_above_bytes"] < 0.6 * measured["64"]["peak_above_bytes"]
    assert measured["2 x 32"]["peak_above_bytes"] < 1.1 * measured["32"]["peak_above_bytes"]
    for m in measured.values():
        assert m["peak_bytes"] == m["held_before_bytes"] + m["peak_above_bytes"]


def test_a_buffer_made_unseen_and_freed_in_the_step_is_the_steps_memory_and_resize_counts():
    held = torch.zeros(1000)  # 4000 bytes held before
    made = {}
    live = LiveTensors()
    live.hold(held)
    with live:
        worker = threading.Thread(target=lambda: made.update(t=torch.ones(2000)))  # 8000 bytes, unseen
        worker.start()
        worker.join()
        total = (held.sum() + made.pop("t").sum()).item()  # seen first as an input, then freed
        unseen = live.peak_above
        grown = torch.empty(0)
        grown.untyped_storage().resize_(20000)  # as FSDP2 allocates its gathered parameters
        grown.untyped_storage().resize_(0)  # and frees them
    assert total == 2000
    assert live.before == 4000  # the thread's buffer was not held before the step...
    assert unseen == 8000 + 2 * 4  # ...it was the step's, beside the two sums' results (4-byte floats)
    assert live.peak_above == 20000


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's counters, faked: memory_allocated is what the "device" holds now, max_memory_allocated
    the most since the last reset_peak_memory_stats.  Each training step on the CPU adds 100 bytes for
    its forward and frees them in its optimizer step (hooks stand for the allocator)."""
    calls = []
    state = {"now": 5000, "peak": 5000}

    def add(n):
        state["now"] += n
        state["peak"] = max(state["peak"], state["now"])

    def reset(device):
        calls.append(("reset", state["now"]))
        state["peak"] = state["now"]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync",)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    return calls, add


def test_on_a_gpu_the_peak_above_is_max_memory_allocated_minus_what_was_allocated_when_the_step_began(fake_cuda):
    calls, add = fake_cuda
    model, optimizer = vit(width=32, depth=1)
    peak = StepPeak(model, optimizer, torch.device("cuda", 0))
    step_number = iter(range(1, 10))
    sizes = {}
    model.register_forward_hook(lambda *_: add(sizes.setdefault("forward", 100 * next(step_number))))
    optimizer.register_step_post_hook(lambda *_: (add(-sizes.pop("forward")), add(7)))  # 7 bytes stay
    train(model, optimizer, 4, n=4)
    # steps 1 and 2 left 14 bytes, so step 3 began at 5014 and reached 5014 + 300 before its step freed them
    assert calls.count(("reset", 5014)) == 1 and len([c for c in calls if c[0] == "reset"]) == 1
    assert peak.result() == {"measured_step": 3, "how": "torch.cuda.max_memory_allocated",
                             "held_before_bytes": 5014, "peak_above_bytes": 300, "peak_bytes": 5314}
    assert "torch.cuda.max_memory_allocated" in str(peak)


def test_a_compiled_model_on_the_cpu_is_not_measured():
    model, optimizer = vit(width=32, depth=1)
    compiled = torch.compile(model, backend="eager")
    peak = StepPeak(compiled, optimizer, CPU)
    assert peak.result()["peak_bytes"] is None and "torch.compile" in str(peak)
