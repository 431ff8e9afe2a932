# %% [markdown]
# # Lesson 17: debugging a hung or mismatched job
#
# Script: [`day3/17_debugging_hangs.py`](../day3/17_debugging_hangs.py).
#
# A distributed job that hangs is the most common thing learners ask about. Every collective pairs the n-th
# call of every rank: if one rank calls something else, or one call fewer, or a tensor of another size, the
# ranks wait for each other, or crash. This lesson takes lesson 6's DDP loop and breaks it in the three ways
# learners meet most (`--bug`), then shows what each tool tells:
#
# - **skip**: rank 0 writes a checkpoint and waits in a barrier that the other ranks skip (the barrier is
#   indented under `if rank == 0`);
# - **uneven**: the last rank's shard holds one batch more (a data set split by hand, without
#   DistributedSampler's padding);
# - **shape**: the last rank all_reduces one number more than the others.
#
# The tools, each a few lines in the script: the collective **timeout** (`init_process_group(timeout=...)`,
# `--timeout` here); the **flight recorder** (`TORCH_FR_BUFFER_SIZE`, each rank's last collectives) and its
# dump when a collective fails (`failed_collective`), which ends each rank with a line naming the collective
# it waited in and the other ranks' last one; torch's flight recorder **analyzer**;
# `TORCH_DISTRIBUTED_DEBUG=DETAIL`; and a **stack dump** of every rank: faulthandler on SIGUSR1, `py-spy dump`,
# and torch's **debug server** (`--debug-server PORT`), one web page with every rank's stacks and records.
#
# The repros run on the CPU with gloo, also on a GPU node: NCCL's watchdog ends a process whose collective
# timed out from its own thread, before the rank can say where it waited
# ([the learners' guide](../docs/learners/debugging-hangs.md) says what NCCL does and how to read it).

# %%
from nbhelpers import *

import html
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

# The one switch. False: 320 samples, a 5 s timeout, 2 CPU processes. True: --quick, the lesson's 10 s timeout.
FULL_SIZE = False
SIZE = ["--quick"] if FULL_SIZE else ["--train-samples", "320", "--batch-size", "16", "--epochs", "1",
                                      "--loader", "memory", "--timeout", "5"]
SIZE += ["--save-every", "3", "--device", "cpu"]
TIMEOUT = 10 if FULL_SIZE else 5  # seconds a rank waits in a collective before it gives up
RUN = run_dir("17_debugging_hangs")


def repro(bug, *more, env=None):
    """Run the lesson with one --bug on 2 ranks.  It must fail: return its exit code, seconds, error lines."""
    start = time.perf_counter()
    try:
        run_lesson("day3/17_debugging_hangs.py", "--nproc", "2", *SIZE, "--bug", bug, "--run-dir", RUN / bug,
                   *more, env=env)
    except subprocess.CalledProcessError as failed:  # what we came for: the run fails, and says where
        seconds = time.perf_counter() - start
        lines = [line for line in failed.output.splitlines() if "error:" in line]
        return failed.returncode, seconds, lines
    raise AssertionError(f"--bug {bug} ran to the end: it should have failed")


# %% [markdown]
# ## What changed against lesson 6
#
# The three bugs, inline and switched by `--bug`; a barrier after each checkpoint and after the epoch; the
# loss all_reduced each step for the log; before the process group, the flight recorder's environment and
# faulthandler; the short timeout; the debug server (`--debug-server`); and `failed_collective`, which
# catches the exception of a collective that timed out, dumps the flight recorder and ends the rank with
# one line.

# %%
show_diff("day1/6_mnist_ddp_pt.py", "day3/17_debugging_hangs.py")

# %% [markdown]
# ## The healthy run

# %%
run_lesson("day3/17_debugging_hangs.py", "--nproc", "2", *SIZE, "--bug", "none", "--run-dir", RUN / "none");

# %% [markdown]
# ## A rank that skips a collective
#
# Rank 0 waits in the checkpoint's barrier; rank 1 has gone on into the next step, where DDP's backward
# all_reduces the gradient bucket. gloo pairs the two and neither completes: both ranks wait until the
# timeout. This run has a longer timeout and `--debug-server PORT`: while the ranks wait, the cell reads
# torch's debug server, on rank 0, the way a browser would (below).

# %%
SKIP_TIMEOUT = 20  # long enough to read the debug server's pages while the ranks wait
with socket.socket() as s:  # a free port for the debug server, never a fixed one
    s.bind(("127.0.0.1", 0))
    PORT = s.getsockname()[1]
pages = {}


