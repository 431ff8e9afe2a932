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
#
# READY means every row of the table passed: every step; a GPU of its own for every rank (GPU profiles); the
# ranks on all the job's nodes, at least 2; NCCL between the nodes over the network the profile declares
# (SITE_NCCL_TRANSPORT: IB, Socket, ...); all_reduce bus bandwidth of at least SITE_MIN_BUSBW_SHARE (empty: 0.5)
# of SITE_LINK_GBPS (a node's network, Gbit/s); every lesson's torch and packages; the precision the lessons
# default to (bf16) native on the GPUs; where the profile exports COURSE_MODEL_DIR (a model staged for lesson 23),
# that model readable on every node, one the course's GPT can be, its SHA256SUMS holding.  Without SITE_NCCL_TRANSPORT (GPU profiles) or SITE_LINK_GBPS, those rows
# are "not judged" and the check says NOT READY.  Those three values are checked here before anything is
# submitted: a value that cannot be one is one line, and exit 1.
set -euo pipefail
COURSE_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ " $* " != *" --help "* && " $* " != *" -h "* ]] || { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0; }

# The profile's readiness values (from its file or the environment, as the job will see them), in a subshell: the
# environment submit.sh gets stays as it is.  No profile, or one that does not exist: submit.sh says so itself.
problem="$(
    site=""
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --site) site="${2:-}"; shift $(($# > 1 ? 2 : 1)) ;;
            --site=*) site="${1#*=}"; shift ;;
            --) break ;;
            *) shift ;;
        esac
    done
    source "$COURSE_REPO/slurm/lib/site.sh"
    COURSE_SITE_FILE="$(course_site_resolve "$site" 2>/dev/null && echo "$COURSE_SITE_FILE")" || exit 0
    [[ -n "$COURSE_SITE_FILE" ]] || exit 0
    set +u  # a profile may read unset variables, as in site_setup
    course_load_site "$COURSE_SITE_FILE"
    origin() {  # as submit.sh names a setting
        if [[ " $COURSE_SITE_FROM_ENV " == *" $1 "* ]]; then echo "(from the environment)"; else echo "in $COURSE_SITE_FILE"; fi
    }
    # a decimal number in (low, high]: the regex for its form, awk for its size
    within() { [[ "$1" =~ ^([0-9]+([.][0-9]*)?|[.][0-9]+)$ ]] && awk -v v="$1" -v h="$2" 'BEGIN { exit !(v > 0 && v <= h) }'; }
    if [[ -n "${SITE_NCCL_TRANSPORT:-}" && ! "$SITE_NCCL_TRANSPORT" =~ ^[A-Za-z][A-Za-z0-9_\ -]{0,39}$ ]]; then
        echo "SITE_NCCL_TRANSPORT='$SITE_NCCL_TRANSPORT' $(origin SITE_NCCL_TRANSPORT): one network name as NCCL prints it in" \
             "'via NET/<name>/' (IB, Socket, or a plugin's, e.g. 'AWS Libfabric'), or empty"
    elif [[ -n "${SITE_LINK_GBPS:-}" ]] && ! within "$SITE_LINK_GBPS" 1e12; then
        echo "SITE_LINK_GBPS='$SITE_LINK_GBPS' $(origin SITE_LINK_GBPS): the network bandwidth of one node to the others in Gbit/s," \
             "a number above 0 such as 200, or empty (then the bandwidth is not judged, and the check says NOT READY)"
    elif [[ -n "${SITE_MIN_BUSBW_SHARE:-}" ]] && ! within "$SITE_MIN_BUSBW_SHARE" 1; then
        echo "SITE_MIN_BUSBW_SHARE='$SITE_MIN_BUSBW_SHARE' $(origin SITE_MIN_BUSBW_SHARE): the share of SITE_LINK_GBPS the bus bandwidth" \
             "must reach, above 0 and at most 1 (empty: 0.5)"
    fi
)" || problem=""  # a profile that cannot be read: submit.sh says why
if [[ -n "$problem" ]]; then
    echo "readiness_check.sh: error: $problem. Nothing was submitted." >&2
    exit 1
fi

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
