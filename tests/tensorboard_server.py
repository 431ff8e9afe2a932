"""A real `tensorboard` for tests: 127.0.0.1 only, a free port, wait until it has loaded, always stopped.

    with tensorboard(log_dir, runs={"per-param", "flat"}) as tb:
        tb.json("/data/plugin/pytorch_profiler/views", run="flat")

The server runs in its own process group (TensorBoard starts a data-server child); leaving the `with`
block, normally or by an exception, terminates that group by the PID we started, then kills it if needed.
"""
import contextlib
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

PROFILER_API = "/data/plugin/pytorch_profiler"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorBoard:
    def __init__(self, port: int, proc: subprocess.Popen, log_path: Path):
        self.port, self.proc, self.log_path = port, proc, log_path
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str, timeout: float = 30, **params) -> tuple:
        """(HTTP status, body text) of GET path?params; a 4xx/5xx is returned, not raised."""
        query = ("?" + urllib.parse.urlencode(params)) if params else ""
        try:
            with urllib.request.urlopen(self.url + path + query, timeout=timeout) as r:
                body = r.read()
                if r.headers.get("Content-Encoding") == "gzip":  # the profiler plugin's large answers
                    body = gzip.decompress(body)
                return r.status, body.decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def json(self, path: str, **params):
        status, body = self.get(path, **params)
        assert status == 200, f"GET {path} {params} -> {status}: {body[:300]}\n{self.log()}"
        return json.loads(body)

    def log(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"--- tensorboard log (last 3000 chars)\n{text[-3000:]}"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # the group we created for it: it and its data server
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@contextlib.contextmanager
def tensorboard(log_dir, runs=(), timeout: float = 120, work_dir=None):
    """Start TensorBoard on `log_dir`, wait until the profiler plugin lists `runs` and has finished loading."""
    log_dir = Path(log_dir)
    log_path = Path(work_dir or log_dir.parent) / f"tensorboard-{os.getpid()}-{time.monotonic_ns()}.log"
    exe = Path(sys.executable).with_name("tensorboard")
    port = free_port()
    cmd = [str(exe), "--logdir", str(log_dir), "--host", "127.0.0.1", "--port", str(port),
           "--reload_interval", "2"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        tb = TensorBoard(port, proc, log_path)
        deadline, last = time.monotonic() + timeout, None
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"tensorboard exited with {proc.returncode}\n{tb.log()}")
            try:
                status, body = tb.get(PROFILER_API + "/runs", timeout=5)
                last = body
                if status == 200:
                    answer = json.loads(body)
                    if not answer["loading"] and set(runs) <= set(answer["runs"]):
                        break
            except (OSError, ValueError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise AssertionError(f"tensorboard did not load {sorted(runs)} in {timeout} s "
                                     f"(last /runs answer: {last})\n{tb.log()}")
            time.sleep(0.5)
        yield tb
    finally:
        _stop(proc)
