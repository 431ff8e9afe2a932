#!/usr/bin/env bash
# Command 2: set everything up (as quickstart.sh) and run the test suite.  Extra arguments go to pytest,
# e.g. ./run_tests.sh -m "not slurm" or ./run_tests.sh tests/test_data_tools.py.
#   ./run_tests.sh            the full suite (CI runs this): every test, the real 2-node Slurm and the browser too
#   ./run_tests.sh --quick    the quick tier for contributors: the in-process tests and, for every lesson, the one
#                             run that proves its central claim (tests marked quick); a few minutes
# (docs/contributors/tests.md, "Two tiers").  Three pytest-xdist workers (TEST_WORKERS=N to change, -n 0 for
# none): many tests wait part of the time for Slurm jobs, signals or timeouts, and on 2 cores a third stream
# fills those gaps.  --dist loadfile: a test file runs in one worker, so its module fixtures run once (the
# reference runs that several files read run once in the whole session: tests/catalogue.py);
# --no-loadscope-reorder: the files go to the workers longest first, in the order tests/conftest.py gives them
# from the last run's times, so that no long file is left to run alone at the end.  A worker with Slurm tests
# starts its own test cluster (clusters on one machine are independent).
# The tests start real components: Slurm and munge, Chromium, network namespaces (scripts/system_packages.sh
# lists the Debian packages).  As root or with password-less sudo, the missing ones are installed first
# (nothing to do on a second run); otherwise their tests skip, and the last line says how many and the
# command that runs them.  The exit code is pytest's (5: no tests collected).
set -euo pipefail
cd "$(dirname "$0")"
scripts/system_packages.sh install || true  # without root their tests skip; an apt-get failure is said above
source scripts/setup_env.sh
# Bytecode caches for the checkout's own modules, even where the caller's environment forbids them (a
# PYTHONDONTWRITEBYTECODE=1 left in a shell): the suite starts about a thousand interpreters, and without the
# caches each one compiles course/ and data_tools/ again, and every pytest process rewrites the asserts of all
# ~60 test modules again (about 9 CPU-seconds a collection).  A shared read-only venv keeps setup_env.sh's
# setting: there is nothing to write.
[ "$read_only" = 1 ] || unset PYTHONDONTWRITEBYTECODE

# --quick anywhere among the arguments; a -m EXPR of the caller's narrows the tier (both must hold), for pytest
# keeps only the last -m it is given
quick="" marks="" args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick="quick or not (slow or slurm or browser or gpu)"; shift ;;
    -m) [ $# -ge 2 ] || { echo "run_tests: -m needs an expression" >&2; exit 2; }; marks="$2"; shift 2 ;;
    -m*) marks="${1#-m}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
tier=()
if [ -n "$quick" ] && [ -n "$marks" ]; then tier=(-m "($quick) and ($marks)")
elif [ -n "$quick$marks" ]; then tier=(-m "$quick$marks")
fi

report="$(mktemp)"
status=0
COURSE_SKIP_REPORT="$report" "$PY" -m pytest -p tests.skip_report -n "${TEST_WORKERS:-3}" --dist loadfile \
  --no-loadscope-reorder ${tier[@]+"${tier[@]}"} ${args[@]+"${args[@]}"} \
  || status=$?
read -r root_skips package_skips <"$report" || true  # empty when pytest stopped before the end
root_skips="${root_skips:-0}" package_skips="${package_skips:-0}"
rm -f "$report"
skipped=$((root_skips + package_skips))
if [ "$skipped" -gt 0 ]; then
  missing="$(scripts/system_packages.sh missing)"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo "
  run="./run_tests.sh"; [ "$root_skips" -gt 0 ] && run="${sudo}./run_tests.sh"  # the Slurm tests need root
  echo "run_tests: $skipped $([ "$skipped" -eq 1 ] && echo test || echo tests) skipped for missing system packages or root" \
       "($root_skips need root, $package_skips need packages${missing:+; missing: $missing}); to run them:" \
       "${missing:+${sudo}apt-get install -y $missing && }$run"
fi
exit "$status"
