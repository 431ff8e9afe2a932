#!/bin/bash
# Submit a lesson's launcher with the sbatch options of your cluster, taken from a site profile.
#
#   slurm/submit.sh LESSON --site NAME [options] [-- lesson args]
#
#   slurm/submit.sh 6_mnist_ddp_pt --site perlmutter -- --epochs 4
#   slurm/submit.sh 10 --site jsc --nodes 4                      # a lesson by its number
#   slurm/submit.sh 9 --site palmetto --dry-run                  # print the sbatch command, submit nothing
#
# LESSON      a launcher in slurm/: its name (6_mnist_ddp_pt), its number (6), or its path (any job
#             script of the same shape, e.g. scripts/readiness_job.sh)
# --site      a profile in slurm/sites/ (perlmutter, jsc, ...) or a path to one; default: $COURSE_SITE.
#             Its site_setup runs in the job, once, before the ranks (the same profile and set-up as
#             `./day2/multinode_setup_and_run.sh --site NAME LESSON` inside an salloc allocation)
# What a lesson asks for is what a learner runs it with in class (docs/lessons.toml: ranks and nodes; the
# launcher's #SBATCH --nodes and --ntasks-per-node are those): one rank per GPU, as many GPUs per node as
# ranks per node, at most the node's (SITE_GPUS_PER_NODE; CPU-only sites: SITE_TASKS_PER_NODE ranks).
# --nodes N               nodes (day-1 lessons: always 1; day-2 launchers: default 2)
# --gpus-per-node G       GPUs per node, one rank each (default: the lesson's ranks per node, at most
#                         SITE_GPUS_PER_NODE; a job script without --ntasks-per-node: SITE_GPUS_PER_NODE)
# --ntasks-per-node T     ranks per node (default: G on GPU sites; the lesson's on CPU-only ones, at most
#                         SITE_TASKS_PER_NODE)
# --time T                wall-clock limit (default: the launcher's #SBATCH --time)
# --no-reservation        leave the profile's SITE_RESERVATION out (the week before the workshop, when the
#                         reservation has not begun: `scripts/readiness_check.sh --site NAME --no-reservation`)
# --dry-run               print the exact sbatch command and exit; nothing is checked with or sent to Slurm
# --test-only             ask Slurm whether and when it would run the job (sbatch --test-only), submit nothing
# --no-check              submit without asking Slurm first (by default a refused option fails before submission)
# --interactive [LESSON]  the allocation LESSON asks for, interactively, with the profile's options: for a
#                         one-node lesson a shell on a compute node with the site set-up (srun --ntasks=1
#                         --pty: one task with the cores and GPUs of the node's ranks), or, with a command
#                         after --, that command there:
#                           slurm/submit.sh --interactive --site NAME -- ./quickstart.sh
#                         for a lesson on 2 nodes (or --nodes 2) salloc, whose shell holds the nodes for
#                         day2/multinode_setup_and_run.sh. No LESSON: lesson 0's (day 1), with --nodes 2
#                         lesson 9's (day 2). Each day's: `python -m course.sizing --table`.
#
# Every SITE_* value may also come from the environment, which wins over the profile:
#   SITE_ACCOUNT=m1234_g slurm/submit.sh 6 --site perlmutter
# Logs go to logs/<lesson>-<job id>.out under the current directory (the job's working directory).
set -euo pipefail

COURSE_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib/site.sh
source "$COURSE_REPO/slurm/lib/site.sh"

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}

die() {
    echo "submit.sh: error: $*" >&2
    exit 1
}

