"""Section 5: fixed costs: launching N ranks and initializing their process group, per launcher.

benchmarks/startup_probe.py is launched as a lesson is (course.launching.launch: ranks forked from the launching
process, the default where no GPU is visible; from a fork server, the default on a GPU node; each spawned as a fresh
interpreter with COURSE_START_METHOD=spawn; or torchrun) and records when each rank
started, imported torch, entered worker(), and got through init_process_group and a first barrier.  Times
are from the moment the launch command was started (wall clock; one machine).
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, Row

PROBE = REPO / "benchmarks" / "startup_probe.py"


# the launcher as the table names it; "self (spawn)" is `COURSE_START_METHOD=spawn python lesson.py --nproc N`
LAUNCHERS = {"fork": "self (fork)", "forkserver": "self (fork server)", "spawn": "self (spawn)",
             "torchrun": "torchrun"}


def launch_command(launcher: str, nproc: int, out: Path) -> list:
    if launcher in ("fork", "forkserver", "spawn"):
        return [sys.executable, str(PROBE), "--nproc", str(nproc), "--out", str(out)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                str(PROBE), "--out", str(out)]
    raise ValueError(launcher)


def measure(launcher: str, nproc: int, timeout: float = 300) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        out = Path(tmp) / "times.json"
        start = time.time()
        env = dict(os.environ, COURSE_START_METHOD=launcher) if launcher != "torchrun" else \
            {k: v for k, v in os.environ.items() if k != "COURSE_START_METHOD"}
        proc = subprocess.run(launch_command(launcher, nproc, out), capture_output=True, text=True,
                              timeout=timeout, env=env)
        total = time.time() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{launcher} with {nproc} ranks exited {proc.returncode}: "
                               f"{proc.stderr.strip().splitlines()[-1:] or ''}")
        ranks = json.loads(out.read_text())
    return {"running": max(r["entered"] for r in ranks) - start,
            "init": max(r["ready"] - r["entered"] for r in ranks),
            "ready": max(r["ready"] for r in ranks) - start,
            "import": max(r["imported"] - r["started"] for r in ranks),
            "total": total}


def run(ctx):
    sizes = ctx.pick([2], [2, 4], [2, 4])
    repeats = ctx.pick(1, 1, 3)
    best = {}
    for _ in range(repeats):
        for nproc in sizes:
            for launcher in LAUNCHERS:
                m = measure(launcher, nproc)
                old = best.get((launcher, nproc))
                best[(launcher, nproc)] = m if old is None or m["ready"] < old["ready"] else old
    ref = best[("spawn", 2)]["ready"]
    rows = []
    for (launcher, nproc), m in best.items():
        tag = f"{LAUNCHERS[launcher]}, {nproc} ranks:"
        imported = {"fork": f"of which import torch {m['import']:.1f} s, once, in the launching process "
                            f"(each rank is a copy of it)",
                    "forkserver": f"import torch {m['import']:.2f} s per rank (the fork server imported it once)"
                    }.get(launcher, f"of which import torch {m['import']:.1f} s per rank")
        rows.append(Row("startup", f"{tag} launch -> every rank in worker()", m["running"], "s", note=imported))
        rows.append(Row("startup", f"{tag} init_process_group + first barrier", m["init"], "s"))
        rows.append(Row("startup", f"{tag} launch -> every rank ready", m["ready"], "s", m["ready"] / ref,
                        "self (spawn), 2 ranks", note=f"exit after {m['total']:.1f} s"))
    return rows
