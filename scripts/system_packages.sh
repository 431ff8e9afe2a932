#!/usr/bin/env bash
# The Debian/Ubuntu packages the tests start for real, and installing those that are missing.
#   scripts/system_packages.sh missing   # the missing ones on one line, space-separated (empty line: none)
#   scripts/system_packages.sh install   # installs the missing ones as root or with password-less sudo (apt-get
#                                        # update only when a first try fails); exit 2: cannot (no root, no
#                                        # apt-get), exit 1: apt-get failed
# A package counts as present when dpkg says it is installed, or when what the tests use of it is there
# (e.g. another build of Slurm on PATH, google-chrome instead of chromium), so a second run costs nothing.
# Used by run_tests.sh and .ci/run.
set -euo pipefail

PACKAGES=(slurm-wlm munge chromium iproute2 util-linux procps dataset-fashion-mnist python3-venv)
has_commands() {  # every command named is an executable on PATH (bash's lookup also returns a plain file)
  local name path
  for name; do path="$(command -v "$name")" && [ -x "$path" ] || return 1; done
}

provided() {  # what the tests use of a package is there, whatever installed it
  case "$1" in
    slurm-wlm) has_commands slurmctld slurmd sinfo srun sbatch salloc scontrol scancel squeue ;;
    munge) has_commands munged munge && [ -e /etc/munge/munge.key ] ;;
    chromium) has_commands chromium || has_commands chromium-browser || has_commands google-chrome ;;
    iproute2) has_commands ip ;;
    util-linux) has_commands nsenter unshare mount ;;
    procps) has_commands ps pkill ;;
    dataset-fashion-mnist) [ -d /usr/share/datasets/fashion-mnist ] ;;
    python3-venv) "${PYTHON:-python3}" -c "import ensurepip, venv" 2>/dev/null ;;
    *) return 1 ;;
  esac
}

missing() {
  local installed="" pkg out=()
  if command -v dpkg-query >/dev/null; then
    installed="$(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${PACKAGES[@]}" 2>/dev/null || true)"
  fi
  for pkg in "${PACKAGES[@]}"; do
    grep -qx "$pkg installed" <<<"$installed" || provided "$pkg" || out+=("$pkg")
  done
  echo "${out[*]-}"  # (bash < 4.4: an empty array is unset)
}

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif sudo -n true 2>/dev/null; then sudo "$@"; else return 2; fi
}

install() {
  local want log
  read -ra want <<<"$(missing)"
  [ "${#want[@]}" -eq 0 ] && return 0
  command -v apt-get >/dev/null || return 2
  as_root true || return 2
  echo "==> installing the system packages the tests use: ${want[*]}"
  log="$(mktemp)"
  export DEBIAN_FRONTEND=noninteractive
  if ! as_root apt-get install -y -q --no-install-recommends "${want[@]}" >"$log" 2>&1; then
    # a fresh machine has no package lists yet
    if ! { as_root apt-get update -q && as_root apt-get install -y -q --no-install-recommends "${want[@]}"; } \
         >"$log" 2>&1; then
      tail -n 5 "$log" >&2
      echo "error: apt-get could not install ${want[*]} (the last lines of its output are above)" >&2
      rm -f "$log"
      return 1
    fi
  fi
  rm -f "$log"
}

case "${1:-}" in
  missing) missing ;;
  install) install ;;
  *) echo "usage: $0 missing|install" >&2; exit 2 ;;
esac
