"""A headless Chromium driven by Playwright: open a page, wait for the DOM, take a screenshot.

    with Chromium() as browser:
        browser.open("http://127.0.0.1:6006/#timeseries")
        browser.wait_for("document.querySelectorAll('canvas').length > 0", timeout=60)
        browser.screenshot(Path("page.png"))

Playwright (the maintained automation library, pip package `playwright`) drives Debian's own Chromium
(`executable_path`): no browser is downloaded, nothing but the page's own requests leaves the machine.
Playwright starts the browser with a fresh profile and ends it when the block ends, whatever happened.
"""
import contextlib
import shutil
import time
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def scalar_chart_points(tag: str) -> str:
    """JavaScript giving the number of points TensorBoard's legacy Scalars page draws for `tag`: it renders
    each tag in a <tf-scalar-card> (Polymer, shadow DOM) whose Plottable chart draws the run's curve as an SVG
    <path class="line">; 0 while the card is not there."""
    return r"""
(() => {
  const deep = (root, sel, out = []) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.matches(sel)) out.push(el);
      if (el.shadowRoot) deep(el.shadowRoot, sel, out);
    }
    return out;
  };
  const card = deep(document, 'tf-scalar-card').find(c => c.tag === 'TAG');
  if (!card) return 0;
  const points = deep(card.shadowRoot || card, 'path.line')
    .map(p => (p.getAttribute('d') || '').split(/[ML]/).length - 1);
  return Math.max(0, ...points);
})()
""".replace("TAG", tag)


def find_chromium():
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Chromium:
    def __init__(self, window=(1400, 900), timeout: float = 60):
        self.window, self.timeout = window, timeout
        self._playwright = self.browser = self.page = None

    def __enter__(self):
        from playwright.sync_api import sync_playwright

        exe = find_chromium()
        if exe is None:
            raise FileNotFoundError("no chromium on PATH (apt-get install -y chromium)")
        self._playwright = sync_playwright().start()
        try:
            self.browser = self._playwright.chromium.launch(
                executable_path=exe, headless=True, timeout=self.timeout * 1000,
                args=["--disable-gpu", "--disable-quic", "--disable-background-networking",
                      "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"])
            self.page = self.browser.new_page(viewport={"width": self.window[0], "height": self.window[1]})
            self.page.set_default_timeout(self.timeout * 1000)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        if self.browser is not None:
            with contextlib.suppress(Exception):
                self.browser.close()
        if self._playwright is not None:
            self._playwright.stop()
        return False

    def open(self, url: str) -> None:
        self.page.goto(url, wait_until="commit")

    def evaluate(self, expression: str):
        return self.page.evaluate(expression)

    def wait_for(self, expression: str, timeout: float = 60, interval: float = 0.5):
        """Poll a JavaScript expression until it is truthy; return its value (or raise TimeoutError).  A page
        that is navigating away in between (a click on a link) is polled again once it has loaded."""
        from playwright.sync_api import Error

        deadline, value = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            with contextlib.suppress(Error):
                value = self.page.evaluate(expression)
                if value:
                    return value
            time.sleep(interval)
        raise TimeoutError(f"not true after {timeout} s (last value {value!r}): {expression[:200]}")

    def screenshot(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(path))
        return path