# ---------------------------------------------------------------------------------------------- arguments
LESSON="" SITE="${COURSE_SITE:-}" NODES="" GPUS="" TASKS="" TIME="" MODE=submit CHECK=yes INTERACTIVE=no
RESERVATION=yes
LESSON_ARGS=()
need_value() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value (see --help)"; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --site) need_value "$@"; SITE="$2"; shift 2 ;;
        --site=*) SITE="${1#*=}"; shift ;;
        --nodes|-N) need_value "$@"; NODES="$2"; shift 2 ;;
        --nodes=*) NODES="${1#*=}"; shift ;;
        --gpus-per-node) need_value "$@"; GPUS="$2"; shift 2 ;;
        --gpus-per-node=*) GPUS="${1#*=}"; shift ;;
        --ntasks-per-node) need_value "$@"; TASKS="$2"; shift 2 ;;
        --ntasks-per-node=*) TASKS="${1#*=}"; shift ;;
        --time|-t) need_value "$@"; TIME="$2"; shift 2 ;;
        --time=*) TIME="${1#*=}"; shift ;;
        --dry-run) MODE=dry-run; shift ;;
        --test-only) MODE=test-only; shift ;;
        --no-check) CHECK=no; shift ;;
        --no-reservation) RESERVATION=no; shift ;;
        --interactive) INTERACTIVE=yes; shift ;;
        --) shift; LESSON_ARGS=("$@"); break ;;
        -*) die "unknown option $1 (lesson arguments go after --; see --help)" ;;
        *) [[ -z "$LESSON" ]] || die "one lesson at a time ('$LESSON' and '$1'); lesson arguments go after --"
           LESSON="$1"; shift ;;
    esac
done

launcher_names() {
    local file
    for file in "$COURSE_REPO"/slurm/*.sh; do
        [[ "$(basename "$file")" == submit.sh ]] || basename "$file" .sh
    done | sort -V | tr '\n' ' ' | sed 's/ $//'
    echo
}

if [[ "$INTERACTIVE" == yes && -z "$LESSON" ]]; then
    # day 1's allocation (lesson 0's: one node), or with --nodes 2 or more day 2's (lesson 9's: 2 per node)
    if [[ -n "$NODES" && "$NODES" =~ ^[0-9]+$ && "$NODES" -gt 1 ]]; then
        LESSON="$COURSE_REPO/slurm/9_torch_dist_multi_node.sh"
    else
        LESSON="$COURSE_REPO/slurm/0_torch_dist.sh"
    fi
fi
[[ -n "$LESSON" ]] || die "which lesson? the launchers are: $(launcher_names)"
[[ -n "$SITE" ]] || die "which site? give --site NAME (or export COURSE_SITE); the profiles are: $(course_site_names)"

# ---------------------------------------------------------------------------------------------- the launcher
find_launcher() {
    local name="$1" matches=()
    if [[ "$name" == */*.sh && -f "$name" ]]; then  # a job script elsewhere (scripts/readiness_job.sh)
        echo "$(cd "$(dirname "$name")" && pwd)/$(basename "$name")"
        return
    fi
    name="$(basename "$name")"
    name="${name%.sh}"
    name="${name%.py}"
    if [[ -f "$COURSE_REPO/slurm/$name.sh" && "$name" != submit ]]; then
        echo "$COURSE_REPO/slurm/$name.sh"
        return
    fi
    if [[ "$name" =~ ^[0-9]+$ ]]; then
        shopt -s nullglob
        matches=("$COURSE_REPO/slurm/${name}_"*.sh)
        shopt -u nullglob
        if [[ ${#matches[@]} -eq 1 ]]; then
            echo "${matches[0]}"
            return
        fi
    fi
    return 1
}
LAUNCHER="$(find_launcher "$LESSON")" ||
    die "no launcher for '$LESSON' in slurm/; the launchers are: $(launcher_names)"
NAME="$(basename "$LAUNCHER" .sh)"

# The launcher's own defaults, from its #SBATCH lines.
sbatch_default() {
    sed -n "s/^#SBATCH --$1=\([^ ]*\).*/\1/p" "$LAUNCHER" | head -n1
}
LAUNCHER_NODES="$(sbatch_default nodes)"
LAUNCHER_NTASKS="$(sbatch_default ntasks)"  # set only by single-process launchers (--ntasks=1)
LAUNCHER_TASKS="$(sbatch_default ntasks-per-node)"  # the lesson's ranks per node (docs/lessons.toml)

# ---------------------------------------------------------------------------------------------- the profile
SITE_FILE="$(course_site_file "$SITE")" ||
    die "no site profile '$SITE' (looked for $(course_sites_dir)/$SITE.env); the profiles are: $(course_site_names)"
course_load_site "$SITE_FILE"
SITE_NAME="$(basename "$SITE_FILE" .env)"

# Every check below names the setting and where it came from.
origin() {
    if [[ " $COURSE_SITE_FROM_ENV " == *" $1 "* ]]; then echo "$1 (from the environment)"; else echo "$1 in $SITE_FILE"; fi
}
is_count() { [[ "$1" =~ ^(0|[1-9][0-9]*)$ ]]; }
is_word() { [[ -z "$1" || "$1" =~ ^[^[:space:]]+$ ]]; }

: "${SITE_GPU_FLAG:=none}" "${SITE_ACCOUNT_REQUIRED:=no}"
for var in SITE_ACCOUNT SITE_PARTITION SITE_QOS SITE_CONSTRAINT SITE_RESERVATION; do
    is_word "${!var:-}" || die "$(origin $var) is '${!var}': one word, no spaces"
done
case "$SITE_ACCOUNT_REQUIRED" in
    yes|no) ;;
    *) die "$(origin SITE_ACCOUNT_REQUIRED) is '$SITE_ACCOUNT_REQUIRED': yes or no" ;;
