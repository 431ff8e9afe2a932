"""What a data-parallel training run leaves behind (lessons 4 to 8 and 10 to 12): the loss of every step averaged
over the ranks, and rank 0's metrics.json, model.pt, loss.png and closing line.

    losses = results.mean_over_ranks(losses)  # on every rank: one all_reduce
    if rank == 0:
        results.write(args, model, losses, seconds, accuracy, test_loss, len(sampler))
"""
import torch
import torch.distributed as dist

from course.training.output import plot_curves, save_weights, write_json


def mean_over_ranks(losses: list) -> list:
    """The loss of each global batch: this rank's loss tensors, one a step, summed over the ranks in ONE
    all_reduce at the end (not one a step) and divided by the world size.  Every rank must call it."""
    losses = torch.stack(losses)
    dist.all_reduce(losses)
    return (losses / dist.get_world_size()).tolist()


def write(args, model, losses: list, seconds: float, accuracy: float, test_loss: float, shard: int, *,
          samples: int = None, ranks: str = "", line: bool = True, plot: bool = True, title: str = "",
          **extra) -> dict:
    """Rank 0: metrics.json (the run's settings and results, then `extra`), model.pt (unwrapped from DDP),
    loss.png (the mean loss of every step) and one line "W ranks x batch b = global batch W*b; test accuracy".

    `args.lesson`: the lesson's name (course/launching/cli.py sets it); `losses`: mean_over_ranks' list (its length is
    the number of steps); `shard`: the samples in one rank's shard per epoch (len(sampler)), which caps the
    samples seen, unless the lesson counted them itself (`samples`: lessons 8 and 11).
    `ranks`: what the line calls the ranks ("W ranks" unless given); `line=False`: no line (lessons 7, 8, 11
    and 12 end with their own); `plot=False`: no loss.png (lesson 8 draws its own); `title`: the plot's.
    `extra` adds keys to metrics.json or replaces one (lesson 8's lr, lesson 11's dataset and epochs).
    Returns metrics.json's contents."""
    world_size, step, run = dist.get_world_size(), len(losses), args.run_dir
    global_batch = world_size * args.batch_size
    if samples is None:
        samples = min(step * global_batch, args.epochs * world_size * shard)
    metrics = {
        "lesson": args.lesson, "dataset": args.dataset, "model": args.model,
        "world_size": world_size, "backend": dist.get_backend(), "batch_size": args.batch_size,
        "global_batch_size": global_batch, "lr": args.lr, "epochs": args.epochs, "steps": step,
        "samples_seen": samples, "train_seconds": seconds, "samples_per_second": samples / seconds,
        "test_accuracy": accuracy, "test_loss": test_loss, "loss_per_step": losses, **extra}
    write_json(run / "metrics.json", metrics)
    save_weights(run / "model.pt", model)
    if plot:
        plot_curves(run / "loss.png", {f"{world_size} ranks": (range(1, step + 1), losses)}, "step",
                    "training loss (mean over ranks)", title or f"{args.model}, global batch {global_batch}")
    if line:
        print(f"{ranks or f'{world_size} ranks'} x batch {args.batch_size} = global batch {global_batch}; "
              f"test accuracy {accuracy:.4f}; outputs in {run}", flush=True)
    return metrics
