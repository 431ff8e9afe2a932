#!/bin/bash
# Lesson 22 under Slurm: a small GPT pre-trained on text every Python has, on a 2-D mesh over two nodes: tensor
# parallelism with sequence parallelism inside each node, FSDP2 across the nodes (or, with -- --layout fsdp,
# FSDP2 over all ranks).
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   SITE_ACCOUNT=m1234_g slurm/submit.sh 22_gpt_pretraining --site perlmutter
#   slurm/submit.sh 22_gpt_pretraining --site cpu-only -- --quick --layout fsdp    (lesson arguments after --)
#   slurm/submit.sh 22_gpt_pretraining --site palmetto --dry-run    (print the sbatch command, submit nothing)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/22_gpt_pretraining.sh [lesson arguments]
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=22_gpt_pretraining # the name in squeue and in the log file name
#SBATCH --nodes=2                     # a row of the mesh per node, the data-parallel dimension across them
#SBATCH --ntasks-per-node=2           # one task per rank, 2 per node (docs/lessons.toml); one GPU each (submit.sh)
#SBATCH --cpus-per-task=4             # cores per rank: data, Python, OMP threads
#SBATCH --time=00:20:00               # wall-clock limit
#SBATCH --output=logs/%x-%j.out       # stdout+stderr: logs/<job name>-<job id>.out
set -euo pipefail

# sbatch runs a copy of this file from a spool directory: find the course from where the job was submitted.
COURSE_REPO="${COURSE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
source "$COURSE_REPO/slurm/lib/job.sh" ||
    { echo "error: no course in $COURSE_REPO: submit from the repository root or export COURSE_REPO" >&2; exit 1; }
job_start "$@"

# One task per rank, numbered node by node: --inner (a row's length) is the tasks per node, so that each row
# is one node (the lesson prints every row's node; a --layout or --inner given after -- wins). The text is
# Python's own documentation: nothing to download on a compute node. If one rank fails, stop the others.
step srun --kill-on-bad-exit=1 "$PYTHON" -u "$COURSE_REPO/day5/22_gpt_pretraining.py" \
    --layout fsdp-tp --inner "${SLURM_NTASKS_PER_NODE:-2}" "$@"
