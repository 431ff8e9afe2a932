"""What a run leaves behind: metrics, weights and plots under one run dir, written atomically by rank 0.

Every file is written to a temporary name in the same directory and renamed into place, so a reader (or a
second run writing the same default dir) sees either the old file or the complete new one, never half.
"""
import csv
import io
import json
import os
import sys
import tempfile
from pathlib import Path

import torch


def rank_print(rank: int, *parts) -> None:
    """A per-rank line, prefixed so that the interleaved output of N ranks can be told apart."""
    line = " ".join(str(p) for p in parts)
    sys.stdout.write(f"[rank {rank}] {line}\n")  # one write per line: ranks' lines do not interleave
    sys.stdout.flush()


def _atomic_write(path: Path, write) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def write_json(path, data) -> Path:
    return _atomic_write(path, lambda f: f.write((json.dumps(data, indent=2) + "\n").encode()))


def write_csv(path, rows: list, fieldnames=None) -> Path:
    fieldnames = fieldnames or list(rows[0])
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fieldnames)
    writer.writeheader()
    writer.writerows(rows)
    return _atomic_write(path, lambda f: f.write(buf.getvalue().encode()))


def save_weights(path, model) -> Path:
    """The model's state dict (unwrapped from DDP), on the CPU so it loads anywhere; or a state dict itself
    (lesson 15 gathers its sharded parameters into one first)."""
    model = getattr(model, "module", model)
    state = {k: v.detach().cpu() for k, v in (model if isinstance(model, dict) else model.state_dict()).items()}
    return _atomic_write(path, lambda f: torch.save(state, f))


def load_weights(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def plot_curves(path, curves: dict, xlabel: str, ylabel: str, title: str) -> Path:
    """One PNG with one line per curve; `curves` maps a label to (xs, ys)."""
    import matplotlib

    matplotlib.use("agg")  # headless: compute nodes have no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return _atomic_write(path, lambda f: f.write(buf.getvalue()))


def writable_log_dir(log_dir) -> Path:
    """Create `log_dir` (before any rank starts), or say in one line why it cannot be."""
    from course.launching.cli import CourseError

    log_dir = Path(log_dir)
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(log_dir, os.W_OK):
            raise PermissionError("not writable")
    except OSError as e:
        raise CourseError(f"log dir {log_dir} cannot be written ({e.strerror or e}); "
                          "choose another with --log-dir") from None
    return log_dir
