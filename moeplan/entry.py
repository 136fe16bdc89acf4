"""The ``moeplan`` console script: Ctrl-C while the command's modules load (torch, typer, rich: about half a second)
ends with one line and exit 130, as it does once :func:`moeplan.cli.main` runs, not with a traceback of the import
that was interrupted nor, when it lands where Python swallows it, not at all (:mod:`moeplan.interrupts`)."""
from __future__ import annotations

import sys

from moeplan.interrupts import INTERRUPTED_EXIT, interrupted, keep_swallowed_interrupts


def main() -> None:
    """Import the CLI, then run it (:func:`moeplan.cli.main`)."""
    keep_swallowed_interrupts()
    try:
        from moeplan.cli import main as cli_main
    except (KeyboardInterrupt, RuntimeError) as e:  # a Ctrl-C inside a class body's __set_name__ arrives wrapped
        if not interrupted(e):
            raise
        sys.stderr.write("moeplan: interrupted (Ctrl-C) while starting; nothing was written\n")
        sys.exit(INTERRUPTED_EXIT)
    cli_main()
