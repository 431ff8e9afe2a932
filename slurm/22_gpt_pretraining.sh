#!/bin/bash
# Lesson 22 under Slurm: a small GPT pre-trained on text every Python has, on a 2-D mesh over two nodes: tensor
# parallelism with sequence parallelism inside each node, FSDP2 across the nodes (or, with -- --layout fsdp,
# FSDP2 over all ranks).
#
# Preemptible (lessons 12 and 16): 120 s before the time limit Slurm sends SIGUSR1 to this script
# (--signal=B:USR1@120). The trap passes it on through srun to every rank; the ranks finish their step, write
# a DCP checkpoint together and exit 0, and this script runs `scontrol requeue`: the job goes back to the queue
# with the same id and, when it runs again, resumes from the newest intact checkpoint (--resume if-any).
# A checkpoint every 50 steps as well (after a node failure the job loses at most 50 steps). Submitted again,
# the job goes on from the same run dir's checkpoint: give another --run-dir (after --) to start afresh.
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   SITE_ACCOUNT=m1234_g slurm/submit.sh 22_gpt_pretraining --site perlmutter
#   slurm/submit.sh 22_gpt_pretraining --site cpu-only -- --quick --layout fsdp    (lesson arguments after --)
#   slurm/submit.sh 22_gpt_pretraining --site palmetto --dry-run    (print the sbatch command, submit nothing)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/22_gpt_pretraining.sh [lesson arguments]
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=22_gpt_pretraining # the name in squeue and in the log file name
#SBATCH --nodes=2                     # a row of the mesh per node, the data-parallel dimension across them
#SBATCH --ntasks-per-node=2           # one task per rank, 2 per node (docs/lessons.toml); one GPU each (submit.sh)
#SBATCH --cpus-per-task=4             # cores per rank: data, Python, OMP threads
#SBATCH --time=00:20:00               # wall-clock limit
#SBATCH --output=logs/%x-%j.out       # stdout+stderr: logs/<job name>-<job id>.out
#SBATCH --open-mode=append            # a requeued run appends to the log instead of overwriting it
#SBATCH --requeue                     # allow `scontrol requeue` (and preemption) to put the job back in the queue
#SBATCH --signal=B:USR1@120           # SIGUSR1 to this script (B: the batch shell only) 120 s before the limit
set -euo pipefail

# sbatch runs a copy of this file from a spool directory: find the course from where the job was submitted.
COURSE_REPO="${COURSE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
source "$COURSE_REPO/slurm/lib/job.sh" ||
    { echo "error: no course in $COURSE_REPO: submit from the repository root or export COURSE_REPO" >&2; exit 1; }
job_start "$@"
echo "run $((${SLURM_RESTART_COUNT:-0} + 1)) of job $SLURM_JOB_ID (requeued ${SLURM_RESTART_COUNT:-0} times so far)"
LESSON="$COURSE_REPO/day5/22_gpt_pretraining.py"
"$PYTHON" "$COURSE_REPO/course/launching/requires.py" "$LESSON" || exit 1  # this torch has what the lesson needs

# Lesson 12's trap: bash runs a trap only between commands, so the ranks run in the background and this script
# waits for them. The trap only passes the signal on and remembers it; the ranks decide when to stop.
PREEMPTED=no
STEP_PID=""
# shellcheck disable=SC2317  # run by the trap, not called directly
on_usr1() {
    PREEMPTED=yes
    echo "$(date '+%F %T') SIGUSR1: the time limit is near; passing it on to the ranks, which checkpoint and stop"
    [[ -z "$STEP_PID" ]] || kill -USR1 "$STEP_PID" 2>/dev/null || true
}
trap on_usr1 USR1

# One task per rank, numbered node by node: --inner (a row's length) is the tasks per node, so that each row
# is one node (the lesson prints every row's node; a --layout or --inner given after -- wins). The text is
# Python's own documentation: nothing to download on a compute node. If one rank fails, stop the others.
ARGS=(--layout fsdp-tp --inner "${SLURM_NTASKS_PER_NODE:-2}" --checkpoint-every 50 --resume if-any "$@")
echo "+ srun --kill-on-bad-exit=1 $PYTHON -u $LESSON ${ARGS[*]}"
srun --kill-on-bad-exit=1 "$PYTHON" -u "$LESSON" "${ARGS[@]}" &
STEP_PID=$!
STATUS=0
while true; do  # `wait` returns early when the trap runs: wait again until the ranks have really ended
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
