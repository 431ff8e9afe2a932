#!/usr/bin/env python
"""Prepare MNIST or Fashion-MNIST once into the course's data dir.

    python data_tools/prepare_data.py                      # Fashion-MNIST, from the best source available
    python data_tools/prepare_data.py --dataset mnist      # MNIST (needs a download or --source)
    python data_tools/prepare_data.py --source ~/Downloads # the four IDX files you already have
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for data_tools/

from data_tools.datasets import main_prepare

if __name__ == "__main__":
    sys.exit(main_prepare())
