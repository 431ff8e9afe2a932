"""Lesson 11's check that streaming trains on each sample exactly once per epoch, across all ranks.

Every rank counts the indices of the samples it trained on; after the epoch an all_reduce sums the counts
over the ranks: a count of 1 everywhere means each sample once, 0 a sample no rank got, 2 a repeated one.
With --save-order the ranks also keep the order of their samples, for order.json.
"""
import torch
import torch.distributed as dist


class Coverage:
    def __init__(self, num_samples: int, device, save_order: bool = False):
        self.num_samples, self.device, self.save_order = num_samples, device, save_order
        self.epochs, self.order = [], []  # one summary per epoch; this rank's order, per epoch

    def start_epoch(self) -> None:
        self.seen = torch.zeros(self.num_samples, dtype=torch.int32, device=self.device)
        self.order.append([])

    def add(self, index: torch.Tensor) -> None:
        """The indices of the samples of one batch this rank trained on."""
        self.seen.index_add_(0, index.to(self.device),
                             torch.ones(len(index), dtype=torch.int32, device=self.device))
        if self.save_order:
            self.order[-1] += index.tolist()

    def end_epoch(self, epoch: int, steps: list, num_chunks: int, world_size: int) -> str:
        """Sum the counts over the ranks (every rank calls it); return the epoch's summary in words."""
        dist.all_reduce(self.seen)  # how often each sample was trained on, summed over ranks
        once = int((self.seen == 1).sum())
        summary = {"epoch": epoch, "samples": self.num_samples, "trained": int(self.seen.sum()),
                   "seen_once": once, "seen_never": int((self.seen == 0).sum()),
                   "seen_more": int((self.seen > 1).sum()), "steps_per_rank": steps,
                   "chunks_per_rank": [len(range(r, num_chunks, world_size)) for r in range(world_size)]}
        self.epochs.append(summary)
        return ("each seen exactly once" if once == self.num_samples else
                f"{once} seen once, {summary['seen_never']} never, {summary['seen_more']} more often")

    def all_orders(self, world_size: int) -> list:
        """Every rank's order (every rank calls it): orders[epoch][rank]."""
        orders = [None] * world_size
        dist.all_gather_object(orders, self.order)
        return [[orders[r][e] for r in range(world_size)] for e in range(len(self.epochs))]
