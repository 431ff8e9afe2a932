#!/bin/bash
# Lesson 8 under Slurm: the 1-process reference curve, then all ranks with the scaled learning rate.
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   SITE_ACCOUNT=m1234_g slurm/submit.sh 8_mnist_ddp_pt_lr --site perlmutter
#   slurm/submit.sh 8_mnist_ddp_pt_lr --site cpu-only -- --quick    (lesson arguments after --)
#   slurm/submit.sh 8_mnist_ddp_pt_lr --site palmetto --dry-run    (print the sbatch command, submit nothing)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/8_mnist_ddp_pt_lr.sh [lesson arguments]
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=8_mnist_ddp_pt_lr # the name in squeue and in the log file name
#SBATCH --nodes=1                    # day 1: every rank on one node
#SBATCH --ntasks-per-node=4          # one task per rank; GPU sites: one per GPU (submit.sh)
#SBATCH --cpus-per-task=4            # cores per rank: data, Python, OMP threads
#SBATCH --time=00:30:00              # wall-clock limit
#SBATCH --output=logs/%x-%j.out      # stdout+stderr: logs/<job name>-<job id>.out
set -euo pipefail

# sbatch runs a copy of this file from a spool directory: find the course from where the job was submitted.
COURSE_REPO="${COURSE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
source "$COURSE_REPO/slurm/lib/job.sh" ||
    { echo "error: no course in $COURSE_REPO: submit from the repository root or export COURSE_REPO" >&2; exit 1; }
job_start "$@"

# Under srun the lesson compares with a 1-process reference made before in the same --run-dir: make it
# first, as a one-task step, then run all the job's ranks (lr x ranks unless --no-scale).
step srun --kill-on-bad-exit=1 --ntasks=1 "$PYTHON" -u "$COURSE_REPO/day1/8_mnist_ddp_pt_lr.py" "$@"
if ((SLURM_NTASKS > 1)); then
    step srun --kill-on-bad-exit=1 "$PYTHON" -u "$COURSE_REPO/day1/8_mnist_ddp_pt_lr.py" "$@"
fi
