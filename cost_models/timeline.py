"""Timeline: a discrete-event simulation of one PP group's training step (docs/architecture.md §5 "timeline"; docs/step-model.md §2).

Input: one action list per PP rank in ``torch.distributed.pipelining``'s notation: ``{stage}F{mb}``,
``{stage}B{mb}`` (full backward), ``{stage}I{mb}`` / ``{stage}W{mb}`` (input / weight gradient),
``({stage}F{mb};{stage}B{mb})OVERLAP_F_B`` (a forward and a backward of two micro-batches run as one interleaved
action, DualPipe's overlapped chunk pair), ``{stage}SEND_F{mb}`` / ``RECV_F`` / ``SEND_B`` / ``RECV_B``;
``REDUCE_GRAD``, ``UNSHARD`` and ``RESHARD`` are accepted as zero-time no-ops so torch's own lowered lists simulate
too. Each stage is a :class:`StageProgram`: per micro-batch, ordered segments for the forward, the input gradient
(dX) and the weight gradient (dW) — compute, and the collectives between them.

Model (one PP group; DP replicas and TP/EP peers are symmetric, so a collective waits only for its own rank):

- **Streams.** Each rank has a compute stream, which runs compute segments in list order, and one stream per link
  tier (``intra``, ``inter``): a collective holds the stream of every tier it crosses for its ``busy`` time on
  that tier (both at once for an all-to-all that spans nodes), in the order the rank issues them (collectives on one
  tier share its bandwidth). A collective starts when the compute it needs has finished and its tiers are free.
- **Blocking.** A collective the runtime issues on the compute stream blocks it: nothing else computes until it
  ends. A collective runs beside compute — only the segments that need its result wait — when its ``async_by``
  mechanism is on (``shared-expert``), when it is ``native`` (always asynchronous), or inside an ``OVERLAP_F_B``
  pair (each micro-batch's collectives hide under the other's compute; mechanism ``fb``). An ``OVERLAP_F_B`` action
  interleaves the compute segments of its two parts (F, B, F, B, …), each part keeping its own dependencies.
- **Contention.** While any collective of the rank is in flight, a compute segment runs ``compute_slowdown``
  slower for the overlapping time (the SMs or memory bandwidth the communication kernels take), or
  ``slowdown_by_kind[kind]`` where the target gives the collective's kind its own figure (the ``cpu`` emulator,
  whose gloo collectives of different kinds hide different shares of their cost beside compute:
  docs/step-model.md §2); with several collectives in flight the largest slow-down counts.
- **Host.** The host issues one launch per kernel (``kernels`` of a compute segment, one per collective), each
  taking ``host_launch_s``; a segment cannot start before its first kernel is issued nor end before its last. The
  host runs ahead of the device except after a ``host_sync`` segment (the dispatcher's count copy): then it
  waits for the device to reach that point, plus ``host_sync_s``. With ``host_launch_s = 0`` the host never limits.
- **Pipeline.** A SEND starts when its F/B (or I) has finished — every segment of it — and the tier the PP link
  uses is free; with mechanism ``pp`` it runs beside compute, otherwise the sender's compute stream waits for it.
  A RECV completes when the matching SEND does; a compute action waits for the RECV of its input, which must come
  earlier in its rank's list. Data dependencies: F(s, m) needs F(s−1, m); B/I(s, m) needs F(s, m) and B/I(s+1, m);
  W(s, m) needs I(s, m) — locally when the neighbour stage is on the same rank, else through the RECV.
  ``p2p_host_s`` (a runtime whose host thread is the compute stream, the cpu emulator's eager gloo): each SEND and
  each RECV of the rank's list also holds its compute stream that long, the SEND when its part finishes (before the
  transfer starts), the RECV where the list reaches it (before the wait for the data): posting the message and the
  transport's CPU time taken from the compute.
- **Memory.** A stage's ``activation_bytes`` are allocated when its F starts and freed when its B (W when split)
  ends.

Outputs (:class:`Timeline`): step time (max end over all events); per-rank busy compute time and bubble
``1 − (busy + exposed communication + host waits) / step``, the time the compute stream idles for the pipeline
alone (the bubble fraction of docs/references.md §4.3, docs/step-model.md §4); peak live activations per rank; per comm class
the total time of its collectives and the time the compute stream waited on them (exposed; the time a collective
queued on its link behind another is that other's class's), per rank and averaged,
over the step and in the steady state (a rank's overlapped F&B pairs, from its first to its last, when the schedule
pairs them; else the actions from its first backward to its last forward); bytes per
class and tier; per-rank busy intervals of each tier (the DP collectives of ``cost_models/step.py`` fill their
gaps); the time compute waited on the host. Exposure: a compute segment that starts late because of a collective
it needs charges the wait to that collective's class; a blocking collective charges the time it holds the compute
stream; a wait for an input from another rank charges ``pp`` the part after the producer on the peer finished (the
rest is pipeline bubble). In an overlapped pair, a wait on a collective while the pair's other part has not started
for want of its input is that input's wait (the pipeline's, not the collective's: the mechanism had nothing to hide
it under). With uniform single-segment stages 1F1B gives step ``(m + p − 1)(F + B)`` and bubble
``(p − 1)/(m + p − 1)`` — tests/test_timeline.py checks this and an independent DAG longest path.

Errors: PlanError (a ValueError) for malformed actions, a RECV with no SEND (or a SEND with no RECV), a compute
action whose input never arrives, and deadlocks (no action can progress), naming the rank and the action.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping, NamedTuple, Sequence

from moeplan.actions import COMPUTE_KINDS, OVERLAP, RECV_KINDS, SEND_KINDS, parse_action
from moeplan.errors import MoeplanError, PlanError
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
            out.append(s if after == s.after else replace(s, after=after))
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
            out.append(replace(s, after=after))
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


@dataclass(frozen=True)
class Timeline:
    """Result of :func:`simulate`; per-rank tuples are indexed by PP rank (see the module docstring).

    ``rank_end_s``: when each rank's last event ends; ``step_time_s`` is their max. ``exposed_comm_s``: per comm
    class, exposed seconds averaged over ranks (as ``bubble`` is), with the ``pp`` key always present.
    ``tier_busy``: per rank and tier, the (start, end) intervals its collectives hold the tier, in order.
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
    tier_busy: tuple[Mapping[str, tuple[tuple[float, float], ...]], ...]
    first_forward_s: tuple[Mapping[int, float], ...]  # per rank: stage -> start of its first forward
    last_backward_end_s: tuple[Mapping[int, float], ...]  # per rank: stage -> end of its last backward
    events: tuple[Event, ...]
    segment_events: tuple[SegmentEvent, ...] = ()

    @property
    def exposed_comm_s(self) -> Mapping[str, float]:
        out = {c: s.exposed_s for c, s in self.comm.items()}
        out.setdefault("pp", 0.0)
        return MappingProxyType(out)

    @property
    def exposed_comm_per_rank_s(self) -> tuple[Mapping[str, float], ...]:
        return tuple(MappingProxyType({"pp": 0.0, **{c: s.exposed_s for c, s in r.items()}})
                     for r in self.comm_per_rank)


