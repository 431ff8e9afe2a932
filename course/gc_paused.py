"""The first module the fork server imports (course/supervise.start_method): it switches off Python's cyclic
garbage collector in that process.

The fork server does nothing but import torch, torch._dynamo and the course's modules and then fork ranks;
without the collector those imports take about 1 CPU-second less (5 instead of 6 on a 2-core machine: the
collector walks the whole growing heap again and again while they run).  Every rank forked from it turns the
collector back on before anything else (supervise._rank).
"""
import gc

gc.disable()
