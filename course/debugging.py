"""What lesson 17 uses to turn a hung or mismatched job into one line that names the rank and the collective.

- `install(rank)`, before init_process_group: the flight recorder on (TORCH_FR_BUFFER_SIZE, the last
  collectives of this process with their Python stacks), and faulthandler: every thread's Python stack on
  SIGUSR1 (`kill -USR1 PID`, or to the launcher of `--nproc N`, which passes it on to every rank; under Slurm
  `scancel --signal=USR1 JOBID`) and when the process crashes (SIGABRT from gloo, SIGSEGV).
- `named_failures(worker, info, args)`: a collective that times out or fails ends this rank with one line: which
  collective it waited in (its sequence number, its shapes, the lesson line that issued it), how long, and the
  last collective every other rank that still answers had entered (exchanged through the rendezvous store,
  which outlives a broken gloo connection).  This rank's flight recorder dump is written to
  RUN_DIR/flight_recorder/rank_R for the analyzer:
      python -m torch.distributed.flight_recorder.fr_trace RUN_DIR/flight_recorder -p rank_
  (add --allow-incomplete-ranks when a rank crashed before it could write its dump).

Checked in torch 2.14.1 (CPU, gloo): the flight recorder records gloo's collectives (state "scheduled" only:
gloo does not report their completion to it), but the automatic dump on a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT,
TORCH_FR_DUMP_TEMP_FILE) is done by ProcessGroupNCCL's watchdog only, so this rank dumps it itself.  gloo's
dump names its group '' in pg_config while its entries say '0': the analyzer then stops with KeyError
('0', 0); the dump written here names the group as the entries do, and the analyzer reads it.
"""
import faulthandler
import json
import os
import pickle
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from course.cli import CourseError

BUGS = ("none", "skip", "uneven", "shape")
FR_DIR = "flight_recorder"
PEER_WAIT_S = 3.0  # how long a failed rank waits for the others' last collectives before it reports


def install(rank: int) -> None:
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # read when the first process group is made
    faulthandler.enable(all_threads=True)  # a crash (gloo's abort on a size mismatch) prints the Python stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: where is every thread now?


def _entries() -> list:
    try:
        return pickle.loads(torch._C._distributed_c10d._dump_fr_trace()).get("entries", [])
    except Exception:  # recorder off (TORCH_FR_BUFFER_SIZE=0) or nothing recorded
        return []


def _lesson_line(entry: dict) -> str:
    """The first frame of the collective's Python stack that is not inside torch: the line that issued it."""
    for frame in entry.get("frames", []):
        name = frame.get("filename", "")
        if "site-packages" not in name and "/torch/" not in name and not name.startswith("<"):
            return f"{Path(name).name}:{frame.get('line')}"
    return "?"


def describe(entry: dict) -> str:
    """'all_reduce #21 (shape [101770], issued at 17_debugging_hangs.py:95)'"""
    op = entry.get("profiling_name", "?").split(":")[-1]
    shapes = entry.get("input_sizes") or []
    shape = "shape " + ", ".join(str(list(s)) for s in shapes) if shapes else "no tensor"
    return f"{op} #{entry.get('collective_seq_id')} ({shape}, issued at {_lesson_line(entry)})"


def summary() -> dict:
    """This rank's last collective and when it entered it."""
    entries = _entries()
    if not entries:
        return {"what": "no collective recorded", "since_s": None}
    last = entries[-1]
    return {"what": describe(last), "since_s": time.time() - last["time_created_ns"] / 1e9}


def dump(run_dir: Path, rank: int) -> Path:
    """This rank's flight recorder, in the file layout the analyzer reads (see the module docstring)."""
    data = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    groups = {e["process_group"][0]: e["process_group"][1] for e in data.get("entries", [])}
    ranks = next(iter(data.get("pg_config", {}).values()), {}).get("ranks", str(list(range(dist.get_world_size()))))
    data["pg_config"] = {name: {"name": name, "desc": desc, "ranks": ranks} for name, desc in groups.items()}
    path = Path(run_dir) / FR_DIR / f"rank_{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(data))
    return path


def _peers(rank: int, mine: dict) -> str:
    """Publish this rank's last collective in the rendezvous store and read the others' (PEER_WAIT_S)."""
    world = dist.get_world_size()
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"course/last/{rank}", json.dumps(mine))
        store.set_timeout(timedelta(seconds=PEER_WAIT_S))
    except Exception:
        return "; the other ranks could not be asked (the store on rank 0 is gone: rank 0 has exited)"
    said = []
    for other in range(world):
        if other == rank:
            continue
        try:
            store.wait([f"course/last/{other}"])
            theirs = json.loads(store.get(f"course/last/{other}"))
            said.append(f"rank {other} last entered {theirs['what']}")
        except Exception:
            said.append(f"rank {other} did not say (it has exited, crashed or is stuck outside a collective)")
    return "; " + "; ".join(said)


def _why(error: Exception) -> str:
    text = str(error)
    if "Detected mismatch between collectives" in text:  # TORCH_DISTRIBUTED_DEBUG=DETAIL's fingerprint check
        return "TORCH_DISTRIBUTED_DEBUG=DETAIL found: " + " ".join(text.split())[:700]
    if "Timed out" in text or "timed out" in text:
        return "timed out"
    if "Connection reset" in text or "Connection closed" in text or "Broken pipe" in text:
        return "the connection to another rank was lost (it crashed or exited: see its messages)"
    return f"failed ({type(error).__name__}: {text.strip().splitlines()[0][:200] if text.strip() else ''})"


def named_failures(worker, info, args):
    """Run `worker(info, args)`; a failed collective ends this rank with one line naming it, how long this
    rank waited in it, and the other ranks' last collectives.  Used as launch(partial(named_failures, worker))."""
    start = time.time()
    try:
        return worker(info, args)
    except RuntimeError as error:
        if isinstance(error, CourseError) or not dist.is_initialized():
            raise
        rank, mine = info.rank, summary()
        waited = f"{mine['since_s']:.1f} s" if mine["since_s"] is not None else "?"
        where = dump(args.run_dir, rank)
        line = (f"rank {rank} waited {waited} in {mine['what']} and stopped: {_why(error)} "
                f"(--timeout {args.timeout:g} s; {time.time() - start:.1f} s after it started)"
                + _peers(rank, mine)
                + f".  Flight recorder: python -m torch.distributed.flight_recorder.fr_trace {where.parent} -p rank_")
        raise CourseError(line) from None


def check_args(args) -> None:
    """Bad input before any rank starts."""
    if args.bug != "none" and args.nproc < 2 and "RANK" not in os.environ and "SLURM_PROCID" not in os.environ:
        raise CourseError(f"--bug {args.bug} needs at least 2 ranks (--nproc 2): with one rank there is no "
                          f"other rank to wait for")
