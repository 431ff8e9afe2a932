"""Print {script: its --help text} as JSON for the scripts named on the command line, in one process.

Each script runs as `python SCRIPT --help` would run it (as __main__, with that argv), so argparse prints
the same text; the process imports torch once for all of them instead of once per script.
"""
import contextlib
import io
import json
import runpy
import sys


def help_of(script: str) -> str:
    out, argv = io.StringIO(), sys.argv
    sys.argv = [script, "--help"]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise RuntimeError(f"{script} --help exited with {e.code}") from None
    finally:
        sys.argv = argv
    return out.getvalue()


if __name__ == "__main__":
    print(json.dumps({script: help_of(script) for script in sys.argv[1:]}))
