"""Print {script: its --help text} as JSON for the scripts named on the command line, in one process.

Each script runs as `python SCRIPT --help` would run it (tests/as_main.py), so argparse prints the same
text; the process imports torch once for all of them instead of once per script.
"""
import contextlib
import io
import json
import sys

from as_main import run_as_main


def help_of(script: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run_as_main([script, "--help"])
    if code:
        raise RuntimeError(f"{script} --help exited with {code}")
    return out.getvalue()


if __name__ == "__main__":
    print(json.dumps({script: help_of(script) for script in sys.argv[1:]}))
