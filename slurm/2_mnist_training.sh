#!/bin/bash
# Lesson 2 under Slurm: the single-process baseline, one task (and one GPU on a GPU site).
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   SITE_ACCOUNT=m1234_g slurm/submit.sh 2_mnist_training --site perlmutter
#   slurm/submit.sh 2_mnist_training --site cpu-only -- --quick    (lesson arguments after --)
#   slurm/submit.sh 2_mnist_training --site palmetto --dry-run    (print the sbatch command, submit nothing)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/2_mnist_training.sh [lesson arguments]
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=2_mnist_training  # the name in squeue and in the log file name
#SBATCH --nodes=1                    # one node
#SBATCH --ntasks=1                   # one process: the baseline later lessons distribute
#SBATCH --cpus-per-task=4            # cores for its data, Python and OMP threads
#SBATCH --time=00:20:00              # wall-clock limit
#SBATCH --output=logs/%x-%j.out      # stdout+stderr: logs/<job name>-<job id>.out
set -euo pipefail

# sbatch runs a copy of this file from a spool directory: find the course from where the job was submitted.
COURSE_REPO="${COURSE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
source "$COURSE_REPO/slurm/lib/job.sh" ||
    { echo "error: no course in $COURSE_REPO: submit from the repository root or export COURSE_REPO" >&2; exit 1; }
job_start "$@"

# One task: srun gives it the job's cores (and its GPU); the lesson starts no other processes.
step srun --kill-on-bad-exit=1 --ntasks=1 "$PYTHON" -u "$COURSE_REPO/day1/2_mnist_training.py" "$@"
