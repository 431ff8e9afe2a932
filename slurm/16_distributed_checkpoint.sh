#!/bin/bash
# Lesson 16 under Slurm: FSDP2 training with distributed checkpoints (DCP), then one file for inference.
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   SITE_ACCOUNT=m1234_g slurm/submit.sh 16_distributed_checkpoint --site perlmutter -- --max-steps 400
#   slurm/submit.sh 16_distributed_checkpoint --site cpu-only -- --quick --async-save   (lesson arguments after --)
#   slurm/submit.sh 16_distributed_checkpoint --site palmetto --dry-run    (print the sbatch command, submit nothing)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/16_distributed_checkpoint.sh [lesson arguments]
#
# What the job does: trains with every rank saving its own shards (--checkpoint-every), resuming from the
# newest complete checkpoint in --checkpoint-dir if there is one (--resume if-any): submit the same command
# again after a time limit and it goes on, also with another number of ranks (keep ranks x --batch-size
# equal: the lesson says which --batch-size to use).  Then one task, without a process group, exports the
# newest checkpoint to one ordinary file for inference: EXPORT (default: RUN_DIR/model-export.pt, where
# RUN_DIR is runs/16_distributed_checkpoint unless --run-dir is given).
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=16_distributed_checkpoint  # the name in squeue and in the log file name
#SBATCH --nodes=1                    # day 3: every rank on one node
#SBATCH --ntasks-per-node=4          # one task per rank; GPU sites: one per GPU (submit.sh)
#SBATCH --cpus-per-task=4            # cores per rank: data, Python, OMP threads
#SBATCH --time=00:20:00              # wall-clock limit
#SBATCH --output=logs/%x-%j.out      # stdout+stderr: logs/<job name>-<job id>.out
set -euo pipefail

# sbatch runs a copy of this file from a spool directory: find the course from where the job was submitted.
COURSE_REPO="${COURSE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
source "$COURSE_REPO/slurm/lib/job.sh" ||
    { echo "error: no course in $COURSE_REPO: submit from the repository root or export COURSE_REPO" >&2; exit 1; }
job_start "$@"

LESSON="$COURSE_REPO/day3/16_distributed_checkpoint.py"
RUN_DIR=runs/16_distributed_checkpoint
ARGS=("$@")
for i in "${!ARGS[@]}"; do  # the run dir the lesson will use: the default, or the one given
    case "${ARGS[$i]}" in
        --run-dir) RUN_DIR="${ARGS[$((i + 1))]:-$RUN_DIR}" ;;
        --run-dir=*) RUN_DIR="${ARGS[$i]#--run-dir=}" ;;
    esac
done
EXPORT="${EXPORT:-$RUN_DIR/model-export.pt}"

# One task per rank, each writing its own shards. If one rank fails, stop the others.
step srun --kill-on-bad-exit=1 "$PYTHON" -u "$LESSON" --resume if-any "$@"
# One task, no process group: DCP reads every rank's shards and assembles whole tensors.
step srun --kill-on-bad-exit=1 --ntasks=1 --nodes=1 "$PYTHON" -u "$LESSON" "$@" --export "$EXPORT"
