"""The first module the fork server imports (course/supervise.start_method): it switches off Python's cyclic
garbage collector in that process, and every process forked from it (a rank) switches it back on at once.

The fork server does nothing but import torch, torch._dynamo and the course's modules and then fork ranks;
without the collector those imports take about 0.5 CPU-seconds less (4.2 instead of 4.7-5.0 on a 2-core
machine: the collector walks the whole growing heap again and again while they run).  A rank, which trains,
has the collector as any Python process does.
"""
import gc
import os

gc.disable()
os.register_at_fork(after_in_child=gc.enable)
