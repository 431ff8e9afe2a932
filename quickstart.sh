#!/usr/bin/env bash
# Command 1: set everything up (venv, requirements, dataset) and run the day-1 lessons in quick mode on the
# hardware present, ending with a summary.  Idempotent: run it again at any time.  Where the venv comes from
# (your own .venv, a trainer's shared one with VENV=/path, one on the site's PyTorch with COURSE_SYSTEM_TORCH=1):
# scripts/setup_env.sh and docs/trainers/install.md.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh
exec "$PY" -m course.day1_sequence --quick "$@"