# ---- parsing and validation -------------------------------------------------------------------------------------------
_Key = tuple[str, int, int]  # (kind, stage, micro-batch)


@dataclass
class _Rank:
    """One rank's parsed list: per action, its text, kind tag and keys (private to one simulate call)."""

    texts: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # "compute", "send", "recv", "noop"
    keys: list[tuple[_Key, ...]] = field(default_factory=list)


def _parse_all(actions: Sequence[Sequence[str]], num_stages: int) -> tuple[list[_Rank], dict[int, int]]:
    """Parse every list; map each stage to the one rank that computes it (PlanError on a stage on two ranks, out of
    range, or an action appearing twice)."""
    ranks, owner, seen = [], {}, set()
    for r, texts in enumerate(actions):
        rk = _Rank()
        for text in texts:
            a = parse_action(text)
            keys = tuple((p.kind, p.stage, p.microbatch) for p in (a.parts or (a,)))
            kind = ("compute" if a.kind in COMPUTE_KINDS or a.kind == OVERLAP else "send" if a.kind in SEND_KINDS
                    else "recv" if a.kind in RECV_KINDS else "noop")
            for k in keys if kind != "noop" else ():
                if k[1] >= num_stages:
                    raise PlanError(f"rank {r} action {text.strip()}: stage {k[1]} out of range (the stages have "
                                    f"{num_stages})")
                if k in seen:
                    raise PlanError(f"rank {r} action {text.strip()!r}: appears twice")
                seen.add(k)
                if kind == "compute" and owner.setdefault(k[1], r) != r:
                    raise PlanError(f"rank {r} action {text.strip()}: stage {k[1]} already runs on rank {owner[k[1]]}")
            rk.texts.append(text.strip())
            rk.kinds.append(kind)
            rk.keys.append(keys)
        ranks.append(rk)
    for r, rk in enumerate(ranks):
        for text, kind, keys in zip(rk.texts, rk.kinds, rk.keys):
            if kind in ("send", "recv") and owner.get(keys[0][1]) != r:
                raise PlanError(f"rank {r} action {text!r}: stage {keys[0][1]} computes on rank "
                                f"{owner.get(keys[0][1])}")
    return ranks, owner


