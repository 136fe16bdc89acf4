"""Timeline: a discrete-event simulation of per-rank pipeline action lists (DESIGN §5 "timeline").

Input: one list of actions per PP rank in ``torch.distributed.pipelining``'s notation (``_Action.from_str``):
``{stage}F{mb}``, ``{stage}B{mb}`` (full backward), ``{stage}I{mb}`` / ``{stage}W{mb}`` (input / weight gradient),
``{stage}SEND_F{mb}``, ``{stage}RECV_F{mb}``, ``{stage}SEND_B{mb}``, ``{stage}RECV_B{mb}``; ``REDUCE_GRAD``,
``UNSHARD`` and ``RESHARD`` are accepted as zero-time no-ops so torch's own lowered lists simulate too.

Model (one PP group; DP replicas and TP/EP peers are symmetric):

- Each rank has a compute stream (F, B, I, W in list order) and a comm stream (SENDs in list order).
- In-layer collectives (TP, EP, CP) are serialized on the compute stream in v1: they are already part of
  ``forward_s`` / ``backward_s``; ``StageCost.fwd_comm_s`` / ``bwd_comm_s`` say which share is which class, so the
  timeline can report the compute-stream time spent on each class as exposed.
- A SEND starts when its F/B (or I) has finished and the comm stream is free, and lasts ``p2p_s``.
- A RECV occupies no stream: it completes when the matching SEND on the peer completes. As in torch's
  ``_PipelineScheduleRuntime`` (RECV posts an ``irecv``; the consuming F/B waits on it), a compute action waits on
  the RECV of its own input, which must appear earlier in its rank's list; compute waits on nothing else remote.
- Data dependencies: F(s, m) needs F(s−1, m); B/I(s, m) needs F(s, m) and B/I(s+1, m); W(s, m) needs I(s, m) —
  locally when the neighbour stage is on the same rank, else through the RECV.
- Activation memory: ``activation_bytes`` of a stage is allocated at F start and freed at B end (at W end when the
  backward is split — conservative: part of it could go at I end).

Outputs (``Timeline``): step time = max end over all events; per-rank busy (compute) time; bubble per rank
``1 − busy / step_time`` and its mean over ranks (the definition of FACTS §4.3's bubble fraction); per-rank peak live
activation bytes; exposed comm per class, per rank and averaged over ranks (the in-layer classes as above, plus
``pp``: the part of a compute action's wait on its RECV after the producer on the peer finished, i.e. the exposed
transfer); the events. With uniform stages (F, B per chunk, p2p 0) 1F1B gives step (m + p − 1)(F + B) and bubble
(p − 1)/(m + p − 1), interleaved ((p − 1)/v)/(m + (p − 1)/v) (FACTS §4.3) — tests/test_timeline.py checks both.

One comm stream per rank carries both directions (DESIGN §5 names one per link tier: PP p2p always uses one tier
here, so a single stream is the same model until in-layer collectives move off the compute stream).

Errors: PlanError (a ValueError) for malformed actions, a RECV with no SEND (or a SEND with no RECV), a compute
action whose input never arrives, and deadlocks (no action can progress), naming the rank and the action. The
simulation is list scheduling by dependency resolution (start = max(stream free, dependencies' ends)); with
in-order streams this equals an event-ordered simulation.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Mapping, NamedTuple, Sequence

from moeplan.errors import PlanError

COMPUTE_KINDS = ("F", "B", "I", "W")
SEND_KINDS = ("SEND_F", "SEND_B")
RECV_KINDS = ("RECV_F", "RECV_B")
NOOP_KINDS = ("REDUCE_GRAD", "UNSHARD", "RESHARD")
_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|REDUCE_GRAD|UNSHARD|RESHARD|F|B|I|W)(\d*)")

Stream = Literal["compute", "comm", "recv"]

#: same-rank producer kinds each action waits on (its own stage and micro-batch)
_LOCAL_DEP = MappingProxyType({"B": ("F",), "I": ("F",), "W": ("I",), "SEND_F": ("F",), "SEND_B": ("B", "I")})
#: input from a neighbour stage: (stage step, producer kinds, RECV kind, SEND kind)
_INPUT = MappingProxyType({"F": (-1, ("F",), "RECV_F", "SEND_F"), "B": (1, ("B", "I"), "RECV_B", "SEND_B"),
                           "I": (1, ("B", "I"), "RECV_B", "SEND_B")})
_NO_INPUT = (0, (), "", "")
_new_tuple = tuple.__new__  # builds NamedTuples without their Python-level __new__ (hot loops)


class Action(NamedTuple):
    """One parsed action: ``stage`` (pipeline stage id), ``kind`` (``F``, ``SEND_F``, ...), ``microbatch`` (−1 for
    the no-op kinds, which carry none)."""

    stage: int
    kind: str
    microbatch: int


def parse_action(text: str) -> Action:
    """Parse ``"3F12"`` → ``Action(3, "F", 12)``; raise PlanError on anything else."""
    match = _ACTION_RE.fullmatch(text.strip())
    if match is None or (match.group(3) == "") != (match.group(2) in NOOP_KINDS):
        raise PlanError(f"action={text!r}: must be '{{stage}}{{kind}}{{microbatch}}' with kind one of "
                        f"{', '.join(COMPUTE_KINDS + SEND_KINDS + RECV_KINDS)}")
    return Action(int(match.group(1)), match.group(2), int(match.group(3)) if match.group(3) else -1)


_Key = tuple[str, int, int]  # (kind, stage, micro-batch): a parsed action as simulate keys it


def _parse_rank(texts: Sequence[str]) -> list[_Key]:
    """``parse_action`` over one rank's list as keys (the hot path of ``simulate``)."""
    out, match = [], _ACTION_RE.fullmatch
    for text in texts:
        m = match(text)
        if m is None or (m.group(3) == "") != (m.group(2) in NOOP_KINDS):
            a = parse_action(text)  # raises unless only surrounding spaces were in the way
            out.append((a.kind, a.stage, a.microbatch))
            continue
        stage, kind, mb = m.groups()
        out.append((kind, int(stage), int(mb) if mb else -1))
    return out


