#!/bin/bash
# Lesson 23 under Slurm: a Hugging Face model fine-tuned with FSDP2 over two nodes, its weights read by each rank
# from the safetensors files (its own rows only) and written back in Hugging Face's format.  By default the model
# is lesson 22's (runs/22_gpt_pretraining/hf: submit lesson 22 first); a model staged on shared storage with
# -- --model-dir /shared/models/NAME (the instructor guide: staging a model; every run checks its SHA256SUMS).
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   SITE_ACCOUNT=m1234_g slurm/submit.sh 23_hf_finetuning --site perlmutter
#   slurm/submit.sh 23_hf_finetuning --site cpu-only -- --quick    (lesson arguments after --)
#   slurm/submit.sh 23_hf_finetuning --site palmetto --dry-run    (print the sbatch command, submit nothing)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/23_hf_finetuning.sh [lesson arguments]
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=23_hf_finetuning   # the name in squeue and in the log file name
#SBATCH --nodes=2                     # FSDP2 across both nodes
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

# One task per rank. The pairs are built from Python's own documentation and the model is read from disk:
# nothing to download on a compute node. If one rank fails, stop the others.
step srun --kill-on-bad-exit=1 "$PYTHON" -u "$COURSE_REPO/day5/23_hf_finetuning.py" "$@"
