#!/bin/bash
# Lesson 11 under Slurm: lesson 10's DDP across two nodes, streaming from a chunked HDF5 file.
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   SITE_ACCOUNT=m1234_g slurm/submit.sh 11_mnist_ddp_pt_multinode_streaming --site perlmutter
#   slurm/submit.sh 11_mnist_ddp_pt_multinode_streaming --site cpu-only -- --quick    (lesson arguments after --)
#   slurm/submit.sh 11_mnist_ddp_pt_multinode_streaming --site palmetto --dry-run    (print the sbatch command, submit nothing)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/11_mnist_ddp_pt_multinode_streaming.sh [lesson arguments]
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=11_mnist_ddp_pt_multinode_streaming # the name in squeue and in the log file name
#SBATCH --nodes=2                    # day 2: ranks on two nodes
#SBATCH --ntasks-per-node=2          # one task per rank, 2 per node (docs/lessons.toml); one GPU each (submit.sh)
#SBATCH --cpus-per-task=4            # cores per rank: data, Python, OMP threads
#SBATCH --time=00:20:00              # wall-clock limit
#SBATCH --output=logs/%x-%j.out      # stdout+stderr: logs/<job name>-<job id>.out
set -euo pipefail

# sbatch runs a copy of this file from a spool directory: find the course from where the job was submitted.
COURSE_REPO="${COURSE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
source "$COURSE_REPO/slurm/lib/job.sh" ||
    { echo "error: no course in $COURSE_REPO: submit from the repository root or export COURSE_REPO" >&2; exit 1; }
job_start "$@"

# The HDF5 file is written here, once (the batch script is one process on the first node), never by every
# rank; an existing file with the right layout is reused. Given --h5-file, the lesson brings its own.
if [[ " $* " != *" --h5-file"* ]]; then
    h5_args=() previous=""
    for arg in "$@"; do  # the lesson's --dataset decides which file it reads
        [[ "$previous" == --dataset ]] && h5_args=(--dataset "$arg")
        [[ "$arg" == --dataset=* ]] && h5_args=("$arg")
        previous="$arg"
    done
    step "$PYTHON" "$COURSE_REPO/data_tools/create_mnist_h5.py" "${h5_args[@]}"
fi
# multinode_setup_and_run.sh finds rank 0's address and a free port, then starts one task per rank with
# srun --kill-on-bad-exit=1 (or, with LAUNCHER=torchrun in the environment, one torchrun per node). It keeps
# the site set-up job_start did (no second site_setup).
step "$COURSE_REPO/day2/multinode_setup_and_run.sh" 11_mnist_ddp_pt_multinode_streaming.py "$@"
