"""The ``moeplan`` console script: Ctrl-C while the command's modules load (torch, typer, rich: about half a second)
ends with one line and exit 130, as it does once :func:`moeplan.cli.main` runs, not with a traceback of the import
that was interrupted."""
from __future__ import annotations

import sys

INTERRUPTED_EXIT = 130  # moeplan.cli_errors.INTERRUPTED_EXIT, not imported: this module must load in no time


def main() -> None:
    """Import the CLI, then run it (:func:`moeplan.cli.main`)."""
    try:
        from moeplan.cli import main as cli_main
    except (KeyboardInterrupt, RuntimeError) as e:  # a Ctrl-C inside a class body's __set_name__ arrives wrapped
        if not isinstance(e, KeyboardInterrupt) and not isinstance(e.__cause__, KeyboardInterrupt):
            raise
        sys.stderr.write("moeplan: interrupted (Ctrl-C) while starting; nothing was written\n")
        sys.exit(INTERRUPTED_EXIT)
    cli_main()
