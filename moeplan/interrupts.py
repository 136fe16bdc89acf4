"""Ctrl-C as the command line ends on it, shared by the console script (:mod:`moeplan.entry`), the CLI's error
report (:mod:`moeplan.cli_errors`) and ``moeplan run``: standard library only, so that the console script can use it
before torch, typer and rich load."""
from __future__ import annotations

import _thread
import signal
import sys
import threading
import time

INTERRUPTED_EXIT = 130
"""Exit code of a command stopped by Ctrl-C: 128 + SIGINT, as a shell reports it."""


def interrupted(e: BaseException | None) -> bool:
    """Whether ``e`` is, or was raised by, a Ctrl-C: Python hands some on wrapped (a KeyboardInterrupt inside a class
    body's ``__set_name__``, while a module such as torch loads, arrives as the RuntimeError it caused). The chain
    followed is the one Python's traceback prints: ``__cause__``, else ``__context__`` unless ``raise ... from None``
    suppressed it. A handler that turned the Ctrl-C into its own error that way (``moeplan run``'s RunInterrupted)
    has dealt with it."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ if e.__cause__ is not None or e.__suppress_context__ else e.__context__
    return False


def _interrupt_main_soon() -> None:
    time.sleep(0.01)  # the hook that started this thread has returned by then
    _thread.interrupt_main(signal.SIGINT)


def repost_interrupt(unraisable) -> None:
    """``sys.unraisablehook``: a KeyboardInterrupt raised where Python cannot propagate it (a weakref callback, a
    ``__del__``, a garbage collection) is otherwise printed as "Exception ignored in ..." and lost. CI saw one land in
    importlib's module-lock callback while torch loaded, and ``moeplan run`` went on training as if no Ctrl-C had
    come. Here it is posted again to the main thread, from a helper thread 10 ms later
    (:func:`_thread.interrupt_main`, which runs the SIGINT handler in force at the main thread's next bytecode
    boundary): posted from inside the hook, the handler would run before the hook returned, and its exception would be
    swallowed again. So the Ctrl-C ends the command as any Ctrl-C does. Other exceptions go to Python's own hook."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)
        return
    while True:
        try:
            threading.Thread(target=_interrupt_main_soon, daemon=True).start()
            return
        except KeyboardInterrupt:  # the posted one (or a new Ctrl-C) came before this hook returned: post it again
            continue


def keep_swallowed_interrupts() -> None:
    """Install :func:`repost_interrupt` as ``sys.unraisablehook`` (idempotent)."""
    sys.unraisablehook = repost_interrupt
