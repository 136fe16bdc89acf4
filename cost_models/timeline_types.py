"""The timeline's inputs and outputs (the simulator itself: cost_models/timeline.py).

Inputs: :class:`StageProgram`, one pipeline stage's segments per pass for one micro-batch, built from the layers'
segment lists with :func:`concat_segments` and :func:`compact`; :class:`RunSettings`, what runs beside compute
(the overlap mechanisms, the compute slow-down, host costs, the PP link); ``TIERS``, the link tiers.
Outputs: :class:`Timeline`, the simulated step, with an :class:`Event` per executed action, a
:class:`SegmentEvent` per segment (on request) and :class:`CommStats` per comm class (:func:`overlap_rate_of`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Sequence

from moeplan.errors import PlanError
from moeplan.state import Segment, Tier

TIERS: tuple[Tier, ...] = ("intra", "inter")


@dataclass(frozen=True)
class StageProgram:
    """One pipeline stage (a VPP chunk of a PP rank) for ONE micro-batch on one device: the ordered segments of its
    forward, input-gradient (dX), weight-gradient (dW, as a separate W action: no dependencies left) and full
    backward (B: dX and dW, each dW segment after the dX it needs) passes (``after`` indices within each list), and
    the activation bytes it keeps from F until its backward ends."""

    fwd: tuple[Segment, ...]
    bwd_input: tuple[Segment, ...]
    bwd_weight: tuple[Segment, ...]
    backward: tuple[Segment, ...]
    activation_bytes: float = 0.0

    @staticmethod
    def uniform(forward_s: float, backward_input_s: float, backward_weight_s: float = 0.0,
                activation_bytes: float = 0.0) -> "StageProgram":
        """A stage of one compute segment per pass (no collectives). Raises PlanError on a negative value."""
        for name, v in (("forward_s", forward_s), ("backward_input_s", backward_input_s),
                        ("backward_weight_s", backward_weight_s), ("activation_bytes", activation_bytes)):
            if v < 0:
                raise PlanError(f"{name}={v!r}: must be >= 0")

        def one(name: str, s: float, after: tuple[int, ...] = ()) -> tuple[Segment, ...]:
            return (Segment(name, "compute", s, after=after, kernels=1, deferrable=name == "weight_grad"),) \
                if s > 0 else ()

        fwd, dx = one("forward", forward_s), one("input_grad", backward_input_s)
        return StageProgram(fwd, dx, one("weight_grad", backward_weight_s),
                            dx + one("weight_grad", backward_weight_s, (0,) if dx else ()), activation_bytes)

    def phase(self, kind: str) -> tuple[Segment, ...]:
        """Segments of an action kind: F, I, W or B."""
        return {"F": self.fwd, "I": self.bwd_input, "W": self.bwd_weight, "B": self.backward}[kind]

    def seconds(self, kind: str) -> float:
        """Serial seconds of an action kind: every segment one after the other (compute and collectives)."""
        return sum(s.seconds for s in self.phase(kind))


def concat_segments(parts: Sequence[Sequence[Segment]]) -> tuple[Segment, ...]:
    """Concatenate segment lists (layers in execution order) into one, shifting ``after`` indices; a part's first
    segment also waits for what ends the previous part (its last segment that is not a deferrable weight gradient,
    and the collectives just before it): the next layer needs it."""
    out: list[Segment] = []
    for part in parts:
        base = len(out)
        tail: list[int] = []
        i = base - 1
        while i >= 0 and out[i].deferrable:
            i -= 1
        if i >= 0:
            tail.append(i)
            while out[i].kind == "comm" and i - 1 >= 0 and out[i - 1].kind == "comm":
                i -= 1
                tail.append(i)
        for j, s in enumerate(part):
            after = tuple(i + base for i in s.after) if base else s.after
            if j == 0 and tail:
                after = tuple(sorted(set(after) | set(tail)))
            out.append(s if after == s.after else s.with_after(after))
    return tuple(out)


def compact(segs: Sequence[Segment]) -> tuple[Segment, ...]:
    """Merge each compute segment into the compute segment right before it when it needs nothing that one does not
    (the stream runs them back to back either way), keeping deferrable weight gradients apart: fewer, equivalent
    segments for the simulation of long pipelines."""
    out: list[Segment] = []
    where: list[int] = []  # old index -> new index
    for s in segs:
        after = tuple(sorted({where[j] for j in s.after}))
        prev = out[-1] if out else None
        if (prev is not None and s.kind == "compute" and prev.kind == "compute" and not s.deferrable
                and not prev.deferrable and set(after) <= {len(out) - 1, *prev.after}):
            out[-1] = replace(prev, name=f"{prev.name}+{s.name}", seconds=prev.seconds + s.seconds,
                              kernels=prev.kernels + s.kernels)
        else:
            out.append(s.with_after(after))
        where.append(len(out) - 1)
    return tuple(out)


@dataclass(frozen=True)
class RunSettings:
    """What runs beside compute (docs/step-model.md §2): the overlap mechanisms that are on, the compute slow-down
    while a collective is in flight (a fraction; ``slowdown_by_kind``: per collective kind where it has its own),
    the host's cost per kernel launch and per sync (seconds), and the PP link: ``p2p_s`` seconds per transfer of
    ``p2p_bytes`` on ``p2p_tier``, and ``p2p_host_s`` seconds of the compute stream per SEND and per RECV (the
    target's ``launch.p2p_host_s``)."""

    p2p_s: float = 0.0
    p2p_tier: Tier = "inter"
    p2p_bytes: float = 0.0
    p2p_host_s: float = 0.0
    mechanisms: frozenset[str] = frozenset({"pp"})
    compute_slowdown: float = 0.0
    slowdown_by_kind: Mapping[str, float] = field(default_factory=dict)
    host_launch_s: float = 0.0
    host_sync_s: float = 0.0


class SegmentEvent(NamedTuple):
    """One simulated segment (with ``simulate(..., detail=True)``): its rank, the part it belongs to (``3F7``), its
    index in that part's segment list, ``compute`` or the tiers a collective held, and seconds from the step
    start."""

    rank: int
    part: str
    index: int
    name: str
    stream: str
    start_s: float
    end_s: float


class Event(NamedTuple):
    """One executed action: ``stream`` is ``compute`` (F, B, I, W, an OVERLAP_F_B pair), ``comm`` (a SEND) or
    ``recv`` (a RECV, spanning the peer's SEND: it occupies no stream of its own rank). Seconds from the step
    start."""

    rank: int
    action: str
    stream: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class CommStats:
    """One comm class on one rank (or averaged over ranks): seconds of its collectives, seconds the compute stream
    waited on them, over the step and in the steady state, and bytes sent per tier."""

    total_s: float = 0.0
    exposed_s: float = 0.0
    steady_total_s: float = 0.0
    steady_exposed_s: float = 0.0
    intra_bytes: float = 0.0
    inter_bytes: float = 0.0

    @property
    def overlap_rate(self) -> float | None:
        """``1 − exposed / total`` (docs/references.md §4.4; docs/step-model.md §2), None when the class moved nothing."""
        return overlap_rate_of(self.exposed_s, self.total_s)

    @property
    def steady_overlap_rate(self) -> float | None:
        return overlap_rate_of(self.steady_exposed_s, self.steady_total_s)


def overlap_rate_of(exposed: float, total: float) -> float | None:
    """``1 − exposed / total`` rounded to 12 digits (sums of many waits leave float noise), None when nothing moved."""
    return round(1 - exposed / total, 12) + 0.0 if total > 0 else None


class Records(NamedTuple):
    """What :attr:`Timeline.events` and :attr:`Timeline.segment_events` are built from when first read (most
    callers need neither): per event ``(rank, text id, stream)`` and ``(start, end)`` rows, stream 0 for compute and
    1 for a SEND, then each RECV as ``(rank, text id)`` with the SEND it spans; per segment event ``(rank, text id,
    program, index)`` and ``(start, end)``; the texts; each program's segments."""

    events: Any
    event_times: Any
    recvs: Any
    recv_times: Any
    segments: Any
    segment_times: Any
    texts: Sequence[str]
    programs: Sequence[Sequence[Segment]]


@dataclass(frozen=True)
class Timeline:
    """Result of :func:`simulate`; per-rank tuples are indexed by PP rank (see the module docstring).

    ``rank_end_s``: when each rank's last event ends; ``step_time_s`` is their max. ``exposed_comm_s``: per comm
    class, exposed seconds averaged over ranks (as ``bubble`` is), with the ``pp`` key always present.
    ``tier_busy``: per rank and tier, the (start, end) intervals its collectives hold the tier, in order, as a
    float array of shape (n, 2). ``events`` (an :class:`Event` per executed action) and ``segment_events`` (a
    :class:`SegmentEvent` per segment, with ``simulate(..., detail=True)``) are built from ``records`` when first
    read.
    """

    step_time_s: float
    rank_end_s: tuple[float, ...]
    busy_s: tuple[float, ...]
    bubble_per_rank: tuple[float, ...]
    bubble: float
    peak_activation_bytes: tuple[float, ...]
    comm: Mapping[str, CommStats]
    comm_per_rank: tuple[Mapping[str, CommStats], ...]
    host_wait_s: tuple[float, ...]
    tier_busy: tuple[Mapping[str, Any], ...]
    first_forward_s: tuple[Mapping[int, float], ...]  # per rank: stage -> start of its first forward
    last_backward_end_s: tuple[Mapping[int, float], ...]  # per rank: stage -> end of its last backward
    records: Records = field(repr=False, compare=False)

    @cached_property
    def events(self) -> tuple[Event, ...]:
        """Every executed action, in the order the simulation finished them, then the RECVs."""
        rec, streams = self.records, ("compute", "comm")
        out = [Event(r, rec.texts[t], streams[k], a, b)
               for (r, t, k), (a, b) in zip(rec.events.tolist(), rec.event_times.tolist())]
        out += [Event(r, rec.texts[t], "recv", a, b)
                for (r, t), (a, b) in zip(rec.recvs.tolist(), rec.recv_times.tolist())]
        return tuple(out)

    @cached_property
    def segment_events(self) -> tuple[SegmentEvent, ...]:
        """Every segment, in the order it was scheduled (empty unless ``simulate(..., detail=True)``)."""
        rec = self.records
        streams: dict[tuple[int, int], str] = {}
        out = []
        for (r, t, g, i), (a, b) in zip(rec.segments.tolist(), rec.segment_times.tolist()):
            s = rec.programs[g][i]
            stream = streams.get((g, i))
            if stream is None:
                stream = streams[(g, i)] = "compute" if s.kind == "compute" else "+".join(
                    tier for tier in TIERS if s.comm is not None and s.comm.busy_s(tier) > 0)
            out.append(SegmentEvent(r, rec.texts[t], i, s.name, stream, a, b))
        return tuple(out)

    @property
    def exposed_comm_s(self) -> Mapping[str, float]:
        out = {c: s.exposed_s for c, s in self.comm.items()}
        out.setdefault("pp", 0.0)
        return MappingProxyType(out)

    @property
    def exposed_comm_per_rank_s(self) -> tuple[Mapping[str, float], ...]:
        return tuple(MappingProxyType({"pp": 0.0, **{c: s.exposed_s for c, s in r.items()}})
                     for r in self.comm_per_rank)
