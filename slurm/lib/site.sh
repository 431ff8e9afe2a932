# Site profiles: where they are, how they are read, how a site is set up.  Sourced by slurm/submit.sh (the
# sbatch options), slurm/lib/job.sh (every launcher, inside the job) and day2/multinode_setup_and_run.sh
# (inside an salloc or sbatch allocation): one implementation for every path.  Needs COURSE_REPO.
#
# A profile (slurm/sites/NAME.env) is a bash file of SITE_* settings and an optional site_setup function.
# Any SITE_* variable already set in the environment wins over the profile, so a value can be given without
# editing any file:   SITE_ACCOUNT=m1234_g slurm/submit.sh 6 --site perlmutter
# (set but empty counts: `SITE_CONSTRAINT= slurm/submit.sh ...` drops the profile's constraint).

COURSE_SITE_VARS=(
    SITE_DESCRIPTION SITE_ACCOUNT SITE_ACCOUNT_REQUIRED SITE_ACCOUNT_SUFFIX SITE_PARTITION SITE_QOS
    SITE_CONSTRAINT SITE_RESERVATION SITE_GPU_FLAG SITE_GPU_TYPE SITE_GPUS_PER_NODE SITE_TASKS_PER_NODE
    SITE_CPUS_PER_TASK SITE_SBATCH_EXTRA SITE_MASTER_ADDR
    SITE_NCCL_TRANSPORT SITE_LINK_GBPS SITE_MIN_BUSBW_SHARE  # what the readiness check judges against
)

# The directory of the profiles shipped with the course.
course_sites_dir() {
    echo "$COURSE_REPO/slurm/sites"
}

# NAME (a profile in slurm/sites/) or a path to a .env file -> the absolute path of the profile; 1 if none.
course_site_file() {
    local site="$1" file
    if [[ "$site" == */* || "$site" == *.env ]]; then
        file="$site"
    else
        file="$(course_sites_dir)/$site.env"
    fi
    [[ -f "$file" ]] || return 1
    echo "$(cd "$(dirname "$file")" && pwd)/$(basename "$file")"
}

# The names of the shipped profiles, one line.
course_site_names() {
    local file names=()
    for file in "$(course_sites_dir)"/*.env; do
        [[ -e "$file" ]] && names+=("$(basename "$file" .env)")
    done
    echo "${names[*]}"
}

# Reads a profile: clears every SITE_* setting and site_setup, sources FILE, then puts back the values the
# environment had (COURSE_SITE_FROM_ENV lists their names), exported as they were: a value given in the
# environment to slurm/submit.sh reaches the job too.
course_load_site() {
    local file="$1" var
    local -A from_env=() exported=()
    for var in $(compgen -e); do  # exported: they go on to what is started from here (submit.sh's sbatch: the job)
        exported[$var]=1
    done
    for var in "${COURSE_SITE_VARS[@]}"; do
        if [[ -n "${!var+set}" ]]; then
            from_env[$var]="${!var}"
        fi
    done
    for var in "${COURSE_SITE_VARS[@]}"; do
        unset "$var"
    done
    unset -f site_setup
    # shellcheck source=/dev/null
    source "$file"
    COURSE_SITE_FROM_ENV=""
    for var in "${COURSE_SITE_VARS[@]}"; do
        if [[ -n "${from_env[$var]+set}" ]]; then
            printf -v "$var" '%s' "${from_env[$var]}"
            [[ -z "${exported[$var]+set}" ]] || export "$var"  # unset took the export away
            COURSE_SITE_FROM_ENV+="${COURSE_SITE_FROM_ENV:+ }$var"
        fi
    done
}

# Which profile: $1 (--site: a name in slurm/sites/ or a path), else COURSE_SITE_ENV (a path: what submit.sh
# hands to the job), else COURSE_SITE (a name or a path).  Sets COURSE_SITE_FILE to the profile's absolute
# path, or to "" when none is given (then there is no site set-up).  A profile that does not exist: one line
# on stderr and exit 1.
course_site_resolve() {
    local site="${1:-}" origin="--site ${1:-}"
    COURSE_SITE_FILE=""
    if [[ -z "$site" && -n "${COURSE_SITE_ENV:-}" ]]; then
        [[ -f "$COURSE_SITE_ENV" ]] || {
            echo "error: the site profile $COURSE_SITE_ENV is gone" \
                 "(submitted with COURSE_SITE_ENV=$COURSE_SITE_ENV)" >&2
            exit 1
        }
        site="$COURSE_SITE_ENV" origin="COURSE_SITE_ENV=$COURSE_SITE_ENV"
    elif [[ -z "$site" && -n "${COURSE_SITE:-}" ]]; then
        site="$COURSE_SITE" origin="COURSE_SITE=$COURSE_SITE"
    fi
    [[ -n "$site" ]] || return 0
    COURSE_SITE_FILE="$(course_site_file "$site")" || {
        if [[ "$site" == */* || "$site" == *.env ]]; then
            echo "error: $origin: no such file; give a profile's path or a name in $(course_sites_dir):" \
                 "$(course_site_names)" >&2
        else
            echo "error: $origin: no site profile '$site' (no $(course_sites_dir)/$site.env); the profiles are:" \
                 "$(course_site_names) (or give a path to a .env file)" >&2
        fi
        exit 1
    }
}

