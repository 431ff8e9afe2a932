"""pytest plugin for run_tests.sh: how many tests were skipped because this machine lacks root or a system
package (Slurm, munge, Chromium), so that run_tests.sh can end with one line saying how to run them.

    COURSE_SKIP_REPORT=FILE python -m pytest -p tests.skip_report ...

writes "ROOT PACKAGES" (two counts) to FILE when the session ends.  The reasons are the skips' own texts:
the Slurm cluster's skip_reason() says "needs root" or names the apt-get command, the browser test names
`apt-get install -y chromium`.  Under pytest-xdist the controller counts the reports its workers send.
"""
import os

_counts = {"root": set(), "packages": set()}


def _category(reason: str):
    if "needs root" in reason:
        return "root"
    if "apt-get install" in reason or "munge package" in reason:
        return "packages"
    return None


def pytest_runtest_logreport(report):
    if not report.skipped or not isinstance(report.longrepr, (tuple, list)):
        return
    category = _category(str(report.longrepr[2]))
    if category is not None:
        _counts[category].add(report.nodeid)


def pytest_sessionfinish(session):
    path = os.environ.get("COURSE_SKIP_REPORT")
    if path and not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        with open(path, "w") as out:
            out.write(f"{len(_counts['root'])} {len(_counts['packages'])}\n")
