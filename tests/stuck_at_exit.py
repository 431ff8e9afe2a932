"""A job whose rank 1 finishes its work and then cannot exit: it leaves a thread running that never ends,
and Python waits for such a thread before a process exits.  The launcher must end the job anyway.

    python tests/stuck_at_exit.py --nproc 2
"""
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/

from course.launching import cli  # noqa: E402
from course.launching.launch import launch  # noqa: E402


def worker(info, args):
    print(f"[rank {info.rank}] done", flush=True)
    if info.rank == 1:
        threading.Thread(target=threading.Event().wait).start()  # not a daemon: exiting waits for it


if __name__ == "__main__":
    cli.main(lambda args: launch(worker, args),
             cli.parser(__doc__, "tests/stuck_at_exit.py", data=False, outputs=False, nproc_default=2))
