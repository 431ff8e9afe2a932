#!/bin/bash
# The readiness check's job (scripts/readiness_check.sh submits it with the site profile's options): on 2 nodes
# with one rank per GPU (CPU sites: SITE_TASKS_PER_NODE ranks), each check in turn, then one verdict table,
# judged against what the profile declares (SITE_GPU_FLAG, SITE_NCCL_TRANSPORT, SITE_LINK_GBPS,
# SITE_MIN_BUSBW_SHARE; course/readiness.py says how).
#SBATCH --job-name=readiness         # the name in squeue and in the log file name
#SBATCH --nodes=2                    # the network between two nodes is what days 2 to 4 need
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
READINESS="$COURSE_REPO/course/readiness.py"
# "2(x2)" or "2,1": the first node's count (multinode_setup_and_run.sh reads it the same way)
TASKS_PER_NODE="${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}}"
TASKS_PER_NODE="${TASKS_PER_NODE%%[(,]*}"
# What the verdict judges against: the profile's values (slurm/lib/site.sh loaded them) and the job's size.
DECLARED=(--site "${COURSE_SITE_FILE:-}" --nodes "${SLURM_JOB_NUM_NODES:-}" --ranks "${SLURM_NTASKS:-}"
          --gpu-flag "${SITE_GPU_FLAG:-none}" --nccl-transport "${SITE_NCCL_TRANSPORT:-}"
          --link-gbps "${SITE_LINK_GBPS:-}" --min-busbw-share "${SITE_MIN_BUSBW_SHARE:-}")
"$PYTHON" "$READINESS" settings "$RESULTS" "${DECLARED[@]}" || exit 1  # a value that cannot be one: one line

# One check: its command, its exit code and seconds in steps.tsv; a failing check does not stop the others.
check() {
    local name="$1" start=$SECONDS code=0
    shift
    echo "==== readiness: $name"
    echo "+ $*"
    "$@" || code=$?
    printf '%s\t%s\t%s\n' "$name" "$code" "$((SECONDS - start))" >>"$RESULTS/steps.tsv"
}

# Every rank: its device, its GPU's UUID and compute capability; each node's first rank: torch, every lesson's
# packages, the data.
check "environment, data and GPUs" srun --kill-on-bad-exit=1 "$PYTHON" -u "$READINESS" rank "$RESULTS"
check "all_reduce across nodes" "$MULTINODE" 9_torch_dist_multi_node.py
# NCCL's own account of the network it chose between the nodes ("via NET/IB/0"), one file per process
check "bus bandwidth" env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_DEBUG_FILE="$RESULTS/nccl-%h-%p.log" \
    "$MULTINODE" "$READINESS" bandwidth "$RESULTS" \
    ${READINESS_MAX_MIB:+--max-mib "$READINESS_MAX_MIB"}  # not set: 1024 MiB on GPUs, 256 on CPUs
# One lesson of each day, short, on the GPUs: day 1 on one node, the others across both
check "day-1 lesson (6)" srun --kill-on-bad-exit=1 --nodes=1 --ntasks="$TASKS_PER_NODE" "$PYTHON" -u \
    "$COURSE_REPO/day1/6_mnist_ddp_pt.py" --quick --max-steps 5 --run-dir "$RESULTS/6"
check "DDP lesson (10)" "$MULTINODE" 10_mnist_ddp_pt_multinode.py --quick --max-steps 5 --run-dir "$RESULTS/10"
check "day-3 lesson (15)" srun --kill-on-bad-exit=1 "$PYTHON" -u "$COURSE_REPO/day3/15_fsdp2.py" --quick \
    --max-steps 3 --run-dir "$RESULTS/15"
# as its launcher runs it: a row of the mesh per node (--inner: the tasks per node)
check "day-4 lesson (20)" srun --kill-on-bad-exit=1 "$PYTHON" -u "$COURSE_REPO/day4/20_device_mesh_2d.py" \
    --inner "$TASKS_PER_NODE" --quick --max-steps 2 --run-dir "$RESULTS/20"
"$PYTHON" "$READINESS" verdict "$RESULTS" "${DECLARED[@]}"