esac
if [[ "$SITE_ACCOUNT_REQUIRED" == yes && -z "${SITE_ACCOUNT:-}" ]]; then
    die "site $SITE_NAME needs an account (the project your time is charged to; \`sacctmgr show assoc user=\$USER\`" \
        "or your site's portal lists yours): set SITE_ACCOUNT in $SITE_FILE or export SITE_ACCOUNT=<account>"
fi
if [[ -n "${SITE_ACCOUNT_SUFFIX:-}" && -n "${SITE_ACCOUNT:-}" && "$SITE_ACCOUNT" != *"$SITE_ACCOUNT_SUFFIX" ]]; then
    die "$(origin SITE_ACCOUNT) is '$SITE_ACCOUNT', but site $SITE_NAME charges GPU jobs to an account ending in" \
        "'$SITE_ACCOUNT_SUFFIX' (e.g. ${SITE_ACCOUNT}${SITE_ACCOUNT_SUFFIX})"
fi
case "$SITE_GPU_FLAG" in
    none|gpus-per-node|gres|gpus) ;;
    *) die "$(origin SITE_GPU_FLAG) is '$SITE_GPU_FLAG': use none (CPU only), gpus-per-node (--gpus-per-node=N)," \
           "gres (--gres=gpu:N) or gpus (--gpus=TYPE:N for the whole job)" ;;
esac
[[ -z "${SITE_GPU_TYPE:-}" || "$SITE_GPU_TYPE" =~ ^[A-Za-z0-9_.-]+$ ]] ||
    die "$(origin SITE_GPU_TYPE) is '$SITE_GPU_TYPE': a GPU type name such as a100 or v100 (no count, no colon:" \
        "the count comes from SITE_GPUS_PER_NODE or --gpus-per-node)"
problem="$(course_master_addr_problem "${SITE_MASTER_ADDR:-}")"
[[ -z "$problem" ]] ||
    die "$(origin SITE_MASTER_ADDR) is '$SITE_MASTER_ADDR': $problem; write e.g. '{host}i', or leave it empty"
for var in SITE_GPUS_PER_NODE SITE_TASKS_PER_NODE SITE_CPUS_PER_TASK; do
    [[ -z "${!var:-}" ]] || is_count "${!var}" || die "$(origin $var) is '${!var}': a whole number"
