#!/bin/bash
# Run a day-2 lesson on every node of the current Slurm allocation.
#
#   salloc --nodes 2 --ntasks-per-node=2 --gpus-per-node=2 --time=00:30:00   # day 2's allocation (a shell)
#   ./day2/multinode_setup_and_run.sh --site mycluster 10_mnist_ddp_pt_multinode.py --quick
#   ./day2/multinode_setup_and_run.sh --site mycluster --launcher torchrun 9_torch_dist_multi_node.py
#   sbatch --nodes 2 --ntasks-per-node=2 day2/multinode_setup_and_run.sh --site mycluster 9_torch_dist_multi_node.py
#
# Options come before the lesson (a name in day2/ or a path); everything after the lesson goes to the lesson.
#   --site NAME|PATH     the site profile, the same one slurm/submit.sh takes: a name in slurm/sites/ or a path
#                        to a .env file; default: $COURSE_SITE (`export COURSE_SITE=mycluster` once per shell).
#                        Its site_setup (modules, environment, NCCL/gloo interface, the venv) runs here, before
#                        any rank starts, and srun passes the environment on to every rank. No profile: no site
#                        set-up, python from the repository's .venv. A profile that is missing or whose
#                        site_setup fails stops the script before any rank starts. Started by a launcher in
#                        slurm/, it finds the launcher's set-up done and does not run site_setup again.
#   --launcher srun      (default) one Slurm task per rank, as many as the allocation has tasks; the lesson
#                        reads SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS/SLURM_NODEID (lesson 9)
#   --launcher torchrun  one torchrun agent per node, each starting the node's ranks (c10d rendezvous at
#                        MASTER_ADDR:MASTER_PORT); the lesson reads RANK/LOCAL_RANK/WORLD_SIZE
# It sets up what every rank needs to find the others, then starts the ranks:
#   MASTER_ADDR  the first host of the allocation (`scontrol show hostnames`): rank 0 runs there.  A site whose
#                nodes reach each other by other names (JSC: the name with an `i`, on InfiniBand) sets
#                SITE_MASTER_ADDR='{host}i' in its profile; an exported MASTER_ADDR is kept.  Either is checked
#                on that node: one of its addresses (and no loopback one with more nodes), or one line
#   MASTER_PORT  derived from the job id (two jobs on one node get different ports), checked free there
# srun --kill-on-bad-exit=1: if one rank dies, the others are stopped instead of waiting for it forever.
# The profile's sbatch options (account, partition, GPUs) are not applied here: give them to salloc/sbatch
# (`slurm/submit.sh 9 --site mycluster --dry-run` prints them).
# Environment: COURSE_SITE (same as --site), LAUNCHER (same as --launcher), PYTHON (default: python3 on PATH
# after the site set-up; without a profile the repository's .venv), MASTER_ADDR (rank 0's address, instead of
# the first node's name), MASTER_PORT (skip the derived one), NPROC_PER_NODE (torchrun: ranks per node,
# default: tasks per node), SITE_MASTER_ADDR (as in a profile).
set -euo pipefail

usage() {
    echo "usage: $0 [--site NAME|PATH] [--launcher srun|torchrun] LESSON [lesson args...]" \
         "(LESSON: a file in day2/ or a path; NAME: a profile in slurm/sites/; default \$COURSE_SITE)"
}

ALL_ARGS=("$@")
LAUNCHER="${LAUNCHER:-srun}" SITE=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --launcher|--site) [[ $# -ge 2 && -n "$2" ]] || { echo "error: $1 needs a value" >&2; usage >&2; exit 2; }
                           if [[ "$1" == --site ]]; then SITE="$2"; else LAUNCHER="$2"; fi; shift 2 ;;
        --launcher=*) LAUNCHER="${1#*=}"; shift ;;
        --site=*) SITE="${1#*=}"; [[ -n "$SITE" ]] || { echo "error: --site needs a value" >&2; exit 2; }; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) break ;;
    esac
done
if [[ $# -lt 1 ]]; then usage >&2; exit 2; fi
case "$LAUNCHER" in
    srun|torchrun) ;;
    *) echo "error: --launcher must be srun or torchrun, not '$LAUNCHER'" >&2; exit 2 ;;
esac

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    cat >&2 <<EOF
error: not inside a Slurm allocation (SLURM_JOB_ID is not set). Get one first, then run this script in it:
  salloc --nodes 2 --ntasks-per-node=2 --time=00:30:00   # + --gpus-per-node=2 and --partition/--account at your site
  $0 ${ALL_ARGS[*]}
