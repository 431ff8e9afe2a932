#!/bin/bash
# Lesson 7 under Slurm: time DDP training at world sizes 1, 2, 4, ... up to the job's tasks.
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   SITE_ACCOUNT=m1234_g slurm/submit.sh 7_mnist_ddp_pt_timing --site perlmutter
#   slurm/submit.sh 7_mnist_ddp_pt_timing --site cpu-only -- --quick    (lesson arguments after --)
#   slurm/submit.sh 7_mnist_ddp_pt_timing --site palmetto --dry-run    (print the sbatch command, submit nothing)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/7_mnist_ddp_pt_timing.sh [lesson arguments]
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=7_mnist_ddp_pt_timing # the name in squeue and in the log file name
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

# One job step per world size, each a fresh set of ranks inside the allocation (srun --ntasks=W); every
# step adds a row to the timing table, which rank 0 rewrites with the plot. The first step starts over.
lesson="$COURSE_REPO/day1/7_mnist_ddp_pt_timing.py"
fresh=(--fresh)
for ((ranks = 1; ranks <= SLURM_NTASKS; ranks *= 2)); do
    step srun --kill-on-bad-exit=1 --ntasks="$ranks" "$PYTHON" -u "$lesson" "${fresh[@]}" "$@"
    fresh=()
done
if ((SLURM_NTASKS & (SLURM_NTASKS - 1))); then  # not a power of two: time all the tasks too
    step srun --kill-on-bad-exit=1 --ntasks="$SLURM_NTASKS" "$PYTHON" -u "$lesson" "$@"
fi
