"""A headless Chromium driven over the DevTools protocol: open a page, wait for the DOM, take a screenshot.

    with Chromium() as browser:
        browser.open("http://127.0.0.1:6006/#timeseries")
        browser.wait_for("document.querySelectorAll('canvas').length > 0", timeout=60)
        browser.screenshot(Path("page.png"))

Chromium (Debian package `chromium`) runs with a fresh profile in a temporary directory, no network beyond
what the page asks for, and is terminated (by the PID we started, then its process group) when the block
ends, whatever happened.
"""
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium():
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Chromium:
    def __init__(self, window=(1400, 900), timeout: float = 60):
        self.window, self.timeout = window, timeout
        self.proc = self.ws = None
        self._ids = itertools.count(1)

    def __enter__(self):
        import websocket  # websocket-client

        exe = find_chromium()
        if exe is None:
            raise FileNotFoundError("no chromium on PATH (apt-get install -y chromium)")
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage", f"--user-data-dir={self.profile}",
               "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
               f"--window-size={self.window[0]},{self.window[1]}", "about:blank"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        try:
            port_file = Path(self.profile) / "DevToolsActivePort"
            deadline = time.monotonic() + self.timeout
            while not (port_file.exists() and port_file.read_text().strip()):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"chromium did not start (exit code {self.proc.poll()})")
                time.sleep(0.1)
            port = int(port_file.read_text().split()[0])
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                page = next(t for t in json.load(r) if t["type"] == "page")
            self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=self.timeout,
                                                  suppress_origin=True)
            self.call("Page.enable")
            self.call("Runtime.enable")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        if self.ws is not None:
            with contextlib.suppress(Exception):
                self.ws.close()
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        shutil.rmtree(getattr(self, "profile", ""), ignore_errors=True)
        return False

    def call(self, method: str, **params) -> dict:
        """Send one DevTools command and return its result; events arriving meanwhile are skipped."""
        call_id = next(self._ids)
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}...: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60, interval: float = 0.5):
        """Poll a JavaScript expression until it is truthy; return its value (or raise TimeoutError)."""
        deadline, value = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):
                value = self.evaluate(expression)
                if value:
                    return value
            time.sleep(interval)
        raise TimeoutError(f"not true after {timeout} s (last value {value!r}): {expression[:200]}")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
