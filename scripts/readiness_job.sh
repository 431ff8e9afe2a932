#!/bin/bash
# The readiness check's job (scripts/readiness_check.sh submits it with the site profile's options): on 2 nodes
# with one rank per GPU (CPU sites: SITE_TASKS_PER_NODE ranks), each check in turn, then one verdict table.
#SBATCH --job-name=readiness         # the name in squeue and in the log file name
#SBATCH --nodes=2                    # the network between two nodes is what day 2 and 3 need
#SBATCH --time=00:20:00              # wall-clock limit
#SBATCH --output=logs/%x-%j.out      # stdout+stderr: logs/readiness-<job id>.out
set -euo pipefail

COURSE_REPO="${COURSE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
source "$COURSE_REPO/slurm/lib/job.sh" ||
    { echo "error: no course in $COURSE_REPO: submit from the repository root or export COURSE_REPO" >&2; exit 1; }
job_start "$@"

RESULTS="${READINESS_DIR:-runs/readiness-$SLURM_JOB_ID}"
mkdir -p "$RESULTS"
: >"$RESULTS/steps.tsv"
MULTINODE="$COURSE_REPO/day2/multinode_setup_and_run.sh"

# One check: its command, its exit code and seconds in steps.tsv; a failing check does not stop the others.
check() {
    local name="$1" start=$SECONDS code=0
    shift
    echo "==== readiness: $name"
    echo "+ $*"
    "$@" || code=$?
    printf '%s\t%s\t%s\n' "$name" "$code" "$((SECONDS - start))" >>"$RESULTS/steps.tsv"
}

check "environment and data" srun --kill-on-bad-exit=1 --ntasks-per-node=1 --ntasks="$SLURM_JOB_NUM_NODES" \
    "$PYTHON" -u "$COURSE_REPO/course/readiness.py" node "$RESULTS"
check "all_reduce across nodes" "$MULTINODE" 9_torch_dist_multi_node.py
check "bus bandwidth" "$MULTINODE" "$COURSE_REPO/course/readiness.py" bandwidth "$RESULTS" \
    ${READINESS_MAX_MIB:+--max-mib "$READINESS_MAX_MIB"}  # not set: 1024 MiB on GPUs, 256 on CPUs
check "DDP lesson (10)" "$MULTINODE" 10_mnist_ddp_pt_multinode.py --quick --max-steps 20 --run-dir "$RESULTS/10"
check "day-3 lesson (15)" srun --kill-on-bad-exit=1 "$PYTHON" -u "$COURSE_REPO/day3/15_fsdp2.py" --quick \
    --max-steps 10 --run-dir "$RESULTS/15"
"$PYTHON" "$COURSE_REPO/course/readiness.py" verdict "$RESULTS"
