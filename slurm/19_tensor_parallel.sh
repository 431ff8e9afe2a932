#!/bin/bash
# Lesson 19 under Slurm: tensor parallelism (parallelize_module) cuts every block's matrices over the ranks of
# one node; all ranks compute on the same batch.
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   SITE_ACCOUNT=m1234_g slurm/submit.sh 19_tensor_parallel --site perlmutter
#   slurm/submit.sh 19_tensor_parallel --site cpu-only -- --quick --width 128    (lesson arguments after --)
#   slurm/submit.sh 19_tensor_parallel --site palmetto --dry-run    (print the sbatch command, submit nothing)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/19_tensor_parallel.sh [lesson arguments]
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=19_tensor_parallel # the name in squeue and in the log file name
#SBATCH --nodes=1                    # day 4: every rank on one node (tensor parallelism needs a fast link)
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

# One task per rank; each holds 1/T of every block's matrices and computes on the whole batch. If one rank
# fails, stop the others.
step srun --kill-on-bad-exit=1 "$PYTHON" -u "$COURSE_REPO/day4/19_tensor_parallel.py" "$@"
