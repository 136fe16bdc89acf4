"""Shared by the benchmark scripts: run a ``moeplan`` command in a subprocess."""
from __future__ import annotations

import subprocess
import sys


def moeplan_cli(*args: str) -> str:
    """``python -m moeplan.cli ARGS``; its stdout, or exit with the command and the end of its stderr."""
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "moeplan.cli", *args], capture_output=True,
                          text=True)
    if proc.returncode:
        sys.exit(f"moeplan {' '.join(args[:2])} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return proc.stdout
