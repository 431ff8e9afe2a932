"""TensorBoard that only its owner can reach (course/tensorboard_private.py), started for real: on a Unix socket
in a mode-700 directory, another user (uid 65534) is refused by the kernel, while the owner's browser reaches
it through a forwarded port, as `ssh -L 6006:SOCKET` gives it on a laptop (here a small forwarder on
127.0.0.1 stands in for ssh).  For contrast, the same other user connects to anything on 127.0.0.1.
"""
import contextlib
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import PYTHON, REPO, require_chromium
from headless_chromium import Chromium, scalar_chart_points

pytestmark = pytest.mark.slow
NOBODY = 65534
TAG, POINTS = "train/loss", 12


def as_nobody(code: str) -> subprocess.CompletedProcess:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to act as another user")
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "/usr/bin/python3",
                           "-c", code], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def forwarded(sock: Path):
    """127.0.0.1:PORT -> the Unix socket, as `ssh -L PORT:SOCKET` forwards it; yields PORT."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()

    def pipe(a, b):
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def accept():
        while not stop.is_set():
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(str(sock))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        server.close()


@pytest.fixture(scope="module")
def private_tensorboard(tmp_path_factory):
    from torch.utils.tensorboard import SummaryWriter

    logdir = tmp_path_factory.mktemp("private-tb-logs")
    with SummaryWriter(str(logdir / "run")) as writer:
        for step in range(POINTS):
            writer.add_scalar(TAG, 2.0 / (step + 1), step)
    base = Path(tempfile.mkdtemp(prefix="course-tb-", dir="/tmp"))  # a shared place, as a login node's /tmp
    base.chmod(0o755)  # everyone may pass through: only the socket's own directory keeps them out
    sock = base / "private" / "tb.sock"
    log = open(base / "tensorboard.log", "w")
    proc = subprocess.Popen([PYTHON, "-m", "course.tensorboard_private", "--logdir", logdir, "--socket", sock,
                             "--reload-interval", "1"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (base / "tensorboard.log").read_text()
            time.sleep(0.5)
        yield sock, base / "tensorboard.log"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        proc.wait(timeout=20)
        log.close()
        shutil.rmtree(base, ignore_errors=True)


def test_only_the_owner_can_reach_the_private_tensorboard(private_tensorboard):
    sock, log = private_tensorboard
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    assert f"ssh -N -L 6006:{sock}" in log.read_text()
    with forwarded(sock) as port:
        deadline = time.monotonic() + 60
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=10) as r:
                if TAG in r.read().decode():
                    break
            assert time.monotonic() < deadline, "TensorBoard never listed the run's scalars"
            time.sleep(1)
    refused = as_nobody(f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({str(sock)!r})")
    assert refused.returncode != 0 and "PermissionError" in refused.stderr, refused.stderr
    # what the private socket is for: a port on 127.0.0.1 is open to every user of the machine
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        reached = as_nobody(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5)")
    assert reached.returncode == 0, reached.stderr


CHART_POINTS = scalar_chart_points(TAG)


@pytest.mark.browser
def test_the_owners_browser_draws_the_runs_through_the_forwarded_socket(private_tensorboard):
    require_chromium()
    sock, _ = private_tensorboard
    artifacts = Path(os.environ.get("TEST_ARTIFACTS", REPO / "test-artifacts"))
    with forwarded(sock) as port, Chromium(window=(1400, 1200)) as browser:
        browser.open(f"http://127.0.0.1:{port}/#scalars")
        try:
            points = browser.wait_for(f"{CHART_POINTS} >= {POINTS}", timeout=90) and browser.evaluate(CHART_POINTS)
        finally:
            shot = browser.screenshot(artifacts / "tensorboard-private.png")
    assert points == POINTS, f"the chart has {points} points, expected {POINTS}; see {shot}"
