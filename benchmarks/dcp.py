"""Section dcp: lesson 16's distributed checkpoints against lesson 12's one file, at 2 and 4 ranks.

Each rank builds the ViT, shards it with fully_shard per block and on the root (lesson 15), and takes one
SGD step so that the momentum exists: the state is the weights and the momentum, fp32.
- save: dcp.save of every rank's shards (each rank writes its own file, rank 0 .metadata) against lesson
  12's way applied to a sharded model: the whole state gathered onto rank 0 (get_state_dict with
  full_state_dict and cpu_offload) and written there with torch.save.  MB/s of the whole state, the
  slowest rank's time, best of the rounds (each round writes a new directory).
- load: dcp.load into every rank's shards (+ set_state_dict) against torch.load of the one file on every
  rank, then set_state_dict(full_state_dict=True), which keeps each rank's rows.
- digest: the sha256 of every file a save wrote, each rank its own file (as lesson 16's
  course/checkpoints/dcp.py's Writer does inside the save; rank 0 also .metadata), against dcp.save itself; the sha256
  of lesson 12's one file against torch.save on rank 0; and at a load each rank hashing its share of the
  files, against dcp.load.  The course's goal: the digest at most 10 % of the save.
- stall: k training steps with no save, with a dcp.save after every step, and with a dcp.async_save after
  every step, with its thread executor and with its process executor (on a gloo group of its own; each save
  first waits for the previous one, as lesson 16 does; every save through lesson 16's Writer): the extra time
  per step against no save is the save's stall on the training loop.  async_save copies (stages) the state
  to CPU memory before it returns: the time in that call and the copy inside it (the Writer's stage(),
  which async_save calls, timed by the Writer as lesson 16 reports it) are measured for every save, to say
  which part of the stall the copy is.  The process executor starts a process per rank at its first save:
  that first save is timed apart.
The files go to a directory under --out, so mostly to the page cache: the rows measure the checkpoint code
path, the collectives and the serialization, not a parallel file system.  On one 2-core machine the ranks
and the async saver's thread share the cores.
"""
import itertools
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import Row, max_over_ranks, spawn
from course.checkpoints.files import sha256_of
from course.models import ViT
from data_tools.datasets import InMemoryMNIST


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return max_over_ranks(time.perf_counter() - start)


