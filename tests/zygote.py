"""`python SCRIPT args` for the tests, without paying for `import torch` each time.

Almost all of the suite's CPU time is Python processes importing torch and torch._dynamo (about 4 CPU-seconds
each on a 2-core machine: docs/contributors/tests.md, "Time"); the lessons' own work at the tests' sizes is
a small part.  So each test worker starts this file once as a server: it imports torch, torch.distributed,
torch._dynamo and matplotlib, and nothing of the course (whose modules read the environment when imported),
and then forks one child per command.  The child becomes what `python SCRIPT args` would be: the command's
environment, working directory, stdin/stdout/stderr, sys.argv, sys.path[0] (and PYTHONPATH), the signal
handlers a fresh interpreter would start with, its own process group; it runs SCRIPT as __main__ and exits
through the normal interpreter shutdown (atexit handlers, threads joined, streams flushed).  The server never
computes with torch, so a child's OpenMP threads start fresh (a fork after parallel work would hang:
tests/test_launch.py).

After its imports the server freezes its objects (gc.freeze): a child's garbage collections never walk the
hundreds of thousands of objects torch made while importing, nor touch (and so copy) the pages that hold
them.  Measured here: lesson 0 under its own launcher, its forked ranks included, 0.8 instead of 2.5
CPU-seconds; a torchrun worker of lesson 0 0.65 instead of 2.0.

`python -m torch.distributed.run ...` is served too: the agent is a child like any other, and each worker it
starts (torchrun's SubprocessHandler, `python -u SCRIPT args` in a new session) is forked here instead of
from a fresh interpreter, when its environment differs from the agent's only in what torchrun sets for it
(RANK, MASTER_PORT, TORCHELASTIC_*, ...).  The rest is torchrun's own: the rendezvous, the store, the
monitoring of the workers (their pid, poll, wait) and the signals to their sessions.

What a child cannot have of a fresh interpreter: its own string-hash seed (every child shares the server's,
so sets of strings iterate in the same order in every rank), sys.orig_argv and sys.flags (the server's), and
for a torchrun worker its parent (the server's watcher, not the agent).  No lesson depends on them.

conftest.run() sends a command here only when nothing that is read while torch, matplotlib or Python start
up differs from the server's own environment (see _DIFFERENCES_THAT_BYPASS); every other command, and every
test that watches processes, starts a fresh interpreter as before.  COURSE_TEST_ZYGOTE=0 turns it off.

    python tests/zygote.py SOCKET      (the server; conftest starts it)

The CPU seconds of each command (its wait4 usage) come back with its exit code; a torchrun worker's watcher
appends the worker's to a file the agent's client reads when the agent ends.
"""
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

# Variables read when Python, torch, its OpenMP/MKL runtime or matplotlib start: a command whose environment
# differs from the server's in one of them gets a fresh interpreter.
_DIFFERENCES_THAT_BYPASS = ("PYTHON", "OMP_", "KMP_", "MKL_", "GOMP_", "TORCH", "PYTORCH", "CUDA", "NCCL",
                            "MPL", "HOME", "TMPDIR", "LD_", "MALLOC", "LC_", "LANG", "XDG_")
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "matplotlib", "matplotlib.pyplot")


# ------------------------------------------------------------------------------------------ client

