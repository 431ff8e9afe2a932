"""What lesson 17 uses to turn a hung or mismatched job into one line that names the rank and the collective.

The tools themselves (the timeout, the flight recorder and its dump, faulthandler, torch's debug server) are
called in the lesson; this module formats what they give and keeps the books:
- `one_line(error, record, rank, args, dump)`: which collective this rank waited in (its sequence number, its
  shapes, the lesson line that issued it), how long, and the last collective every other rank that still
  answers had entered (exchanged through the rendezvous store, which outlives a broken gloo connection);
- `write_dump(record, run_dir, rank)`: this rank's flight recorder in RUN_DIR/flight_recorder/rank_R, where
  torch's analyzer reads it:
      python -m torch.distributed.flight_recorder.fr_trace RUN_DIR/flight_recorder -p rank_
  (add --allow-incomplete-ranks when a rank crashed before it could write its dump);
- `repros_on_gloo(args)`, `check_args(args)`: what the lesson's --bug and --debug-server need, before any rank
  starts.

Checked in torch 2.14.1 (CPU, gloo): the flight recorder records gloo's collectives (state "scheduled" only:
gloo does not report their completion to it); the dump on a timeout is written by ProcessGroupNCCL's watchdog
only (gloo has none), so on gloo the failed rank dumps it itself.  gloo's dump names its group '' in pg_config
while its entries say '0': the analyzer (and the debug server's /fr_trace page) then stop with KeyError
('0', 0); the dump written here names the group as the entries do, and the analyzer reads it.
"""
import argparse
import ctypes
import importlib.util
import json
import os
import pickle
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from course.launching.cli import CourseError, positive_int

BUGS = ("none", "skip", "uneven", "shape")
FR_DIR = "flight_recorder"
PEER_WAIT_S = 3.0  # how long a failed rank waits for the others' last collectives before it reports


def dump_prefix(run_dir: Path) -> str:
    """RUN_DIR/flight_recorder/rank_ (the directory made): where NCCL's watchdog writes rank R's dump as
    rank_R when TORCH_FR_DUMP_TEMP_FILE names it, and where write_dump writes gloo's."""
    (Path(run_dir) / FR_DIR).mkdir(parents=True, exist_ok=True)
    return str(Path(run_dir) / FR_DIR / "rank_")


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


def summary(record: bytes) -> dict:
    """This rank's last collective, from its flight recorder, and when it entered it."""
    try:
        entries = pickle.loads(record).get("entries", [])
    except Exception:  # recorder off (TORCH_FR_BUFFER_SIZE=0) or nothing recorded
        entries = []
    if not entries:
        return {"what": "no collective recorded", "since_s": None}
    last = entries[-1]
    return {"what": describe(last), "since_s": time.time() - last["time_created_ns"] / 1e9}


def write_dump(record: bytes, run_dir: Path, rank: int) -> Path:
    """This rank's flight recorder, in the file layout the analyzer reads (see the module docstring)."""
    data = pickle.loads(record)
    groups = {e["process_group"][0]: e["process_group"][1] for e in data.get("entries", [])}
    ranks = next(iter(data.get("pg_config", {}).values()), {}).get("ranks", str(list(range(dist.get_world_size()))))
    data["pg_config"] = {name: {"name": name, "desc": desc, "ranks": ranks} for name, desc in groups.items()}
    path = Path(dump_prefix(run_dir) + str(rank))
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


def one_line(error: Exception, record: bytes, rank: int, args, dump: Path, started: float) -> str:
    """The line a failed rank ends with: where it waited, how long, why it stopped, what the others did."""
    mine = summary(record)
    waited = f"{mine['since_s']:.1f} s" if mine["since_s"] is not None else "?"
    return (f"rank {rank} waited {waited} in {mine['what']} and stopped: {_why(error)} "
            f"(--timeout {args.timeout:g} s; {time.time() - started:.1f} s after it started)"
            + _peers(rank, mine)
            + f".  Flight recorder: python -m torch.distributed.flight_recorder.fr_trace {dump.parent} -p rank_")


def repros_on_gloo(args) -> None:
    """--bug runs on the CPU with gloo, whatever --device and --backend ask: says so in one line (rank 0)."""
    gpu = args.backend == "nccl" or args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.bug == "none" or not gpu:
        return
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(f"lesson 17: --bug {args.bug} runs on the CPU with gloo (asked: --device {args.device} --backend "
              f"{args.backend}): NCCL's watchdog ends a process whose collective timed out from its own thread, "
              f"before the rank can say where it waited, and NCCL does not check that the ranks' collectives "
              f"match", flush=True)
    args.device, args.backend = "cpu", "gloo"


def port(text: str) -> int:
    """--debug-server's value: a TCP port, 1-65535."""
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1-65535)")
    return value


def check_args(args) -> None:
    """Bad input before any rank starts."""
    from course.launching.environment import world_size

    if args.bug != "none" and world_size(args) < 2:  # however launched: --nproc, torchrun or an srun step
        raise CourseError(f"--bug {args.bug} needs at least 2 ranks (--nproc 2): with one rank there is no "
                          f"other rank to wait for")
    if args.debug_server and importlib.util.find_spec("jinja2") is None:
        raise CourseError("--debug-server needs Jinja2, which torch.distributed.debug renders its pages with: "
                          "pip install Jinja2 (it is in requirements.txt)")
    if args.debug_server and os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        with socket.socket() as s:  # rank 0's page would otherwise fail in its own process, the job going on
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", args.debug_server))
            except OSError:
                raise CourseError(f"--debug-server {args.debug_server}: that port is already in use on "
                                  f"{socket.gethostname()}; choose another") from None
    repros_on_gloo(args)


def ends_with_this_process() -> None:
    """Every process forked from here from now on gets SIGTERM when this one ends (Linux's
    PR_SET_PDEATHSIG).  start_debug_server starts its web page's process from rank 0 as a daemon, which
    multiprocessing ends at a normal exit only.  Measured without this hook: after the launcher's SIGTERM had
    ended rank 0, the page's process went on, listening on its port and on the sockets it inherited from
    rank 0, and holding the job's output open (a caller waiting for that output waited in vain).  The lesson
    starts it with "fork": the ranks' default here is a fork server, whose children this hook never sees."""
    if sys.platform.startswith("linux"):
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        os.register_at_fork(after_in_child=lambda: prctl(1, signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
