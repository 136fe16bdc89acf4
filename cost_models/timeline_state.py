"""The timeline simulator's working state (cost_models/timeline.py, private to one simulation): each phase's
segments compiled for the loop (:class:`_Prog`), a compute part being scheduled (:class:`_Part`), the per-rank
clocks and accumulators (:class:`_State`) and what scheduling needs besides them (:class:`_Context`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from moeplan.cost_models.timeline_types import TIERS, Event, RunSettings, SegmentEvent, StageProgram
from moeplan.state import Segment

_Key = tuple[str, int, int]  # (kind, stage, micro-batch)


class _Prog:
    """One phase's segments compiled for the simulation loop: per segment, plain lists of what the loop reads
    (built once per segment list and settings)."""

    __slots__ = ("segs", "n", "secs", "is_comm", "after", "kernels", "defer", "blocking", "busy", "sync", "cls",
                 "kind", "wire", "to_comm")

    def __init__(self, segs: tuple[Segment, ...], mechanisms: frozenset[str]) -> None:
        self.segs, self.n = segs, len(segs)
        self.secs = [s.seconds for s in segs]
        self.is_comm = [s.kind == "comm" for s in segs]
        self.after = [s.after for s in segs]
        self.kernels = [s.kernels for s in segs]
        self.defer = [s.deferrable for s in segs]
        # a collective outside an OVERLAP_F_B pair blocks compute unless native or its mechanism is on
        self.blocking = [s.async_by != "native" and (s.async_by is None or s.async_by not in mechanisms)
                         for s in segs]
        self.busy = [tuple((t, s.comm.busy_s(t)) for t in TIERS if s.comm.busy_s(t) > 0) if s.comm else ()
                     for s in segs]
        self.sync = [s.host_sync for s in segs]
        self.cls = [s.comm.comm_class if s.comm else "" for s in segs]
        self.kind = [s.comm.kind if s.comm else "" for s in segs]
        self.wire = [(s.comm.wire_intra_bytes, s.comm.wire_inter_bytes) if s.comm else (0.0, 0.0) for s in segs]
        self.to_comm = [0.0] * len(segs)  # compute seconds from a segment to the part's next collective
        run = float("inf")
        for i in range(len(segs) - 1, -1, -1):
            run = 0.0 if self.is_comm[i] else run + self.secs[i]
            self.to_comm[i] = run


class _Part:
    """One compute part (F, B, I or W of a stage and micro-batch) being scheduled on a rank."""

    __slots__ = ("key", "text", "prog", "ready", "produced", "remote", "overlapped", "in_steady", "host", "ends",
                 "ptr", "pool", "start", "end", "queued")

    def __init__(self, key: _Key, text: str, prog: _Prog, ready: float, produced: float, remote: bool,
                 overlapped: bool, in_steady: bool, host: float) -> None:
        self.key, self.text, self.prog = key, text, prog
        self.ready, self.produced, self.remote = ready, produced, remote
        self.overlapped = overlapped  # part of an OVERLAP_F_B pair: its collectives never block compute
        self.in_steady, self.host = in_steady, host
        self.ends = [0.0] * prog.n
        self.ptr = 0
        self.pool: list[int] = []  # deferrable weight gradients waiting for a gap
        self.start, self.end = -1.0, 0.0
        self.queued: dict[int, tuple[float, str]] = {}  # collective -> (its start, the class it queued behind)

    @property
    def finished(self) -> bool:
        return self.ptr >= self.prog.n and not self.pool

    def dep(self, i: int) -> tuple[float, int]:
        """(when segment ``i``'s inputs are ready, the segment it waits on last, −1 for the part's input)."""
        dep, dep_seg, ends = self.ready, -1, self.ends
        for j in self.prog.after[i]:
            if ends[j] > dep:
                dep, dep_seg = ends[j], j
        return dep, dep_seg


@dataclass
class _State:
    """Per-rank clocks and accumulators of one simulation."""

    num_ranks: int
    compute_free: list[float] = field(default_factory=list)
    host: list[float] = field(default_factory=list)
    tier_free: list[dict[str, float]] = field(default_factory=list)
    prio_free: list[dict[str, float]] = field(default_factory=list)
    tier_cls: list[dict[str, str]] = field(default_factory=list)  # class of the transfer a tier is busy with last
    prio_cls: list[dict[str, str]] = field(default_factory=list)  # the same among priority transfers
    inflight: list[list[tuple[float, float, float]]] = field(default_factory=list)  # (begin, end, σ)
    busy: list[float] = field(default_factory=list)
    host_wait: list[float] = field(default_factory=list)
    stats: list[dict[str, list[float]]] = field(default_factory=list)  # class -> [total, exp, st_total, st_exp, in, out]
    tier_busy: list[dict[str, list[tuple[float, float]]]] = field(default_factory=list)
    live: list[list[tuple[float, float]]] = field(default_factory=list)  # (time, ±bytes)
    end: dict[_Key, float] = field(default_factory=dict)  # compute part -> end
    start: dict[_Key, float] = field(default_factory=dict)
    send_end: dict[_Key, float] = field(default_factory=dict)
    send_start: dict[_Key, float] = field(default_factory=dict)
    send_ready: dict[_Key, float] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    first_f: list[dict[int, float]] = field(default_factory=list)
    last_b: list[dict[int, float]] = field(default_factory=list)
    carry: list[list[_Part]] = field(default_factory=list)  # per rank: parts of earlier pairs still running
    detail: list[SegmentEvent] | None = None

    def __post_init__(self) -> None:
        n = self.num_ranks
        self.compute_free, self.host, self.busy, self.host_wait = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        self.tier_free = [{t: 0.0 for t in TIERS} for _ in range(n)]
        self.prio_free = [{t: 0.0 for t in TIERS} for _ in range(n)]
        self.tier_cls = [{t: "" for t in TIERS} for _ in range(n)]
        self.prio_cls = [{t: "" for t in TIERS} for _ in range(n)]
        self.inflight = [[] for _ in range(n)]
        self.stats = [{} for _ in range(n)]
        self.tier_busy = [{t: [] for t in TIERS} for _ in range(n)]
        self.live = [[] for _ in range(n)]
        self.first_f = [{} for _ in range(n)]
        self.last_b = [{} for _ in range(n)]
        self.carry = [[] for _ in range(n)]

    def stat(self, r: int, cls: str) -> list[float]:
        s = self.stats[r].get(cls)
        if s is None:
            s = self.stats[r][cls] = [0.0] * 6
        return s


@dataclass(frozen=True)
class _Context:
    """What one simulation's scheduling needs besides the clocks: the programs, the stage owners, each RECV's list
    index, each rank's SENDs by the part they carry (text, list index) and its steady window, and the settings."""

    stages: Sequence[StageProgram]
    owner: Mapping[int, int]
    recv_at: Mapping[_Key, int]
    sends: Sequence[Mapping[_Key, tuple[_Key, str, int]]]
    windows: Sequence[tuple[int, int]]
    cfg: RunSettings
    progs: dict[tuple[int, str], _Prog] = field(default_factory=dict)

    def steady(self, r: int, index: int) -> bool:
        """Whether action ``index`` of rank ``r`` lies in the rank's steady window."""
        return self.windows[r][0] <= index <= self.windows[r][1]

    def prog(self, stage: int, kind: str) -> _Prog:
        """Stage ``stage``'s ``kind`` pass compiled for the loop (once per simulation)."""
        p = self.progs.get((stage, kind))
        if p is None:
            p = self.progs[(stage, kind)] = _Prog(self.stages[stage].phase(kind), self.cfg.mechanisms)
        return p