class Zygote:
    def __init__(self, python: str, workdir: str, env: dict):
        self.path = os.path.join(workdir, f"zygote-{os.getpid()}.sock")
        self.env = dict(env)
        self.cpu_seconds = 0.0  # of every command it ran to its end (the user and system time of each)
        self.runs = 0
        self.proc = subprocess.Popen([python, __file__, self.path], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the test zygote did not start (exit {self.proc.poll()})")
            time.sleep(0.05)

    def serves(self, cmd: list, env: dict, python: str) -> bool:
        script = len(cmd) >= 2 and str(cmd[1]).endswith(".py")
        torchrun = len(cmd) >= 3 and [str(c) for c in cmd[1:3]] == ["-m", TORCHRUN]
        if cmd[0] != python or not (script or torchrun) or self.proc.poll() is not None:
            return False
        changed = {k for k in set(env) | set(self.env) if env.get(k) != self.env.get(k)} - {"PYTHONPATH"}
        if any(os.path.isfile(os.path.join(p, name)) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p
               for name in ("sitecustomize.py", "usercustomize.py")):
            return False  # Python imports it while starting up: only a fresh interpreter does
        return not any(k.startswith(_DIFFERENCES_THAT_BYPASS) for k in changed)

    def run(self, cmd: list, env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
        self.runs += 1
        cpu_file = f"{self.path}.{self.runs}.cpu"  # torchrun's workers' CPU seconds, one line each
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            request = json.dumps({"argv": [str(c) for c in cmd], "env": env, "cwd": str(cwd),
                                  "cpu_file": cpu_file}).encode()
            socket.send_fds(conn, [struct.pack("!I", len(request)) + request], [null, out_w, err_w])
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        chunks = {out_r: [], err_r: []}
        readers = [threading.Thread(target=_drain, args=(fd, chunks[fd]), daemon=True) for fd in chunks]
        for t in readers:
            t.start()
        deadline = time.monotonic() + timeout
        pid = None
        lines = conn.makefile("rb")  # the pid and the exit code may arrive in one packet
        try:
            conn.settimeout(timeout)
            pid = int(_read_line(lines))
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            code, cpu = _read_line(lines).split()
            code = int(code)
            self.cpu_seconds += float(cpu)
        except (socket.timeout, TimeoutError):
            if pid is not None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for t in readers:
                t.join(10)
            raise subprocess.TimeoutExpired(cmd, timeout, output=b"".join(chunks[out_r]),
                                            stderr=b"".join(chunks[err_r])) from None
        finally:
            lines.close()
            conn.close()
            if os.path.exists(cpu_file):  # written by each worker's watcher before the worker's agent learns its end
                with open(cpu_file) as f:
                    self.cpu_seconds += sum(float(line) for line in f if line.strip())
                os.unlink(cpu_file)
        for t in readers:  # a process left holding the streams (a grandchild) must not hold the test past its time
            t.join(max(1.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in readers):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise subprocess.TimeoutExpired(cmd, timeout, output=b"".join(chunks[out_r]),
                                            stderr=b"".join(chunks[err_r]))
        decode = lambda b: b"".join(b).decode(errors="replace")  # noqa: E731
        return subprocess.CompletedProcess(cmd, code, decode(chunks[out_r]), decode(chunks[err_r]))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            os.unlink(self.path)
            os.rmdir(os.path.dirname(self.path))
        except OSError:
            pass


def _drain(fd: int, into: list):
    with os.fdopen(fd, "rb", buffering=0) as f:
        while block := f.read(65536):
            into.append(block)


def _read_line(lines) -> str:
    line = lines.readline()
    if not line.endswith(b"\n"):
        raise ConnectionError("the test zygote's child ended without a status")
    return line.decode()


# ------------------------------------------------------------------------------------------ torchrun's workers

TORCHRUN = "torch.distributed.run"
# What torchrun's agent sets for its workers (torch/distributed/elastic/agent/server/local_elastic_agent.py): read
# when a process group starts, not while torch imports.
_TORCHRUN_SETS = ("LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                  "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_",
                  "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")


def _fork_torchrun_workers(server: str, cpu_file):
    """In torchrun's agent: start each worker `python -u SCRIPT args` (torchrun's SubprocessHandler) from this
    zygote instead of a fresh interpreter, when its environment differs from the agent's only in what torchrun
    sets for it and its output is the agent's (no --redirects/--tee).  Everything else of torchrun is its own:
    the rendezvous, the store, the monitoring (poll, wait), the signals to the worker's session (os.killpg)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    original = subprocess_handler.SubprocessHandler._popen

    def _popen(handler, args, env):
        args = [str(a) for a in args]
        changed = {k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)}
        if (args[0] == sys.executable and len(args) >= 3 and args[1] == "-u" and args[2].endswith(".py")
                and handler._stdout is None and handler._stderr is None
                and not any(k.startswith(_DIFFERENCES_THAT_BYPASS) and not k.startswith(_TORCHRUN_SETS)
                            for k in changed)):
            return _Worker(server, [args[0], *args[2:]], env, cpu_file)
        return original(handler, args, env)

    def close(handler, death_sig=None):
        try:
            original_close(handler, death_sig)
        except ProcessLookupError:  # its watcher reaped it first: a Popen's zombie would still have its group
            if not isinstance(handler.proc, _Worker):
                raise

    original_close = subprocess_handler.SubprocessHandler.close
    subprocess_handler.SubprocessHandler._popen = _popen
    subprocess_handler.SubprocessHandler.close = close


class _Worker:
    """What torchrun's agent uses of a worker's Popen (pid, poll, wait, returncode), for a worker forked by the
    zygote: its watcher sends the pid, then the exit code, over a socket."""

    def __init__(self, server: str, argv: list, env: dict, cpu_file):
        self.args, self.returncode, self._buf = argv, None, b""
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(server)
        request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "unbuffered": True,
                              "worker_of": cpu_file or os.devnull}).encode()
        socket.send_fds(self._conn, [struct.pack("!I", len(request)) + request], [0, 1, 2])
        self._line(None)
        line, self._buf = self._buf.split(b"\n", 1)
        if line == b"1 0":
            raise ConnectionError("the test zygote did not start torchrun's worker")
        self.pid = int(line)

    def _line(self, timeout) -> bool:
        import select

        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return False
            chunk = self._conn.recv(4096)
            if not chunk:  # its watcher is gone: say so as a failure
                self._buf += b"1 0\n"
                break
            self._buf += chunk
        return True

    def poll(self):
        if self.returncode is None and self._line(0):
            self.returncode = int(self._buf.split()[0])
            self._conn.close()
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None and not self._line(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.poll()

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


# ------------------------------------------------------------------------------------------ server

def _serve(path: str):
    """Accept commands for ever; return (in a forked child) the command that child is to run."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the per-command watchers are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the client waits for the name: it appears once we listen
    server.listen(64)
    while True:
        conn, _ = server.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        (size,) = struct.unpack("!I", msg[:4])
        while len(msg) < 4 + size:
            msg += conn.recv(1 << 20)
        request = json.loads(msg[4:4 + size])
        if os.fork() == 0:  # the watcher: starts the command, reports its pid and its exit code
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            pid = os.fork()
            if pid == 0:
                conn.close()
                return request, fds
            try:
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                _, status, usage = os.wait4(pid, 0)  # its CPU time, with that of the ranks it waited for
                cpu = usage.ru_utime + usage.ru_stime
                if request.get("worker_of"):  # a torchrun worker: its agent's client counts it
                    with open(request["worker_of"], "a") as f:
                        f.write(f"{cpu:.3f}\n")
                conn.sendall(f"{os.waitstatus_to_exitcode(status)} {cpu:.3f}\n".encode())
            finally:  # the client may have gone (its timeout): the watcher ends here in every case
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


def _become(request: dict, fds: list):
    """Turn this forked child into `python SCRIPT args` (or `python -m torch.distributed.run args`) with the
    request's environment and streams."""
    if request.get("worker_of"):
        os.setsid()  # as torchrun starts its workers (Popen(start_new_session=True))
    else:
        os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    at_start = dict(_AT_START)
    if request.get("worker_of"):  # torchrun's agent handles these: an exec'ed worker starts with the defaults
        at_start.update({signal.SIGTERM: signal.SIG_DFL, signal.SIGHUP: signal.SIG_DFL,
                         signal.SIGQUIT: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler})
    for sig, disposition in at_start.items():  # what a fresh interpreter started by the same parent has
        try:
            signal.signal(sig, disposition)
        except (OSError, ValueError, TypeError):
            pass
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED")) or request.get("unbuffered", False)  # -u
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = _stream(1, unbuffered, line=False)  # a pipe: block-buffered, as Python makes it
    sys.stderr = _stream(2, unbuffered, line=True, errors="backslashreplace")  # line-buffered (3.9+)
    script, *args = request["argv"][1:]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if script == "-m":  # torchrun's agent: sys.path[0] is the directory, as for any `python -m`
        module, *args = args
        sys.argv = [module, *args]  # runpy puts the module's file first
        sys.path[0:1] = [os.getcwd(), *extra]
        _fork_torchrun_workers(request["zygote"], request.get("cpu_file"))
    else:
        sys.argv = [script, *args]
        sys.path[0:1] = [os.path.dirname(os.path.abspath(script)), *extra]
    import random
    random.seed()
    return script if script != "-m" else ("-m", module)


def _stream(fd: int, unbuffered: bool, line: bool, errors: str = "strict"):
    import io

    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8", errors=errors,
                            line_buffering=line, write_through=unbuffered)


def _dispositions() -> dict:
    """Every signal's handler as this interpreter started: inherited ignores (a background job's SIGINT),
    Python's own (SIGINT, SIGPIPE, SIGXFSZ), the default for the rest."""
    found = {}
    for sig in range(1, signal.NSIG):
        try:
            handler = signal.getsignal(sig)
        except ValueError:
            continue
        if handler is not None and sig not in (signal.SIGKILL, signal.SIGSTOP):
            found[sig] = handler
    return found


if __name__ == "__main__":
    import gc
    import importlib

    _AT_START = _dispositions()

    gc.disable()
    for name in _PRELOAD:
        importlib.import_module(name)
    gc.enable()
    gc.freeze()  # the imports' objects stay: no collection in a child walks them (nor copies their pages)
    request, fds = _serve(sys.argv[1])
    request["zygote"] = sys.argv[1]
    script = _become(request, fds)
    del request, fds
    import runpy

    if isinstance(script, tuple):
        runpy.run_module(script[1], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(script, run_name="__main__")