def _check_pairs(ranks: Sequence[_Rank], owner: Mapping[int, int]) -> dict[_Key, int]:
    """Every RECV has its SEND on the neighbour stage and every SEND its RECV; return each RECV's list index."""
    recv_at: dict[_Key, int] = {}
    sends: dict[_Key, int] = {}
    for r, rk in enumerate(ranks):
        for i, (kind, keys) in enumerate(zip(rk.kinds, rk.keys)):
            if kind == "recv":
                recv_at[keys[0]] = i
            elif kind == "send":
                sends[keys[0]] = r
    for kind, stage, mb in recv_at:
        peer = stage - 1 if kind == "RECV_F" else stage + 1
        if ("SEND" + kind[4:], peer, mb) not in sends:
            raise PlanError(f"rank {owner[stage]} action {stage}{kind}{mb}: no rank runs its SEND "
                            f"{peer}SEND{kind[4:]}{mb}")
    for (kind, stage, mb), r in sends.items():
        peer = stage + 1 if kind == "SEND_F" else stage - 1
        if ("RECV" + kind[4:], peer, mb) not in recv_at:
            raise PlanError(f"rank {r} action '{stage}{kind}{mb}': no rank runs its RECV {peer}RECV{kind[4:]}{mb}")
    return recv_at


# ---- the simulation ---------------------------------------------------------------------------------------------------
_LOCAL = {"B": ("F",), "I": ("F",), "W": ("I",)}
_INPUT = {"F": (-1, ("F",), "RECV_F", "SEND_F"), "B": (1, ("B", "I"), "RECV_B", "SEND_B"),
          "I": (1, ("B", "I"), "RECV_B", "SEND_B")}
_EPS = 1e-12


class StepExceeded(MoeplanError):
    """:func:`simulate` stopped early: a rank's compute already ends at ``at_s`` seconds, past ``stop_above_s``, so
    the step (at least as long) cannot come in under it. Raised on purpose for a caller that asked for it, not a
    fault."""

    def __init__(self, at_s: float) -> None:
        super().__init__(f"a rank's compute runs past {at_s:.6g} s")
        self.at_s = at_s


class _Blocked(Exception):
    """A compute action whose remote input has not been simulated yet (the sweep tries again later)."""


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


def _input_ready(st: _State, r: int, key: _Key, ctx: _Context, index: int, label: str) -> tuple[float, float, bool]:
    """(time the input of compute part ``key`` is ready, when its producer finished, whether it came from another
    rank); raises _Blocked when a remote producer has not been simulated, PlanError for a missing local one."""
    kind, stage, mb = key
    ready, produced, remote = 0.0, 0.0, False
    for dep in _LOCAL.get(kind, ()):
        k = (dep, stage, mb)
        if k not in st.end:
            raise PlanError(f"schedule deadlock: rank {r} action {label!r} waits on '{stage}{dep}{mb}' (rank {r}), "
                            f"which can never run")
        ready = max(ready, st.end[k])
    step, kinds, recv_kind, send_kind = _INPUT.get(kind, (0, (), "", ""))
    peer = stage + step
    if step and 0 <= peer < len(ctx.stages):
        if ctx.owner.get(peer) == r:
            k = next(((x, peer, mb) for x in kinds if (x, peer, mb) in st.end), None)
            if k is None:
                raise PlanError(f"schedule deadlock: rank {r} action {label!r} waits on '{peer}{kinds[0]}{mb}' "
                                f"(rank {r}), which can never run")
            ready = max(ready, st.end[k])
        else:
            at = ctx.recv_at.get((recv_kind, stage, mb))
            if at is None or at > index:
                raise PlanError(f"rank {r} action {label!r}: needs {stage}{recv_kind}{mb} earlier in its rank's list")
            sk = (send_kind, peer, mb)
            if sk not in st.send_end:
                raise _Blocked(sk)
            ready, produced, remote = max(ready, st.send_end[sk]), st.send_ready[sk], True
    return ready, produced, remote


def _local_deps(key: _Key, ctx: _Context, r: int) -> list[_Key]:
    """The same-rank parts ``key`` needs (its own stage's earlier part, a local neighbour stage's)."""
    kind, stage, mb = key
    out = [(d, stage, mb) for d in _LOCAL.get(kind, ())]
    step, kinds, _, _ = _INPUT.get(kind, (0, (), "", ""))
    if step and ctx.owner.get(stage + step) == r:
        out += [(x, stage + step, mb) for x in kinds]
    return out


def _slowdown_s(start: float, end: float, intervals: list[tuple[float, float, float]]) -> float:
    """Extra seconds of a compute segment over [start, end]: ∫ σ(t) dt, σ(t) the largest slow-down of the
    collectives ``(begin, end, σ)`` in flight at t (``intervals`` pruned of those that ended before start)."""
    intervals[:] = [iv for iv in intervals if iv[1] > start]
    if len(intervals) == 1:  # the common case: one collective in flight
        a, b, slow = intervals[0]
        return slow * max(0.0, min(b, end) - max(a, start))
    cuts = sorted({start, end, *(t for a, b, _ in intervals for t in (a, b) if start < t < end)})
    extra = 0.0
    for lo, hi in zip(cuts, cuts[1:]):
        extra += (hi - lo) * max((slow for a, b, slow in intervals if a <= lo and b >= hi), default=0.0)
    return extra


