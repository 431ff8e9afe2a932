"""TensorBoard that only you can reach, on a login node shared with everyone.

    python -m course.tensorboard_private --logdir log_ddp          # on the login node; Ctrl+C stops it
    ssh -N -L 6006:SOCKET you@login.cluster                          # on your laptop (the line it prints)
    open http://127.0.0.1:6006

`tensorboard --host 127.0.0.1` keeps TensorBoard off the network, but not away from the other users of the
same login node: any of them can connect to 127.0.0.1:6006 and read your runs.  Here TensorBoard (the same
program, its plugins included) listens on a Unix socket instead of a port, in a directory that only you can
enter (mode 700, checked before it starts): the kernel refuses everyone else at the directory.  OpenSSH
forwards a local port of your laptop to that socket (`-L port:/path/to/socket`, OpenSSH 6.7 and later), so
your browser reaches it as before.  In Open OnDemand, open a terminal on the login node for the first line
and use the printed `ssh -L` from your laptop, or run TensorBoard inside your own JupyterLab session, which
OnDemand already keeps private (docs/learners/monitoring.md).
"""
import argparse
import getpass
import os
import socket
import stat
import sys
from pathlib import Path


def default_socket() -> Path:
    """$XDG_RUNTIME_DIR (a login session's own directory, mode 700) if set, else ~/.course-tensorboard; one
    socket per host, since a home directory is shared by every login node."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(base) / "course-tensorboard" if base else Path.home() / ".course-tensorboard"
    return folder / f"{socket.gethostname().split('.')[0]}.sock"


def private_dir(folder: Path) -> Path:
    """`folder`, created if needed with mode 700, or a one-line SystemExit if it is not yours alone."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid():
        raise SystemExit(f"error: {folder} belongs to uid {info.st_uid}, not to you ({getpass.getuser()}); "
                         f"give --socket a path in a directory of your own")
    if stat.S_IMODE(info.st_mode) & 0o077:
        folder.chmod(0o700)  # ours: closing it is safe, and the only way to be private
    return folder


def serve(logdir: Path, sock: Path, extra=()) -> int:
    from tensorboard import default, program
    from werkzeug import serving

    class UnixSocketServer(serving.ThreadedWSGIServer, program.TensorBoardServer):
        daemon_threads = True

        def __init__(self, wsgi_app, flags):
            super().__init__(f"unix://{sock}", 0, wsgi_app)  # a leftover socket file is replaced
            os.chmod(sock, 0o600)

        def get_url(self):  # TensorBoard records a port in its list of running servers: none (0) here
            return "http://localhost:0/"

        def print_serving_message(self):
            host = socket.getfqdn()
            print(f"TensorBoard for {logdir} on the Unix socket {sock}: only you can reach it (its directory is "
                  f"mode 700). On your laptop: ssh -N -L 6006:{sock} {getpass.getuser()}@{host}   then open "
                  f"http://127.0.0.1:6006 (Ctrl+C here stops it)", file=sys.stderr, flush=True)

    tensorboard = program.TensorBoard(plugins=default.get_plugins(), server_class=UnixSocketServer)
    tensorboard.configure(argv=["tensorboard", "--logdir", str(logdir), *extra])
    return tensorboard.main() or 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m course.tensorboard_private", description=__doc__.split("\n\n")[0])
    p.add_argument("--logdir", type=Path, required=True, help="what to show (a run dir, ./log_ddp, ...)")
    p.add_argument("--socket", type=Path, default=None,
                   help=f"the socket's path, in a directory only you use (default: {default_socket()})")
    p.add_argument("--reload-interval", type=int, default=5, help="seconds between TensorBoard's rescans")
    args = p.parse_args(argv)
    if not args.logdir.is_dir():
        p.exit(2, f"{p.prog}: error: --logdir {args.logdir} is not a directory\n")
    sock = (args.socket or default_socket()).absolute()
    if len(str(sock).encode()) > 100:  # sun_path holds 108 bytes
        p.exit(2, f"{p.prog}: error: the socket path {sock} is too long for a Unix socket; give a shorter --socket\n")
    private_dir(sock.parent)
    return serve(args.logdir, sock, ["--reload_interval", str(args.reload_interval)])


if __name__ == "__main__":
    sys.exit(main())
