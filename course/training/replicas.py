"""Lesson 3's bookkeeping: what each rank trained, as fingerprints, and rank 0's report comparing them; and
lesson 11's check that the replicas are still identical."""
import hashlib

import torch
import torch.distributed as dist

from course.training.output import save_weights, write_json


def fingerprint(tensors) -> str:
    """16 hex digits of a SHA-256 over the tensors' bytes: equal fingerprints, equal tensors."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def notes(rank: int, model, order, steps: int, seconds: float) -> dict:
    """One rank's notes: its weights' fingerprint, its data order's (a hashlib object fed the indices)."""
    return {"rank": rank, "weights": fingerprint(model.state_dict().values()),
            "data_order": order.hexdigest()[:16], "steps": steps, "train_seconds": seconds}


def report(everyone: list, args, steps: int, accuracy: float, model) -> None:
    """Rank 0: every rank's notes side by side, metrics.json and model.pt."""
    world_size = len(everyone)
    same_weights = len({r["weights"] for r in everyone}) == 1
    same_order = len({r["data_order"] for r in everyone}) == 1
    for r in everyone:
        print(f"  rank {r['rank']}: weights {r['weights']}  data order {r['data_order']}  "
              f"{r['steps']} steps  {r['train_seconds']:.1f} s")
    print(f"identical weights on all {world_size} ranks: {same_weights}; identical data order: {same_order}.",
          flush=True)
    if world_size > 1:
        print(f"{world_size} processes did {world_size} x {steps} steps to produce one model: this is replication, "
              "not data parallelism (lesson 4 splits the data instead).", flush=True)
    write_json(args.run_dir / "metrics.json", {
        "lesson": "3_mnist_distributed", "dataset": args.dataset, "model": args.model,
        "world_size": world_size, "batch_size": args.batch_size, "steps": steps,
        "test_accuracy": accuracy, "identical_weights": same_weights, "identical_data_order": same_order,
        "ranks": everyone})
    save_weights(args.run_dir / "model.pt", model)


def identical_on_all_ranks(tensors) -> bool:
    """Every rank calls it: whether these tensors are equal on every rank, number for number, a NaN equal to a
    NaN (weights that became NaN everywhere are still identical replicas); one all_gather of them all,
    flattened into one tensor."""
    mine = torch.cat([t.detach().reshape(-1) for t in tensors])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.allclose(t, everyone[0], rtol=0, atol=0, equal_nan=True) for t in everyone)
