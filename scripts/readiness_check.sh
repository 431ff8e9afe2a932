#!/bin/bash
# The trainer's dry run, the week before a workshop: one small job on 2 nodes of the site profile (one rank
# per GPU), which checks the environment and the data on every node, runs lesson 9's all_reduce across the
# nodes (NCCL on GPUs), measures all_reduce bus bandwidth against message size, runs a quick DDP lesson (10)
# and a day-3 lesson (15), and ends with one verdict table: what passed, the bandwidth, what to fix.
#
#   scripts/readiness_check.sh --site NAME                 # submit, wait, print the verdict (exit 1: not ready)
#   scripts/readiness_check.sh --site NAME --gpus-per-node 4 --dry-run   # the sbatch command only
#
# Options go to slurm/submit.sh (--site, --gpus-per-node, --ntasks-per-node, --time, --dry-run, --test-only);
# READINESS_MAX_MIB=64 sets the largest all_reduce (MiB; not set: 1024 on GPUs, 256 on CPUs).  The log: logs/readiness-<job id>.out.
set -euo pipefail
COURSE_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ " $* " != *" --help "* && " $* " != *" -h "* ]] || { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0; }

submitted="$("$COURSE_REPO/slurm/submit.sh" "$COURSE_REPO/scripts/readiness_job.sh" "$@")"
echo "$submitted"
job="$(sed -n 's/^Submitted batch job \([0-9]*\)$/\1/p' <<<"$submitted")"
[[ -n "$job" ]] || exit 0  # --dry-run, --test-only: nothing to wait for
log="logs/readiness-$job.out"
echo "readiness: waiting for job $job (log: $log)"
while squeue --noheader --job "$job" 2>/dev/null | grep -q .; do
    sleep 5
done
sleep 1  # the log's last lines
if ! grep -q "^READY: every check passed" "$log" 2>/dev/null; then
    sed -n '/^readiness verdict$/,$p' "$log" 2>/dev/null || true
    grep -q "^readiness verdict$" "$log" 2>/dev/null || echo "readiness: the job ended before its verdict; read $log"
    exit 1
fi
sed -n '/^readiness verdict$/,$p' "$log"
