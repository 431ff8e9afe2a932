"""Run a lesson as `python lesson.py args...` would, then print the threads its rank computed with.

    srun ... python tests/threads_of_rank.py LESSON ARGS...

After the lesson returns, each rank prints one line `threads of rank R: N (OMP_NUM_THREADS=V)`, N being
torch's intra-op threads as the lesson's launch set them (course/launching/devices.py, share_cpu_cores).
"""
import os
import sys

import torch

from as_main import run_as_main

code = run_as_main(sys.argv[1:])
rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
print(f"threads of rank {rank}: {torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})",
      flush=True)
sys.exit(code)
