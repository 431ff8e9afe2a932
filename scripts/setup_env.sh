#!/usr/bin/env bash
# Set up (or check) everything the course needs; idempotent, safe to run again.  Sourced by quickstart.sh and
# run_tests.sh.  Respects: PYTHON (interpreter for the venv, default python3), VENV (default .venv),
# COURSE_DATA_DIR (where datasets go, default data/), DATASET (default fashion-mnist).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
PY="$VENV/bin/python"
DATASET="${DATASET:-fashion-mnist}"

say() { printf '==> %s\n' "$*"; }

as_root() {  # run a command as root if we are root or have password-less sudo; else fail
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif sudo -n true 2>/dev/null; then sudo "$@"; else return 1; fi
}

# Before a first install, enough free disk: PyTorch (with its CUDA libraries) is about 6 GB in the venv, and
# pip needs room for the wheels while it unpacks them.  A full disk would otherwise stop pip halfway.
if ! compgen -G "$VENV/lib/python*/site-packages/torch" >/dev/null; then
  need_gb="${COURSE_MIN_FREE_GB:-8}"
  where="$VENV"; while [ ! -d "$where" ]; do where="$(dirname "$where")"; done
  free_kb="$(df -Pk "$where" | awk 'NR == 2 {print $4}')"
  if [ "$free_kb" -lt $((need_gb * 1024 * 1024)) ]; then
    echo "error: $((free_kb / 1024 / 1024)) GB free on the disk of $where, the venv needs about $need_gb GB" \
         "(PyTorch is about 6 GB): free some space, or put the venv on a larger disk with VENV=/path/to/venv" >&2
    exit 1
  fi
fi

if [ ! -x "$PY" ]; then
  say "creating the virtual environment $VENV"
  "${PYTHON:-python3}" -m venv "$VENV" || {
    echo "error: could not create a venv; on Debian/Ubuntu: apt-get install python3-venv" >&2; exit 1; }
fi

# Reinstall only when a requirements file changed since the last successful install.
stamp="$VENV/.course-requirements"
want="$(cat "$REPO"/requirements*.txt | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing requirements into $VENV (torch is large: a few minutes the first time)"
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet -r "$REPO/requirements.txt" -r "$REPO/requirements-test.txt" -r "$REPO/requirements-docs.txt"
  echo "$want" > "$stamp"
fi

# The dataset: Debian's package if we can install it, otherwise prepare_data.py tries a download.
if [ "$DATASET" = fashion-mnist ] && [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null \
   && ! "$PY" -c "import sys; sys.path.insert(0, '$REPO'); from data_tools.datasets import require; require('$DATASET')" 2>/dev/null; then
  say "installing Debian's dataset-fashion-mnist (needs root; skipped otherwise)"
  as_root apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
    || { as_root apt-get update -q >/dev/null 2>&1 && as_root apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1; } \
    || say "could not install it; trying a download instead"
fi
"$PY" "$REPO/data_tools/prepare_data.py" --dataset "$DATASET"
