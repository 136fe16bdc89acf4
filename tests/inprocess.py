"""``moeplan`` commands run inside the test process (imported by the test modules as ``from inprocess import ...``)."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys


def run_moeplan(*args: object, cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``moeplan ARGS`` run in this process through the console entry point (``moeplan.cli.main``), returned as a
    finished process: its exit code, stdout and stderr. It saves the interpreter and torch start-up of a
    subprocess (2-3 s each); tests of what only a separate process shows (a terminal's width, signals, the
    environment, the ranks of ``moeplan run``) spawn one."""
    from moeplan.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: object = 0
    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv = ["moeplan", *map(str, args)]
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
    returncode = code if isinstance(code, int) else (0 if code is None else 1)
    return subprocess.CompletedProcess(["moeplan", *map(str, args)], returncode, out.getvalue(), err.getvalue())
