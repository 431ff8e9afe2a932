"""Two launches from one process, as lesson 7's sweep makes them: 2 ranks, then 3, with a different
environment each time.  Every rank prints what it sees, and whether Python's garbage collector is on.

    python tests/launch_twice.py
"""
import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/

from course.launching import cli  # noqa: E402
from course.launching.launch import launch  # noqa: E402


def worker(info, args):
    # One write per line: with PYTHONUNBUFFERED=1, print() writes the text and its newline separately, and
    # two ranks' lines could interleave on the shared pipe.
    sys.stdout.write(f"launch={os.environ['PROBE_LAUNCH']} rank={info.rank} world={info.world_size} "
                     f"port={os.environ['MASTER_PORT']} gc={int(gc.isenabled())}\n")
    sys.stdout.flush()


def both(args):
    for n in (2, 3):
        os.environ["PROBE_LAUNCH"] = str(n)
        launch(worker, args, nproc=n)


if __name__ == "__main__":
    cli.main(both, cli.parser(__doc__, "tests/launch_twice.py", data=False, outputs=False, nproc_default=2))
