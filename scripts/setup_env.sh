#!/usr/bin/env bash
# Set up (or check) everything the course needs; idempotent, safe to run again.  Sourced by quickstart.sh and
# run_tests.sh; run on its own, it sets up and runs nothing else.  Three ways to install, one script
# (docs/trainers/install.md):
#   a venv per user       the default: VENV=.venv in the checkout, everything installed into it (~6 GB);
#   one shared venv       a trainer runs `VENV=/shared/venv ./quickstart.sh` once; for a learner who cannot write
#                         into it, the set-up only checks it and writes nothing into it (not even bytecode);
#   the site's PyTorch    COURSE_SYSTEM_TORCH=1: a new venv sees the interpreter's packages (the site's PyTorch
#                         module) and gets only what they lack; a too-old torch stops before anything is made.
# Respects: PYTHON (interpreter for a new venv, default python3), VENV (default .venv), COURSE_SYSTEM_TORCH,
# COURSE_DATA_DIR (where datasets go, default data/), DATASET (default fashion-mnist), COURSE_MIN_FREE_GB.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
PY="$VENV/bin/python"
DATASET="${DATASET:-fashion-mnist}"
# What pip installs (requirements.txt, -test, -docs), the releases a venv of its own gets (constraints.txt),
# and what the venv's stamp records: a change reinstalls.
REQUIREMENTS=("$REPO"/requirements*.txt)
CONSTRAINTS="$REPO/constraints.txt"

say() { printf '==> %s\n' "$*"; }

as_root() {  # run a command as root if we are root or have password-less sudo; else fail
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif sudo -n true 2>/dev/null; then sudo "$@"; else return 1; fi
}

wants_system_torch=0; torch_version=""
case "${COURSE_SYSTEM_TORCH:-0}" in 0 | "" | no | false) ;; *) wants_system_torch=1 ;; esac

# Which kind of venv: one that uses the interpreter's packages (made with COURSE_SYSTEM_TORCH=1, recorded in
# its pyvenv.cfg), and one we may write into (a shared venv is read-only for everyone but its owner).
system_torch="$wants_system_torch"
read_only=0
if [ -x "$PY" ]; then
  system_torch=0
  grep -qsiE '^include-system-site-packages *= *true' "$VENV/pyvenv.cfg" && system_torch=1
  if [ "$wants_system_torch" = 1 ] && [ "$system_torch" = 0 ]; then
    echo "error: COURSE_SYSTEM_TORCH=1, but $VENV exists with its own packages (COURSE_SYSTEM_TORCH applies" \
         "when a venv is made): choose a new one with VENV=/path/to/venv, or remove $VENV first" >&2
    exit 1
  fi
  site_packages=("$VENV"/lib/python*/site-packages)
  [ -w "$VENV" ] && [ -w "${site_packages[0]}" ] || read_only=1
fi

stamp="$VENV/.course-requirements"
want="$(cat "${REQUIREMENTS[@]}" "$CONSTRAINTS" | sha256sum | cut -c1-16)"
have="$(cat "$stamp" 2>/dev/null || true)"

if [ "$read_only" = 1 ]; then
  # A shared venv: no pip, no stamp, no __pycache__ (Python would skip unwritable ones anyway; this also
  # covers files its owner left writable).  Its requirements changed since the trainer's set-up: go on
  # only while it still meets every one of them, else stop and say what the trainer runs.
  export PYTHONDONTWRITEBYTECODE=1
  if [ "$have" != "$want" ]; then
    if unmet="$("$PY" "$REPO/scripts/requirements_check.py" "${REQUIREMENTS[@]}")"; then
      echo "note: the shared venv $VENV (read-only for you) was set up for older requirement files but meets" \
           "all of today's, so the course goes on; the trainer refreshes it with: VENV=$VENV ./quickstart.sh" >&2
    else
      echo "error: the shared venv $VENV (read-only for you) is out of date: it lacks $(paste -sd, <<<"$unmet" |
            sed 's/,/, /g'); the trainer must update it (in the course's checkout: VENV=$VENV ./quickstart.sh)," \
           "or make your own venv: leave VENV unset" >&2
      exit 1
    fi
  fi
elif [ ! -x "$PY" ] || [ "$have" != "$want" ]; then
  # The site's torch, checked before anything is made: importable, with metadata pip can see, recent enough.
  pins=(--constraint="$CONSTRAINTS")  # a venv of its own: the tested torch and torchvision
  if [ "$system_torch" = 1 ]; then
    base="$PY"; [ -x "$base" ] || base="${PYTHON:-python3}"
    torch_version="$("$base" "$REPO/scripts/requirements_check.py" --site-torch "$REPO/requirements.txt")" || exit 1
    # pip keeps the site's torch: without this pin, torchvision's newest release (which requires its own torch
    # release) would make pip download a second torch of ~6 GB into the venv
    pins=("torch==$torch_version")
  fi

  # Before a first install, enough free disk: PyTorch (with its CUDA libraries) is about 6 GB in the venv,
  # and pip needs room for the wheels while it unpacks them.  A full disk would otherwise stop pip halfway.
  if [ "$system_torch" = 1 ] || ! compgen -G "$VENV/lib/python*/site-packages/torch" >/dev/null; then
    need_gb="${COURSE_MIN_FREE_GB:-$([ "$system_torch" = 1 ] && echo 1 || echo 8)}"
    where="$VENV"; while [ ! -d "$where" ]; do where="$(dirname "$where")"; done
    free_kb="$(df -Pk "$where" | awk 'NR == 2 {print $4}')"
    if [ "$free_kb" -lt $((need_gb * 1024 * 1024)) ]; then
      echo "error: $((free_kb / 1024 / 1024)) GB free on the disk of $where, the venv needs about $need_gb GB" \
           "(PyTorch is about 6 GB): free some space, or put the venv on a larger disk with VENV=/path/to/venv" >&2
      exit 1
    fi
  fi

  if [ ! -x "$PY" ]; then
    into="$VENV"; while [ ! -e "$into" ]; do into="$(dirname "$into")"; done  # where it would be written
    if [ ! -w "$into" ]; then
      echo "error: cannot create the venv $VENV: $into is not writable for you; a shared venv is set up by its" \
           "owner (VENV=$VENV ./quickstart.sh), or choose another place with VENV=/path/to/venv" >&2
      exit 1
    fi
    say "creating the virtual environment $VENV$([ "$system_torch" = 1 ] && echo " on top of the site's torch $torch_version")"
    made_here=0; [ -e "$VENV" ] || made_here=1
    "${PYTHON:-python3}" -m venv $([ "$system_torch" = 1 ] && echo --system-site-packages) "$VENV" || {
      [ "$made_here" = 1 ] && rm -rf "$VENV"  # no half-made venv that the next run would take for a real one
      echo "error: could not create a venv; on Debian/Ubuntu: apt-get install python3-venv" >&2; exit 1; }
  fi

  if [ "$system_torch" = 1 ]; then
    say "installing into $VENV what the site's packages lack (torch $torch_version stays the site's)"
  else
    say "installing requirements into $VENV (torch is large: a few minutes the first time)"
  fi
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet ${pins[@]+"${pins[@]}"} "${REQUIREMENTS[@]/#/--requirement=}"  # (bash < 4.4: empty arrays)
  echo "$want" > "$stamp"
fi

# A venv on the site's torch needs the site's module in every shell (and job) that uses it.
if [ "$system_torch" = 1 ] && [ -z "${torch_version:-}" ]; then
  "$PY" "$REPO/scripts/requirements_check.py" --site-torch "$REPO/requirements.txt" >/dev/null || exit 1
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