done

# ---------------------------------------------------------------------------------------------- the request
[[ -z "$NODES" ]] || { is_count "$NODES" && ((NODES >= 1)); } || die "--nodes $NODES: a whole number, at least 1"
[[ -z "$GPUS" ]] || is_count "$GPUS" || die "--gpus-per-node $GPUS: a whole number"
[[ -z "$TASKS" ]] || { is_count "$TASKS" && ((TASKS >= 1)); } || die "--ntasks-per-node $TASKS: a whole number, at least 1"
[[ -z "$TIME" || "$TIME" =~ ^([0-9]+-)?[0-9]+(:[0-9]+){0,2}$ ]] ||
    die "--time $TIME: minutes, MM:SS, HH:MM:SS or D-HH:MM:SS"
if [[ "$INTERACTIVE" == no && "$LAUNCHER_NODES" == 1 && -n "$NODES" && "$NODES" != 1 ]]; then
    die "$NAME is a one-node lesson (day 1); the multi-node lessons are the day-2 launchers (9, 10, 11, ...)"
fi
NNODES="${NODES:-${LAUNCHER_NODES:-1}}"

NODE_GPUS="${SITE_GPUS_PER_NODE:-0}"  # what a node has; a lesson asks for its ranks' GPUs, at most these
if [[ "$SITE_GPU_FLAG" == none ]]; then
    [[ -z "$GPUS" ]] || ((GPUS == 0)) ||
        die "site $SITE_NAME has no GPUs (SITE_GPU_FLAG=none), but $GPUS per node were asked for"
    GPUS=0
elif [[ -z "$GPUS" ]] && ((NODE_GPUS == 0)); then
    die "site $SITE_NAME requests GPUs with SITE_GPU_FLAG=$SITE_GPU_FLAG, but SITE_GPUS_PER_NODE is not set:" \
        "set it in $SITE_FILE or give --gpus-per-node G"
elif [[ -n "$GPUS" ]] && ((GPUS == 0)); then
    die "site $SITE_NAME requests GPUs with SITE_GPU_FLAG=$SITE_GPU_FLAG: --gpus-per-node must be at least 1"
fi
at_most() {  # $1, or $2 where $2 is a smaller positive number
    if [[ -n "$2" ]] && (($2 > 0 && $2 < $1)); then echo "$2"; else echo "$1"; fi
}
if [[ "$LAUNCHER_NTASKS" == 1 ]]; then
    # A single-process lesson: one task, at most one GPU.
    [[ -z "$TASKS" || "$TASKS" == 1 ]] || die "$NAME runs a single process: --ntasks-per-node must be 1"
    [[ "$SITE_GPU_FLAG" == none ]] || GPUS=1
    TASKS=""
elif [[ "$SITE_GPU_FLAG" != none ]]; then
    if [[ -z "$GPUS" && -n "$TASKS" ]]; then  # one GPU per rank asked for, at most the node's
        ((TASKS <= NODE_GPUS)) ||
            die "--ntasks-per-node $TASKS is more than the $NODE_GPUS GPUs per node: NCCL needs one GPU per rank"
        GPUS="$TASKS"
    elif [[ -z "$GPUS" ]]; then  # the lesson's ranks per node, at most the node's GPUs
        GPUS="$(at_most "${LAUNCHER_TASKS:-$NODE_GPUS}" "$NODE_GPUS")"
    fi
    TASKS="${TASKS:-$GPUS}"  # one rank per GPU
    ((TASKS <= GPUS)) || die "--ntasks-per-node $TASKS is more than the $GPUS GPUs per node: NCCL needs one GPU per rank"
elif [[ -z "$TASKS" ]]; then
    TASKS="${LAUNCHER_TASKS:-${SITE_TASKS_PER_NODE:-}}"
    [[ -z "$TASKS" ]] || TASKS="$(at_most "$TASKS" "${SITE_TASKS_PER_NODE:-}")"
