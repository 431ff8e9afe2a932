#!/bin/bash
# Lesson 18 under Slurm: lesson 13's DDP loop measured against the hardware: the collectives' bus bandwidth,
# the matmul peak, a step's FLOPs counted by torch, hardware FLOPs utilization (HFU) against that peak
# and DDP's all_reduce per step.
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   SITE_ACCOUNT=m1234_g slurm/submit.sh 18_hardware_limits --site perlmutter
#   slurm/submit.sh 18_hardware_limits --site cpu-only -- --quick --sizes-mib 1 16 64    (lesson arguments after --)
#   slurm/submit.sh 18_hardware_limits --site palmetto --dry-run    (print the sbatch command, submit nothing)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/18_hardware_limits.sh [lesson arguments]
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=18_hardware_limits # the name in squeue and in the log file name
#SBATCH --nodes=1                    # day 4: every rank on one node
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

# One task per rank; the collectives timed, then DDP's loop, its first step's FLOPs counted. If one rank fails,
# stop the others.
step srun --kill-on-bad-exit=1 "$PYTHON" -u "$COURSE_REPO/day4/18_hardware_limits.py" "$@"
