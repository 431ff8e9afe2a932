#!/bin/bash
# Lesson 14 under Slurm: gradient accumulation and activation checkpointing under DDP on one node, one rank
# per GPU.
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   SITE_ACCOUNT=m1234_g slurm/submit.sh 14_accumulation_checkpointing --site perlmutter
#   slurm/submit.sh 14_accumulation_checkpointing --site cpu-only -- --quick --accumulate 4  (lesson args after --)
#   slurm/submit.sh 14_accumulation_checkpointing --site palmetto --dry-run    (print the sbatch command, submit nothing)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/14_accumulation_checkpointing.sh [lesson arguments]
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=14_accumulation_checkpointing # the name in squeue and in the log file's name
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

# One task per rank; k micro-batches per optimizer step, one all_reduce round per step. If one rank fails,
# stop the others.
step srun --kill-on-bad-exit=1 "$PYTHON" -u "$COURSE_REPO/day3/14_accumulation_checkpointing.py" "$@"
