"""The training loop's helpers: what a run leaves behind (output.py, results.py), exact evaluation
(evaluate.py), --precision and --compile (precision.py), replicas compared (replicas.py), the samples each rank
trained on (coverage.py), lesson 8's reference curves (curves.py), FSDP2 shards initialized from the seed
(sharded_init.py)."""
