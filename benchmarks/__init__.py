"""The course's benchmark: `python benchmarks/bench.py` (see bench.py and benchmarks/README.md)."""
