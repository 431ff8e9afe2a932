"""Where rank 0 listens: the MASTER_PORT it takes, and the checks that turn a wrong MASTER_ADDR or MASTER_PORT
into one line instead of a hang.

Never a fixed port that two users (or two jobs on one node) could both pick: a free port for the ranks this
process starts itself, a port derived from the job id under srun.  Beside it in course/launching/: launch.py
decides which applies; devices.py picks each rank's device and backend; supervise.py starts and watches the
ranks of `--nproc N`.
"""
import os
import socket
import time

from course.launching.cli import CourseError


def free_port() -> int:
    """A port nobody uses right now on this machine: never a fixed one two users could both pick."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_master_port() -> int:
    """Derived from the job id: all ranks compute the same port, two jobs on one node differ."""
    return 10_000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20_000


def check_port_is_free(addr: str, port: int) -> None:
    """Rank 0, before it listens: a port in use would only fail later, inside init_process_group."""
    with socket.socket() as s:
        # As the TCPStore does: a port left in TIME_WAIT by the previous job step (srun after srun in one
        # job, same job id, same port) is free to listen on; only a live listener counts as in use.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            raise CourseError(f"port {port} on {addr} is already in use (another job or user?); "
                              f"choose another with MASTER_PORT=<free port>") from None


def check_master_addr_is_here(addr: str) -> None:
    """Rank 0 hosts the store at MASTER_ADDR: an address of another machine would only fail after --timeout."""
    try:
        ip = socket.gethostbyname(addr)
        with socket.socket() as s:
            s.bind((ip, 0))
    except OSError as e:
        raise CourseError(f"rank 0 runs on {socket.gethostname()}, but MASTER_ADDR={addr} is not an address of "
                          f"this host ({e.strerror or e}); unset MASTER_ADDR (the first node of the job is "
                          f"taken) or set it to rank 0's hostname") from None


def wait_for_rank0(rank: int, timeout) -> None:
    """Connect to rank 0's store at MASTER_ADDR:MASTER_PORT until it answers or `timeout` seconds pass.

    init_process_group does the same, but an unreachable address costs it up to twice its timeout, and it
    fails with a traceback; this fails within the timeout, with one line that says what to check.
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    deadline = time.monotonic() + (timeout or 300)
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(left, 5))).close()
            return
        except OSError as e:  # refused (rank 0 not listening yet), unreachable, unknown name, timed out
            last = e.strerror or str(e) or type(e).__name__
        if left <= 0:
            raise CourseError(f"rank {rank} could not reach rank 0 at MASTER_ADDR={addr} MASTER_PORT={port} within "
                              f"--timeout {timeout or 300:g} s ({last}); MASTER_ADDR must be rank 0's host, "
                              f"reachable from this node (check the name, a firewall, GLOO_SOCKET_IFNAME/"
                              f"NCCL_SOCKET_IFNAME), and rank 0 must have started") from None
        time.sleep(min(0.2, max(left, 0)))
