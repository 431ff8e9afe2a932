"""The course website (scripts/build_site.sh): built once per test module with warnings as errors, then checked.

- the build passes with -W, i.e. no warning at all (a broken link, a missing page, a bad notebook);
- every lesson of docs/lessons.toml has its page: the catalog's title, idea, objectives and minutes, the
  script and the launcher included, and every plot of the committed notebook as an image file of the site;
- every link inside the site leads to a file of the site (and to an anchor that exists there);
- (browser) a lesson page served by a real http.server on 127.0.0.1 and opened in headless Chromium shows
  its plots loaded, the sidebar with every lesson, and previous/next links to its neighbours in course order.
"""
import functools
import html
import json
import os
import re
import sys
import threading
import time
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from conftest import REPO, require_chromium, run
from headless_chromium import Chromium

if sys.version_info < (3, 11):  # requirements-docs.txt installs Sphinx 9 only there
    pytest.skip("the website needs Python >= 3.11 (Sphinx 9)", allow_module_level=True)
import tomllib  # noqa: E402 - after the skip: Python 3.11 on

pytestmark = pytest.mark.slow  # builds the whole site once (Sphinx): the full suite

LESSONS = tomllib.loads((REPO / "docs/lessons.toml").read_text())["lesson"]
SMART_QUOTES = str.maketrans("\u2018\u2019\u201c\u201d", "''\"\"")  # the site typesets quotes
BROWSED = "2"  # the lesson opened in the browser: the single-process baseline, with its loss curve


def page(lesson) -> str:
    """A lesson page's path in the site: its notebook's path with .html."""
    return lesson["notebook"].removesuffix(".ipynb") + ".html"


# a notebook cell that draws: matplotlib's show, the notebooks' draw_* diagrams, lesson 5's plot_trace
DRAWS = re.compile(r"\b(plt\.show|draw_\w+|plot_trace)\(")


def plots(lesson) -> int:
    """How many plots (PNG outputs) the committed notebook holds; fails where a cell that draws holds none."""
    notebook = json.loads((REPO / lesson["notebook"]).read_text())
    count = 0
    for number, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        images = sum("image/png" in output.get("data", {}) for output in cell.get("outputs", []))
        draws = DRAWS.search("".join(cell["source"]))
        assert images or not draws, f"{lesson['notebook']}: cell {number} draws ({draws[1]}) but holds no plot"
        count += images
    return count


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once for this module by the one command (into a temporary directory)."""
    out = tmp_path_factory.mktemp("site") / "html"
    start = time.monotonic()
    proc = run([REPO / "scripts/build_site.sh", out], env={"VENV": sys.prefix}, timeout=600, check=False)
    seconds = time.monotonic() - start
    print(f"\nsite built in {seconds:.1f} s (exit code {proc.returncode})")
    return out, proc, seconds


@pytest.fixture(scope="module")
def built(site):
    """The site's directory, for the checks of its pages: only once it built."""
    out, proc, _ = site
    if proc.returncode != 0:
        pytest.fail("the site did not build: see test_the_site_builds_without_a_warning", pytrace=False)
    return out


def test_the_site_builds_without_a_warning(site):
    out, proc, _ = site
    assert proc.returncode == 0 and "WARNING" not in proc.stdout + proc.stderr, \
        f"scripts/build_site.sh exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    assert (out / "index.html").is_file() and (out / "docs/index.html").is_file()


