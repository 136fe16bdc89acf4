"""How the ``moeplan`` command line (moeplan.cli) ends on an error: one line on stderr and an exit code
(docs/architecture.md §8.7).

- Bad input (a :class:`~moeplan.errors.MoeplanError` that is a ``ValueError``) exits 2 and a plan that cannot fit
  (:class:`~moeplan.errors.InfeasibleError`) exits 3, each with ``error: <message>`` and no traceback.
- Anything else is a bug: one line naming the command as an internal error, exit 1; ``moeplan --debug COMMAND``
  prints the traceback too.
- Typer handles its own before: usage errors (unknown option, missing argument: usage text and exit 2),
  ``typer.Exit``, an abort (end of input: ``Aborted!``, exit 1) and a closed stdout pipe (exit 1).

``--debug`` and the command's name are not module state: the app's callback puts them in the click context
(``ctx.obj``, an :class:`Invocation`), and the app's group (:class:`GuardedGroup`) attaches that to whatever leaves
a command, on its way to :func:`moeplan.cli.main`, which reports it (:func:`exit_on_error`, :func:`invocation_of`).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import NoReturn, Optional

import typer
from rich.console import Console
from typer.core import TyperGroup

from moeplan.errors import InfeasibleError, MoeplanError
from moeplan.interrupts import INTERRUPTED_EXIT, interrupted

err = Console(stderr=True, highlight=False, soft_wrap=True)
"""stderr of the command line: error lines, warnings, progress bars."""


@dataclass(frozen=True)
class Invocation:
    """What the error report needs of this invocation: ``--debug``, and the command's name (None: no command yet)."""

    debug: bool = False
    command: Optional[str] = None


def one_line(text: str) -> str:
    """``text`` as one printable line: whitespace runs become one space, other control characters their escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(text.split()))


def warn(line: str) -> None:
    """One warning line on stderr (``warning: ...``), printed as it is (never read as rich markup)."""
    err.print(f"warning: {one_line(line)}", markup=False)


BROKEN_PIPE_EXIT = 141
"""Exit code when stdout's reader went away (``moeplan describe X | head -1``): 128 + SIGPIPE, what a shell reports
for a program that a closed pipe stopped."""


def exit_on_broken_pipe() -> NoReturn:
    """Stop quietly because stdout's reader closed the pipe: nothing on stderr, exit :data:`BROKEN_PIPE_EXIT`; stdout
    is pointed at /dev/null first, so that the interpreter's last flush does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(BROKEN_PIPE_EXIT)


def exit_on_interrupt(command: str | None = None) -> NoReturn:
    """Stop on Ctrl-C that came before a command's own handling: ``moeplan [COMMAND]: interrupted (Ctrl-C); nothing
    was written`` on stderr, exit :data:`INTERRUPTED_EXIT`."""
    err.print(f"moeplan{f' {command}' if command else ''}: interrupted (Ctrl-C); nothing was written", markup=False)
    sys.exit(INTERRUPTED_EXIT)


class StdoutConsole(Console):
    """The console of a command's output. Strings print as they are, never as rich markup: names, labels and reasons
    come from the user's files (a model named ``[/oops]`` raised rich's MarkupError), so styles are given as
    :class:`rich.text.Text`. A reader that closes the pipe ends the command by :func:`exit_on_broken_pipe` (rich's
    own handler exits 1, the code of a bug)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**{"markup": False, **kwargs})

    def on_broken_pipe(self) -> None:
        self.quiet = True
        exit_on_broken_pipe()


def exit_on_error(e: Exception, invocation: Invocation) -> NoReturn:
    """Report ``e`` (the exception being handled) on stderr as the module docstring says, and exit; a Ctrl-C that
    arrives wrapped (:func:`interrupted`) as :func:`exit_on_interrupt`."""
    if interrupted(e):
        exit_on_interrupt(invocation.command)
    if isinstance(e, InfeasibleError):
        err.print(f"error: {one_line(str(e))}", markup=False)
        sys.exit(3)
    if isinstance(e, MoeplanError) and isinstance(e, ValueError):
        err.print(f"error: {one_line(str(e))}", markup=False)
        sys.exit(2)
    if invocation.debug:
        import traceback

        traceback.print_exc()
    command = f"moeplan {invocation.command}" if invocation.command else "moeplan"
    what = one_line(f"{type(e).__name__}: {e}")[:300]
    err.print(f"error: internal error in `{command}`: {what} (a bug: please report it; `moeplan --debug ...` "
              f"prints the traceback)", markup=False)
    sys.exit(1)


_INVOCATION = "_moeplan_invocation"
"""The attribute of an exception that holds the :class:`Invocation` it left (typer marks exceptions the same way)."""


def invocation_of(e: BaseException) -> Invocation:
    """The :class:`Invocation` in which ``e`` left a command; the default (no ``--debug``, no command) for an
    exception raised outside any command."""
    return getattr(e, _INVOCATION, Invocation())


class GuardedGroup(TyperGroup):
    """The app's command group: an exception out of a command leaves with the :class:`Invocation` in ``ctx.obj``
    attached (:func:`invocation_of`) and is otherwise unchanged, so that typer still handles its own (usage errors,
    ``typer.Exit``) and :func:`moeplan.cli.main` reports the rest, traceback and all."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except KeyboardInterrupt:  # Ctrl-C while the arguments are parsed: typer's main would exit 130 in silence
            exit_on_interrupt()

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # a write outside the console: before click, which turns it into exit 1
            exit_on_broken_pipe()
        except KeyboardInterrupt:  # Ctrl-C before the command's own handling (moeplan run's, once ranks run)
            exit_on_interrupt(ctx.invoked_subcommand)
        except typer.Exit:  # the command's own exit code (moeplan run's 130 after its line on a Ctrl-C), as it is
            raise
        except Exception as e:
            if interrupted(e):
                exit_on_interrupt(ctx.invoked_subcommand)
            if isinstance(ctx.obj, Invocation) and not hasattr(e, _INVOCATION):
                setattr(e, _INVOCATION, ctx.obj)
            raise
