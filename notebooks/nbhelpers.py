"""What the course's notebooks share: run a lesson for real, show a diff, read outputs, draw diagrams.

Every notebook starts with `from nbhelpers import *`.  The notebooks run the real lesson scripts as separate
processes, the way you would start them in a terminal, so what you see is what the script does:

    run_lesson("day1/4_mnist_manual_ddp.py", "--quick", nproc=2)
        = python -m torch.distributed.run --standalone --nproc_per_node=2 day1/4_mnist_manual_ddp.py --quick
    run_lesson("day1/0_torch_dist.py", "--nproc", "2")
        = python day1/0_torch_dist.py --nproc 2          (the script spawns its own ranks)
    run_lesson("day2/9_torch_dist_multi_node.py", nproc=2, nnodes=2)
        = two torchrun agents on this machine, one per pretend node, meeting at node 0's address and port

`run_lesson` streams the output into the notebook and, like `subprocess.run(..., check=True)`, raises
CalledProcessError when the run fails, so a failed lesson fails its cell (and CI).  Never use a bare
`!torchrun ...` in a notebook: a failing `!` command does not fail the cell.

Two things `run_lesson` does beyond a terminal:
- it hides a few lines that PyTorch prints on some machines and that say nothing about the lesson (NOISE
  below: the CUDA build's `gpuGetDeviceCount failed` on a machine without a GPU, the profiler's `USDT:` lines,
  torchrun's OMP_NUM_THREADS banner); they stay in the text it returns;
- it records every run in the notebook as a small JSON output of type RECORD_MIME (command, seconds, how
  many cores other programs used meanwhile, and the run's throughput read from its metrics.json), which
  tests/test_notebook_consistency.py reads back to check that notebooks agree with each other.
"""
import difflib
import json
import os
import re
import resource
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "runs" / "notebooks"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # so that a notebook can `import course...` to read what a run wrote

__all__ = ["REPO", "RUNS", "run_lesson", "run_dir", "gpu_count", "full_size_nproc", "md", "record_result",
           "ddp_buckets", "diff_counts", "show_diff", "show_diff_stats", "show_tagged", "read_json", "read_csv", "show_table",
           "plt", "RANK_COLORS", "draw_allreduce", "draw_gpus", "draw_replicas", "draw_shards", "draw_buckets",
           "draw_nodes", "draw_chunks", "draw_lr_schedule", "draw_profiler_schedule", "plot_trace"]

# ------------------------------------------------------------------------------------------ plotting setup
import matplotlib  # noqa: E402

if "ipykernel" in sys.modules:
    # small PNGs: committed notebooks stay small and render in any repository browser
    try:
        from IPython import get_ipython

        get_ipython().run_line_magic("matplotlib", "inline")
        get_ipython().run_line_magic("config", "InlineBackend.figure_formats = ['png']")
    except Exception:  # not inside IPython after all: plots simply are not shown
        pass
else:
    matplotlib.use("agg")
import matplotlib.pyplot as plt  # noqa: E402

plt.rcParams.update({"figure.dpi": 80, "savefig.dpi": 80, "figure.figsize": (8, 3.6), "axes.grid": True,
                     "grid.alpha": 0.3, "font.size": 10})
RANK_COLORS = plt.get_cmap("tab10").colors


# ------------------------------------------------------------------------------------------ running lessons

def _display_command(cmd) -> str:
    shown = [Path(c).name if c == sys.executable else c for c in cmd]
    return " ".join(shlex.quote(str(c)) for c in shown)


# Lines that say nothing about the lesson, hidden from the notebook (run_lesson still returns them):
NOISE = [
    # PyTorch's CUDA build on a machine without a GPU, each time the profiler stops
    re.compile(r"gpuGetDeviceCount failed with code \d+"),
    # the profiler's tracing probes, at each start and stop
    re.compile(r"^USDT:.*SyncActivityProfilerHandler"),
    # the profiler, about memory allocated before it started (its memory view then lacks those frees)
    re.compile(r"Memory block of unknown size was allocated before the profiling started"),
    # torchrun's banner when it sets OMP_NUM_THREADS itself
    re.compile(r"Setting OMP_NUM_THREADS environment variable for each process"),
    re.compile(r"^(W\d{4} [\d:.]+ \d+ \S+\] )?\*{20,}\s*$"),
    re.compile(r"^WARNING:torch\.distributed\.run:\s*$"),
    # c10d on machines whose hostname does not resolve
    re.compile(r"hostname of the client socket cannot be retrieved"),
]