def _empty_mapping() -> Mapping[str, float]:
    return MappingProxyType({})


@dataclass(frozen=True)
class StageCost:
    """Cost of one pipeline stage (one VPP chunk of one PP rank) for ONE micro-batch on one device.

    Seconds: ``forward_s``; ``backward_s`` = full B = ``backward_input_s`` (dX) + ``backward_weight_s`` (dW).
    ``activation_bytes``: kept from the F until its B (W when split). ``fwd_comm_s`` / ``bwd_comm_s``: seconds per
    comm class (``tp``, ``ep``, ``cp``...) of in-layer collectives that are PART of ``forward_s`` / ``backward_s``
    (the backward collectives sit on the input-gradient path, so they count in I, not in W).
    Raises PlanError on a negative value, I + W ≠ B, or comm shares larger than the time they are part of.
    """

    forward_s: float
    backward_s: float
    backward_input_s: float
    backward_weight_s: float
    activation_bytes: float
    fwd_comm_s: Mapping[str, float] = field(default_factory=_empty_mapping)
    bwd_comm_s: Mapping[str, float] = field(default_factory=_empty_mapping)

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "activation_bytes"):
            if getattr(self, name) < 0:  # our own fields, all present: not a config default lookup
                raise PlanError(f"{name}={getattr(self, name)!r}: must be >= 0")
        split = self.backward_input_s + self.backward_weight_s
        if abs(split - self.backward_s) > 1e-9 * max(1.0, self.backward_s):
            raise PlanError(f"backward_s={self.backward_s!r}: must equal backward_input_s + backward_weight_s "
                            f"= {split!r}")
        for name, comm, total in (("fwd_comm_s", self.fwd_comm_s, self.forward_s),
                                  ("bwd_comm_s", self.bwd_comm_s, self.backward_input_s)):
            if any(v < 0 for v in comm.values()) or sum(comm.values()) > total * (1 + 1e-9):
                raise PlanError(f"{name}={dict(comm)!r}: must be >= 0 and sum to at most the time it is part of "
                                f"({total!r} s)")


class Event(NamedTuple):
    """One executed action: ``stream`` is ``compute``, ``comm`` (a SEND) or ``recv`` (a RECV, spanning the peer's
    SEND: it occupies no stream of its own rank). Times in seconds from the step start."""

    rank: int
    action: str
    stream: Stream
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Timeline:
    """Result of ``simulate``; per-rank tuples are indexed by PP rank. See the module docstring for definitions.

    ``rank_end_s``: when each rank's last event (compute or SEND) ends; ``step_time_s`` is their max.
    ``exposed_comm_s``: per comm class, exposed seconds averaged over ranks (as ``bubble`` is); the per-rank values
    are in ``exposed_comm_per_rank_s``. Every mapping has the ``pp`` key.
    """

    step_time_s: float
    rank_end_s: tuple[float, ...]
    busy_s: tuple[float, ...]
    bubble_per_rank: tuple[float, ...]
    bubble: float
    peak_activation_bytes: tuple[float, ...]
    exposed_comm_s: Mapping[str, float]
    exposed_comm_per_rank_s: tuple[Mapping[str, float], ...]
    events: tuple[Event, ...]


