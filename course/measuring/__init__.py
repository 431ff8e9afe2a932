"""What a step costs and holds, measured: bytes held (memory.py), what accumulation and checkpointing save
(accumulation.py), lesson 7's timing table (timing.py), the profiler behind --profile (profiling.py), the
hardware monitor behind --watch-hardware (monitor.py), bandwidth, FLOPs and the clock that waits for the
GPU (hardware.py), day 4's collectives, cut parameters and pipeline bubble (parallel.py), and hangs turned
into one line (debugging.py)."""