def _worker(rank, world, cfg):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from course.checkpoints.dcp import Writer, copy_seconds
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = ViT(7, cfg["width"], cfg["depth"], cfg["heads"])
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ds = InMemoryMNIST(cfg["dataset"], "train", cfg["data_dir"], limit=cfg["batch"] * world * 4)
    data = [(ds.images[i:i + cfg["batch"]], ds.labels[i:i + cfg["batch"]])
            for i in range(rank * cfg["batch"], len(ds.labels), world * cfg["batch"])]

    def steps(k, save=None):
        for x, y in itertools.islice(itertools.cycle(data), k):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if save:
                save()

    steps(1)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 2  # weights + momentum
    root = Path(cfg["dir"])
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    counter = itertools.count()

    def fresh() -> Path:
        return root / f"r{next(counter)}"  # the same name on every rank: they count alike

    def dcp_save(path):
        m, o = get_state_dict(model, optimizer)
        dcp.save({"model": m, "optimizer": o}, checkpoint_id=path)

    def rank0_save(path):
        m, o = get_state_dict(model, optimizer, options=full)  # every rank takes part in the gathers
        if rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            torch.save({"model": m, "optimizer": o}, path / "state.pt")

    def dcp_load(path):
        m, o = get_state_dict(model, optimizer)
        dcp.load({"model": m, "optimizer": o}, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=m, optim_state_dict=o)

    def file_load(path):
        saved = torch.load(path / "state.pt", weights_only=True)
        set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"],
                       options=StateDictOptions(full_state_dict=True))

    def own_files(path):  # what lesson 16's Writer (course/checkpoints/dcp.py) hashes on this rank (rank 0: .metadata)
        return [p for p in sorted(path.iterdir()) if p.name.startswith(f"__{rank}_")
                or (rank == 0 and p.name == ".metadata")]

    def share(path):  # what each rank verifies at a resume: every W-th file by name
        return sorted(p for p in path.iterdir() if p.is_file())[rank::world]

    names = ("dcp save", "rank-0 save", "dcp load", "file load", "dcp digest", "file digest", "share digest")
    best = {k: float("inf") for k in names}
    for _ in range(cfg["rounds"]):
        a, b = fresh(), fresh()
        best["dcp save"] = min(best["dcp save"], _timed(lambda: dcp_save(a)))
        best["rank-0 save"] = min(best["rank-0 save"], _timed(lambda: rank0_save(b)))
        best["dcp digest"] = min(best["dcp digest"], _timed(lambda: [sha256_of(f) for f in own_files(a)]))
        best["file digest"] = min(best["file digest"], _timed(lambda: rank == 0 and sha256_of(b / "state.pt")))
        best["share digest"] = min(best["share digest"], _timed(lambda: [sha256_of(f) for f in share(a)]))
        best["dcp load"] = min(best["dcp load"], _timed(lambda: dcp_load(a)))
        best["file load"] = min(best["file load"], _timed(lambda: file_load(b)))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(a), shutil.rmtree(b)

    saver = dist.new_group(backend="gloo")
    pending, calls, copies = [], {"thread": [], "process": []}, {"thread": [], "process": []}

    def async_save(kind):
        if pending:
            pending.pop().result()  # the previous save written before the next begins
        m, o = get_state_dict(model, optimizer)
        path, called = fresh(), time.perf_counter()
        pending.append(dcp.async_save({"model": m, "optimizer": o}, storage_writer=Writer(path), process_group=saver,
                                      async_checkpointer_type=AsyncCheckpointerType(kind)))
        calls[kind].append(time.perf_counter() - called)  # the copy (staging), then the hand-over
        copies[kind].append(copy_seconds(path))  # the copy alone, timed in Writer.stage

    def sync_save():
        m, o = get_state_dict(model, optimizer)
        dcp.save({"model": m, "optimizer": o}, storage_writer=Writer(fresh()))

    def with_async(kind):
        return lambda: (steps(k, lambda: async_save(kind)), pending.pop().result())  # the last one written too

    def first_save():  # the process executor's first save starts a process per rank (a fresh Python, torch)
        async_save("process")
        pending.pop().result()

    first_process = _timed(first_save)
    calls["process"].clear()
    copies["process"].clear()

    def clean():
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)

    k = cfg["steps"]
    step = {k_: float("inf") for k_ in ("none", "sync", "thread", "process")}
    for _ in range(cfg["rounds"]):
        step["none"] = min(step["none"], _timed(lambda: steps(k)) / k)
        step["sync"] = min(step["sync"], _timed(lambda: steps(k, sync_save)) / k)
        clean()
        for kind in ("thread", "process"):
            step[kind] = min(step[kind], _timed(with_async(kind)) / k)
            clean()
    call = {kind: max_over_ranks(statistics.median(c)) for kind, c in calls.items()}
    copy = {kind: max_over_ranks(statistics.median(c)) for kind, c in copies.items()}
    return {"best": best, "step": step, "bytes": state_bytes, "call": call, "copy": copy,
            "first_process": first_process}


def _ratio(a: float, b: float, base: float) -> str:
    """(a - base) / (b - base), the ratio of two stalls, or why there is none (noise can make one negative)."""
    return f"{(a - base) / (b - base):.2f}" if a > base and b > base else "n/a (a stall within the noise)"


