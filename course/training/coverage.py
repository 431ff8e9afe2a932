"""Lesson 11's bookkeeping: which samples each rank trained on, the loss of every step, and how long each
rank waited for data; summed over the ranks after every epoch and at the end.

Coverage: every rank counts the indices of the samples it trained on; after the epoch an all_reduce sums the
counts over the ranks: a count of 1 everywhere means each sample once, 0 a sample no rank got, 2 a repeated
one.  With --save-order the ranks also keep the order of their samples, for order.json.

Losses: ranks take different numbers of steps in an epoch (the one with a chunk less runs out early and
shadows the others under join()), so each epoch's losses sit in a tensor as long as the longest rank's epoch,
NaN where this rank had no batch; the mean over the ranks ignores the NaNs.
"""
import time

import torch
import torch.distributed as dist

from course.training.output import rank_print, write_json
from course.training.replicas import identical_on_all_ranks
from data_tools.h5stream import chunk_bounds


class Coverage:
    def __init__(self, num_samples: int, device, save_order: bool = False):
        self.num_samples, self.device, self.save_order = num_samples, device, save_order
        self.epochs, self.order, self.losses = [], [], []  # per epoch: summary; this rank's order; its losses
        self.steps = self.own_steps = 0  # steps taken part in (with join()'s shadow steps); on own batches
        self.wait = 0.0  # seconds this rank waited for its next batch

    def start_epoch(self, my_chunks: list, chunks, args) -> list:
        """Every rank calls it: returns every rank's number of steps this epoch, from the samples in its chunks
        (one chunk more or less between ranks: their steps differ), or fewer where --max-steps ends training."""
        samples = sum(stop - start for start, stop in
                      (chunk_bounds(c, chunks.chunk_samples, chunks.num_samples) for c in my_chunks))
        my_steps = -(-samples // args.batch_size)
        if args.max_steps:
            my_steps = min(my_steps, args.max_steps - self.steps)
        steps = [None] * dist.get_world_size()
        dist.all_gather_object(steps, my_steps)
        self.seen = torch.zeros(self.num_samples, dtype=torch.int32, device=self.device)
        self.order.append([])
        self.losses.append(torch.full((max(steps),), float("nan"), device=self.device))
        self.step_in_epoch, self.epoch_steps = 0, steps
        return steps

    def timed(self, batches):
        """The batches, unchanged, adding the time spent waiting for each to self.wait."""
        ready = time.perf_counter()
        for batch in batches:
            self.wait += time.perf_counter() - ready
            yield batch
            ready = time.perf_counter()

    def add(self, index: torch.Tensor, loss: torch.Tensor) -> None:
        """The indices of the samples of one batch this rank trained on, and its loss."""
        self.seen.index_add_(0, index.to(self.device),
                             torch.ones(len(index), dtype=torch.int32, device=self.device))
        self.losses[-1][self.step_in_epoch] = loss.detach()
        self.step_in_epoch += 1
        if self.save_order:
            self.order[-1] += index.tolist()

    def end_epoch(self, epoch: int, num_chunks: int) -> None:
        """Every rank calls it: sums the counts over the ranks; rank 0 says whether each sample was seen once."""
        dist.all_reduce(self.seen)  # how often each sample was trained on, summed over ranks
        rank, world_size, steps = dist.get_rank(), dist.get_world_size(), self.epoch_steps
        self.steps += max(steps)
        self.own_steps += steps[rank]
        once = int((self.seen == 1).sum())
        summary = {"epoch": epoch, "samples": self.num_samples, "trained": int(self.seen.sum()),
                   "seen_once": once, "seen_never": int((self.seen == 0).sum()),
                   "seen_more": int((self.seen > 1).sum()), "steps_per_rank": steps,
                   "chunks_per_rank": [len(range(r, num_chunks, world_size)) for r in range(world_size)]}
        self.epochs.append(summary)
        seen = ("each seen exactly once" if once == self.num_samples else
                f"{once} seen once, {summary['seen_never']} never, {summary['seen_more']} more often")
        if rank == 0:
            rank_print(rank, f"epoch {epoch}: {self.num_samples} training samples in {num_chunks} chunks, {seen}; "
                             f"steps per rank {steps}")

    def gather(self, model, optimizer) -> tuple:
        """Every rank calls it, at the end: returns (the loss of every step averaged over the ranks that had a
        batch, whether every rank holds the same weights and the same momentum); keeps every rank's seconds
        waiting for data and, with --save-order, orders[epoch][rank]."""
        world_size = dist.get_world_size()
        losses = torch.cat(self.losses)
        per_rank = [torch.empty_like(losses) for _ in range(world_size)]
        dist.all_gather(per_rank, losses)
        identical = identical_on_all_ranks(
            t for p in model.parameters() for t in (p, optimizer.state[p]["momentum_buffer"]))
        self.waits = [None] * world_size
        dist.all_gather_object(self.waits, round(self.wait, 3))
        if self.save_order:
            everyone = [None] * world_size
            dist.all_gather_object(everyone, self.order)
            self.orders = [[everyone[r][e] for r in range(world_size)] for e in range(len(self.epochs))]
        return torch.stack(per_rank).nanmean(0).tolist(), identical

    def outputs(self, args, layout, identical: bool) -> dict:
        """Rank 0, after gather(): writes order.json (--save-order: the sample order each rank trained on, per
        epoch, order[epoch][rank]); returns what results.write adds to metrics.json for lesson 11."""
        if self.save_order:
            write_json(args.run_dir / "order.json", {"epochs": self.orders})
        source = f"streamed from {args.h5_file.name}" if args.source == "h5" else "the same chunks from memory"
        return {"title": f"{args.model}, {source} (chunks of {layout.chunk_samples})",
                "samples": sum(e["trained"] for e in self.epochs), "dataset": layout.dataset,
                "source": args.source, "h5_file": str(args.h5_file), "chunk_samples": layout.chunk_samples,
                "workers": args.workers, "epochs": len(self.epochs), "per_epoch": self.epochs,
                "replicas_identical": identical, "data_wait_seconds": self.waits}