def _mean_mapping(per_rank: Sequence[Mapping[str, float]]) -> Mapping[str, float]:
    classes = sorted({c for m in per_rank for c in m})
    n = max(1, len(per_rank))
    return MappingProxyType({c: sum(m.get(c, 0.0) for m in per_rank) / n for c in classes})


@dataclass
class _Ops:
    """Scratch arrays of one simulation (private, lives for one ``simulate`` call). Op ids index every list."""

    label: list[str] = field(default_factory=list)
    rank: list[int] = field(default_factory=list)
    action: list[_Key] = field(default_factory=list)
    index: list[int] = field(default_factory=list)  # position in its rank's action list
    dur: list[float] = field(default_factory=list)
    deps: list[tuple[int, ...]] = field(default_factory=list)
    input_send: list[int] = field(default_factory=list)  # the SEND a compute op receives its input from, or −1
    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    key: dict[tuple[str, int, int], int] = field(default_factory=dict)  # (kind, stage, mb) → op id
    queues: list[list[int]] = field(default_factory=list)  # rank r: compute 2r, comm 2r+1
    # per rank, in list order: (text, stream, op id — for a RECV its key until ``_check_pairs`` resolves its SEND)
    slots: list[list[tuple[str, str, int | tuple[str, int, int]]]] = field(default_factory=list)
    recv_send: dict[tuple[str, int, int], int] = field(default_factory=dict)  # RECV key → its SEND's op id


def _stage_ranks(parsed: Sequence[Sequence[_Key]], num_stages: int) -> dict[int, int]:
    """Map each stage to the one rank that runs its compute; raise PlanError on a stage on two ranks or out of range."""
    owner: dict[int, int] = {}
    for r, acts in enumerate(parsed):
        for kind, stage, mb in acts:
            if kind in NOOP_KINDS:
                continue
            if stage >= num_stages:
                raise PlanError(f"rank {r} action {stage}{kind}{mb}: stage {stage} out of range (stage_costs has "
                                f"{num_stages} stages)")
            if kind in COMPUTE_KINDS and owner.setdefault(stage, r) != r:
                raise PlanError(f"rank {r} action {stage}{kind}{mb}: stage {stage} already runs on rank "
                                f"{owner[stage]}")
    return owner


def _add_ops(parsed: Sequence[Sequence[_Key]], texts: Sequence[Sequence[str]], owner: Mapping[int, int],
             stage_costs: Sequence[StageCost], p2p_s: float) -> tuple[_Ops, dict[tuple[str, int, int], int]]:
    """Create an op per compute action and SEND; return the ops and the list index of every RECV."""
    ops = _Ops(queues=[[] for _ in range(2 * len(parsed))], slots=[[] for _ in parsed])
    recv_at: dict[tuple[str, int, int], int] = {}
    durations = {"F": [c.forward_s for c in stage_costs], "B": [c.backward_s for c in stage_costs],
                 "I": [c.backward_input_s for c in stage_costs], "W": [c.backward_weight_s for c in stage_costs],
                 "SEND_F": [p2p_s] * len(stage_costs), "SEND_B": [p2p_s] * len(stage_costs)}
    keys, label, rank, action, index, dur = ops.key, ops.label, ops.rank, ops.action, ops.index, ops.dur
    for r, acts in enumerate(parsed):
        compute_q, comm_q, rank_texts, slots = ops.queues[2 * r], ops.queues[2 * r + 1], texts[r], ops.slots[r]
        for idx, key in enumerate(acts):
            kind, stage, mb = key
            if kind in NOOP_KINDS:
                continue
            if owner.get(stage) != r:
                raise PlanError(f"rank {r} action {rank_texts[idx]!r}: stage {stage} computes on rank "
                                f"{owner.get(stage)}")
            if key in keys or key in recv_at:
                raise PlanError(f"rank {r} action {rank_texts[idx]!r}: appears twice")
            if kind in RECV_KINDS:
                recv_at[key] = idx
                slots.append((rank_texts[idx], "recv", key))
                continue
            op = keys[key] = len(label)
            label.append(rank_texts[idx])
            rank.append(r)
            action.append(key)
            index.append(idx)
            dur.append(durations[kind][stage])
            if kind in SEND_KINDS:
                comm_q.append(op)
                slots.append((rank_texts[idx], "comm", op))
            else:
                compute_q.append(op)
                slots.append((rank_texts[idx], "compute", op))
    return ops, recv_at


