# What every launcher in slurm/ does around its lesson.  Sourced by the launchers, inside the job:
#
#   COURSE_REPO="${COURSE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
#   source "$COURSE_REPO/slurm/lib/job.sh" || { echo "error: ..." >&2; exit 1; }
#   job_start "$@"                     # site setup, then the start time and the resolved settings
#   step srun --kill-on-bad-exit=1 "$PYTHON" -u "$COURSE_REPO/day1/6_mnist_ddp_pt.py" "$@"
#
# The end time and the exit code are printed when the script ends, whatever ends it.
#
# The site profile comes from COURSE_SITE_ENV (a path; slurm/submit.sh exports it) or COURSE_SITE (a name in
# slurm/sites/ or a path); its site_setup runs here, once per job (slurm/lib/site.sh).  Without either (a
# plain `sbatch slurm/X.sh`) no profile is loaded: python comes from the repository's .venv if there is one,
# else from PATH.

# shellcheck source=site.sh
source "$COURSE_REPO/slurm/lib/site.sh"

_job_started=$SECONDS

_job_end() {
    local status=$?
    echo "==== ${SLURM_JOB_NAME:-job} ${SLURM_JOB_ID:-}: ended $(date '+%F %T %Z') after $((SECONDS - _job_started)) s," \
         "exit code $status"
}

# Prints a command, then runs it: the log shows exactly what ran.  A command that runs a lesson (its first
# argument that is a .py file) first checks that PYTHON has what that lesson needs with those arguments
# (course/launching/requires.py: packages and torch release): one line and exit 1, before any rank, if not.
step() {
    local i
    for ((i = 1; i <= $#; i++)); do
        if [[ "${!i}" == *.py && -f "${!i}" ]]; then
            "$PYTHON" "$COURSE_REPO/course/launching/requires.py" "${@:i}" || exit 1
            break
        fi
    done
    echo "+ $*"
    "$@"
}

# $1: label, $2: value (skipped when empty).
_job_setting() {
    [[ -n "${2:-}" ]] && printf '  %-18s %s\n' "$1" "$2"
    return 0
}

job_start() {
    trap _job_end EXIT
    echo "==== ${SLURM_JOB_NAME:-job} ${SLURM_JOB_ID:-}: started $(date '+%F %T %Z') on $(hostname)"

    # The site set-up of every path (slurm/lib/site.sh); multinode_setup_and_run.sh, started below in the
    # same job, finds it done (COURSE_SITE_READY) and does not run it again.
    course_site_resolve ""
    course_site_setup
    # A site whose nodes reach each other by other names (SITE_MASTER_ADDR, e.g. {host}i): rank 0's address for
    # every step of the job (the lessons, lesson 12's torchrun, multinode_setup_and_run.sh, which keeps it).
    # Without it the lessons take the first node's name themselves; an exported MASTER_ADDR is kept.
    if [[ -n "${SITE_MASTER_ADDR:-}" && -z "${MASTER_ADDR:-}" ]]; then
        course_master_addr "$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | head -n1)"
    fi
    # Each rank gets the cores of its task: as many threads, no more (the node may have many more cores).
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"
    # Since Slurm 22.05 srun no longer inherits --cpus-per-task from the batch job: pass it on.
    if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
        export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
    fi

    echo "settings:"
    _job_setting "site profile" "${COURSE_SITE_FILE:-none (plain sbatch: add --partition/--account/GPUs yourself)}"
    _job_setting "site" "${SITE_DESCRIPTION:-}"
    _job_setting "repository" "$COURSE_REPO"
    _job_setting "working dir" "$PWD"
    _job_setting "nodes" "${SLURM_JOB_NUM_NODES:-?} (${SLURM_JOB_NODELIST:-?})"
    _job_setting "tasks (ranks)" "${SLURM_NTASKS:-?}, ${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-?}} per node"
    _job_setting "cpus per task" "${SLURM_CPUS_PER_TASK:-1} (OMP_NUM_THREADS=$OMP_NUM_THREADS)"
    _job_setting "gpus" "${SLURM_GPUS_ON_NODE:-0} on this node${CUDA_VISIBLE_DEVICES:+ (CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES)}"
    _job_setting "partition" "${SLURM_JOB_PARTITION:-}"
    _job_setting "account" "${SLURM_JOB_ACCOUNT:-}"
    _job_setting "qos" "${SLURM_JOB_QOS:-}"
    _job_setting "time limit" "$(squeue --noheader --format=%l --job "${SLURM_JOB_ID:-0}" 2>/dev/null || true)"
    _job_setting "python" "$PYTHON ($("$PYTHON" --version 2>&1))"
    local var
    for var in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_DEBUG HDF5_USE_FILE_LOCKING MASTER_ADDR MASTER_PORT; do
        _job_setting "$var" "${!var:-}"
    done
    _job_setting "lesson args" "$*"
}
