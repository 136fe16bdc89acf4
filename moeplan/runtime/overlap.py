"""Running an ``OVERLAP_F_B`` pair: the forward of one micro-batch and the backward of another on one compute
stream, each one's collectives in flight while the other computes (docs/runtime.md "fb overlap").

The pair's halves run on two host threads — the forward on the caller's, the backward on a worker thread — that
share ONE compute stream, a token only one of them holds at a time (:class:`ComputeStream`). A half gives the token
up for as long as one of its collectives is in flight and takes it back afterwards (a hook around every collective
of moeplan.runtime.parallel, which all in-layer collectives go through), so the other half computes meanwhile: compute stays serial, as on
one device stream, and communication overlaps it wherever the other half has work. This is the effect of
DeepSeek-V3's DualPipe overlapped chunk (arXiv 2412.19437 §3.2.1) and of Megatron-LM's
``--overlap-moe-expert-parallel-comm`` / MindSpeed ``--moe-fb-overlap``, which place the switch points by hand at
the dispatch and combine; here they fall where each half issues a collective.

The backward half runs its collectives on a second set of process groups with the same members
(moeplan.runtime.groups.StreamGroups, switched per thread by moeplan.runtime.parallel.use_stream_groups), so the two
halves' collectives never mix on one group whatever order the scheduling gives them on each rank.

Measurement (when ``totals`` is given): per comm class, ``busy`` seconds its collectives were in flight and
``seconds`` the compute stream idled waiting for them: the stream is idle from the moment its token is given up with
no half ready to compute, until a half takes it back; that wait is charged to the class of the collective whose
completion ended it. Idle time that ends with a half starting (thread start-up) is charged to no class.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from moeplan.runtime.groups import StreamGroups
from moeplan.runtime.metrics import CommTotals
from moeplan.runtime.parallel import use_comm_hook, use_stream_groups


class ComputeStream:
    """The one compute stream the two halves of a pair share (see the module docstring)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._owner: int | None = None
        self._waiting = 0
        self._idle_since: float | None = None
        self.totals: CommTotals | None = None

    def acquire(self, comm_class: str | None = None) -> None:
        """Take the stream, after a collective of ``comm_class`` completed (None: at the start of a half)."""
        with self._cv:
            if self._owner is None and self._idle_since is not None:
                if comm_class is not None and self.totals is not None:
                    self.totals.seconds[comm_class] += time.perf_counter() - self._idle_since
                self._idle_since = None
            self._waiting += 1
            while self._owner is not None:
                self._cv.wait()
            self._waiting -= 1
            self._owner = threading.get_ident()

    def release(self) -> None:
        """Give the stream up (a collective starts, or the half ended)."""
        with self._cv:
            self._owner = None
            if self._waiting == 0:
                self._idle_since = time.perf_counter()
            self._cv.notify()


class _Half:
    """The collective hook (moeplan.runtime.parallel.use_comm_hook) of one half of a pair: gives the compute stream
    up while the collective is in flight and records its in-flight time under its comm class (the group's members
    looked up in ``classes``; ``other`` when absent)."""

    def __init__(self, stream: ComputeStream, classes: Mapping[tuple[int, ...], str]) -> None:
        self.stream, self.classes = stream, classes

    def __call__(self, group: dist.ProcessGroup, run: Callable[[], object]) -> None:
        cls = self.classes.get(tuple(sorted(dist.get_process_group_ranks(group))), "other")
        self.stream.release()
        t0 = time.perf_counter()
        try:
            run()
        finally:
            busy = time.perf_counter() - t0
            self.stream.acquire(cls)
        if self.stream.totals is not None:
            self.stream.totals.busy[cls] += busy


def _init_worker(clones: Mapping[tuple[int, ...], dist.ProcessGroup], threads: int) -> None:
    """The worker thread's setup: the backward half's process groups, and the creator's intra-op thread count. A
    new thread otherwise gets the process default (one OpenMP thread per CPU the process could use when torch
    started): on a process bound to one core of two with ``torch.set_num_threads(1)`` but no
    ``OMP_NUM_THREADS=1``, a pair of 0.85 ms compute bursts with a 1 ms wait between them took ≈0.8 s per burst."""
    torch.set_num_threads(threads)
    use_stream_groups(clones)


class PairRunner:
    """Runs the two halves of ``OVERLAP_F_B`` pairs (see the module docstring); one per executor, its worker thread
    kept for the run. ``groups``: the backward half's process groups."""

    def __init__(self, groups: StreamGroups) -> None:
        self.groups = groups
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeplan-fb", initializer=_init_worker,
                                        initargs=(groups.clones, torch.get_num_threads()))

    def run(self, forward: Callable[[], None], backward: Callable[[], None], *,
            totals: CommTotals | None = None) -> None:
        """Run ``forward`` here and ``backward`` on the worker thread on one :class:`ComputeStream`; return when both
        are done (an exception from either is raised here). ``totals``: where the pair's comm figures go (None: not
        recorded)."""
        stream = ComputeStream()
        stream.totals = totals
        hook = _Half(stream, self.groups.classes)

        def half(fn: Callable[[], None]) -> None:
            stream.acquire()
            use_comm_hook(hook)
            try:
                fn()
            finally:
                use_comm_hook(None)
                stream.release()

        future = self._pool.submit(half, backward)
        try:
            half(forward)
        finally:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
