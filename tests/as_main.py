"""Run a script inside this process as `python SCRIPT ARGS...` would run it, for the helpers beside it.

As __main__, with that sys.argv and the script's folder first on sys.path; returns its exit code.
"""
import os
import runpy
import sys


def run_as_main(argv: list) -> int:
    saved_argv, saved_path = sys.argv, sys.path[:]
    sys.argv = [str(a) for a in argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