fi

OPTIONS=()
[[ -z "${SITE_ACCOUNT:-}" ]] || OPTIONS+=("--account=$SITE_ACCOUNT")
[[ -z "${SITE_PARTITION:-}" ]] || OPTIONS+=("--partition=$SITE_PARTITION")
[[ -z "${SITE_QOS:-}" ]] || OPTIONS+=("--qos=$SITE_QOS")
[[ -z "${SITE_CONSTRAINT:-}" ]] || OPTIONS+=("--constraint=$SITE_CONSTRAINT")
[[ -z "${SITE_RESERVATION:-}" || "$RESERVATION" == no ]] || OPTIONS+=("--reservation=$SITE_RESERVATION")
OPTIONS+=("--nodes=$NNODES")  # also when it is the launcher's: the command says what it asks for
[[ -z "$TASKS" ]] || OPTIONS+=("--ntasks-per-node=$TASKS")
[[ -z "${SITE_CPUS_PER_TASK:-}" ]] || OPTIONS+=("--cpus-per-task=$SITE_CPUS_PER_TASK")
if ((GPUS > 0)); then
    TYPE="${SITE_GPU_TYPE:+$SITE_GPU_TYPE:}"
    case "$SITE_GPU_FLAG" in
        gpus-per-node) OPTIONS+=("--gpus-per-node=$TYPE$GPUS") ;;
        gres) OPTIONS+=("--gres=gpu:$TYPE$GPUS") ;;
        gpus) OPTIONS+=("--gpus=$TYPE$((GPUS * NNODES))") ;;  # for the whole job: GPUs per node x nodes
    esac
fi
[[ -z "$TIME" ]] || OPTIONS+=("--time=$TIME")
if [[ -n "${SITE_SBATCH_EXTRA:-}" ]]; then
    read -ra EXTRA <<<"$SITE_SBATCH_EXTRA"
    OPTIONS+=("${EXTRA[@]}")
fi
# The job finds the course and the profile (for modules, environment, NCCL hints) through these.
[[ "$COURSE_REPO$SITE_FILE" != *,* ]] || die "the paths $COURSE_REPO and $SITE_FILE must not contain commas (sbatch --export)"
OPTIONS+=("--export=ALL,COURSE_REPO=$COURSE_REPO,COURSE_SITE_ENV=$SITE_FILE")

COMMAND=(sbatch "${OPTIONS[@]}" "$LAUNCHER" "${LESSON_ARGS[@]}")
show() {  # the command as one line you can paste into a shell
    local arg words=()
    for arg in "$@"; do
        if [[ "$arg" =~ ^[A-Za-z0-9_/.,=:+@%-]+$ ]]; then
            words+=("$arg")
        else
            words+=("'${arg//\'/\'\\\'\'}'")
        fi
    done
    echo "${words[*]}"
}