def read_pages():
    """Once rank 0 has written its checkpoint (just before its barrier), read three pages of the server."""
    deadline = time.monotonic() + 120
    while not (REPO / RUN / "skip" / "checkpoint.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # both ranks now wait
    for page in ("stacks", "fr_trace_json", "pyspy_dump"):
        while page not in pages and time.monotonic() < deadline:
            try:
                pages[page] = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/{page}", timeout=60).read().decode()
            except OSError:  # rank 0 starts the page's process: it may take seconds
                time.sleep(0.5)


reader = threading.Thread(target=read_pages, daemon=True)
reader.start()
# py-spy, for the /pyspy_dump page, is found on the ranks' PATH: the one beside this Python
venv_bin = str(Path(sys.executable).parent)
code, seconds, lines = repro("skip", "--timeout", SKIP_TIMEOUT, "--debug-server", PORT,
                             env={"PATH": venv_bin + os.pathsep + os.environ.get("PATH", "")})
reader.join(timeout=60)
zero = next(l for l in lines if l.startswith("[rank 0]"))
barrier = re.search(r"barrier #(\d+)", zero).group(1)
bucket = re.search(r"all_reduce #\d+ \(shape \[(\d+)\]", zero).group(1)
md(f"The job ended with exit code {code} after {seconds:.1f} s, {SKIP_TIMEOUT} s of them the timeout. Rank 0 says it "
   f"waited in **barrier #{barrier}**, and that rank 1 had last entered **all_reduce #{barrier}** of "
   f"{int(bucket):,} numbers: the MLP's gradients, DDP's one bucket. The same sequence number on both sides "
   f"is the clue: the ranks disagree on what their {barrier}th collective is.")

# %% [markdown]
# ## Every rank's stack, while it waits: torch's debug server
#
# `--debug-server PORT` calls `torch.distributed.debug.start_debug_server(port=PORT)` in every rank: each rank
# answers requests on a port of its own, and rank 0 serves a page for the whole job at `http://HOST:PORT`.
# `/stacks` shows every rank's Python stacks (as faulthandler prints them), read while the two ranks waited:


# %%
def sections(page):
    """{rank: the text the page shows for it}: the page's HTML, one <h2>Rank R: ...</h2> per rank."""
    parts = re.split(r"<h2>Rank (\d+): [^<]*</h2>", pages.get(page, ""))
    return {int(r): html.unescape(re.sub(r"<[^>]+>", "", text)).strip() for r, text in zip(parts[1::2], parts[2::2])}


LESSON_FRAME = re.compile(r'17_debugging_hangs\.py(?:", line |:)\d')  # faulthandler's and py-spy's frame lines


def main_thread(text):
    """The stack of the thread that runs the lesson, from its top down to the lesson's line (faulthandler's
    format or py-spy's: its header, which names the script, and its colours left out)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    block = next((b for b in re.split(r"\n(?=Thread |Current thread )", text)[1:] if LESSON_FRAME.search(b)), "")
    lines = block.strip().splitlines()
    return "\n".join(lines[:next((i + 1 for i, l in enumerate(lines) if LESSON_FRAME.search(l)), 0)])


stacks = sections("stacks")
assert sorted(stacks) == [0, 1] and all(map(sections, ("fr_trace_json", "pyspy_dump"))), \
    f"the debug server's pages were not all read while the ranks waited (read: {sorted(pages)})"
for rank, text in stacks.items():
    print(f"--- rank {rank}\n{main_thread(text)}")

# %% [markdown]
# `/pyspy_dump` runs `py-spy dump` on every rank (py-spy must be on the ranks' `PATH` and may attach to
# them: root, or `kernel.yama.ptrace_scope=0`):

# %%
if shutil.which("py-spy", path=venv_bin + os.pathsep + os.environ.get("PATH", "")) is None:
    print("py-spy is not installed here (pip install py-spy; it is in requirements.txt): no py-spy page to show")
for rank, text in sections("pyspy_dump").items():
    print(f"--- rank {rank}\n{main_thread(text)}")

# %% [markdown]
# `/fr_trace_json` shows every rank's flight recorder as JSON; the last three entries of each:

# %%
for rank, text in sections("fr_trace_json").items():
    entries = json.loads(text)["entries"][-3:]
    print(f"rank {rank}: " + "; ".join(f"#{e['collective_seq_id']} {e['profiling_name']} {e['input_sizes']}"
                                        for e in entries))
md(f"The pages agree with the ranks' lines: rank 0 waits in `barrier` and rank 1 in `backward`, where DDP's "
   f"all_reduce runs; the records end in barrier #{barrier} and all_reduce #{barrier}. The server's `/fr_trace` "
   f"page, the analyzer's view, stops on gloo with the analyzer's `KeyError: ('0', 0)`: the dump the ranks "
   f"write themselves (below) is fixed up for it.")

# %% [markdown]
# ## What each rank's flight recorder holds
#
# The last collectives of each rank, by sequence number, read from the dumps the ranks wrote: up to the
# mismatch the two rows agree; at the last number rank 0 has a barrier and rank 1 an all_reduce.

# %%
import pickle

COLORS = {"all_reduce": "tab:blue", "barrier": "tab:red", "broadcast": "tab:green", "allgather": "tab:purple"}
fig, ax = plt.subplots(figsize=(9, 2.4))
for rank in (0, 1):
    dump = pickle.loads((REPO / RUN / "skip" / "flight_recorder" / f"rank_{rank}").read_bytes())
    for entry in dump["entries"][-8:]:
        op = entry["profiling_name"].split(":")[-1]
        seq = entry["collective_seq_id"]
        ax.scatter(seq, rank, marker="s", s=900, color=COLORS.get(op, "tab:gray"), alpha=0.5)
        sizes = entry["input_sizes"]
        ax.annotate(op + (f"\n{sizes[0][0]:,}" if sizes and sizes[0] else ""), (seq, rank), ha="center",
                    va="center", fontsize=7)
ax.set(yticks=[0, 1], yticklabels=["rank 0", "rank 1"], ylim=(-0.6, 1.6), xlabel="collective sequence number",
       title="--bug skip: the last collectives of each rank (flight recorder)")
plt.show()

# %% [markdown]
# ## The flight recorder's analyzer
#
# Each failed rank wrote its flight recorder (its last collectives, with the Python stack that issued each)
# to `flight_recorder/rank_R` in its run directory. torch's analyzer compares the ranks' records:

# %%
done = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                       str(RUN / "skip" / "flight_recorder"), "-p", "rank_"], cwd=REPO, capture_output=True,
                      text=True, check=True)
report = done.stdout + done.stderr  # the analyzer logs its report
culprit = next(l for l in report.splitlines() if "Culprit" in l)
print("\n".join(report.splitlines()[:10]))
md(f"The analyzer: *{culprit.strip().removeprefix('error msg: ')}*: rank 0's record is the reference, and "
   f"rank 1 is the one whose collective of that sequence number differs.")

# %% [markdown]
# ## Tensors of different sizes
#
# Rank 1 all_reduces 3 numbers, rank 0 two. With these sizes gloo completes rank 0's all_reduce (with wrong
# numbers) and rank 0 goes on; rank 1 waits for the rest. With other sizes gloo aborts the rank that
# receives more bytes than it expects.

# %%
code, seconds, lines = repro("shape")
said = " ".join(lines)
one = re.search(r"rank 1 (?:waited [\d.]+ s in|last entered) (all_reduce #\d+) \(shape \[(\d+)\]", said)
zero = re.search(r"rank 0 (?:waited [\d.]+ s in|last entered) (\w+) (#\d+) \((?:shape \[(\d+)\])?", said)
buckets = ddp_buckets()  # DDP's gradient buckets after its first backward: [[parameter index, ...], ...]
indices = sum(len(b) for b in buckets)
what = (f"DDP's one-time broadcast of its rebuilt bucket order: after the first backward DDP rebuilds its "
        f"gradient buckets in the order the gradients arrived, and at the start of the second step's forward rank 0 "
        f"sends every rank its order ({indices} parameter indices and the number of buckets: {indices + 1} numbers; "
        f"the next broadcast carries the bucket sizes, {len(buckets)} number{'s' if len(buckets) > 1 else ''})"
        if zero.group(1) == "broadcast" and zero.group(3) == str(indices + 1) else "a collective of the next step")
md(f"Exit code {code} after {seconds:.1f} s. Rank 1's last collective: **{one.group(1)}** of "
   f"**{one.group(2)}** numbers, one more than the 2 of every other rank. Rank 0 had already gone on to "
   f"**{zero.group(1)} {zero.group(2)}**: {what}. The two ranks' sequence numbers no longer agree, which is how a "
   f"size mismatch shows when gloo does not abort.")

# %% [markdown]
# ## Try it yourself
#
# 1. Run `--bug uneven` under torchrun (`torchrun --nproc_per_node=2 day3/17_debugging_hangs.py --quick
#    --timeout 5 --bug uneven`). Expect a non-zero exit a few seconds after the timeout, rank 0 in a
#    `barrier` and rank 1 in an `all_reduce` of 101,770 numbers with the same sequence number: why is rank 0's
#    a barrier?
# 2. Start `--bug skip --timeout 30 --debug-server 25999` and, while it waits, send SIGUSR1 to the launcher
#    (`kill -USR1 PID`, the PID of the `python` you started). Expect every rank's Python stack: rank 0's ends
#    in `barrier`, rank 1's in `backward`. Then try `py-spy dump --pid` on one rank's PID, and open
#    http://localhost:25999/stacks: the same stacks, both ranks on one page.
# 3. Run the fingerprint check on plain collectives: `TORCH_DISTRIBUTED_DEBUG=DETAIL python
#    solutions/17_detail.py` (two ranks all_reduce 4 and 5 numbers). Expect both ranks to fail within a
#    fraction of a second, each naming `TensorShape=[4]` and `TensorShape=[5]`.
#
# Next: [lesson 18](18_hardware_limits.ipynb): what the hardware allows, before day 4 splits the model.
