"""Lesson 8's bookkeeping: the 1-process reference curve, moving means, and how far a run's curve is from it.

A curve is a list of (samples seen by all ranks, loss).  The reference is the 1-process curve of the same
settings (dataset, model, batch per rank, base lr, seed, samples), kept as run_dir/reference_ws1_*.csv.
Every comparison is also kept in run_dir/gaps.json, one entry per world size and lr, so that a run with
the scaled lr and one without (--no-scale) can be set side by side, whichever ran first.
"""
import bisect
import csv
import json
from pathlib import Path

from course.training.output import plot_curves, write_csv, write_json

LESSON = "day1/8_mnist_ddp_pt_lr.py"


def reference_path(args) -> Path:
    """One reference per setting that changes the 1-process curve (not the world size, nor --no-scale)."""
    return args.run_dir / (f"reference_ws1_{args.dataset}_{args.model}_b{args.batch_size}_lr{args.lr:g}"
                           f"_seed{args.seed}_n{args.train_samples or 'all'}.csv")


def load_curve(path: Path) -> list:
    with open(path, newline="") as f:
        return [(int(r["samples_seen"]), float(r["loss"])) for r in csv.DictReader(f)]


def save_reference(path: Path, curve: list) -> None:
    """Keep the longest 1-process curve: a shorter run of the same settings is a prefix of it."""
    if path.exists() and load_curve(path)[-1][0] >= curve[-1][0]:
        return
    write_csv(path, [{"samples_seen": s, "loss": f"{loss:.6f}"} for s, loss in curve])


def samples_needed(args, world_size: int) -> int:
    per_epoch = args.train_samples or 60_000
    total = args.epochs * per_epoch
    return min(total, args.max_steps * world_size * args.batch_size) if args.max_steps else total


def has_reference(args, world_size: int) -> bool:
    """Whether run_dir holds a 1-process curve covering what a run of `world_size` ranks will see."""
    path = reference_path(args)
    return path.exists() and load_curve(path)[-1][0] >= samples_needed(args, world_size)


def moving_mean(curve: list, at: list, window: float) -> list:
    """For each x in `at`: the mean loss of `curve`'s points with samples seen in (x - window, x]."""
    xs, sums = [x for x, _ in curve], [0.0]
    for _, loss in curve:
        sums.append(sums[-1] + loss)
    means = []
    for x in at:
        lo, hi = bisect.bisect_right(xs, x - window), bisect.bisect_right(xs, x)
        means.append((sums[hi] - sums[lo]) / (hi - lo) if hi > lo else float("nan"))
    return means


def smooth(curve: list, window: float) -> list:
    """(samples seen, moving mean of the loss over the last `window` samples), from the first full window
    (the curve itself when it is shorter than one window)."""
    at = [x for x, _ in curve if x >= window]
    return list(zip(at, moving_mean(curve, at, window))) if at else curve


def deviation(curve: list, reference: list, window: float, after: float):
    """The gap between the smoothed curves at `curve`'s points after `after` samples (and within the
    reference): max and mean |gap|, and the mean gap (> 0: `curve` is higher, behind the reference)."""
    at = [x for x, _ in curve if max(after, window) <= x <= reference[-1][0]]
    if not at:
        return None
    gaps = [(x, mine - ref) for x, mine, ref in
            zip(at, moving_mean(curve, at, window), moving_mean(reference, at, window))]
    worst = max(gaps, key=lambda g: abs(g[1]))
    return {"max_abs": round(abs(worst[1]), 5), "at_samples": worst[0],
            "mean_abs": round(sum(abs(g) for _, g in gaps) / len(gaps), 5),
            "mean": round(sum(g for _, g in gaps) / len(gaps), 5), "points": len(gaps),
            "window_samples": window, "after_samples": after}


def reference_flags(args) -> str:
    flags = [f"--dataset {args.dataset}", f"--model {args.model}", f"--batch-size {args.batch_size}",
             f"--lr {args.lr:g}", f"--seed {args.seed}", f"--epochs {args.epochs}", f"--run-dir {args.run_dir}"]
    if args.train_samples:
        flags.append(f"--train-samples {args.train_samples}")
    return " ".join(flags)


def _behind(gap: float) -> str:
    return f"{abs(gap):.4f} " + ("behind (higher than)" if gap > 0 else "ahead of (lower than)")


