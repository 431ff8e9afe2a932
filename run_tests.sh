#!/usr/bin/env bash
# Command 2: set everything up (as quickstart.sh) and run the test suite.  Extra arguments go to pytest,
# e.g. ./run_tests.sh -m "not slurm" or ./run_tests.sh tests/test_data_tools.py.  Two pytest-xdist workers
# (TEST_WORKERS=N to change, -n 0 for none): most tests wait for processes, Slurm jobs or servers part of
# the time, and two streams keep both cores busy.  --dist loadfile: a test file runs in one worker, so its
# module fixtures (all launchers submitted at once, a reference run) run once; a worker with Slurm tests
# starts its own test cluster (clusters on one machine are independent).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh
exec "$PY" -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