# Sets up the site of COURSE_SITE_FILE (course_site_resolve) in this shell, for everything started from it:
# loads the profile and runs its site_setup (modules, environment, NCCL/gloo interface, a venv); srun passes
# the exported environment on to every rank.  Without a profile: the repository's .venv if there is one.
# Then exports PYTHON (as given, else python3 on PATH), after checking that it can import torch.
# Once per job: it exports COURSE_SITE_READY=<job id>:<profile or none>, and a script started from here in
# the same job (a launcher's multinode_setup_and_run.sh) that asks for no profile, or for the same one,
# keeps what it inherited.  Sets COURSE_SITE_STATUS: "set up", "set up by the caller" or "none".
# A site_setup that fails (any command in it, as under set -e): one line on stderr and exit 1.
course_site_setup() {
    local ready="${SLURM_JOB_ID:-}:${COURSE_SITE_FILE:-none}" saved_trap saved_options="$-"
    if [[ -n "${COURSE_SITE_READY:-}" && "${COURSE_SITE_READY%%:*}" == "${SLURM_JOB_ID:-}" ]] &&
       [[ -z "$COURSE_SITE_FILE" || "$COURSE_SITE_READY" == "$ready" ]]; then
        COURSE_SITE_FILE="${COURSE_SITE_READY#*:}"
        [[ "$COURSE_SITE_FILE" != none ]] || COURSE_SITE_FILE=""
        COURSE_SITE_STATUS="set up by the caller"
    elif [[ -n "$COURSE_SITE_FILE" ]]; then
        # Module and activation scripts often use unset variables: not under set -u.
        set +u
        course_load_site "$COURSE_SITE_FILE"
        if declare -F site_setup >/dev/null; then
            # Any failing command in site_setup stops here, with the command and the profile named.
            saved_trap="$(trap -p ERR)"
            set -E
            trap '_course_site_setup_failed $? "$BASH_COMMAND"' ERR
            site_setup
            trap - ERR
            eval "$saved_trap"
            [[ "$saved_options" == *E* ]] || set +E
        fi
        [[ "$saved_options" != *u* ]] || set -u
        COURSE_SITE_STATUS="set up"
        export COURSE_SITE_READY="$ready"
    else
        if [[ -f "$COURSE_REPO/.venv/bin/activate" ]]; then
            set +u
            # shellcheck source=/dev/null
            source "$COURSE_REPO/.venv/bin/activate"
            [[ "$saved_options" != *u* ]] || set -u
        fi
        COURSE_SITE_STATUS="none"
        export COURSE_SITE_READY="$ready"
    fi

    local chosen="python3 on PATH after the site setup"
    [[ -z "${PYTHON:-}" ]] || chosen="PYTHON, set before the site setup or by it"
    PYTHON="${PYTHON:-$(command -v python3 || command -v python || true)}"
    if [[ -z "$PYTHON" ]]; then
        echo "error: no python3 on PATH after the site setup; load a module or activate an environment in" \
             "site_setup of ${COURSE_SITE_FILE:-your site profile (--site NAME)}, or export PYTHON=/path/to/python" >&2
        exit 1
    fi
    # The ranks run the lessons with $PYTHON: without torch every rank would fail with a traceback.
    if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" 2>/dev/null
    then
        echo "error: $PYTHON ($chosen) cannot import torch; unset PYTHON or point it at the environment with" \
             "torch (python -c 'import sys; print(sys.executable)' there), or activate that environment in" \
             "site_setup of ${COURSE_SITE_FILE:-your site profile (--site NAME)}. No rank was started." >&2
        exit 1
    fi
    export PYTHON
}

