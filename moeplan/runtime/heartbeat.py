"""Heartbeats: a stopped (SIGSTOP) or silent rank is found by the launcher, not by the other ranks' timeout.

A rank whose process stops makes every other rank wait in its next collective until the collective timeout
(``--timeout``, 60 s by default), and then the launcher sees the waiting ranks fail first and blames one of them. So
each rank of a local run beats: a daemon thread rewrites ``rank-N`` in the run's heartbeat folder (its pid) every
:data:`INTERVAL_S`. A rank blocked in a collective still beats (the thread runs); a stopped process, or one whose
interpreter is stuck holding the GIL, does not. The launcher's :class:`Watchdog` checks the files every second: a
rank whose last beat is older than :func:`stale_after_s` is killed (SIGKILL reaches a stopped process), which ends the
run through torch elastic as any failed rank does, and the launcher reports that rank and why.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

ENV = "MOEPLAN_HEARTBEAT_DIR"
"""The environment variable that names the heartbeat folder of a local run (unset under torchrun: no beats)."""
INTERVAL_S = 1.0
"""Seconds between two beats of a rank."""
STALE_S = 20.0
"""A rank with no beat for this long is declared stopped, when the collective timeout is 40 s or longer."""


def stale_after_s(timeout_s: float) -> float:
    """Seconds without a beat after which a rank is declared stopped: :data:`STALE_S`, or half the collective
    timeout when that is shorter (the waiting ranks must not time out first)."""
    return max(4 * INTERVAL_S, min(STALE_S, timeout_s / 2))


def start_beating(rank: int) -> None:
    """In a rank: beat into the folder named by :data:`ENV` from a daemon thread; nothing when it is unset."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    path, pid = Path(folder) / f"rank-{rank}", str(os.getpid())

    def beat() -> None:
        while True:
            try:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(pid)
                os.replace(tmp, path)  # the watchdog never reads a half-written pid
            except OSError:  # the folder went away: the launcher has ended the run
                return
            time.sleep(INTERVAL_S)

    threading.Thread(target=beat, name="moeplan-heartbeat", daemon=True).start()


class Watchdog:
    """In the launcher: a thread that kills a rank whose beats stopped (module docstring); ``found`` then holds the
    line that names it, for the launcher's report."""

    def __init__(self, folder: str | Path, *, stale_after: float) -> None:
        self.folder, self.stale_after = Path(folder), stale_after
        self.found: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="moeplan-watchdog", daemon=True)

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            now = time.time()
            for path in self.folder.glob("rank-*"):
                if path.suffix:
                    continue
                try:
                    age, pid = now - path.stat().st_mtime, int(path.read_text())
                except (OSError, ValueError):
                    continue
                if age > self.stale_after:
                    self.found = (f"rank {path.name[5:]} stopped: no heartbeat for {age:.0f} s (stopped by a "
                                  f"signal, or hung holding the interpreter); it was killed and the other ranks "
                                  f"stopped")
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                    return
