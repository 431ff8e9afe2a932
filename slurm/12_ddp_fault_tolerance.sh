#!/bin/bash
# Lesson 12 under Slurm: DDP training that checkpoints when the time limit nears, requeues itself and resumes.
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   slurm/submit.sh 12_ddp_fault_tolerance --site perlmutter -- --epochs 20
#   slurm/submit.sh 12_ddp_fault_tolerance --site cpu-only -- --quick    (lesson arguments after --)
#   LAUNCHER=torchrun MAX_RESTARTS=3 slurm/submit.sh 12 --site jsc    (one torchrun per node, restarts)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/12_ddp_fault_tolerance.sh [lesson arguments]
#
# What happens: 120 s before the time limit Slurm sends SIGUSR1 to this script (--signal=B:USR1@120). The trap
# below passes it on to every rank; the ranks agree on a step, rank 0 writes a checkpoint, they exit; then
# this script runs `scontrol requeue`: the job goes back to the queue with the same id, and when it runs again
# the same command resumes from the newest checkpoint. The log (same file, appended) shows every run.
# The lesson arguments are used again on every run: never pass --fresh here.
#   LAUNCHER=srun      (default) one task per rank; srun passes SIGUSR1 on to the tasks. A crashed rank
#                      ends the job (srun --kill-on-bad-exit=1); resubmit it and it resumes.
#   LAUNCHER=torchrun  one torchrun per node, --max-restarts=$MAX_RESTARTS (default 3): a crashed rank makes
#                      torchrun restart every rank from the newest checkpoint. torchrun does not pass SIGUSR1
#                      on to its workers unless told to: --signals-to-handle (torch >= 2.9) does it.
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=12_ddp_fault_tolerance # the name in squeue and in the log file name
#SBATCH --nodes=2                    # day 2: ranks on two nodes
#SBATCH --ntasks-per-node=2          # one task per rank, 2 per node (docs/lessons.toml); one GPU each (submit.sh)
#SBATCH --cpus-per-task=4            # cores per rank: data, Python, OMP threads
#SBATCH --time=00:20:00              # wall-clock limit of one run; the job runs again after a requeue
#SBATCH --output=logs/%x-%j.out      # stdout+stderr: logs/<job name>-<job id>.out
#SBATCH --open-mode=append           # a requeued run appends to the log instead of overwriting it
#SBATCH --requeue                    # allow `scontrol requeue` (and preemption) to put the job back in the queue
#SBATCH --signal=B:USR1@120          # SIGUSR1 to this script (B: the batch shell only) 120 s before the limit
set -euo pipefail

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    echo "error: not inside a Slurm job: submit this script, e.g. slurm/submit.sh 12_ddp_fault_tolerance --site NAME" \
         "(or: mkdir -p logs && sbatch slurm/12_ddp_fault_tolerance.sh); on one machine run the lesson itself:" \
         "python day2/12_ddp_fault_tolerance.py --nproc 2" >&2
    exit 1
fi

# sbatch runs a copy of this file from a spool directory: find the course from where the job was submitted.
COURSE_REPO="${COURSE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
source "$COURSE_REPO/slurm/lib/job.sh" ||
    { echo "error: no course in $COURSE_REPO: submit from the repository root or export COURSE_REPO" >&2; exit 1; }
job_start "$@"
echo "run $((${SLURM_RESTART_COUNT:-0} + 1)) of job $SLURM_JOB_ID (requeued ${SLURM_RESTART_COUNT:-0} times so far)"

LESSON="$COURSE_REPO/day2/12_ddp_fault_tolerance.py"
LAUNCHER="${LAUNCHER:-srun}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
case "$LAUNCHER" in
    srun|torchrun) ;;
    *) echo "error: LAUNCHER must be srun or torchrun, not '$LAUNCHER'" >&2; exit 2 ;;
esac