@pytest.mark.parametrize("lesson", LESSONS, ids=[lesson["id"] for lesson in LESSONS])
def test_every_lesson_has_its_page(built, lesson):
    out = built
    path = out / page(lesson)
    assert path.is_file(), f"no page for lesson {lesson['id']}: {page(lesson)}"
    text = path.read_text()
    plain = html.unescape(re.sub(r"<[^>]+>", "", text)).translate(SMART_QUOTES)
    words = " ".join(plain.split())
    for fact in (lesson["title"], f"about {lesson['minutes']} minutes", lesson["idea"][1:],
                 *[objective.split(" can ", 1)[-1] for objective in lesson["objectives"]]):
        missing = " ".join(fact.split()) not in words
        assert not missing, f"{page(lesson)} lacks {fact!r}"
    for part in ("script", "launcher"):
        anchor = f'id="lesson-{lesson["id"]}-{part}"'.lower().replace("_", "-")
        assert anchor in text, f"{page(lesson)} has no {part} section"
        lines = [line.strip() for line in (REPO / lesson[part]).read_text().splitlines() if len(line) > 20]
        for line in (lines[0], lines[-1]):
            missing = line not in plain
            assert not missing, f"{page(lesson)} does not include {lesson[part]}: {line!r} missing"
    images = re.findall(r'<img[^>]+src="\.\./(_images/[^"]+\.png)"', text)
    assert len(images) == plots(lesson), f"{page(lesson)}: {len(images)} images, the notebook has {plots(lesson)} plots"
    for image in images:
        assert (out / image).stat().st_size > 1000, image


class Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        for name in ("href", "src"):
            if attrs.get(name) and tag in ("a", "img", "link", "script"):
                self.hrefs.append(attrs[name])


@functools.cache
def parsed(path: Path) -> Links:
    links = Links()
    links.feed(path.read_text(errors="replace"))
    return links


def test_every_link_inside_the_site_works(built):
    out = built
    broken = []
    for path in sorted(out.rglob("*.html")):
        if path.relative_to(out).parts[0] == "_static":
            continue  # the theme's template fragments, not pages
        for href in parsed(path).hrefs:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith(("mailto:", "javascript:")):
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{path.relative_to(out)}: {href}")
            elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in parsed(target).ids:
                broken.append(f"{path.relative_to(out)}: {href} (no such anchor)")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)


@pytest.fixture
def served(built):
    """The built site, served by http.server on 127.0.0.1 (a free port) for one test."""
    out = built

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(out)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.browser
def test_a_lesson_page_in_a_browser(served):
    require_chromium()
    index = next(i for i, lesson in enumerate(LESSONS) if lesson["id"] == BROWSED)
    lesson, previous, following = LESSONS[index], LESSONS[index - 1], LESSONS[index + 1]
    artifacts = Path(os.environ.get("TEST_ARTIFACTS", REPO / "test-artifacts"))
    with Chromium(window=(1400, 1000)) as browser:
        browser.open(f"{served}/")  # the root forwards to the home page
        browser.wait_for("location.pathname.endsWith('/docs/index.html')", timeout=30)
        browser.open(f"{served}/{page(lesson)}")
        try:
            browser.wait_for("document.readyState === 'complete'", timeout=30)
            images = browser.evaluate(
                "Array.from(document.querySelectorAll('article img'))"
                ".map(i => ({src: i.getAttribute('src'), complete: i.complete, width: i.naturalWidth}))")
            sidebar = browser.evaluate(
                "Array.from(document.querySelectorAll('.bd-sidebar-primary nav a[href]')).map(a => a.href)")
            current = browser.evaluate(
                "Array.from(document.querySelectorAll('.bd-sidebar-primary nav a.current')).map(a => a.textContent)")
            pager = browser.evaluate(
                "Object.fromEntries(Array.from(document.querySelectorAll('.prev-next-area a'))"
                ".map(a => [a.classList.contains('left-prev') ? 'previous' : 'next', a.href]))")
        finally:
            shot = browser.screenshot(artifacts / "site-lesson.png")
        assert len(images) == plots(lesson) > 0, f"{images}; see {shot}"
        assert all(image["complete"] and image["width"] > 0 for image in images), f"not loaded: {images}"
        missing = [page(other) for other in LESSONS
                   if other is not lesson and not any(href.endswith("/" + page(other)) for href in sidebar)]
        assert not missing, f"the sidebar lacks links to {missing}; see {shot}"
        assert any(text.strip().startswith(f"Lesson {lesson['id']}:") for text in current), \
            f"the sidebar does not mark this page as the current one: {current}"
        assert pager.get("previous", "").endswith("/" + page(previous)), pager
        assert pager.get("next", "").endswith("/" + page(following)), pager
        browser.evaluate("document.querySelector('.prev-next-area a.right-next').click()")
        browser.wait_for(f"location.pathname.endsWith('/{page(following)}') && document.readyState === 'complete'",
                         timeout=30)