def compare(curve: list, world_size: int, lr: float, args):
    """Print how far this run's smoothed loss is from the 1-process curve, and, when run_dir holds the same
    comparison with the other lr (scaled or not), set the two side by side.  None without a reference."""
    reference_file = reference_path(args)
    if world_size == 1:
        save_reference(reference_file, curve)
        print(f"1 process: this run is the reference, saved as {reference_file}", flush=True)
        return None
    if not reference_file.exists():
        print(f"no 1-process reference for these settings in {args.run_dir}: make it with\n"
              f"  python {LESSON} --nproc 1 {reference_flags(args)}\n"
              f"and run this again (started with plain python, the lesson makes it itself)", flush=True)
        return None
    reference = load_curve(reference_file)
    if reference[-1][0] < curve[-1][0]:
        print(f"the reference covers the first {reference[-1][0]} of this run's {curve[-1][0]} samples; "
              f"comparing those", flush=True)
    result = deviation(curve, reference, args.smooth_samples, args.compare_after)
    if result is None:
        print(f"too few samples to compare after {args.compare_after} (--compare-after, --smooth-samples)")
        return None
    print(f"against 1 process at equal samples seen (moving mean over {args.smooth_samples} samples, after the "
          f"first {args.compare_after}): max |gap| {result['max_abs']:.4f} at {result['at_samples']} samples, "
          f"mean |gap| {result['mean_abs']:.4f}; on average {_behind(result['mean'])} the 1-process curve",
          flush=True)
    side_by_side(args, world_size, lr, not args.no_scale, reference_file, result)
    return result


def side_by_side(args, world_size: int, lr: float, scaled: bool, reference_file: Path, result: dict) -> None:
    """Keep this comparison in run_dir/gaps.json and compare it with the other lr's, if there is one."""
    path = args.run_dir / "gaps.json"
    gaps = json.loads(path.read_text()) if path.exists() else {}
    key = f"{reference_file.name} {world_size} ranks {'scaled' if scaled else 'not scaled'}"
    gaps[key] = {"world_size": world_size, "lr": lr, "scaled": scaled, **result}
    write_json(path, gaps)
    other = gaps.get(f"{reference_file.name} {world_size} ranks {'not scaled' if scaled else 'scaled'}")
    if other is None:
        again = "--no-scale" if scaled else "without --no-scale"
        other_lr = args.lr if scaled else args.lr * world_size
        print(f"run the same command {again} to see {world_size} ranks with lr {other_lr:g} against the same "
              f"curve", flush=True)
        return
    with_scale, without = (gaps[key], other) if scaled else (other, gaps[key])
    closer = without["mean_abs"] / with_scale["mean_abs"] if with_scale["mean_abs"] else float("inf")
    print(f"{world_size} ranks against 1 process: with the lr scaled to {with_scale['lr']:g} on average "
          f"{_behind(with_scale['mean'])}, at most {with_scale['max_abs']:.4f} apart; with the 1-process lr "
          f"{without['lr']:g} on average {_behind(without['mean'])}, at most {without['max_abs']:.4f} apart.",
          flush=True)
    if closer > 1:
        print(f"Scaling the lr with the world size keeps the {world_size}-rank curve {closer:.1f}x closer to "
              f"1 process than the unscaled lr does.", flush=True)
    else:
        print(f"Here the unscaled lr kept the {world_size}-rank curve as close to 1 process as the scaled one "
              f"({1 / closer:.1f}x): compare after more samples (--compare-after, more epochs).", flush=True)


def plot(path: Path, curve: list, world_size: int, lr: float, compared: bool, args) -> None:
    """This run's smoothed curve, and the 1-process reference's when it was compared with it."""
    curves = {f"{world_size} ranks x batch {args.batch_size}, lr {lr:g}": smooth(curve, args.smooth_samples)}
    if compared:
        curves = {f"1 process x batch {args.batch_size}, lr {args.lr:g}":
                  smooth(load_curve(reference_path(args)), args.smooth_samples), **curves}
    plot_curves(path, {label: tuple(zip(*points)) for label, points in curves.items()},
                "samples seen (all ranks)", f"training loss, moving mean over {args.smooth_samples} samples",
                f"{args.model}: {world_size} ranks against 1 process, compared after {args.compare_after}")