or submit it as a batch job:
  sbatch --nodes 2 --ntasks-per-node=2 --time=00:30:00 $0 ${ALL_ARGS[*]}
EOF
    exit 1
fi

# Where this script lives. sbatch runs a copy from Slurm's spool directory: then ask Slurm for the original.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ ! -f "$HERE/9_torch_dist_multi_node.py" ]]; then
    ORIGINAL="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p' | head -n1)"
    HERE="$(cd "$(dirname "${ORIGINAL:-.}")" && pwd)"
fi
REPO="$(dirname "$HERE")"
COURSE_REPO="$REPO"
# shellcheck source=../slurm/lib/site.sh
source "$REPO/slurm/lib/site.sh"
course_site_resolve "$SITE"  # a missing profile stops here, in one line

LESSON="$1"; shift
if [[ "$LESSON" != */* && -f "$HERE/$LESSON" ]]; then
    LESSON="$HERE/$LESSON"
elif [[ -f "$LESSON" ]]; then
    LESSON="$(cd "$(dirname "$LESSON")" && pwd)/$(basename "$LESSON")"
else
    echo "error: no lesson '$LESSON' (neither $HERE/$LESSON nor a file of that path); the lessons are:" >&2
    ls "$HERE"/*.py 2>/dev/null | xargs -n1 basename >&2 || true
    exit 2
fi

# The site set-up (slurm/lib/site.sh, as for slurm/submit.sh's jobs): the profile's site_setup runs in this
# shell; srun starts every rank with this shell's environment.  Then PYTHON is the python it provides.
course_site_setup
case "$COURSE_SITE_STATUS" in
    "set up")
        echo "multinode: site profile $COURSE_SITE_FILE: site_setup done${SITE_DESCRIPTION:+ ($SITE_DESCRIPTION)}" ;;
    "set up by the caller")
        if [[ -n "$COURSE_SITE_FILE" ]]; then
            echo "multinode: site profile $COURSE_SITE_FILE: set up by the job script"
        else
            echo "multinode: no site profile (the job script's environment)"
        fi ;;
    *) echo "multinode: no site profile (--site NAME or COURSE_SITE=NAME loads one)" ;;
esac
# PYTHON has what the lesson needs with these arguments (packages, torch release), or one line and no rank
"$PYTHON" "$REPO/course/launching/requires.py" "$LESSON" "$@" || exit 1

# Each rank gets the cores of its task and as many threads, as in a batch job (slurm/lib/job.sh): srun (Slurm
# >= 22.05) no longer takes --cpus-per-task from salloc's environment, so it is passed on; without it a rank
# would count every core of the node as its own.
CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$CPUS_PER_TASK}"
if [[ -z "${SLURM_CPUS_PER_TASK:-}" && "${SITE_CPUS_PER_TASK:-1}" -gt 1 ]]; then
    echo "multinode: note: this allocation gives each task 1 CPU (no --cpus-per-task), the site profile asks for" \
         "$SITE_CPUS_PER_TASK: allocate with --cpus-per-task=$SITE_CPUS_PER_TASK to give each rank its cores"
fi
NNODES="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
NTASKS="${SLURM_NTASKS:-$NNODES}"
# "4(x2)" or "4,2": the first node's count; torchrun starts the same number of ranks on every node
TASKS_PER_NODE="${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}}"
TASKS_PER_NODE="${TASKS_PER_NODE%%[(,]*}"
NPROC_PER_NODE="${NPROC_PER_NODE:-$TASKS_PER_NODE}"

FIRST_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)" || true
if [[ -z "$FIRST_NODE" ]]; then
    echo "error: cannot expand the node list '$SLURM_JOB_NODELIST' with scontrol" >&2
    exit 1
fi
# Rank 0 runs on the first node; the ranks reach it at MASTER_ADDR: an exported one as it is, else the site
# profile's SITE_MASTER_ADDR made from the node's name (e.g. {host}i), else the node's name (slurm/lib/site.sh).
course_master_addr "$FIRST_NODE"
CHECK_ADDR=""
if [[ "$MASTER_ADDR" != "$FIRST_NODE" ]]; then
    CHECK_ADDR="$MASTER_ADDR"  # a name of the first node? checked there, with the port
fi
if [[ -z "${MASTER_PORT:-}" || -n "$CHECK_ADDR" ]]; then
    # Check the port (the formula of course/launching/ports.py: all ranks agree) on the node where rank 0 will
    # listen (not here: salloc's shell runs on the login node).  As the lesson's own check
    # (course/launching/ports.py): a port left in TIME_WAIT by this job's previous step is free.  If a live
    # listener holds it, the kernel picks a free port from its ephemeral range (above 32767 as Linux ships):
    # never 10000..29999, where other jobs' derived ports are.  A MASTER_ADDR not of this node (or a loopback
    # one, with more nodes) is one line.
    CHECKED="$(srun --nodes=1 --ntasks=1 --nodelist="$FIRST_NODE" --kill-on-bad-exit=1 "$PYTHON" -c '
import socket, sys
addr, nodes, given, origin = sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
host, problem = socket.gethostname(), ""
if addr:
    try:
        ip = socket.gethostbyname(addr)
        with socket.socket() as s:
            s.bind((ip, 0))
    except OSError as e:
        problem = f"is not an address of {host}, the job\x27s first node, where rank 0 listens ({e.strerror or e})"
    else:
        if ip.startswith("127.") and nodes > 1:
            problem = f"is {ip}: on each of the {nodes} nodes that node itself, where no rank 0 listens"
if problem:
    print(f"error: MASTER_ADDR={addr} ({origin}) {problem}; unset MASTER_ADDR, or give a name of {host} that every "
          f"node reaches (SITE_MASTER_ADDR in the site profile, e.g. {{host}}i).")
    sys.exit()
if given:
    print(given)
    sys.exit()
derived = int(sys.argv[1])
with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", derived))
        print(derived)
        sys.exit()
    except OSError:
        print(f"port {derived} is in use on {socket.gethostname()}; the kernel picks a free one", file=sys.stderr)
with socket.socket() as s:
    s.bind(("", 0))
    print(s.getsockname()[1])
' "$((10000 + SLURM_JOB_ID % 20000))" "$CHECK_ADDR" "$NNODES" "${MASTER_PORT:-}" "$MASTER_ADDR_FROM")"
    if [[ "$CHECKED" == error:* ]]; then
        echo "$CHECKED No rank was started." >&2
        exit 1
    fi
    MASTER_PORT="$CHECKED"
fi
export MASTER_ADDR MASTER_PORT

echo "multinode: job $SLURM_JOB_ID, $NNODES node(s) ($SLURM_JOB_NODELIST), launcher $LAUNCHER," \
     "rank 0 at $MASTER_ADDR:$MASTER_PORT${CHECK_ADDR:+ ($MASTER_ADDR_FROM)}"
echo "multinode: $PYTHON $LESSON $*"

if [[ "$LAUNCHER" == srun ]]; then
    # one task per rank: SLURM_NTASKS of them, placed as the allocation says
    srun --kill-on-bad-exit=1 --ntasks="$NTASKS" --cpus-per-task="$CPUS_PER_TASK" "$PYTHON" -u "$LESSON" "$@"
else
    # one torchrun agent per node, with the CPUs of all its ranks; the agents meet at MASTER_ADDR:MASTER_PORT
    GPUS_PER_AGENT=()
    if [[ -n "${SLURM_GPUS_PER_TASK:-}" ]]; then
        # An allocation made with --gpus-per-task=[type:]N passes it on to this step (srun reads the variable as
        # its own option), whose one task per node would get the GPUs of one rank, for all the node's ranks
        # (course/launching/devices.py stops them); a larger --gpus-per-task Slurm refuses: ask per node instead.
        PER_RANK="${SLURM_GPUS_PER_TASK##*:}" GPU_TYPE="${SLURM_GPUS_PER_TASK%"${SLURM_GPUS_PER_TASK##*:}"}"
        GPUS_PER_AGENT=(--gpus-per-node="${GPU_TYPE}$((PER_RANK * TASKS_PER_NODE))")
        unset SLURM_GPUS_PER_TASK
    fi
    # The agent on the first node (SLURM_NODEID 0, read in each task) hosts the rendezvous: torchrun would guess
    # it from MASTER_ADDR and the node's own name and addresses, and a name on another network ({host}i) that
    # the node's name does not resolve to would leave every agent a client, waiting for a host that never comes.
    srun --kill-on-bad-exit=1 --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 \
        --cpus-per-task=$((TASKS_PER_NODE * CPUS_PER_TASK)) ${GPUS_PER_AGENT[@]+"${GPUS_PER_AGENT[@]}"} \
        bash -c 'exec "$0" -m torch.distributed.run --rdzv_conf=is_host=$((SLURM_NODEID == 0)) "$@"' "$PYTHON" \
        --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" \
        --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$SLURM_JOB_ID" \
        "$LESSON" "$@"
fi
