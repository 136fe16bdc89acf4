"""What a running layout search is doing, on stderr (``moeplan compile``): a rich progress bar on a terminal once
the search has run for a second, else one status line every ten seconds (a log or CI output keeps no bar).
"""
from __future__ import annotations

import threading
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from moeplan.search_eval import SearchProgress


def status_line(p: SearchProgress, elapsed_s: float) -> str:
    """One line of the search's state: its phase, the options, how many were simulated and pruned, the best step
    so far and the seconds since it started."""
    if p.phase == "estimate":
        return f"search: estimating {p.options:,} options in closed form · {elapsed_s:.0f} s"
    best = f" · best {p.best_s:.3f} s" if p.best_s < float("inf") else ""
    return (f"search: {p.options:,} options · {p.simulated} simulated of {p.to_simulate} chosen · {p.pruned:,} "
            f"pruned by a bound{best} · {elapsed_s:.0f} s")


class SearchStatus:
    """A ``progress`` callback for moeplan.search.search that shows the latest :class:`SearchProgress` on
    ``console``: after ``after_s`` seconds a transient rich progress bar if the console is a terminal, else one
    :func:`status_line` every ``every_s`` seconds. Use it as a context manager around the search; nothing is
    shown for a search that ends sooner."""

    def __init__(self, console: Console, *, after_s: float = 1.0, every_s: float = 10.0) -> None:
        self.console, self.after_s, self.every_s = console, after_s, every_s
        self.state: SearchProgress | None = None
        self.t0 = time.monotonic()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._thread = threading.Thread(target=self._show, daemon=True)

    def __call__(self, p: SearchProgress) -> None:
        with self._lock:
            self.state = p
            self._update()

    def __enter__(self) -> SearchStatus:
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        with self._lock:
            if self._bar is not None:
                self._bar.stop()

    def _show(self) -> None:
        if self.console.is_terminal:
            if self._done.wait(self.after_s):
                return
            with self._lock:
                self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=self.console, transient=True)
                self._task = self._bar.add_task("search", total=None)
                self._bar.start()
                self._update()
            return
        while not self._done.wait(self.every_s):
            with self._lock:
                if self.state is not None:
                    self.console.print(status_line(self.state, time.monotonic() - self.t0), markup=False)

    def _update(self) -> None:
        """Show the latest state on the bar, if it is up (the caller holds the lock)."""
        p = self.state
        if self._bar is None or self._task is None or p is None:
            return
        if p.phase == "estimate":
            self._bar.update(self._task, description=f"estimating {p.options:,} options", total=None)
            return
        best = f" · best {p.best_s:.3f} s" if p.best_s < float("inf") else ""
        self._bar.update(self._task, description=f"simulating · {p.pruned:,} pruned{best}",
                         total=p.to_simulate, completed=min(p.simulated + p.pruned, p.to_simulate))
