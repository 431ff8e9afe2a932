"""Run a lesson as `python lesson.py args...` would, then say which threads this process still runs.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/threads_after_lesson.py LESSON ARGS...

After the lesson's own code has returned (it has called destroy_process_group), each rank prints one line
`rank R exit CODE threads NAME,NAME,...`: the names of its live threads (Linux, /proc/self/task).  A gloo
thread among them means the process group outlived the lesson and will still run while the interpreter
shuts down (tests/test_faults.py).
"""
import gc
import os
import sys

from as_main import run_as_main

code = run_as_main(sys.argv[1:])
gc.collect()
# From /proc by hand, not psutil: psutil.Process().threads() gives each thread's id and CPU times but not its
# name (/proc/self/task/TID/comm), and the name is what shows a gloo thread.
names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
print(f"rank {os.environ.get('RANK')} exit {code} threads {','.join(names)}", flush=True)
sys.exit(code)