def _schedule(st: _State, r: int, parts: list[_Part], ctx: _Context, *, carry: bool) -> list[_Part]:
    """List-schedule ``parts`` on rank ``r``'s streams (module docstring); return the parts left unfinished.

    A part's collectives are issued as soon as the compute before them is (blocking the compute stream unless the
    part is overlapped or the collective asynchronous). Of the parts' next compute segments (in list order within
    a part; a lone part simply runs in order) the one that can start first runs, and among those that can start
    now the one closest to its part's next collective (so the links stay fed); when every part would wait, a
    deferrable weight gradient that is ready runs instead (DualPipe orders its pairs by hand to the same end).
    With ``carry``, scheduling stops as soon as every remaining segment would wait for a collective: what is left
    continues with the next overlapped pair (DualPipe's chunk boundaries are not aligned). Each part has its own
    host cursor: the host issues one while another waits at a host sync."""
    cfg, h = ctx.cfg, ctx.cfg.host_launch_s
    if len(parts) == 1 and not parts[0].overlapped:
        _run_in_order(st, r, parts[0], ctx)
        return []
    free = st.compute_free[r]
    inflight, detail = st.inflight[r], st.detail is not None
    # (ready, part, segment): deferrable weight gradients by when ready, with those an earlier call left pooled
    pool = [(p.dep(i)[0], q, i) for q, p in enumerate(parts) for i in p.pool]
    heapq.heapify(pool)
    # per part: (when its next compute segment's inputs are ready, the segment they come from), None when done
    heads: list[tuple[float, int] | None] = [None] * len(parts)
    moved: Sequence[int] = range(len(parts))  # parts whose pointer moved since their head was computed
    inf = float("inf")
    while True:
        for q in moved:
            p = parts[q]
            prog = p.prog
            n, is_comm, defer = prog.n, prog.is_comm, prog.defer
            while p.ptr < n and (is_comm[p.ptr] or p.overlapped and defer[p.ptr]):
                i = p.ptr
                p.ptr += 1
                if not is_comm[i]:
                    heapq.heappush(pool, (p.dep(i)[0], q, i))
                    p.pool.append(i)
                    continue
                p.host += h
                end, free = _issue_comm(st, r, p, i, p.dep(i)[0], p.host, free, ctx)
                if prog.sync[i]:
                    p.host = max(p.host, end) + cfg.host_sync_s
                _mark(st, r, p, i, end - prog.secs[i], end)
            heads[q] = p.dep(p.ptr) if p.ptr < n else None
            if p.ptr >= n and not p.pool and p.key not in st.end:
                free = _finish(st, r, p, ctx, free)
        floor = free + _EPS
        best, best_t, best_key, best_tie = -1, inf, inf, inf
        for q, p in enumerate(parts):
            head = heads[q]
            if head is None:
                continue
            prog, i = p.prog, p.ptr
            t = p.host + h if prog.kernels[i] else p.host
            if t < free:
                t = free
            if t < head[0]:
                t = head[0]
            key_t, tie = (t if t > floor else floor), prog.to_comm[i]
            if best < 0 or key_t < best_key or (key_t == best_key and tie < best_tie):
                best, best_t, best_key, best_tie = q, t, key_t, tie
        pool_t = inf
        if pool:
            pool_t = max(free, pool[0][0], parts[pool[0][1]].host + h)
        if best < 0 and not pool:
            break
        if carry and min(best_t, pool_t) > floor:
            break
        if pool and pool_t < best_t - _EPS:
            _, q, i = heapq.heappop(pool)
            p = parts[q]
            p.pool.remove(i)
            dep, dep_seg = p.dep(i)
        else:
            q = best
            p = parts[q]
            i = p.ptr
            p.ptr += 1
            dep, dep_seg = heads[q]  # type: ignore[misc]
        moved = (q,)
        prog = p.prog
        issue = p.host + h if prog.kernels[i] else p.host
        start = dep if dep > free else free
        if dep > free:  # waiting for an input; a host later still is charged for the rest
            _charge_wait(st, r, p, dep_seg, free, dep, parts)
        if issue > start:
            st.host_wait[r] += issue - start
            start = issue
        dur = prog.secs[i]
        if inflight:
            dur += _slowdown_s(start, start + dur, inflight)
        p.host += prog.kernels[i] * h
        end = start + dur
        if end < p.host:
            end = p.host
        st.busy[r] += end - start
        free = end
        p.ends[i] = end
        if p.start < 0:
            p.start = start
        if end > p.end:
            p.end = end
        if detail:
            _detail(st, r, p, i, start, end)
    st.compute_free[r] = free
    st.host[r] = max([st.host[r]] + [p.host for p in parts])
    left = [p for p in parts if p.key not in st.end]
    if left and not carry:
        raise PlanError(f"timeline: rank {r} could not finish {', '.join(p.text for p in left)} (a simulator bug)")
    return left


