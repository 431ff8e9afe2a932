#!/usr/bin/env bash
# Command 2: set everything up (as quickstart.sh) and run the test suite.  Extra arguments go to pytest,
# e.g. ./run_tests.sh -m "not slurm" or ./run_tests.sh tests/test_data_tools.py
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh
exec "$PY" -m pytest "$@"