if [[ "$INTERACTIVE" == yes ]]; then
    # On the node: the profile's site_setup (as in a batch job), back to this directory, then the shell or command
    SETUP='source "$COURSE_REPO/slurm/lib/site.sh" && course_site_resolve "" && course_site_setup && cd "$0" && '
    SETUP+='echo "interactive: $(hostname), site profile ${COURSE_SITE_FILE:-none}, python $PYTHON" && exec "$@"'
    if ((NNODES > 1)); then
        COMMAND=(salloc)  # its shell (or the command) holds every node of the allocation
        for option in "${OPTIONS[@]}"; do
            [[ "$option" == --export=* ]] || COMMAND+=("$option")
        done
        COMMAND+=("${LESSON_ARGS[@]}")
    else
        STEP=()
        for option in "${OPTIONS[@]}"; do  # one task with the cores of all the node's ranks
            [[ "$option" == --ntasks-per-node=* || "$option" == --cpus-per-task=* ]] || STEP+=("$option")
        done
        CORES=$(( ${TASKS:-1} * ${SITE_CPUS_PER_TASK:-1} ))
        if ((${#LESSON_ARGS[@]} == 0)); then
            LESSON_ARGS=(bash -i)
            STEP+=(--pty)
        fi
        COMMAND=(srun "${STEP[@]}" --ntasks=1 --cpus-per-task="$CORES" bash -c "$SETUP" "$PWD" "${LESSON_ARGS[@]}")
    fi
    if [[ "$MODE" == dry-run ]]; then
        show "${COMMAND[@]}"
        exit 0
    fi
    command -v srun >/dev/null || die "srun not found: run this on a login node of a Slurm cluster (or use --dry-run)"
    echo "submit.sh: site $SITE_NAME: ${SITE_DESCRIPTION:-$SITE_FILE}" >&2
    exec "${COMMAND[@]}"
fi

if [[ "$MODE" == dry-run ]]; then
    show "${COMMAND[@]}"
    exit 0
fi

command -v sbatch >/dev/null || die "sbatch not found: run this on a login node of a Slurm cluster (or use --dry-run)"
echo "submit.sh: site $SITE_NAME: ${SITE_DESCRIPTION:-$SITE_FILE}"
[[ -z "$COURSE_SITE_FROM_ENV" ]] || echo "submit.sh: from the environment: $COURSE_SITE_FROM_ENV"

explain() {  # sbatch's complaint -> which profile setting to look at
    local message="$1"
    case "${message,,}" in
        *partition*) echo "check $(origin SITE_PARTITION) ('${SITE_PARTITION:-}'); \`sinfo -s\` lists the partitions" ;;
        *account*) echo "check $(origin SITE_ACCOUNT) ('${SITE_ACCOUNT:-}'); \`sacctmgr show assoc user=\$USER\` lists yours" ;;
        *reservation*) echo "check $(origin SITE_RESERVATION) ('${SITE_RESERVATION:-}'); \`scontrol show reservation\` lists them" ;;
        *qos*) echo "check $(origin SITE_QOS) ('${SITE_QOS:-}'); \`sacctmgr show qos\` lists them" ;;
        *feature*|*constraint*) echo "check $(origin SITE_CONSTRAINT) ('${SITE_CONSTRAINT:-}'); \`sinfo -o '%P %f'\` lists the features" ;;
        *gres*|*gpu*|*"node configuration"*)
            echo "check the GPU request (SITE_GPU_FLAG=$SITE_GPU_FLAG, SITE_GPU_TYPE=${SITE_GPU_TYPE:-}, $GPUS per node," \
                 "${TASKS:-default} tasks per node, SITE_CPUS_PER_TASK=${SITE_CPUS_PER_TASK:-}) in $SITE_FILE;" \
                 "\`sinfo -o '%P %D %c %G'\` lists CPUs and GPUs per node" ;;
        *) echo "check the settings in $SITE_FILE" ;;
    esac
}

if [[ "$CHECK" == yes || "$MODE" == test-only ]]; then
    if ! checked="$(sbatch --test-only "${OPTIONS[@]}" "$LAUNCHER" "${LESSON_ARGS[@]}" 2>&1)"; then
        checked="$(echo "$checked" | sed 's/^sbatch: error: //' | tr '\n' ' ')"
        die "Slurm refuses $NAME with site $SITE_NAME: ${checked% }; $(explain "$checked"). Nothing was submitted."
    fi
    if [[ "$MODE" == test-only ]]; then
        echo "$checked"
        exit 0
    fi
fi

mkdir -p logs  # sbatch cannot create it, and a job whose log file cannot be opened fails silently
echo "submit.sh: $(show "${COMMAND[@]}")"
submitted="$("${COMMAND[@]}")"
echo "$submitted"
JOB_ID="${submitted##* }"
echo "submit.sh: log: logs/$NAME-$JOB_ID.out (follow it: tail -f logs/$NAME-$JOB_ID.out; the queue: squeue --me)"
