"""Exact test accuracy over the whole test set, whatever the world size.

DistributedSampler pads the last shard with repeated samples so that every rank gets the same number;
counting those would make the accuracy wrong.  Instead each rank takes one contiguous, non-overlapping
slice of the test set, counts its correct predictions, and an all_reduce adds up the counts.
"""
import torch
import torch.distributed as dist


@torch.no_grad()
def evaluate(model, test_set, rank: int = 0, world_size: int = 1, batch_size: int = 1000):
    """(accuracy, mean loss, samples counted) over all of `test_set`, summed across ranks.  A DDP-wrapped
    model is evaluated through its `.module` (no DDP hooks)."""
    model = getattr(model, "module", model)
    n = len(test_set)
    start, stop = n * rank // world_size, n * (rank + 1) // world_size
    was_training = model.training
    model.eval()
    device = test_set.labels.device
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # correct, loss sum, count
    for i in range(start, stop, batch_size):
        x, y = test_set[list(range(i, min(i + batch_size, stop)))]
        logits = model(x)
        totals[0] += (logits.argmax(1) == y).sum()
        totals[1] += torch.nn.functional.cross_entropy(logits, y, reduction="sum")
        totals[2] += len(y)
    if world_size > 1:
        dist.all_reduce(totals)  # DIST: the counts of all ranks, each sample counted once
    model.train(was_training)
    correct, loss, count = totals.tolist()
    return correct / count, loss / count, int(count)