def _run_in_order(st: _State, r: int, p: _Part, ctx: _Context) -> None:
    """:func:`_schedule` for one part that overlaps nothing: its segments in list order (the hot path)."""
    cfg, h = ctx.cfg, ctx.cfg.host_launch_s
    prog = p.prog
    secs, is_comm, after, kernels, sync = prog.secs, prog.is_comm, prog.after, prog.kernels, prog.sync
    free, host, ends, ready = st.compute_free[r], p.host, p.ends, p.ready
    inflight, detail = st.inflight[r], st.detail is not None
    busy = host_wait = 0.0
    first = -1.0
    for i in range(prog.n):
        dep, dep_seg = ready, -1
        for j in after[i]:
            if ends[j] > dep:
                dep, dep_seg = ends[j], j
        if is_comm[i]:
            host += h
            end, free = _issue_comm(st, r, p, i, dep, host, free, ctx)
            if sync[i]:
                host = max(host, end) + cfg.host_sync_s
            ends[i] = end
            if first < 0:
                first = end - secs[i]
            if detail:
                _detail(st, r, p, i, end - secs[i], end)
            continue
        issue = host + h if kernels[i] else host
        start = free if free >= dep else dep
        if dep > free:
            _charge_wait(st, r, p, dep_seg, free, dep)
        if issue > start:
            host_wait += issue - start
            start = issue
        dur = secs[i]
        if inflight:
            dur += _slowdown_s(start, start + dur, inflight)
        host += kernels[i] * h
        end = start + dur if start + dur > host else host
        busy += end - start
        free = end
        ends[i] = end
        if first < 0:
            first = start
        if detail:
            _detail(st, r, p, i, start, end)
    if prog.n:
        if p.start < 0:
            p.start = first
        p.end = max(p.end, max(ends))
    st.busy[r] += busy
    st.host_wait[r] += host_wait
    p.host, st.compute_free[r] = host, free
    st.host[r] = max(st.host[r], host)
    st.compute_free[r] = _finish(st, r, p, ctx, free)


def _mark(st: _State, r: int, p: _Part, i: int, start: float, end: float) -> None:
    p.ends[i] = end
    if p.start < 0:
        p.start = start
    if end > p.end:
        p.end = end
    if st.detail is not None:
        _detail(st, r, p, i, start, end)


def _detail(st: _State, r: int, p: _Part, i: int, start: float, end: float) -> None:
    assert st.detail is not None
    s = p.prog.segs[i]
    stream = "compute" if s.kind == "compute" else "+".join(t for t, _ in p.prog.busy[i])
    st.detail.append(SegmentEvent(r, p.text, i, s.name, stream, start, end))


def _finish(st: _State, r: int, p: _Part, ctx: _Context, free: float) -> float:
    """Record a finished part (its end, memory, event) and issue the SEND that carries its output; returns the
    compute stream's free time (a SEND without mechanism ``pp`` blocks it)."""
    kind, stage, mb = p.key
    start = p.start if p.start >= 0 else p.ready
    st.end[p.key], st.start[p.key] = max(p.end, p.ready), start
    act = ctx.stages[stage].activation_bytes
    if kind == "F":
        st.first_f[r].setdefault(stage, start)
        st.live[r].append((start, act))
    elif kind in ("B", "W"):
        st.last_b[r][stage] = st.end[p.key]
        st.live[r].append((st.end[p.key], -act))
    st.events.append(Event(r, p.text, "compute", start, st.end[p.key]))
    send = ctx.sends[r].get(p.key)
    if send is not None:
        free = _send(st, r, send, st.end[p.key], free, ctx)
    return free


def _send(st: _State, r: int, send: tuple[_Key, str, int], ready: float, free: float, ctx: _Context) -> float:
    """Issue a SEND of ``ready``-produced activations or gradients on the PP link (a priority transfer)."""
    key, text, index = send
    cfg = ctx.cfg
    if cfg.p2p_host_s:
        ready = free = _post(st, ctx, r, index, max(free, ready))
    start, _ = _claim_tiers(st, r, [(cfg.p2p_tier, cfg.p2p_s)] if cfg.p2p_s > 0 else [], ready, "pp",
                            priority=True)
    end = start + cfg.p2p_s
    stat = st.stat(r, "pp")
    stat[0] += cfg.p2p_s
    stat[4 if cfg.p2p_tier == "intra" else 5] += cfg.p2p_bytes
    steady = ctx.steady(r, index)
    if steady:
        stat[2] += cfg.p2p_s
    if "pp" not in cfg.mechanisms and end > free:
        wait = end - max(free, ready)
        stat[1] += max(0.0, wait)
        if steady:
            stat[3] += max(0.0, wait)
        free = end
    st.send_end[key], st.send_ready[key], st.send_start[key] = end, ready, start
    st.events.append(Event(r, text, "comm", start, end))
    return free


