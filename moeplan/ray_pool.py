"""The layout search's tasks on a Ray cluster (``moeplan compile --exact --ray ADDRESS``, ``moeplan explore --ray
ADDRESS``; docs/search.md): :class:`RayPool` has the ``map`` / ``imap`` of the forked worker pool
(moeplan/search_eval.py ``_Pool``), so the search sends the same tasks in the same order and gets the same plan.

- What every task reads (the search's ``_SHARED``: the traced graph without its fx modules, the target, the memory
  budget, the slot counts and weights, the load model; ``snapshot()``) is put in the object store once per search,
  and each worker process fetches it once, at its first task of that search, and ``install``s it (:func:`_run`):
  tasks carry only layouts and strategies.
- ``imap`` keeps at most one task per worker CPU in flight and hands results back in order, as they are consumed,
  so memory stays bounded for any number of candidates.
- A task whose worker dies (a node lost, a process killed) is run again, up to ``MAX_RETRIES`` times (Ray's task
  retries); an exception a task raises is not retried: it is the search's answer.

``ADDRESS``: ``local`` starts a Ray instance on this machine (its CPUs, or ``workers`` of them) for the search and
stops it after; ``auto`` joins the cluster running here (``ray start --head``); anything else is a cluster address
(``head:6379``). Ray is an optional extra: ``pip install "moeplan[ray]"``.
"""
from __future__ import annotations

import logging
import socket
from collections import deque
from typing import Callable, Iterable, Iterator

from moeplan.errors import PlanError

MAX_RETRIES = 3
_LOADED: dict[str, str] = {}  # in a worker process: the object id of the shared data its _SHARED holds now


def _ray(address: str = ""):  # noqa: ANN202 (the module)
    """The ``ray`` module; raises PlanError (naming ``address``) when it is not installed."""
    try:
        import ray
    except ImportError:
        raise PlanError(f'ray={address!r}: needs Ray, which is not installed: pip install "moeplan[ray]", or run '
                        f'without --ray') from None
    return ray


def _run(install: Callable[[dict], None], fn: Callable, shared: list, tasks: list) -> list:
    """In a Ray worker: ``fn`` of each of ``tasks``, after ``install`` of the shared data from the object store
    (``shared[0]``, a reference inside a list so that Ray hands it over unresolved) unless this process holds it
    already."""
    ref = shared[0]
    if _LOADED.get("id") != ref.hex():
        install(_ray().get(ref))
        _LOADED["id"] = ref.hex()
    return [fn(t) for t in tasks]


def require(address: str | None) -> None:
    """Raise PlanError now, before any long work, when ``address`` is given and Ray is not installed, or when it is
    a ``host:port`` where nothing answers within 5 s (Ray itself waits minutes for a cluster that is not there)."""
    if address is None:
        return
    _ray(address)
    host, _, port = address.rpartition(":")
    if address not in ("local", "auto") and host and port.isdigit():
        try:
            with socket.create_connection((host, int(port)), timeout=5):
                pass
        except OSError as e:
            raise PlanError(f"ray={address!r}: no Ray cluster answers there ({e.strerror or type(e).__name__})"
                            ) from None


class RayPool:
    """``map`` / ``imap`` of search tasks on the Ray cluster at ``address`` (module docstring). Connects on entry
    unless Ray is connected already (then it leaves the connection as it found it); ``workers``: the CPUs of a
    ``local`` instance (default: this machine's), else the cluster's CPUs. ``snapshot()``: what every task reads,
    taken at the first task; ``install(data)``: puts it where the tasks read it, in a worker. Raises PlanError when
    Ray is not installed or the cluster cannot be reached."""

    def __init__(self, address: str, workers: int | None = None, *, snapshot: Callable[[], dict] = dict,
                 install: Callable[[dict], None] = lambda data: None) -> None:
        self.address, self.requested = address, workers
        self.snapshot, self.install = snapshot, install
        self.workers = 0
        self.started = False
        self.shared: list = []

    def __enter__(self) -> "RayPool":
        ray = _ray(self.address)
        if not ray.is_initialized():
            require(self.address)
            try:
                if self.address == "local":
                    ray.init(num_cpus=self.requested, include_dashboard=False, log_to_driver=False,
                             logging_level=logging.ERROR)
                else:
                    ray.init(address=self.address, log_to_driver=False, logging_level=logging.ERROR)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise PlanError(f"ray={self.address!r}: cannot connect to a Ray cluster there "
                                f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
            self.started = True
        self.workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.remote = ray.remote(max_retries=MAX_RETRIES)(_run)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.started:
            _ray().shutdown()

    def _shared(self) -> list:
        """``snapshot()`` in the object store, put at the first task (once the search has set everything)."""
        if not self.shared:
            self.shared = [_ray().put(self.snapshot())]
        return self.shared

    def map(self, fn: Callable, tasks: list, chunksize: int = 1) -> list:
        """``fn`` of every task, in order; ``chunksize`` tasks per Ray task."""
        shared = self._shared()
        refs = [self.remote.remote(self.install, fn, shared, tasks[i:i + chunksize])
                for i in range(0, len(tasks), chunksize)]
        return [x for part in _ray().get(refs) for x in part]

    def imap(self, fn: Callable, tasks: Iterable) -> Iterator:
        """``fn`` of each task, in order, with at most ``workers`` tasks sent and not yet consumed (``tasks`` is read
        lazily, so it may depend on the results so far)."""
        ray, shared = _ray(), self._shared()
        pending: deque = deque()
        for t in tasks:
            pending.append(self.remote.remote(self.install, fn, shared, [t]))
            if len(pending) >= self.workers:
                yield ray.get(pending.popleft())[0]
        while pending:
            yield ray.get(pending.popleft())[0]

    def unordered(self, fn: Callable, tasks: list) -> Iterator:
        """``fn`` of every task, each as soon as it finishes."""
        ray, shared = _ray(), self._shared()
        refs = [self.remote.remote(self.install, fn, shared, [t]) for t in tasks]
        while refs:
            done, refs = ray.wait(refs, num_returns=1)
            yield ray.get(done[0])[0]