def run(ctx):
    cfg = {"dataset": ctx.dataset, "data_dir": str(ctx.data_dir) if ctx.data_dir else None,
           "width": ctx.pick(32, 256, 512), "depth": ctx.pick(2, 4, 8), "heads": ctx.pick(2, 4, 8),
           "batch": 32, "rounds": ctx.pick(1, 3, 5), "steps": ctx.pick(2, 4, 8)}
    model = f"vit w{cfg['width']} d{cfg['depth']}"
    rows = []
    for world in (2, 4):
        cfg["dir"] = str(ctx.out / f"dcp-{world}")
        r = spawn(_worker, world, cfg)
        mb = r["bytes"] / 2 ** 20
        b, s = r["best"], r["step"]
        tag = f"{model}, {world} ranks:"
        note = f"{mb:.1f} MB of weights + momentum, best of {cfg['rounds']} rounds, page cache"
        rows += [
            Row("dcp", f"{tag} save, dcp.save (every rank its shards)", mb / b["dcp save"], "MB/s",
                b["rank-0 save"] / b["dcp save"], "torch.save on rank 0 (> 1: faster)", note=note),
            Row("dcp", f"{tag} save, torch.save on rank 0 (state gathered first)", mb / b["rank-0 save"], "MB/s"),
            Row("dcp", f"{tag} load, dcp.load (every rank its rows)", mb / b["dcp load"], "MB/s",
                b["file load"] / b["dcp load"], "torch.load on every rank (> 1: faster)"),
            Row("dcp", f"{tag} load, torch.load of the one file on every rank", mb / b["file load"], "MB/s"),
            Row("dcp", f"{tag} train step, no save", s["none"] * 1e3, "ms/step",
                note=f"batch {cfg['batch']} per rank, best of {cfg['rounds']} rounds of {cfg['steps']} steps"),
            Row("dcp", f"{tag} stall per step, dcp.save after every step", (s["sync"] - s["none"]) * 1e3, "ms",
                s["sync"] / s["none"], "step without a save (> 1: slower)"),
            Row("dcp", f"{tag} stall per step, dcp.async_save after every step", (s["thread"] - s["none"]) * 1e3,
                "ms", s["thread"] / s["none"], "step without a save (> 1: slower)",
                note=f"thread executor (the default); async / sync stall: {_ratio(s['thread'], s['sync'], s['none'])}"),
            Row("dcp", f"{tag} stall per step, dcp.async_save (process executor) after every step",
                (s["process"] - s["none"]) * 1e3, "ms", s["process"] / s["none"], "step without a save (> 1: slower)",
                note=f"process / thread stall: {_ratio(s['process'], s['thread'], s['none'])}; its first save "
                     f"(starts a process per rank) took {r['first_process']:.1f} s, not counted"),
            *(row for kind in ("thread", "process") for row in (
                Row("dcp", f"{tag} async_save's call until it returns, {kind} executor", r["call"][kind] * 1e3, "ms",
                    r["call"][kind] / s[kind], "the step with that save (its stall included)",
                    note="median over the saves, slowest rank"),
                Row("dcp", f"{tag} the copy inside that call (the Writer's stage()), {kind} executor",
                    r["copy"][kind] * 1e3, "ms", r["copy"][kind] / max(r["call"][kind], 1e-9), "the whole call",
                    note="median over the saves, slowest rank"))),
            Row("dcp", f"{tag} sha256 of every file of a save, each rank its own (lesson 16)",
                b["dcp digest"] * 1e3, "ms", b["dcp digest"] / b["dcp save"], "dcp.save of the same state",
                note="slowest rank, best of the rounds").check("<=", 0.10),
            Row("dcp", f"{tag} sha256 of the one file on rank 0 (lesson 12)", b["file digest"] * 1e3, "ms",
                b["file digest"] / b["rank-0 save"], "torch.save on rank 0 (state gathered first)").check("<=", 0.10),
            Row("dcp", f"{tag} sha256 of each rank's share of the files, at a resume", b["share digest"] * 1e3, "ms",
                b["share digest"] / b["dcp load"], "dcp.load of the same checkpoint"),
        ]
    return rows
