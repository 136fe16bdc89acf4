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

Code: this module checks the action lists and steps each rank through its list (:func:`simulate`,
:func:`action_time_s`); the simulation's inputs and outputs (:class:`StageProgram`, :class:`RunSettings`,
:class:`Timeline`, :class:`Event`, ...) live in cost_models/timeline_types.py, its working state (each phase
compiled for the loop, the parts in flight, per-rank clocks and accumulators) in cost_models/timeline_state.py, and
the list scheduler of one rank's parts on its streams (host, contention, links, exposure) in
cost_models/timeline_sched.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Sequence

from moeplan.actions import COMPUTE_KINDS, OVERLAP, RECV_KINDS, SEND_KINDS, parse_action
from moeplan.cost_models.timeline_sched import _post, _schedule
from moeplan.cost_models.timeline_state import _Context, _Key, _Part, _State
from moeplan.cost_models.timeline_types import CommStats, Event, RunSettings, StageProgram, Timeline
from moeplan.errors import MoeplanError, PlanError
from moeplan.state import Segment


# ---- parsing and validation -------------------------------------------------------------------------------------------
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


# ---- stepping the ranks through their lists ---------------------------------------------------------------------------
_LOCAL = {"B": ("F",), "I": ("F",), "W": ("I",)}
_INPUT = {"F": (-1, ("F",), "RECV_F", "SEND_F"), "B": (1, ("B", "I"), "RECV_B", "SEND_B"),
          "I": (1, ("B", "I"), "RECV_B", "SEND_B")}


class StepExceeded(MoeplanError):
    """:func:`simulate` stopped early: a rank's compute already ends at ``at_s`` seconds, past ``stop_above_s``, so
    the step (at least as long) cannot come in under it. Raised on purpose for a caller that asked for it, not a
    fault."""

    def __init__(self, at_s: float) -> None:
        super().__init__(f"a rank's compute runs past {at_s:.6g} s")
        self.at_s = at_s


class _Blocked(Exception):
    """A compute action whose remote input has not been simulated yet (the sweep tries again later)."""


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