# SITE_MASTER_ADDR: the name by which every node reaches rank 0, made from the name of the job's first node,
# written {host}: '{host}i' where the nodes' fast network has names of their own (JSC: jwb0001i is jwb0001 on
# InfiniBand), '{host}-ib', '{host}.ib.example.org'.  Empty: the node's name as Slurm gives it.  What is wrong
# with $1 as such a template (one phrase), or nothing.
course_master_addr_problem() {
    local template="$1"
    if [[ -n "$template" && "$template" != *"{host}"* ]]; then
        echo "it has no {host} (the name of the job's first node), so every job would meet at one address"
    elif [[ ! "${template//"{host}"/}" =~ ^[A-Za-z0-9._-]*$ ]]; then
        echo "only letters, digits, '.', '-' and '_' may stand beside {host}"
    fi
}

# MASTER_ADDR, exported for the ranks, for a job whose first node is $1: an exported MASTER_ADDR as it is (you
# chose it), else SITE_MASTER_ADDR (of the profile or the environment) with {host} replaced by $1, else $1.
# MASTER_ADDR_FROM says which.  A bad SITE_MASTER_ADDR, or no node name: one line on stderr and exit 1.
course_master_addr() {
    local host="$1" problem
    if [[ -n "${MASTER_ADDR:-}" ]]; then
        MASTER_ADDR_FROM="exported"
        if [[ "${COURSE_MASTER_ADDR_MADE:-}" == "$MASTER_ADDR "* ]]; then  # made here, by the job script
            MASTER_ADDR_FROM="${COURSE_MASTER_ADDR_MADE#* }"
        fi
        export MASTER_ADDR
        return 0
    fi
    problem="$(course_master_addr_problem "${SITE_MASTER_ADDR:-}")"
    if [[ -n "$problem" ]]; then
        echo "error: SITE_MASTER_ADDR='$SITE_MASTER_ADDR' (${COURSE_SITE_FILE:-from the environment}): $problem;" \
             "write e.g. '{host}i', or leave it empty for the node's own name. No rank was started." >&2
        exit 1
    fi
    if [[ -z "$host" ]]; then
        echo "error: cannot expand the node list '${SLURM_JOB_NODELIST:-}' with scontrol; export MASTER_ADDR=<the" \
             "first node's name>. No rank was started." >&2
        exit 1
    fi
    if [[ -n "${SITE_MASTER_ADDR:-}" ]]; then
        MASTER_ADDR="${SITE_MASTER_ADDR//"{host}"/$host}"
        MASTER_ADDR_FROM="SITE_MASTER_ADDR=$SITE_MASTER_ADDR"
    else
        MASTER_ADDR="$host"
        MASTER_ADDR_FROM="the job's first node"
    fi
    export MASTER_ADDR COURSE_MASTER_ADDR_MADE="$MASTER_ADDR $MASTER_ADDR_FROM"
}

_course_site_setup_failed() {
    local status="$1" command="$2"
    if ((BASH_SUBSHELL == 0)); then  # a failure in $(...) or (...) is reported once, by the shell around it
        echo "error: site_setup of $COURSE_SITE_FILE failed: \`$command\` exited with $status; fix site_setup" \
             "there (run its lines in a shell to see the cause). No rank was started." >&2
    fi
    exit 1
}
