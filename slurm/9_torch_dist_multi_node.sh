#!/bin/bash
# Lesson 9 under Slurm: lesson 0's all_reduce across two nodes, ranks from SLURM_PROCID and friends.
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   SITE_ACCOUNT=m1234_g slurm/submit.sh 9_torch_dist_multi_node --site perlmutter
#   slurm/submit.sh 9_torch_dist_multi_node --site cpu-only -- --timeout 60    (lesson arguments after --)
#   slurm/submit.sh 9_torch_dist_multi_node --site palmetto --dry-run    (print the sbatch command, submit nothing)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/9_torch_dist_multi_node.sh [lesson arguments]
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=9_torch_dist_multi_node # the name in squeue and in the log file name
#SBATCH --nodes=2                    # day 2: ranks on two nodes
#SBATCH --ntasks-per-node=2          # one task per rank, 2 per node (docs/lessons.toml); one GPU each (submit.sh)
#SBATCH --cpus-per-task=4            # cores per rank: data, Python, OMP threads
#SBATCH --time=00:05:00              # wall-clock limit
#SBATCH --output=logs/%x-%j.out      # stdout+stderr: logs/<job name>-<job id>.out
set -euo pipefail

# sbatch runs a copy of this file from a spool directory: find the course from where the job was submitted.
COURSE_REPO="${COURSE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
source "$COURSE_REPO/slurm/lib/job.sh" ||
    { echo "error: no course in $COURSE_REPO: submit from the repository root or export COURSE_REPO" >&2; exit 1; }
job_start "$@"

# multinode_setup_and_run.sh finds rank 0's address and a free port, then starts one task per rank with
# srun --kill-on-bad-exit=1 (or, with LAUNCHER=torchrun in the environment, one torchrun per node). It keeps
# the site set-up job_start did (no second site_setup).
step "$COURSE_REPO/day2/multinode_setup_and_run.sh" 9_torch_dist_multi_node.py "$@"