def _post(st: _State, ctx: _Context, r: int, index: int, at: float) -> float:
    """Hold rank ``r``'s compute stream from ``at`` for the p2p post of its action ``index`` (``p2p_host_s``,
    exposed ``pp`` time); its end."""
    seconds, stat = ctx.cfg.p2p_host_s, st.stat(r, "pp")
    stat[1] += seconds
    if ctx.steady(r, index):
        stat[3] += seconds
    return at + seconds


def _claim_tiers(st: _State, r: int, busy: Sequence[tuple[str, float]], ready: float, cls: str, *,
                 priority: bool) -> tuple[float, str]:
    """(start time, the class it queued behind or "") of a transfer of class ``cls`` that holds each (tier,
    seconds) of ``busy`` from ``ready``. A bulk transfer queues behind the tier's earlier ones; a priority one (a PP
    transfer, the EP count exchange: short and waited on) only behind other priority ones, and pushes the bulk queue
    back by its own time (the link's bytes are conserved, as concurrent NCCL/HCCL streams share it)."""
    start, behind = ready, ""
    tier_free, tier_cls, tier_busy = st.tier_free[r], st.tier_cls[r], st.tier_busy[r]
    frees, classes = (st.prio_free[r], st.prio_cls[r]) if priority else (tier_free, tier_cls)
    for t, _ in busy:
        free = frees[t]
        if free > start:
            start, behind = free, classes[t]
    for t, b in busy:
        if priority:
            frees[t] = start + b
            classes[t] = cls
            free = tier_free[t]
            tier_free[t] = (free if free > start else start) + b
        else:
            tier_free[t] = start + b
        tier_cls[t] = cls
        tier_busy[t].append((start, start + b))
    return start, behind


def _issue_comm(st: _State, r: int, p: _Part, i: int, dep: float, host: float, free: float,
                ctx: _Context) -> tuple[float, float]:
    """Put collective ``i`` of part ``p`` on its tiers' streams once its input is there (``dep``) and the host has
    issued it (``host``); returns (its end, the compute stream's free time, which a blocking collective pushes to
    its end)."""
    prog = p.prog
    blocking = not p.overlapped and prog.blocking[i]
    ready = dep if dep > host else host
    if blocking:  # on the compute stream: it starts after the kernel issued before it
        if host > max(dep, free):  # the stream idles until the host issues it
            st.host_wait[r] += host - max(dep, free)
            free = host
        if free > ready:
            ready = free
    cls = prog.cls[i]
    start, behind = _claim_tiers(st, r, prog.busy[i], ready, cls, priority=prog.sync[i])
    if behind:
        p.queued[i] = (start, behind)
    secs = prog.secs[i]
    end = start + secs
    stat = st.stat(r, cls)
    intra, inter = prog.wire[i]
    stat[0] += secs
    stat[4] += intra
    stat[5] += inter
    if p.in_steady:
        stat[2] += secs
    slow = ctx.cfg.slowdown_by_kind.get(prog.kind[i], ctx.cfg.compute_slowdown)
    if slow:
        st.inflight[r].append((start, end, slow))
    if blocking and end > free:
        _charge_comm_wait(st, r, p, i, free, end)
        free = end
    return end, free


def _charge_comm_wait(st: _State, r: int, p: _Part, i: int, free: float, until: float) -> None:
    """Charge the compute stream's wait [``free``, ``until``] on collective ``i`` of ``p``: to the class it queued
    behind on its link until it started, then to its own class."""
    start, behind = p.queued.get(i, (free, ""))
    if behind and start > free:
        stat = st.stat(r, behind)
        wait = min(start, until) - free
        stat[1] += wait
        if p.in_steady:
            stat[3] += wait
        free = min(start, until)
    if until > free:
        stat = st.stat(r, p.prog.cls[i])
        stat[1] += until - free
        if p.in_steady:
            stat[3] += until - free


def _charge_wait(st: _State, r: int, p: _Part, dep_seg: int, free: float, dep: float,
                 others: Sequence[_Part] = ()) -> None:
    """Charge a compute segment's wait ``dep − free`` to the class it waited on (module docstring). In an
    overlapped pair (``others``: the parts scheduled together), while another part has not started because its
    input from another rank is late, the idle is the pipeline's, not the collective's: that part was to run beside
    it. That stretch is charged as that part's input wait."""
    if dep_seg >= 0:
        if not p.prog.is_comm[dep_seg]:
            return
        late = [o for o in others if o is not p and o.start < 0 and o.ready > free]
        if late:
            o = max(late, key=lambda o: o.ready)
            until = min(dep, o.ready)
            _charge_wait(st, r, o, -1, free, until)
            free = until
        if dep > free:
            _charge_comm_wait(st, r, p, dep_seg, free, dep)
        return
    if p.remote:
        wait = dep - max(free, p.produced)
        if wait > 0:
            stat = st.stat(r, "pp")
            stat[1] += wait
            if p.in_steady:
                stat[3] += wait