def is_noise(line: str) -> bool:
    return any(p.search(line) for p in NOISE)


def _stream(proc, prefix, lines, on_output, errors):
    for line in proc.stdout:
        lines.append(prefix + line)
        if not is_noise(line):
            sys.stdout.write(prefix + line)
            sys.stdout.flush()
        if on_output is not None and not errors:
            try:
                on_output(line)
            except BaseException as e:  # keep reading: a full pipe would block the run
                errors.append(e)


def _torchrun(nproc, *extra):
    return [sys.executable, "-m", "torch.distributed.run", *extra, f"--nproc_per_node={nproc}"]


def run_lesson(script, *args, nproc=None, nnodes=1, env=None, timeout=None, on_output=None) -> str:
    """Run a lesson script from the repository root; stream its output; raise if it fails.

    nproc=None: `python script args` (the script's own launcher, e.g. its --nproc option);
    nproc=N:    `python -m torch.distributed.run --standalone --nproc_per_node=N script args` (torchrun);
    nnodes=K:   K torchrun agents on this machine, each with N ranks, as K nodes of a cluster would start
                (`--nnodes=K --node_rank=k --master_addr=127.0.0.1 --master_port=<free port>`).
    on_output: called with every line the run prints, while it runs (e.g. to send it a signal).
    Returns everything the run printed (stdout and stderr), e.g. to pick numbers out of it.
    """
    path = REPO / script
    if not path.is_file():
        raise FileNotFoundError(f"no lesson script {script} in {REPO}")
    args = [str(a) for a in args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if nproc is not None:  # torchrun's own default, set here so that it does not print a banner about it
        full_env.setdefault("OMP_NUM_THREADS", "1")
    if nnodes > 1:
        if nproc is None:
            raise ValueError("nnodes needs nproc: the ranks each pretend node starts")
        with socket.socket() as s:  # a free port for the rendezvous, never a fixed one
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # each agent is what one node of a cluster runs; node 0's agent hosts the meeting point
        cmds = [_torchrun(nproc, f"--nnodes={nnodes}", f"--node_rank={node}", "--master_addr=127.0.0.1",
                          f"--master_port={port}") + [script, *args]
                for node in range(nnodes)]
        prefixes = [f"[node {node}] " for node in range(nnodes)]
        gpus = _visible_gpus()
        if len(gpus) >= nnodes * nproc:  # like real nodes, each pretend node gets GPUs of its own, as 0..nproc-1
            envs = [{**full_env, "CUDA_VISIBLE_DEVICES": ",".join(gpus[node * nproc:(node + 1) * nproc])}
                    for node in range(nnodes)]
        else:
            envs = [full_env] * nnodes
    elif nproc is not None:
        cmds, prefixes, envs = [_torchrun(nproc, "--standalone") + [script, *args]], [""], [full_env]
    else:
        cmds, prefixes, envs = [[sys.executable, script, *args]], [""], [full_env]

    for cmd in cmds:
        print("$", _display_command(cmd), flush=True)
    others_before = _other_cores_now()
    before, t0 = _cpu_counters(), time.perf_counter()
    lines, procs, threads, errors = [], [], [], []
    for cmd, prefix, cmd_env in zip(cmds, prefixes, envs):
        proc = subprocess.Popen(cmd, cwd=REPO, env=cmd_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        procs.append(proc)
        threads.append(threading.Thread(target=_stream, args=(proc, prefix, lines, on_output, errors),
                                        daemon=True))
        threads[-1].start()
    try:
        codes = [proc.wait(timeout=timeout) for proc in procs]
    except BaseException:  # a timeout or the notebook's stop button: leave no rank behind
        for proc in procs:
            proc.terminate()  # SIGTERM: torchrun and the course's own launcher pass it on to their ranks
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise
    finally:
        for t in threads:
            t.join(timeout=10)
    seconds, after = time.perf_counter() - t0, _cpu_counters()
    output = "".join(lines)
    if errors:
        raise errors[0]
    for cmd, code in zip(cmds, codes):
        if code != 0:  # what subprocess.run(..., check=True) does: the cell fails
            raise subprocess.CalledProcessError(code, _display_command(cmd), output)
    _record_run(script, args, nproc, nnodes, seconds, before, after, max(others_before, _other_cores_now()))
    return RunOutput(output)


# ------------------------------------------------------------------------------------------ recording runs

RECORD_MIME = "application/vnd.course.run+json"


def _cpu_counters():
    """(CPU seconds used by all programs on this machine, CPU seconds used by this kernel and the runs it
    started), or None where /proc/stat does not exist."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    ours = sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for field in ("ru_utime", "ru_stime"))
    return busy, ours


def _other_cores_now(seconds=0.25) -> float:
    """How many cores other programs keep busy right now (a short sample while this notebook waits)."""
    before = _cpu_counters()
    time.sleep(seconds)
    after = _cpu_counters()
    if not (before and after):
        return 0.0
    return round(max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / seconds, 2)


def _display_record(record):
    from IPython.display import display

    # text/plain is empty: the record is for tests/test_notebook_consistency.py, the run's own output is above
    display({RECORD_MIME: record, "text/plain": ""}, raw=True)


def _threads(script, args, nproc):
    """Threads per rank the run used: what course.launching.launch sets (the CPUs this process may use / ranks
    of the node) unless OMP_NUM_THREADS is set; torchrun runs here get OMP_NUM_THREADS=1."""
    if nproc is not None:
        return int(os.environ.get("OMP_NUM_THREADS", 1))
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    ranks = int(args[args.index("--nproc") + 1]) if "--nproc" in args else 1
    from course.launching.devices import usable_cpus

    return max(1, usable_cpus() // ranks)


def _record_run(script, args, nproc, nnodes, seconds, before, after, others_around):
    """Display what the run was and what it measured, for tests/test_notebook_consistency.py.

    other_cores_around: cores other programs used just before and just after the run (the larger);
    other_cores_during: the same over the whole run, an upper bound (a process the run leaves to exit on its
    own, such as a fork server, is not counted as the run's)."""
    if "ipykernel" not in sys.modules:
        return
    record = {"script": script, "args": args, "nproc": nproc, "nnodes": nnodes, "seconds": round(seconds, 3),
              "cores": os.cpu_count(), "other_cores_around": others_around}
    if before and after:
        others = (after[0] - before[0]) - (after[1] - before[1])
        record["other_cores_during"] = round(max(0.0, others) / max(seconds, 1e-6), 2)
    if "--run-dir" in args:
        metrics = REPO / args[args.index("--run-dir") + 1] / "metrics.json"
        if metrics.is_file() and script != "day1/7_mnist_ddp_pt_timing.py":  # 7 records its table itself
            m = json.loads(metrics.read_text())
            device = "cpu" if ("--device" in args and args[args.index("--device") + 1] == "cpu") or not gpu_count() \
                else "cuda"
            result = {"lesson": m.get("lesson"), "model": m.get("model"), "batch_per_rank": m.get("batch_size"),
                      "world_size": m.get("world_size"), "device": device, "sync": m.get("sync"),
                      "threads_per_rank": _threads(script, args, nproc) if device == "cpu" else None}
            if "samples_per_second" in m:
                result.update(samples=m.get("samples_seen"), train_seconds=m["train_seconds"],
                              samples_per_second=m["samples_per_second"])
                record["result"] = result
            elif m.get("ranks") and m.get("world_size") == 1:  # lesson 3 with one process: lesson 2's run
                r = m["ranks"][0]
                samples = r["steps"] * m["batch_size"]
                result.update(samples=samples, train_seconds=r["train_seconds"],
                              samples_per_second=samples / r["train_seconds"])
                record["result"] = result
    _display_record(record)


def record_result(source, **result):
    """Record a result a notebook read from a run's files (e.g. a row of lesson 7's table): model,
    batch_per_rank, world_size, device, threads_per_rank, samples_per_second, train_seconds, ..."""
    if "ipykernel" in sys.modules:
        _display_record({"source": source, "result": result})


def md(text):
    """Show Markdown made from a run's results: numbers in prose come from the run, never typed by hand."""
    from IPython.display import Markdown, display

    display(Markdown(text))


def ddp_buckets(model="mlp", bucket_cap_mb=25.0):
    """The gradient buckets torch DDP really uses for a course model: [[parameter index, ...], ...] in the
    order their all_reduces start, after DDP rebuilt them in the first backward.  Found by wrapping the model
    in DDP in a 1-rank gloo process group, in a separate process (the notebook itself stays free of a
    process group)."""
    code = f"""
import json, os, socket, torch, torch.distributed as dist
from course.models import build_model
s = socket.socket(); s.bind(("127.0.0.1", 0)); os.environ.update(MASTER_ADDR="127.0.0.1",
    MASTER_PORT=str(s.getsockname()[1])); s.close()
dist.init_process_group("gloo", rank=0, world_size=1)
ddp = torch.nn.parallel.DistributedDataParallel(build_model({model!r}, 0), bucket_cap_mb={bucket_cap_mb!r})
for _ in range(5):  # DDP rebuilds its buckets in the order the gradients arrived, after a first backward
    ddp(torch.randn(4, 1, 28, 28)).sum().backward()
    data = ddp._get_ddp_logging_data()
    if "rebuilt_per_bucket_param_indices" in data:
        break
print(json.dumps([[int(i) for i in b.split()] for b in data["rebuilt_per_bucket_param_indices"].split(",")]))
dist.destroy_process_group()
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    return json.loads(out.stdout.strip().splitlines()[-1])


class RunOutput(str):
    """What a run printed: a str (search it, parse it) that IPython does not echo a second time as Out[n]."""

    def _ipython_display_(self):
        pass


def run_dir(name) -> Path:
    """An empty directory runs/notebooks/<name> for this notebook's outputs (relative to the repository)."""
    path = RUNS / name
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path.relative_to(REPO)


def _visible_gpus() -> list:
    """The ids of the GPUs a lesson started from here would see: nvidia-smi's list, narrowed by
    CUDA_VISIBLE_DEVICES (found without importing torch into the notebook)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    ids = [str(i) for i in range(sum(line.startswith("GPU ") for line in out.splitlines()))]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        chosen = [d.strip() for d in visible.split(",") if d.strip()]
        chosen = chosen[:next((i for i, d in enumerate(chosen) if d.startswith("-")), len(chosen))]  # "-1" ends it
        ids = chosen[:len(ids)]
    return ids


def gpu_count() -> int:
    """How many GPUs a lesson started from this notebook would see (0 on a machine without CUDA)."""
    return len(_visible_gpus())


def full_size_nproc(default=2) -> int:
    """All GPUs of this node for the full-size run, or `default` CPU ranks when there is none."""
    return gpu_count() or default


# ------------------------------------------------------------------------------------------ reading outputs

def read_json(path):
    return json.loads((REPO / path).read_text())


def read_csv(path) -> list:
    import csv

    with open(REPO / path, newline="") as f:
        return list(csv.DictReader(f))


def show_table(rows, columns=None, floatfmt="{:.3g}"):
    """A list of dicts as a Markdown table (renders in JupyterLab and in repository browsers)."""
    from IPython.display import Markdown, display

    columns = columns or list(rows[0])

    def fmt(v):
        if isinstance(v, float):
            return floatfmt.format(v)
        return str(v)

    text = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    text += "".join("| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |\n" for r in rows)
    display(Markdown(text))


# ------------------------------------------------------------------------------------------ diffs

def _diff(old, new, context):
    a = (REPO / old).read_text().splitlines()
    b = (REPO / new).read_text().splitlines()
    return list(difflib.unified_diff(a, b, old, new, n=context, lineterm=""))


def _counts(lines):
    """(added, removed) lines of a unified diff, not counting its ---/+++ header."""
    body = lines[2:]
    return sum(l.startswith("+") for l in body), sum(l.startswith("-") for l in body)


_DIFF_STYLES = {"+": "background-color:#e6ffec;color:#116329;display:block",
                "-": "background-color:#ffebe9;color:#a40e26;display:block",
                "@": "background-color:#ddf4ff;color:#57606a;display:block",
                " ": "display:block"}


def show_diff(old, new, context=2):
    """The unified diff of two scripts: + lines are new in `new`, - lines were in `old` only.

    Rendered as HTML with inline colors (JupyterLab, VS Code, nbviewer), with the plain diff as the text
    fallback (a terminal, or a browser that strips styles still shows the +/- lines)."""
    import html

    from IPython.display import display

    lines = _diff(old, new, context)
    added, removed = _counts(lines)
    head = f"{new} against {old}: {added} lines added, {removed} removed"
    body = "".join(f'<span style="{_DIFF_STYLES.get(l[:1], "display:block")}">{html.escape(l) or "&nbsp;"}</span>'
                   for l in lines[2:])  # the ---/+++ header is said in words above
    display({"text/html": f"<p><b>{html.escape(new)}</b> against <b>{html.escape(old)}</b>: {added} lines added "
                          f"(green), {removed} removed (red)</p>\n<pre style=\"font-size:12px;line-height:1.35\">"
                          f"{body}</pre>",
             "text/plain": head + "\n\n" + "\n".join(lines)}, raw=True)


def diff_counts(old, new) -> tuple:
    """(lines added, lines removed) from script `old` to script `new`."""
    return _counts(_diff(old, new, 0))


def show_diff_stats(old, new):
    """Only the size of the change, for scripts that are rewrites of each other rather than edits."""
    added, removed = _counts(_diff(old, new, 0))
    same = difflib.SequenceMatcher(None, (REPO / old).read_text().splitlines(),
                                   (REPO / new).read_text().splitlines()).ratio()
    print(f"{new} against {old}: {added} lines added, {removed} removed, {same:.0%} of the lines in common")


def show_tagged(script, tags=("# DDP:", "# DIST:"), tag=None):
    """The lines of a script that carry a tag: `# DDP:` marks what makes training data-parallel, `# DIST:`
    the other torch.distributed lines (`tag=` picks one)."""
    from IPython.display import Markdown, display

    tags = (tag,) if tag else (tags,) if isinstance(tags, str) else tuple(tags)
    rows = [f"{n:4d}  {line.rstrip()}" for n, line in enumerate((REPO / script).read_text().splitlines(), 1)
            if any(t in line and f"`{t}" not in line for t in tags)]  # not the docstring's `# DDP:` legend
    names = " or ".join(f"`{t}`" for t in tags)
    display(Markdown(f"Lines of **{script}** tagged {names} ({len(rows)}):\n\n```python\n" + "\n".join(rows)
                     + "\n```"))


# ------------------------------------------------------------------------------------------ diagrams

def _box(ax, x, y, w, h, text, color, alpha=0.25, fontsize=9, **kw):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color,
                                ec=color, alpha=alpha, lw=1.5))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, **kw)


def _blank(ax, xlim, ylim):
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.axis("off")


def draw_allreduce(values, op="SUM", title=None):
    """Each rank's tensor before and after all_reduce: every rank ends with the same combined value."""
    n = len(values)
    total = sum(values) if op == "SUM" else max(values)
    fig, ax = plt.subplots(figsize=(1.9 * n + 1.5, 3.2))
    _blank(ax, (-0.3, 1.9 * n), (-0.2, 3.3))
    for r, v in enumerate(values):
        x = 1.9 * r
        _box(ax, x, 2.3, 1.5, 0.8, f"rank {r}\nvalue {v:g}", RANK_COLORS[r % 10])
        _box(ax, x, 0.0, 1.5, 0.8, f"rank {r}\n{total:g}  (mean {total / n:g})", RANK_COLORS[r % 10])
        ax.annotate("", xy=(1.9 * (n - 1) / 2 + 0.75, 1.55), xytext=(x + 0.75, 2.3),
                    arrowprops=dict(arrowstyle="->", color="0.4"))
        ax.annotate("", xy=(x + 0.75, 0.8), xytext=(1.9 * (n - 1) / 2 + 0.75, 1.35),
                    arrowprops=dict(arrowstyle="->", color="0.4"))
    ax.text(1.9 * (n - 1) / 2 + 0.75, 1.45, f"all_reduce({op})", ha="center", va="center", fontsize=10,
            bbox=dict(boxstyle="round", fc="white", ec="0.3"))
    ax.set_title(title or f"all_reduce over {n} ranks: every rank gets the same result")
    plt.show()


def draw_gpus(nproc=4, title=None):
    """One rank per GPU: with set_device(local_rank) before init, and what happens without it."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    for ax, right in zip(axes, (True, False)):
        _blank(ax, (-0.2, 2 * nproc), (-0.3, 3.2))
        for r in range(nproc):
            _box(ax, 2 * r, 2.2, 1.5, 0.8, f"rank {r}\nlocal rank {r}", RANK_COLORS[r % 10])
            _box(ax, 2 * r, 0.0, 1.5, 0.8, f"GPU {r}", "0.5", alpha=0.15 if (right or r) else 0.5)
            target = r if right else 0
            ax.annotate("", xy=(2 * target + 0.75, 0.8), xytext=(2 * r + 0.75, 2.2),
                        arrowprops=dict(arrowstyle="->", color=RANK_COLORS[r % 10], lw=1.5))
        ax.set_title("set_device(local_rank) before init: one GPU each" if right else
                     "forgotten: every rank on GPU 0 (memory, hangs)", fontsize=10)
    fig.suptitle(title or "NCCL: each rank owns one GPU", y=1.02)
    plt.show()


def draw_replicas(n, title=None):
    """N processes each reading the whole dataset in the same order: replication, not parallelism."""
    fig, ax = plt.subplots(figsize=(8, 0.7 * n + 1.2))
    _blank(ax, (-1.6, 10.2), (-0.6, n))
    for r in range(n):
        for b in range(10):
            ax.add_patch(plt.Rectangle((b, r), 0.9, 0.6, fc=plt.get_cmap("viridis")(b / 10), ec="white"))
        ax.text(-0.2, r + 0.3, f"rank {r}", ha="right", va="center")
    ax.text(5, -0.4, "batches of the epoch, in order: the same on every rank", ha="center")
    ax.set_title(title or f"{n} copies of lesson 2: every rank trains on every batch")
    plt.show()


def draw_shards(shards, dataset_size, batch_size=None, show=200, title=None):
    """Which sample each rank gets in one epoch (DistributedSampler): disjoint shards covering the data.

    `shards` is a list (one per rank) of sample indices in the order the rank reads them."""
    n = len(shards)
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.55 * n + 1.6), gridspec_kw={"width_ratios": [3, 2]})
    ax = axes[0]
    for r, shard in enumerate(shards):
        sample = sorted(i for i in shard if i < show)
        ax.scatter(sample, [r] * len(sample), marker="|", s=160, color=RANK_COLORS[r % 10])
    ax.set(yticks=range(n), yticklabels=[f"rank {r}" for r in range(n)], xlim=(-1, show),
           xlabel=f"sample index (the first {show} of {dataset_size})",
           title="who gets which sample (epoch 0)")
    ax.grid(False)
    ax.invert_yaxis()
    ax = axes[1]
    for r, shard in enumerate(shards):
        steps = (len(shard) + batch_size - 1) // batch_size if batch_size else None
        ax.barh(r, len(shard), color=RANK_COLORS[r % 10])
        ax.text(len(shard) * 0.5, r, f"{len(shard)} samples" + (f", {steps} steps" if steps else ""),
                ha="center", va="center", color="white", fontsize=9)
    ax.set(yticks=range(n), yticklabels=[f"rank {r}" for r in range(n)], xlabel="samples per epoch",
           title="shard sizes")
    ax.invert_yaxis()
    fig.suptitle(title or f"DistributedSampler: {n} disjoint shards of {dataset_size} samples")
    fig.tight_layout()
    plt.show()


def draw_buckets(param_sizes, bucket_cap=None, names=None, title=None, buckets=None):
    """DDP's gradient buckets: backward produces the last layer's gradient first; each bucket's all_reduce
    starts once its last gradient exists, while backward still computes the gradients of earlier layers.

    `buckets`: the real assignment, [[parameter index, ...], ...] in launch order (see ddp_buckets());
    without it, parameters in reverse order are packed into buckets of at least bucket_cap elements, the
    rule DDP follows once it has rebuilt its buckets (a bucket closes when it reaches the cap)."""
    names = names or [f"p{i}" for i in range(len(param_sizes))]
    if buckets is None:
        buckets, current, size = [], [], 0
        for i in reversed(range(len(param_sizes))):
            current.append(i)
            size += param_sizes[i]
            if size >= bucket_cap:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)

    total = sum(param_sizes)

    def width(i):  # proportional to size, but wide enough to read the name of a small tensor
        return max(0.11 * len(names[i]) + 0.3, param_sizes[i] / total * 8)

    span = sum(width(i) for i in range(len(param_sizes))) * 1.5 + 3
    fig, ax = plt.subplots(figsize=(min(16.0, max(9.0, 0.62 * span)), 2.8))

    x = 0.0
    for b, bucket in enumerate(buckets):
        for i in bucket:
            w = width(i)
            ax.add_patch(plt.Rectangle((x, 1.2), w, 0.6, fc=RANK_COLORS[b % 10], ec="white", alpha=0.8))
            ax.text(x + w / 2, 1.5, names[i], ha="center", va="center", fontsize=7)
            x += w
        start = x  # the bucket's all_reduce starts once its last gradient exists
        comm = max(1.4, 0.8 * sum(width(i) for i in bucket))
        ax.add_patch(plt.Rectangle((start, 0.3), comm, 0.6, fc=RANK_COLORS[b % 10], ec="black", alpha=0.5))
        ax.text(start + comm / 2, 0.6, f"all_reduce\nbucket {b}", ha="center", va="center", fontsize=8)
        end = start + comm
    ax.text(-0.2, 1.5, "backward\n(gradients)", ha="right", va="center", fontsize=9)
    ax.text(-0.2, 0.6, "communication", ha="right", va="center", fontsize=9)
    ax.annotate("", xy=(end + 0.3, 0.05), xytext=(0, 0.05), arrowprops=dict(arrowstyle="->"))
    ax.text(end + 0.3, -0.2, "time", ha="right", fontsize=9)
    _blank(ax, (-2.4, end + 0.5), (-0.35, 2.1))
    ax.set_title(title or (f"{len(buckets)} buckets: communication overlaps the rest of backward"
                           if len(buckets) > 1 else "1 bucket: its all_reduce starts when backward is done"))
    plt.show()


def draw_nodes(nnodes=2, per_node=2, placement=None, title=None, device="cuda"):
    """Nodes, the ranks on each (global rank, local rank, device) and where rank 0 listens.

    `placement`: [{"rank": g, "node": n, "local_rank": l}, ...] as a run reports it; default: the usual
    block layout of nnodes x per_node ranks."""
    if placement is None:
        placement = [{"rank": n * per_node + l, "node": n, "local_rank": l}
                     for n in range(nnodes) for l in range(per_node)]
    nodes = sorted({p["node"] for p in placement})
    per_node = max(sum(1 for p in placement if p["node"] == n) for n in nodes)
    fig, ax = plt.subplots(figsize=(3.6 * len(nodes) + 0.6, 1.0 + 0.75 * per_node + 0.9))
    height = 0.75 * per_node + 0.7
    _blank(ax, (-0.3, 3.6 * len(nodes)), (-0.7, height + 0.1))
    for i, n in enumerate(nodes):
        x0 = 3.6 * i
        _box(ax, x0, 0, 3.2, height, "", "0.6", alpha=0.12)
        ax.text(x0 + 1.6, height - 0.35, f"node {n}" + ("  (MASTER_ADDR)" if i == 0 else ""), ha="center",
                fontsize=10, weight="bold")
        ranks = sorted((p for p in placement if p["node"] == n), key=lambda p: p["local_rank"])
        for j, p in enumerate(ranks):
            y = height - 0.75 - 0.75 * (j + 1) + 0.15
            dev = f"cuda:{p['local_rank']}" if device == "cuda" else device
            _box(ax, x0 + 0.2, y, 2.8, 0.6, f"global rank {p['rank']}  |  local rank {p['local_rank']}  ->  {dev}",
                 RANK_COLORS[p["rank"] % 10], fontsize=8)
    ax.text(3.6 * len(nodes) / 2 - 0.2, -0.45,
            f"{len(nodes)} node(s), {len(placement)} ranks in one process group; rank 0 listens at "
            f"MASTER_ADDR:MASTER_PORT on node {nodes[0]}", ha="center", fontsize=9)
    ax.set_title(title or "global rank: which share of the work; local rank: which GPU of its node", fontsize=10)
    plt.show()


def draw_chunks(n_samples, chunk, ranks, assignment=None, title=None):
    """An HDF5 dataset cut into chunks of `chunk` samples, and which rank reads which chunk."""
    n_chunks = (n_samples + chunk - 1) // chunk
    assignment = assignment or {c: c % ranks for c in range(n_chunks)}
    fig, ax = plt.subplots(figsize=(9, 1.9))
    for c in range(n_chunks):
        size = min(chunk, n_samples - c * chunk)
        r = assignment.get(c)
        ax.add_patch(plt.Rectangle((c * chunk, 0), size, 1, ec="white",
                                   fc=RANK_COLORS[r % 10] if r is not None else "0.8"))
    ax.set(xlim=(0, n_samples), ylim=(0, 1), yticks=[], xlabel="sample index",
           title=title or f"{n_samples} samples in {n_chunks} chunks of {chunk}: one color per rank")
    ax.grid(False)
    handles = [plt.Rectangle((0, 0), 1, 1, fc=RANK_COLORS[r % 10]) for r in range(ranks)]
    ax.legend(handles, [f"rank {r}" for r in range(ranks)], loc="center left", bbox_to_anchor=(1.01, 0.5),
              frameon=False)
    fig.tight_layout()
    plt.show()


def draw_lr_schedule(base_lr, world_sizes, warmup_steps=0, steps=100, title=None):
    """The linear scaling rule: lr = base_lr * world size, optionally reached by a linear warm-up."""
    fig, ax = plt.subplots(figsize=(7, 3))
    for i, w in enumerate(world_sizes):
        target = base_lr * w
        ys = [base_lr + (target - base_lr) * min(1, (s + 1) / warmup_steps) if warmup_steps else target
              for s in range(steps)]
        ax.plot(range(steps), ys, color=RANK_COLORS[i % 10], label=f"{w} rank(s): global batch {w}b")
    ax.set(xlabel="step", ylabel="learning rate", title=title or "learning rate per world size")
    ax.legend()
    plt.show()


def draw_profiler_schedule(wait, warmup, active, steps=None, title=None):
    """torch.profiler's schedule: which training steps are skipped, traced and discarded, and recorded."""
    steps = steps or wait + warmup + active + 2
    colors = {"wait": "0.85", "warmup": "#f5c26b", "active": "#4c9be8", "after": "0.95"}
    fig, ax = plt.subplots(figsize=(8, 1.6))
    for s in range(steps):
        phase = ("wait" if s < wait else "warmup" if s < wait + warmup else
                 "active" if s < wait + warmup + active else "after")
        ax.add_patch(plt.Rectangle((s, 0), 0.92, 1, fc=colors[phase], ec="white"))
        ax.text(s + 0.46, 0.5, f"step {s + 1}\n{phase}", ha="center", va="center", fontsize=8)
    _blank(ax, (0, steps), (0, 1))
    ax.set_title(title or f"schedule(wait={wait}, warmup={warmup}, active={active}): "
                          f"only the {active} active steps end up in the trace", fontsize=10)
    plt.show()


def plot_trace(paths, spans=("forward", "backward", "gradient sync", "Optimizer.step#SGD.step"),
               comm_prefixes=("gloo:", "nccl:"), title=None):
    """A small Trace view: per rank, the named spans of the main thread and the collectives of the
    communication threads, on one time axis (ms from the first profiled step of any rank).

    `paths`: one Chrome trace (JSON) per rank, as torch.profiler writes them."""
    from course.measuring.profiling import load_trace

    traces = [load_trace(REPO / p) for p in paths]
    events = [[e for e in t["traceEvents"] if e.get("ph") == "X" and "dur" in e] for t in traces]
    t0 = min(e["ts"] for evs in events for e in evs if e["name"].startswith("ProfilerStep#"))
    colors = {name: RANK_COLORS[i] for i, name in zip((0, 1, 2, 4, 5, 6, 7, 8, 9), spans)}
    fig, ax = plt.subplots(figsize=(10, 0.9 * len(paths) + 1.4))
    labels = []
    for r, evs in enumerate(events):
        y = 2 * r
        for e in evs:
            start, width = (e["ts"] - t0) / 1000, e["dur"] / 1000
            if e["name"] in colors:
                ax.broken_barh([(start, width)], (y, 0.8), color=colors[e["name"]])
            elif e["name"].startswith("ProfilerStep#"):
                ax.broken_barh([(start, width)], (y - 0.1, 1.0), fc="none", ec="0.5", lw=0.8)
            elif e["name"].startswith(comm_prefixes):
                ax.broken_barh([(start, width)], (y + 0.9, 0.6), color="crimson")
        labels += [(y + 0.4, f"rank {r} compute"), (y + 1.2, f"rank {r} all_reduce")]
    ax.set_yticks([y for y, _ in labels], [text for _, text in labels], fontsize=8)
    ax.set(xlabel="ms since the first profiled step")
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()] + \
              [plt.Rectangle((0, 0), 1, 1, color="crimson"), plt.Rectangle((0, 0), 1, 1, fc="none", ec="0.5")]
    ax.legend(handles, list(colors) + ["collective (communication thread)", "profiler step"], fontsize=8,
              loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.05 * len(paths)), ncol=3, frameon=False)
    ax.set_title(title or "what each rank did during the profiled steps")
    fig.tight_layout()
    plt.show()
