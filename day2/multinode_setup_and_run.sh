#!/bin/bash
# Run a day-2 lesson on every node of the current Slurm allocation.
#
#   salloc --nodes 2 --ntasks-per-node=4 --time=00:30:00        # get an allocation (a shell on the login node)
#   ./day2/multinode_setup_and_run.sh 10_mnist_ddp_pt_multinode.py --quick
#   ./day2/multinode_setup_and_run.sh --launcher torchrun 9_torch_dist_multi_node.py
#   sbatch --nodes 2 --ntasks-per-node=4 day2/multinode_setup_and_run.sh 9_torch_dist_multi_node.py
#
# The lesson is a name in day2/ or a path. Everything after it goes to the lesson.
# It sets up what every rank needs to find the others, then starts the ranks:
#   MASTER_ADDR  the first host of the allocation (`scontrol show hostnames`): rank 0 runs there
#   MASTER_PORT  derived from the job id (two jobs on one node get different ports), checked free there
#   --launcher srun      (default) one Slurm task per rank, as many as the allocation has tasks; the lesson
#                        reads SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS/SLURM_NODEID (lesson 9)
#   --launcher torchrun  one torchrun agent per node, each starting the node's ranks (c10d rendezvous at
#                        MASTER_ADDR:MASTER_PORT); the lesson reads RANK/LOCAL_RANK/WORLD_SIZE
# srun --kill-on-bad-exit=1: if one rank dies, the others are stopped instead of waiting for it forever.
# Environment: LAUNCHER (same as --launcher), PYTHON (default: the repository's .venv, else python3 on PATH),
# MASTER_PORT (skip the derived one), NPROC_PER_NODE (torchrun: ranks per node, default: tasks per node).
set -euo pipefail

usage() {
    echo "usage: $0 [--launcher srun|torchrun] LESSON [lesson args...]   (LESSON: a file in day2/ or a path)"
}

LAUNCHER="${LAUNCHER:-srun}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --launcher) [[ $# -ge 2 ]] || { usage >&2; exit 2; }; LAUNCHER="$2"; shift 2 ;;
        --launcher=*) LAUNCHER="${1#*=}"; shift ;;
        -h|--help) usage; exit 0 ;;
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
  salloc --nodes 2 --ntasks-per-node=4 --time=00:30:00   # + --partition/--account/--gpus-per-node at your site
  $0 $*
or submit it as a batch job:
  sbatch --nodes 2 --ntasks-per-node=4 --time=00:30:00 $0 $*
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

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then
        PYTHON="$REPO/.venv/bin/python"
    else
        PYTHON="$(command -v python3 || command -v python)"
    fi
fi

# ---- site-specific setup: the one place to adapt to your cluster ------------------------------------------
# module load python cuda nccl            # or: source /path/to/venv/bin/activate
# export NCCL_SOCKET_IFNAME=ib0           # the interface NCCL bootstraps on (see `ip addr`; often ib0/hsn0)
# export GLOO_SOCKET_IFNAME=ib0           # the same for gloo (CPU runs), if hostnames resolve to 127.0.0.1
# export NCCL_DEBUG=INFO                  # NCCL prints which transport (IB, sockets) it picked
# export HDF5_USE_FILE_LOCKING=FALSE      # HDF5 on Lustre/GPFS (lesson 11 reads without locks anyway)
# ------------------------------------------------------------------------------------------------------------

NNODES="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
NTASKS="${SLURM_NTASKS:-$NNODES}"
# "4(x2)" or "4,2": the first node's count; torchrun starts the same number of ranks on every node
TASKS_PER_NODE="${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}}"
TASKS_PER_NODE="${TASKS_PER_NODE%%[(,]*}"
NPROC_PER_NODE="${NPROC_PER_NODE:-$TASKS_PER_NODE}"

MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"
if [[ -z "$MASTER_ADDR" ]]; then
    echo "error: cannot expand the node list '$SLURM_JOB_NODELIST' with scontrol" >&2
    exit 1
fi
if [[ -z "${MASTER_PORT:-}" ]]; then
    MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))   # the formula of course/launch.py: all ranks agree
    # Check it on the node where rank 0 will listen (not here: salloc's shell runs on the login node);
    # if another job holds it, take the next free one.
    MASTER_PORT="$(srun --nodes=1 --ntasks=1 --nodelist="$MASTER_ADDR" --kill-on-bad-exit=1 "$PYTHON" -c '
import socket, sys
first = int(sys.argv[1])
for port in range(first, first + 50):
    try:
        with socket.socket() as s:
            s.bind(("", port))
        print(port)
        break
    except OSError:
        print(f"port {port} is in use on {socket.gethostname()}", file=sys.stderr)
else:
    sys.exit(f"no free port in {first}..{first + 49} on {socket.gethostname()}; export MASTER_PORT=<free port>")
' "$MASTER_PORT")"
fi
export MASTER_ADDR MASTER_PORT

echo "multinode: job $SLURM_JOB_ID, $NNODES node(s) ($SLURM_JOB_NODELIST), launcher $LAUNCHER," \
     "rank 0 at $MASTER_ADDR:$MASTER_PORT"
echo "multinode: $PYTHON $LESSON $*"

if [[ "$LAUNCHER" == srun ]]; then
    # one task per rank: SLURM_NTASKS of them, placed as the allocation says
    srun --kill-on-bad-exit=1 --ntasks="$NTASKS" "$PYTHON" -u "$LESSON" "$@"
else
    # one torchrun agent per node, with the CPUs of all its ranks; the agents meet at MASTER_ADDR:MASTER_PORT
    srun --kill-on-bad-exit=1 --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 \
        --cpus-per-task=$((TASKS_PER_NODE * ${SLURM_CPUS_PER_TASK:-1})) \
        "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" \
        --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$SLURM_JOB_ID" \
        "$LESSON" "$@"
fi
