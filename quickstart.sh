#!/usr/bin/env bash
# Command 1: set everything up (venv, requirements, dataset) and run the day-1 lessons in quick mode on the
# hardware present, ending with a summary.  Idempotent: run it again at any time.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh
exec "$PY" -m course.day1_sequence --quick "$@"