def _link(ops: _Ops, recv_at: Mapping[tuple[str, int, int], int], owner: Mapping[int, int], num_stages: int) -> None:
    """Fill ``deps`` and ``input_send`` of every op; raise PlanError on a missing producer, RECV or SEND."""
    _check_pairs(ops, recv_at, owner)
    for op, (kind, stage, mb) in enumerate(ops.action):
        local = _LOCAL_DEP.get(kind)
        deps = [_need(ops, op, local, stage, mb)] if local else []
        input_send = -1
        step, kinds, recv_kind, send_kind = _INPUT.get(kind, _NO_INPUT)
        if step and 0 <= stage + step < num_stages:
            if owner.get(stage + step) == ops.rank[op]:
                deps.append(_need(ops, op, kinds, stage + step, mb))
            else:
                at = recv_at.get((recv_kind, stage, mb))
                if at is None or at > ops.index[op]:
                    raise PlanError(f"rank {ops.rank[op]} action {ops.label[op]!r}: needs {stage}{recv_kind}{mb} "
                                    f"earlier in its rank's list")
                input_send = _need(ops, op, (send_kind,), stage + step, mb)
                deps.append(input_send)
        ops.deps.append(tuple(deps))
        ops.input_send.append(input_send)


def _need(ops: _Ops, op: int, kinds: Sequence[str], stage: int, mb: int) -> int:
    """Op id of the first of ``kinds`` run for (stage, mb); PlanError naming ``op`` if none is."""
    key = ops.key
    found = key.get((kinds[0], stage, mb), -1)
    if found < 0 and len(kinds) > 1:
        found = key.get((kinds[1], stage, mb), -1)
    if found < 0:
        raise PlanError(f"rank {ops.rank[op]} action {ops.label[op]!r}: needs {stage}{kinds[0]}{mb}, which no rank "
                        f"runs")
    return found


def _check_pairs(ops: _Ops, recv_at: Mapping[tuple[str, int, int], int], owner: Mapping[int, int]) -> None:
    """Every RECV has its SEND on the neighbour stage (recorded in ``recv_send``) and every SEND its RECV."""
    for kind, stage, mb in recv_at:
        peer = stage - 1 if kind == "RECV_F" else stage + 1
        send = ops.key.get(("SEND" + kind[4:], peer, mb), -1)
        ops.recv_send[(kind, stage, mb)] = send
        if send < 0:
            raise PlanError(f"rank {owner[stage]} action {stage}{kind}{mb}: no rank runs its SEND "
                            f"{peer}SEND{kind[4:]}{mb}")
    for (kind, stage, mb), op in ops.key.items():
        if kind in SEND_KINDS:
            peer = stage + 1 if kind == "SEND_F" else stage - 1
            if ("RECV" + kind[4:], peer, mb) not in recv_at:
                raise PlanError(f"rank {ops.rank[op]} action {ops.label[op]!r}: no rank runs its RECV "
                                f"{peer}RECV{kind[4:]}{mb}")


def _run(ops: _Ops) -> None:
    """Fill ``start``/``end``: sweep the in-order streams, alternating direction, until all ops ran.

    Each sweep advances every stream as far as its head's dependencies allow; a sweep with no progress is a
    deadlock (PlanError naming a blocked rank, action and what it waits on).
    """
    n = len(ops.label)
    ops.start, ops.end = [0.0] * n, [-1.0] * n
    start, end, dur, deps, queues = ops.start, ops.end, ops.dur, ops.deps, ops.queues
    ptr, free = [0] * len(queues), [0.0] * len(queues)
    order = [qi for qi, q in enumerate(queues) if q]
    remaining = n
    while remaining:
        done = 0
        for qi in order:
            q, i, t_free = queues[qi], ptr[qi], free[qi]
            while i < len(q):
                op, t = q[i], t_free
                for d in deps[op]:
                    e = end[d]
                    if e < 0.0:
                        break
                    if e > t:
                        t = e
                else:
                    start[op], t_free = t, t + dur[op]
                    end[op] = t_free
                    i += 1
                    continue
                break
            done += i - ptr[qi]
            ptr[qi], free[qi] = i, t_free
        if not done:
            raise _deadlock(ops, ptr)
        remaining -= done
        order.reverse()