def action_time_s(parts: Sequence[Sequence[Segment]], settings: RunSettings = RunSettings()) -> float:
    """Seconds one compute action takes on an idle rank whose inputs are ready: one segment list, or the two parts
    of an OVERLAP_F_B pair (the layout search's closed-form estimate prices layers with it)."""
    st = _State(1)
    ctx = _Context(stages=[StageProgram(tuple(p), (), (), tuple(p)) for p in parts], owner={}, recv_at={},
                   sends=[{}], windows=[(0, -1)], cfg=settings)
    todo = [_Part(("F", i, 0), "", ctx.prog(i, "F"), 0.0, 0.0, False, len(parts) > 1, False, 0.0)
            for i in range(len(parts))]
    _schedule(st, 0, todo, ctx, carry=False)
    return max((st.end[p.key] for p in todo), default=0.0)


def _steady_window(rk: _Rank) -> tuple[int, int]:
    """List indices [first, last] of a rank's steady state (empty when first > last): its OVERLAP_F_B pairs when it
    has any (DualPipe's and the fb schedules' overlapped F&B phase), else from its first backward to its last
    forward (1F1B's one-forward-one-backward phase)."""
    pairs = [i for i, (kind, keys) in enumerate(zip(rk.kinds, rk.keys)) if kind == "compute" and len(keys) > 1]
    if pairs:
        return pairs[0], pairs[-1]
    first, last = len(rk.kinds), -1
    for i, (kind, keys) in enumerate(zip(rk.kinds, rk.keys)):
        if kind != "compute":
            continue
        kinds = {k[0] for k in keys}
        if first == len(rk.kinds) and kinds & {"B", "I", "W"}:
            first = i
        if "F" in kinds:
            last = i
    return first, last


def _next_overlapped(rk: _Rank, i: int) -> bool:
    """Whether the next compute action after list index ``i`` is an OVERLAP_F_B pair."""
    for kind, keys in zip(rk.kinds[i + 1:], rk.keys[i + 1:]):
        if kind == "compute":
            return len(keys) > 1
    return False


def _step_rank(st: _State, r: int, rk: _Rank, i: int, ctx: _Context) -> None:
    """Simulate action ``i`` of rank ``r`` (raises _Blocked when it must wait for another rank). SENDs are issued
    when their part finishes; RECVs only mark where an input is awaited."""
    if rk.kinds[i] == "recv" and ctx.cfg.p2p_host_s:
        st.compute_free[r] = _post(st, ctx, r, i, st.compute_free[r])
    if rk.kinds[i] != "compute":
        return
    keys, text = rk.keys[i], rk.texts[i]
    carried = st.carry[r]
    if carried:
        running = {p.key for p in carried}
        if any(d in running for k in keys for d in _local_deps(k, ctx, r)):
            st.carry[r] = carried = _schedule(st, r, carried, ctx, carry=False)
    inputs = [_input_ready(st, r, k, ctx, i, text) for k in keys]
    pair = len(keys) > 1
    steady = ctx.steady(r, i)
    labels = text[1:text.index(")")].split(";") if pair else [text]
    new = [_Part(k, label, ctx.prog(k[1], k[0]), ready, produced, remote, pair, steady, st.host[r])
           for k, label, (ready, produced, remote) in zip(keys, labels, inputs)]
    st.carry[r] = _schedule(st, r, carried + new, ctx, carry=pair and _next_overlapped(rk, i))


def _peak(live: list[tuple[float, float]]) -> float:
    """Max live activation bytes; frees first at equal times."""
    cur = peak = 0.0
    for _, b in sorted(live):
        cur += b
        peak = max(peak, cur)
    return peak


