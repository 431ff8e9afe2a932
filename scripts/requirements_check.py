#!/usr/bin/env python3
"""What this interpreter lacks of the course's requirements, read from installed packages' metadata.

    python scripts/requirements_check.py requirements.txt requirements-test.txt
        prints each requirement that is not met, one a line ("h5py>=3.8 (not installed)"); exit 1 if any
    python scripts/requirements_check.py --site-torch requirements.txt
        the torch this interpreter already has (a site's PyTorch module): prints its version and exits 0 when
        it meets requirements.txt, else one line saying what is wrong and exits 1

scripts/setup_env.sh runs it for a shared venv it may not write into and for a venv on top of a site's
PyTorch.  It only reads: no pip, no imports of the packages it checks (torch only to name a version that has
no metadata), nothing written.  Standard library only (uses `packaging` when it is there).
"""
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # a bare interpreter (a site module may have no packaging): the small parser below
    Requirement = Version = None


def requirement_lines(path):
    """The requirement specifiers of a pip requirements file: comments, blank lines and options dropped."""
    for line in Path(path).read_text().splitlines():
        line = line.split(" #")[0].split("\t#")[0].strip()
        if line and not line.startswith(("#", "-")):
            yield line


def _release(version: str) -> tuple:
    """(2, 14, 1) of "2.14.1+cu128" or "2.5.0a0+git1234": the release numbers (the fallback's view)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(n) for n in match.group(1).split(".")) if match else ()


def _padded(a: tuple, b: tuple):
    n = max(len(a), len(b))
    return a + (0,) * (n - len(a)), b + (0,) * (n - len(b))


def _fallback_allows(spec: str, version: str) -> bool:
    """`version` meets `spec` (">=2.4,<3"), comparing release numbers only; used without `packaging`."""
    have = _release(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op, want = re.match(r"(~=|==|!=|<=|>=|<|>)\s*(.+)", clause).groups()
        if want.endswith(".*"):
            prefix = _release(want[:-2])
            same = have[:len(prefix)] == prefix
            if (op == "==") != same:
                return False
            continue
        a, b = _padded(have, _release(want))
        ok = {"==": a == b, "!=": a != b, "<=": a <= b, ">=": a >= b, "<": a < b, ">": a > b,
              "~=": a >= b and have[:len(_release(want)) - 1] == _release(want)[:-1]}[op]
        if not ok:
            return False
    return True


def parse(line: str):
    """(name, the requirement as written, allows(version) -> bool) of one requirement line; None when its
    environment marker excludes this interpreter."""
    if Requirement is not None:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            return None
        # prereleases=True: a site's build such as "2.5.0a0+nv24.10" is a torch 2.5 for our purpose
        return req.name, line.split(";")[0].strip(), \
            lambda v: req.specifier.contains(Version(v), prereleases=True)
    line = line.split(";")[0].strip()
    name, spec = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)", line).groups()
    return name, line, lambda v: _fallback_allows(spec, v)


def installed_version(name: str):
    # Python < 3.10 finds "torch_tb_profiler-0.4.3.dist-info" only under its file name's spelling
    for spelling in dict.fromkeys([name, re.sub(r"[-_.]+", "_", name), re.sub(r"[-_.]+", "-", name)]):
        try:
            return importlib.metadata.version(spelling)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def unmet(files) -> list:
    """Each requirement of `files` that this interpreter does not meet, as one short text."""
    problems = []
    for path in files:
        for line in requirement_lines(path):
            parsed = parse(line)
            if parsed is None:
                continue
            name, written, allows = parsed
            found = installed_version(name)
            if found is None:
                problems.append(f"{written} (not installed)")
            elif not allows(found):
                problems.append(f"{written} (found {found})")
    return problems


def site_torch(requirements_txt) -> int:
    """Check the torch this interpreter already has against requirements.txt; print its version if it fits."""
    torch_line = next((parse(line) for line in requirement_lines(requirements_txt)
                       if re.match(r"torch\s*([<>=!~;\[]|$)", line)), None)
    if torch_line is None:
        print(f"error: {requirements_txt} names no torch requirement", file=sys.stderr)
        return 1
    _, written, allows = torch_line
    found = importlib.util.find_spec("torch")
    if found is None:
        print(f"error: COURSE_SYSTEM_TORCH=1, but {sys.executable} cannot import torch: load the site's PyTorch "
              f"module first (e.g. module load pytorch), or leave COURSE_SYSTEM_TORCH unset to install torch into "
              f"the venv (about 6 GB)", file=sys.stderr)
        return 1
    where = Path(found.origin).parent if found.origin else found.submodule_search_locations[0]
    version = installed_version("torch")
    if version is None:  # importable, but pip cannot see it: pip would install a second torch beside it
        try:
            import torch
            named = f"torch {torch.__version__}"
        except Exception as exc:  # noqa: BLE001 - any failure is reported in the one line
            named = f"torch (does not import: {type(exc).__name__})"
        print(f"error: the site's {named} at {where} has no package metadata (no torch-*.dist-info beside it), "
              f"so pip would install a second torch into the venv: ask the site for a PyTorch module installed "
              f"with pip or conda, or leave COURSE_SYSTEM_TORCH unset to install torch into the venv (about 6 GB)",
              file=sys.stderr)
        return 1
    if not allows(version):
        print(f"error: the site's torch {version} (at {where}) does not meet the course's {written} "
              f"(requirements.txt): load a newer PyTorch module (module avail pytorch), or leave "
              f"COURSE_SYSTEM_TORCH unset to install torch into the venv (about 6 GB)", file=sys.stderr)
        return 1
    print(version)
    return 0


def main(argv) -> int:
    if argv[:1] == ["--site-torch"] and len(argv) == 2:
        return site_torch(argv[1])
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip().split("\n\n")[0], file=sys.stderr)
        return 2
    problems = unmet(argv)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
