#!/bin/bash
# Lesson 21 under Slurm: a pipeline over two nodes: one stage (a run of the ViT's blocks) per rank, the
# activations sent point to point from stage to stage, across the nodes at one boundary.
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   SITE_ACCOUNT=m1234_g slurm/submit.sh 21_pipeline_parallel --site perlmutter
#   slurm/submit.sh 21_pipeline_parallel --site cpu-only -- --quick --schedule gpipe    (lesson arguments after --)
#   slurm/submit.sh 21_pipeline_parallel --site palmetto --dry-run    (print the sbatch command, submit nothing)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/21_pipeline_parallel.sh [lesson arguments]
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=21_pipeline_parallel # the name in squeue and in the log file name
#SBATCH --nodes=2                    # the stages run on the ranks of both nodes, in order
#SBATCH --ntasks-per-node=2          # one task per rank (a stage); GPU sites: one per GPU (submit.sh)
#SBATCH --cpus-per-task=4            # cores per rank: data, Python, OMP threads
#SBATCH --time=00:20:00              # wall-clock limit
#SBATCH --output=logs/%x-%j.out      # stdout+stderr: logs/<job name>-<job id>.out
set -euo pipefail

# sbatch runs a copy of this file from a spool directory: find the course from where the job was submitted.
COURSE_REPO="${COURSE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
source "$COURSE_REPO/slurm/lib/job.sh" ||
    { echo "error: no course in $COURSE_REPO: submit from the repository root or export COURSE_REPO" >&2; exit 1; }
job_start "$@"

# One task per stage, numbered node by node: a block per stage (--depth: the tasks) and 1F1B over twice as
# many micro-batches as stages (at least as many as stages is its rule); arguments given after -- win.
# If one rank fails, stop the others.
ranks="${SLURM_NTASKS:-4}"
step srun --kill-on-bad-exit=1 "$PYTHON" -u "$COURSE_REPO/day4/21_pipeline_parallel.py" \
    --depth "$ranks" --schedule 1f1b --microbatches $((2 * ranks)) "$@"