def simulate(actions: Sequence[Sequence[str]], *, stages: Sequence[StageProgram],
             settings: RunSettings = RunSettings(), detail: bool = False,
             stop_above_s: float = float("inf")) -> Timeline:
    """Simulate one training step of a pipeline schedule (see the module docstring for the model).

    ``actions[r]``: PP rank r's actions in order (e.g. ``Schedule.actions``); ``stages[s]``: stage ``s``'s program
    for one micro-batch; ``settings``: the PP link and what runs beside compute; ``detail``: also record every
    segment (``Timeline.segment_events``); ``stop_above_s``: raise :class:`StepExceeded` as soon as a rank's compute
    runs past it (a search that only needs to know whether the step beats a time). Raises PlanError on a malformed
    or deadlocking schedule (never hangs: each sweep must progress).
    """
    if settings.p2p_s < 0:
        raise PlanError(f"p2p_s={settings.p2p_s!r}: must be >= 0")
    ranks, owner = _parse_all(actions, len(stages))
    recv_at = _check_pairs(ranks, owner)
    ctx = _Context(stages=stages, owner=owner, recv_at=recv_at, sends=[_sends_of(r, rk) for r, rk in enumerate(ranks)],
                   windows=[_steady_window(rk) for rk in ranks], cfg=settings)
    st = _State(len(ranks))
    st.detail = [] if detail else None
    ptr = [0] * len(ranks)
    blocked_on: dict[int, _Key] = {}
    while any(ptr[r] < len(rk.kinds) for r, rk in enumerate(ranks)):
        progressed = 0
        for r, rk in enumerate(ranks):
            while ptr[r] < len(rk.kinds):
                try:
                    _step_rank(st, r, rk, ptr[r], ctx)
                except _Blocked as b:
                    blocked_on[r] = b.args[0]
                    if st.carry[r]:  # finish what earlier pairs left rather than hold their SENDs back
                        st.carry[r] = _schedule(st, r, st.carry[r], ctx, carry=False)
                        progressed += 1
                    break
                ptr[r] += 1
                progressed += 1
        if not progressed:
            raise _deadlock(ranks, ptr, blocked_on, owner)
        clock = max(st.compute_free)
        if clock > stop_above_s:
            raise StepExceeded(clock)
    for r in range(len(ranks)):
        st.carry[r] = _schedule(st, r, st.carry[r], ctx, carry=False)
    return _timeline(st, ranks, recv_at)


def _sends_of(r: int, rk: _Rank) -> dict[_Key, tuple[_Key, str, int]]:
    """A rank's SENDs by the compute part whose output they carry; PlanError for a SEND before that part."""
    out, done = {}, set()
    for i, (kind, keys, text) in enumerate(zip(rk.kinds, rk.keys, rk.texts)):
        if kind == "compute":
            done.update(keys)
        elif kind == "send":
            skind, stage, mb = keys[0]
            producers = [(k, stage, mb) for k in (("F",) if skind == "SEND_F" else ("B", "I"))]
            prod = next((p for p in producers if p in done), None)
            if prod is None:
                raise PlanError(f"schedule deadlock: rank {r} action {text!r} waits on '{stage}"
                                f"{'F' if skind == 'SEND_F' else 'B'}{mb}' (rank {r}), which can never run")
            out[prod] = (keys[0], text, i)
    return out


def _deadlock(ranks: Sequence[_Rank], ptr: Sequence[int], blocked_on: Mapping[int, _Key],
              owner: Mapping[int, int]) -> PlanError:
    """Name a blocked action and the transfer it waits on."""
    r = next(i for i, rk in enumerate(ranks) if ptr[i] < len(rk.kinds))
    kind, stage, mb = blocked_on[r]
    return PlanError(f"schedule deadlock: rank {r} action {ranks[r].texts[ptr[r]]!r} waits on "
                     f"'{stage}{kind}{mb}' (rank {owner.get(stage)}), which can never run")


def _timeline(st: _State, ranks: Sequence[_Rank], recv_at: Mapping[_Key, int]) -> Timeline:
    n = len(ranks)
    events = list(st.events)
    for r, rk in enumerate(ranks):  # a RECV spans its peer's SEND
        for text, kind, keys in zip(rk.texts, rk.kinds, rk.keys):
            if kind == "recv":
                k, stage, mb = keys[0]
                sk = ("SEND" + k[4:], stage - 1 if k == "RECV_F" else stage + 1, mb)
                events.append(Event(r, text, "recv", st.send_start[sk], st.send_end[sk]))
    rank_end = tuple(max((e.end_s for e in events if e.rank == r and e.stream != "recv"), default=0.0)
                     for r in range(n))
    step = max(rank_end, default=0.0)
    waits = [sum(v[1] for v in s.values()) + hw for s, hw in zip(st.stats, st.host_wait)]
    bubbles = tuple(max(0.0, 1.0 - (b + w) / step) if step > 0 else 0.0 for b, w in zip(st.busy, waits))
    per_rank = tuple(MappingProxyType({c: CommStats(*v) for c, v in s.items()}) for s in st.stats)
    classes = sorted({c for s in st.stats for c in s} | {"pp"})
    mean = MappingProxyType({c: CommStats(*(sum(s.get(c, [0.0] * 6)[i] for s in st.stats) / max(1, n)
                                            for i in range(6))) for c in classes})
    return Timeline(
        step_time_s=step, rank_end_s=rank_end, busy_s=tuple(st.busy), bubble_per_rank=bubbles,
        bubble=sum(bubbles) / max(1, n), peak_activation_bytes=tuple(_peak(lv) for lv in st.live),
        comm=mean, comm_per_rank=per_rank, host_wait_s=tuple(st.host_wait),
        tier_busy=tuple(MappingProxyType({t: tuple(v) for t, v in tb.items()}) for tb in st.tier_busy),
        first_forward_s=tuple(MappingProxyType(d) for d in st.first_f),
        last_backward_end_s=tuple(MappingProxyType(d) for d in st.last_b), events=tuple(events),
        segment_events=tuple(st.detail or ()))
