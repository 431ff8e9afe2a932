#!/bin/bash
# Slurm batch script for train_ddp.py (train_fsdp.sh is the same for train_fsdp.py).
# Submit it from the folder that holds the training script; arguments go to the script:
#   mkdir -p logs && sbatch train_ddp.sh --epochs 20 --batch-size 64
# One task per rank, on every node; srun starts them and ends the job if one fails (--kill-on-bad-exit).
# 120 s before the time limit Slurm sends SIGUSR1 to this script (--signal=B:USR1@120); the trap below passes it
# on to the ranks, which finish their step, write a checkpoint and exit; then `scontrol requeue` puts the job
# back in the queue, and when it runs again the same command resumes from that checkpoint.
# CHANGE the lines marked CHANGE for your site: account, partition, GPUs, environment.
#SBATCH --job-name=train_ddp         # the name in squeue and in the log file's name
#SBATCH --nodes=2                    # CHANGE: nodes
#SBATCH --ntasks-per-node=4          # one task per rank: one per GPU on GPU nodes
#SBATCH --cpus-per-task=8            # cores per rank: data loading, Python, the rank's OMP threads
##SBATCH --gpus-per-node=4           # CHANGE: GPU nodes: uncomment, one GPU per task (some sites: --gres=gpu:4)
##SBATCH --account=PROJECT           # CHANGE: your project or account, if your site asks for one
##SBATCH --partition=PARTITION       # CHANGE: the partition (queue)
#SBATCH --time=02:00:00              # wall-clock limit of one run; a requeued job gets it again
#SBATCH --output=logs/%x-%j.out      # stdout+stderr: logs/<job name>-<job id>.out (mkdir logs first)
#SBATCH --open-mode=append           # a requeued run appends to the same log
#SBATCH --requeue                    # allow `scontrol requeue` (and preemption) to put the job back in the queue
#SBATCH --signal=B:USR1@120          # SIGUSR1 to this script (B: the batch shell) 120 s before the limit
set -euo pipefail

# CHANGE: your environment, e.g.  module load pytorch   or   source ~/venvs/torch/bin/activate
PYTHON="${PYTHON:-python3}"
SCRIPT="${SCRIPT:-${SLURM_SUBMIT_DIR:-.}/train_ddp.py}"
[[ -f "$SCRIPT" ]] || { echo "error: no $SCRIPT: submit from its folder or set SCRIPT=path" >&2; exit 2; }
echo "job ${SLURM_JOB_ID:-?} run $((${SLURM_RESTART_COUNT:-0} + 1)) on ${SLURM_JOB_NODELIST:-?}, $(date '+%F %T')"

# bash runs a trap only between commands: the step runs in the background and the script waits for it.
PREEMPTED=no
STEP_PID=""
on_usr1() {
    PREEMPTED=yes
    echo "$(date '+%F %T') SIGUSR1: the time limit is near; the ranks checkpoint and stop"
    [[ -z "$STEP_PID" ]] || kill -USR1 "$STEP_PID" 2>/dev/null || true  # srun passes it on to every task
}
trap on_usr1 USR1
# --cpus-per-task again: srun does not take it from sbatch on every Slurm release
srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" "$PYTHON" -u "$SCRIPT" "$@" &
STEP_PID=$!
STATUS=0
while true; do  # `wait` returns early when the trap runs: wait again until the step has ended
    wait "$STEP_PID" && STATUS=0 || STATUS=$?
    kill -0 "$STEP_PID" 2>/dev/null || break
done
if [[ "$PREEMPTED" == yes && "$STATUS" == 0 ]]; then
    echo "requeueing job $SLURM_JOB_ID: it resumes from the newest checkpoint when it runs again"
    scontrol requeue "$SLURM_JOB_ID" || { echo "error: scontrol requeue failed: submit the same command again" >&2; exit 1; }
fi
exit "$STATUS"