# bash runs a trap only between commands, never while a foreground command runs: the ranks run in the
# background and this script waits for them, so that the trap can act at once. It only passes the signal
# on and remembers it; the ranks decide when to stop (after the current step) and checkpoint.
PREEMPTED=no
STEP_PID=""
# shellcheck disable=SC2317  # run by the trap, not called directly
on_usr1() {
    PREEMPTED=yes
    echo "$(date '+%F %T') SIGUSR1: the time limit is near; passing it on to the ranks, which checkpoint and stop"
    [[ -z "$STEP_PID" ]] || kill -USR1 "$STEP_PID" 2>/dev/null || true
}
trap on_usr1 USR1

if [[ "$LAUNCHER" == srun ]]; then
    # One task per rank. srun passes SIGUSR1 on to every task on every node.
    echo "+ srun --kill-on-bad-exit=1 $PYTHON -u $LESSON $*"
    srun --kill-on-bad-exit=1 "$PYTHON" -u "$LESSON" "$@" &
else
    if ! "$PYTHON" -m torch.distributed.run --help 2>/dev/null | grep -q -- --signals-to-handle; then
        echo "error: this torch's torchrun has no --signals-to-handle (torch >= 2.9): it would not pass SIGUSR1 on" \
             "to the ranks, and they could not checkpoint; use LAUNCHER=srun (the default) or a newer torch" >&2
        exit 1
    fi
    NNODES="${SLURM_JOB_NUM_NODES:-1}"
    TASKS_PER_NODE="${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}}"
    TASKS_PER_NODE="${TASKS_PER_NODE%%[(,]*}"  # "4(x2)" or "4,2": torchrun starts as many ranks on every node
    # the first node, or the name job_start made from it with the profile's SITE_MASTER_ADDR, or yours (exported)
    HEAD="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)}"
    PORT="${MASTER_PORT:-$((10000 + SLURM_JOB_ID % 20000))}"  # from the job id, as course/launching/ports.py derives it
    # After a restart the workers could read the previous round's addresses from torchrun's shared store
    # (pytorch/pytorch#135712): a store of their own per round.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    echo "+ srun ... torchrun --max-restarts=$MAX_RESTARTS --signals-to-handle=...,SIGUSR1 $LESSON $*" \
         "($NNODES node(s) x $TASKS_PER_NODE ranks, rendezvous at $HEAD:$PORT)"
    # the first node's agent hosts the rendezvous (is_host, read in each task): torchrun's own guess fails for a
    # HEAD on another network than the node's name (SITE_MASTER_ADDR={host}i; day2/multinode_setup_and_run.sh)
    srun --kill-on-bad-exit=1 --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 \
        --cpus-per-task=$((TASKS_PER_NODE * ${SLURM_CPUS_PER_TASK:-1})) \
        bash -c 'exec "$0" -m torch.distributed.run --rdzv_conf=is_host=$((SLURM_NODEID == 0)) "$@"' "$PYTHON" \
        --nnodes="$NNODES" --nproc_per_node="$TASKS_PER_NODE" \
        --rdzv_backend=c10d --rdzv_endpoint="$HEAD:$PORT" --rdzv_id="$SLURM_JOB_ID" \
        --max-restarts="$MAX_RESTARTS" --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
        "$LESSON" "$@" &
fi
STEP_PID=$!

# `wait` returns early when the trap runs: wait again until the step has really ended.
STATUS=0
while true; do
    wait "$STEP_PID" && STATUS=0 || STATUS=$?
    kill -0 "$STEP_PID" 2>/dev/null || break
done

if [[ "$PREEMPTED" == yes ]]; then
    echo "requeueing job $SLURM_JOB_ID: when it runs again it resumes from the newest checkpoint"
    if ! scontrol requeue "$SLURM_JOB_ID"; then
        echo "error: scontrol requeue failed (does your site allow requeueing? see \`scontrol show config |" \
             "grep -i requeue\`); submit the same command again: it resumes from the checkpoint" >&2
        exit 1
    fi
    exit 0
fi
exit "$STATUS"