def _deadlock(ops: _Ops, ptr: Sequence[int]) -> PlanError:
    """Name an action on the wait cycle: from a blocked stream head, follow what it waits on (or the head that
    action is queued behind) until a head repeats."""
    def head_of(op: int) -> int:
        qi = 2 * ops.rank[op] + (ops.action[op][0] in SEND_KINDS)
        return ops.queues[qi][ptr[qi]]

    op = next(q[i] for q, i in zip(ops.queues, ptr) if i < len(q))
    seen: set[int] = set()
    while op not in seen:
        seen.add(op)
        op = head_of(next(d for d in ops.deps[op] if ops.end[d] < 0.0))
    waits = next(d for d in ops.deps[op] if ops.end[d] < 0.0)
    return PlanError(f"schedule deadlock: rank {ops.rank[op]} action {ops.label[op]!r} waits on {ops.label[waits]!r} "
                     f"(rank {ops.rank[waits]}), which can never run")


def _peak_bytes(ops: _Ops, queue: Sequence[int], stage_costs: Sequence[StageCost]) -> float:
    """Max live activation bytes: + at F start, − at B end (W end when split); frees first at equal times."""
    deltas = []
    for op in queue:
        kind, stage, _ = ops.action[op]
        if kind == "F":
            deltas.append((ops.start[op], stage_costs[stage].activation_bytes))
        elif kind in ("B", "W"):
            deltas.append((ops.end[op], -stage_costs[stage].activation_bytes))
    deltas.sort()
    live = peak = 0.0
    for _, b in deltas:
        live += b
        peak = max(peak, live)
    return peak


def _exposed(ops: _Ops, queue: Sequence[int], stage_costs: Sequence[StageCost]) -> Mapping[str, float]:
    """Compute-stream seconds per comm class: in-layer shares, plus ``pp`` = waits on a RECV after its producer."""
    acc = {"pp": 0.0}
    prev_end, end = 0.0, ops.end
    for op in queue:
        kind, stage, _ = ops.action[op]
        cost = stage_costs[stage]
        shares = cost.fwd_comm_s if kind == "F" else cost.bwd_comm_s if kind in ("B", "I") else {}
        for cls, t in shares.items():
            acc[cls] = acc.get(cls, 0.0) + t
        send = ops.input_send[op]
        if send >= 0:
            ready = max([prev_end, end[ops.deps[send][0]]] + [end[d] for d in ops.deps[op] if d != send])
            acc["pp"] += max(0.0, ops.start[op] - ready)
        prev_end = end[op]
    return MappingProxyType(acc)


def _events(ops: _Ops) -> tuple[Event, ...]:
    """Events per rank in list order; a RECV spans its peer's SEND."""
    start, end, recv_send, events = ops.start, ops.end, ops.recv_send, []
    for r, slots in enumerate(ops.slots):
        for text, stream, op in slots:
            if stream == "recv":
                op = recv_send[op]
            events.append(_new_tuple(Event, (r, text, stream, start[op], end[op])))
    return tuple(events)


def simulate(actions: Sequence[Sequence[str]], *, stage_costs: Sequence[StageCost], p2p_s: float) -> Timeline:
    """Simulate one training step of a pipeline schedule (see the module docstring for the model).

    ``actions[r]``: PP rank r's actions in order (e.g. ``Schedule.actions``); ``stage_costs[s]``: cost of pipeline
    stage ``s`` for one micro-batch; ``p2p_s``: seconds of one SEND of activations or gradients across a stage
    boundary. Raises PlanError on a malformed or deadlocking schedule (never hangs: each sweep must progress).
    """
    if p2p_s < 0:
        raise PlanError(f"p2p_s={p2p_s!r}: must be >= 0")
    parsed = [_parse_rank(rank) for rank in actions]
    owner = _stage_ranks(parsed, len(stage_costs))
    ops, recv_at = _add_ops(parsed, actions, owner, stage_costs, p2p_s)
    _link(ops, recv_at, owner, len(stage_costs))
    _run(ops)
    ranks = range(len(parsed))
    rank_end = tuple(max((ops.end[op] for op in ops.queues[2 * r] + ops.queues[2 * r + 1]), default=0.0)
                     for r in ranks)
    step = max(rank_end, default=0.0)
    busy = tuple(sum(ops.dur[op] for op in ops.queues[2 * r]) for r in ranks)
    bubbles = tuple(1.0 - b / step if step > 0 else 0.0 for b in busy)
    exposed = tuple(_exposed(ops, ops.queues[2 * r], stage_costs) for r in ranks)
    return Timeline(
        step_time_s=step, rank_end_s=rank_end, busy_s=busy, bubble_per_rank=bubbles,
        bubble=sum(bubbles) / max(1, len(bubbles)),
        peak_activation_bytes=tuple(_peak_bytes(ops, ops.queues[2 * r], stage_costs) for r in ranks),
        exposed_comm_s=_mean_mapping(exposed), exposed_comm_per_rank_s=exposed, events=_events(ops))
