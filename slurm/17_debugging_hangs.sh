#!/bin/bash
# Lesson 17 under Slurm: a hung or mismatched DDP job, and what tells you which rank waits in which collective.
#
# Submit it from the repository root with the sbatch options of your site (slurm/sites/NAME.env):
#   SITE_ACCOUNT=m1234_g slurm/submit.sh 17_debugging_hangs --site perlmutter
#   slurm/submit.sh 17_debugging_hangs --site cpu-only -- --quick --bug uneven    (lesson arguments after --)
#   slurm/submit.sh 17_debugging_hangs --site palmetto --dry-run    (print the sbatch command, submit nothing)
# or by hand:  mkdir -p logs && sbatch [site options] slurm/17_debugging_hangs.sh [lesson arguments]
#
# What the job does: without --bug in the lesson arguments, the healthy run, then the --bug skip repro, which
# must end on its own within --timeout with a line per rank naming the collective it waited in; the job
# succeeds when the healthy run succeeds and the repro fails that way (a repro that trained to the end, or
# hung until the time limit, fails the job).  With --bug in the arguments, only that run: the job then fails
# when the repro does, as a real hung job would.  On a GPU site the healthy run uses NCCL, the repro the CPU
# with gloo (its first line says why): NCCL's watchdog would end the ranks before they could say where.
# While a step hangs, from a login node: every rank's Python stack in this job's log
#   scancel --signal=USR1 JOBID
# or py-spy beside the running step (on the node the rank runs on, its PID from the log or ps):
#   srun --overlap --jobid JOBID -w NODE py-spy dump --pid PID
# or, with --debug-server PORT in the lesson arguments, every rank's stacks on one page: http://RANK0_NODE:PORT/stacks
#
# Site-specific options (account, partition, qos, constraint, GPUs) are not in this file: slurm/submit.sh
# adds them to the sbatch command line from the site profile (slurm/sites/).
#SBATCH --job-name=17_debugging_hangs # the name in squeue and in the log file name
#SBATCH --nodes=1                    # day 3: every rank on one node
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

# One task per rank; lesson 6's DDP loop. If one rank fails, stop the others.
LESSON="$COURSE_REPO/day3/17_debugging_hangs.py"
step srun --kill-on-bad-exit=1 "$PYTHON" -u "$LESSON" "$@"
if [[ " $* " != *" --bug "* && " $* " != *" --bug="* ]]; then
    # The repro: rank 0 alone enters the checkpoint's barrier.  It must fail, and say where.
    if step srun --kill-on-bad-exit=1 "$PYTHON" -u "$LESSON" "$@" --bug skip; then
        echo "error: the --bug skip repro exited 0: it should have ended with the waiting ranks named" >&2
        exit 1
    fi
    echo "the --bug skip repro failed on its own, as it should (each rank's line above names its collective)"
fi
