"""Checkpoints the course can verify before it loads them: lesson 12's files, one per checkpoint, written by
rank 0 (files.py), and lesson 16's directories of shards, one file per rank (dcp.py)."""
