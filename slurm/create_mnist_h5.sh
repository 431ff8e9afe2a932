#!/bin/bash
# data_tools/create_mnist_h5.py under Slurm: write lesson 11's chunked HDF5 file once, as one task.
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   SITE_ACCOUNT=m1234_g slurm/submit.sh create_mnist_h5 --site perlmutter
#   slurm/submit.sh create_mnist_h5 --site cpu-only -- --chunk-samples 500    (lesson arguments after --)
#   slurm/submit.sh create_mnist_h5 --site palmetto --dry-run    (print the sbatch command, submit nothing)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/create_mnist_h5.sh [lesson arguments]
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=create_mnist_h5   # the name in squeue and in the log file name
#SBATCH --nodes=1                    # one node
#SBATCH --ntasks=1                   # one process writes the file, never every rank
#SBATCH --cpus-per-task=2            # reading IDX and writing HDF5 needs little
#SBATCH --time=00:10:00              # wall-clock limit
#SBATCH --output=logs/%x-%j.out      # stdout+stderr: logs/<job name>-<job id>.out
set -euo pipefail

# sbatch runs a copy of this file from a spool directory: find the course from where the job was submitted.
COURSE_REPO="${COURSE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
source "$COURSE_REPO/slurm/lib/job.sh" ||
    { echo "error: no course in $COURSE_REPO: submit from the repository root or export COURSE_REPO" >&2; exit 1; }
job_start "$@"

# For sites whose login nodes are too small for it; elsewhere run the script on the login node directly.
step srun --kill-on-bad-exit=1 --ntasks=1 "$PYTHON" -u "$COURSE_REPO/data_tools/create_mnist_h5.py" "$@"
