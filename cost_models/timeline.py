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

Code: this module packs the stages' segment lists and runs the loop (:func:`simulate`, :func:`action_time_s`,
:func:`action_times_s`), then builds the :class:`Timeline`; the simulation's inputs and outputs
(:class:`StageProgram`, :class:`RunSettings`, :class:`Timeline`, :class:`Event`, ...) live in
cost_models/timeline_types.py, the checks and packing of the action lists in cost_models/timeline_lists.py, and the
loop itself — the sweep over the ranks and the list scheduler of one rank's parts on its streams (host, contention,
links, exposure) — in cost_models/timeline_core.py, compiled with numba: the same arithmetic in the same order as
the pure-Python loop it replaced, about 20 times faster on the 718B's step.
"""
from __future__ import annotations

from itertools import chain
from operator import attrgetter
from types import MappingProxyType
from typing import NamedTuple, Sequence

import numpy as np

from moeplan.cost_models import timeline_core as core
from moeplan.cost_models.timeline_lists import KINDS, PackedLists, pack_actions
from moeplan.cost_models.timeline_types import TIERS, CommStats, Records, RunSettings, StageProgram, Timeline
from moeplan.errors import MoeplanError, PlanError
from moeplan.state import Segment


class StepExceeded(MoeplanError):
    """:func:`simulate` stopped early: a rank's compute already ends at ``at_s`` seconds, past ``stop_above_s``, so
    the step (at least as long) cannot come in under it. Raised on purpose for a caller that asked for it, not a
    fault."""

    def __init__(self, at_s: float) -> None:
        super().__init__(f"a rank's compute runs past {at_s:.6g} s")
        self.at_s = at_s


# ---- what the loop reads: the programs and the buffers -----------------------------------------------------------------
class Repeated(NamedTuple):
    """``part`` run ``times`` times back to back as one segment list: what ``concat_segments([part] * times)``
    makes (cost_models/timeline_types.py), packed without building it (:func:`action_times_s`; the layout search
    prices overlapped pairs of 2 and 4 layers this way: moeplan/estimate.py)."""

    part: Sequence[Segment]
    times: int


class _Packed(NamedTuple):
    """The programs as the core reads them, the comm classes (index → name; ``pp`` first), and per program its
    segment count and how many of its segments hold each tier or slow compute."""

    programs: core.Programs
    classes: list[str]
    n: np.ndarray
    on_tier: np.ndarray  # [program, tier]
    slowing: np.ndarray


_FIELDS = attrgetter("seconds", "kind", "kernels", "deferrable", "async_by", "host_sync", "comm", "after")


def _pack_programs(phases: Sequence[Sequence[Segment] | Repeated], activation_bytes: Sequence[float],
                   settings: RunSettings) -> _Packed:
    """Flatten the segment lists (program ``g`` = ``phases[g]``) into :class:`~cost_models.timeline_core.Programs`.
    Each distinct segment is read once: a :class:`Repeated` list's copies are its part's arrays, tiled, with the
    dependencies :func:`~cost_models.timeline_types.concat_segments` gives them."""
    classes: dict[str, int] = {"pp": core.PP}
    mech, slow_by, slow0 = settings.mechanisms, settings.slowdown_by_kind, settings.compute_slowdown
    f8, i8, b1 = np.float64, np.int64, np.bool_
    bases = [p.part if isinstance(p, Repeated) else p for p in phases]
    segs = list(chain.from_iterable(bases))
    secs, kind, kernels, defer, async_by, sync, comms, after = (zip(*map(_FIELDS, segs)) if segs else [()] * 8)
    # a collective outside an OVERLAP_F_B pair blocks compute unless native or its mechanism is on
    blocks = {a: a != "native" and (a is None or a not in mech) for a in set(async_by)}
    rows: dict[int, tuple] = {}  # per collective: tier busy seconds, class, slow-down, wire bytes

    def row(c) -> tuple:
        if c is None:
            return (0.0, 0.0, -1, 0.0, 0.0, 0.0)
        found = rows.get(id(c))
        if found is None:
            bi, bo = c.busy_s("intra"), c.busy_s("inter")
            found = rows[id(c)] = (bi if bi > 0 else 0.0, bo if bo > 0 else 0.0,
                                   classes.setdefault(c.comm_class, len(classes)), slow_by.get(c.kind, slow0),
                                   c.wire_intra_bytes, c.wire_inter_bytes)
        return found

    comm = np.array([row(c) for c in comms], f8).reshape(-1, 6)
    is_comm = np.array([k == "comm" for k in kind], b1)
    deferrable = np.array(defer, b1)
    alen = np.fromiter(map(len, after), i8, count=len(segs))
    aidx = np.fromiter(chain.from_iterable(after), i8, count=int(alen.sum()))
    if any(isinstance(p, Repeated) for p in phases):
        src, alen, aidx = _tiled(phases, [len(b) for b in bases], alen, aidx, is_comm, deferrable)
        comm, is_comm, deferrable = comm[src], is_comm[src], deferrable[src]
    else:
        src = slice(None)
    aoff = np.zeros(len(alen) + 1, i8)
    np.cumsum(alen, out=aoff[1:])
    off = np.zeros(len(phases) + 1, i8)
    np.cumsum([len(b) * (p.times if isinstance(p, Repeated) else 1) for p, b in zip(phases, bases)], out=off[1:])
    secs_a = np.array(secs, f8)[src]
    to_comm = np.empty(len(secs_a))
    core.to_comm(off, secs_a, is_comm, to_comm)
    pg = core.Programs(off=off, secs=secs_a, is_comm=is_comm, kernels=np.array(kernels, i8)[src],
                       defer=deferrable, blocking=np.array([blocks[a] for a in async_by], b1)[src],
                       busy_in=comm[:, 0].copy(), busy_out=comm[:, 1].copy(), sync=np.array(sync, b1)[src],
                       cls=comm[:, 2].astype(i8), slow=comm[:, 3].copy(), wire_in=comm[:, 4].copy(),
                       wire_out=comm[:, 5].copy(), to_comm=to_comm, aoff=aoff, aidx=aidx,
                       act_bytes=np.array(activation_bytes, f8))
    n = np.diff(pg.off)
    program_of = np.repeat(np.arange(len(phases)), n)

    def per_program(x: np.ndarray) -> np.ndarray:
        return np.bincount(program_of, weights=x, minlength=len(phases)).astype(i8)

    on_tier = np.stack([per_program(pg.busy_in > 0), per_program(pg.busy_out > 0)], axis=1)
    slowing = per_program(pg.is_comm & (pg.slow != 0))
    return _Packed(pg, list(classes), n, on_tier, slowing)


def _tiled(phases: Sequence[Sequence[Segment] | Repeated], lengths: list[int], alen: np.ndarray, aidx: np.ndarray,
           is_comm: np.ndarray, deferrable: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The programs' segments as indices into their distinct (base) segments, and their ``after`` lists (lengths,
    flat indices), a :class:`Repeated` list's copies shifted and joined as ``concat_segments`` joins parts: a
    copy's first segment also waits for the previous copy's last segment that is not deferrable, and for the
    collectives right before it."""
    i8 = np.int64
    aoff = np.concatenate(([0], np.cumsum(alen)))
    src, lens, idx = [], [], []
    start = 0
    for p, L in zip(phases, lengths):
        own_len, own_idx = alen[start:start + L], aidx[aoff[start]:aoff[start + L]]
        for j in range(p.times if isinstance(p, Repeated) else 1):
            src.append(np.arange(start, start + L, dtype=i8))
            copy_len, copy_idx = own_len, own_idx + j * L
            tail = []
            q = j * L - 1
            while q >= 0 and deferrable[start + q % L]:
                q -= 1
            if q >= 0:
                tail.append(q)
                while is_comm[start + q % L] and q - 1 >= 0 and is_comm[start + (q - 1) % L]:
                    q -= 1
                    tail.append(q)
            if tail:  # (a tail means the part has segments)
                first = sorted(set(copy_idx[:own_len[0]].tolist()) | set(tail))
                copy_len = own_len.copy()
                copy_len[0] = len(first)
                copy_idx = np.concatenate((np.array(first, i8), copy_idx[own_len[0]:]))
            lens.append(copy_len)
            idx.append(copy_idx)
        start += L
    cat = np.concatenate
    return (cat(src) if src else np.zeros(0, i8), cat(lens) if lens else np.zeros(0, i8),
            cat(idx) if idx else np.zeros(0, i8))


def _buffers(num_ranks: int, num_stages: int, num_mb: int, num_classes: int, part_progs: Sequence[np.ndarray],
             part_kinds: Sequence[np.ndarray], sends: Sequence[int], packed: _Packed, settings: RunSettings,
             detail: bool, slots: int) -> tuple[core.State, core.Parts]:
    """Empty state and part slots sized for these lists: every buffer holds what the run can append to it."""
    R, S, M = num_ranks, num_stages, num_mb
    f8, i8 = np.float64, np.int64
    tier_cap = np.zeros((R, 2), i8)
    infl_cap = np.zeros(R, i8)
    live_cap = np.zeros(R, i8)
    for r in range(R):
        tier_cap[r] = packed.on_tier[part_progs[r]].sum(axis=0)
        infl_cap[r] = packed.slowing[part_progs[r]].sum()
        live_cap[r] = int(np.count_nonzero(part_kinds[r] != core.KI))
        if settings.p2p_s > 0:
            tier_cap[r, 0 if settings.p2p_tier == "intra" else 1] += sends[r]
    def offsets(cap: np.ndarray) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(cap)[:-1])).astype(i8)

    num_events = sum(len(p) for p in part_progs) + sum(sends)
    num_segs = int(sum(packed.n[p].sum() for p in part_progs)) if detail else 0
    nan = np.nan
    st = core.State(
        rf=np.zeros((R, 8)), ri=np.full((R, 4), -1, i8), stats=np.zeros((R, num_classes, 6)),
        stat_order=np.zeros((R, num_classes), i8), stat_n=np.zeros(R, i8),
        k_end=np.full(4 * S * M, nan), k_start=np.full(4 * S * M, nan), send_end=np.full(2 * S * M, nan),
        send_start=np.full(2 * S * M, nan), send_ready=np.full(2 * S * M, nan),
        first_f=np.full((R, S), nan), ff_order=np.zeros((R, S), i8), ff_n=np.zeros(R, i8),
        last_b=np.full((R, S), nan), lb_order=np.zeros((R, S), i8), lb_n=np.zeros(R, i8),
        live=np.zeros((int(live_cap.sum()), 2)), live_off=offsets(live_cap), live_n=np.zeros(R, i8),
        tb=np.zeros((int(tier_cap.sum()), 2)), tb_off=offsets(tier_cap.reshape(-1)), tb_n=np.zeros(2 * R, i8),
        infl=np.zeros((int(infl_cap.sum()), 3)), infl_off=offsets(infl_cap), infl_n=np.zeros(R, i8),
        ev=np.zeros((num_events, 3), i8), ev_t=np.zeros((num_events, 2)), seg=np.zeros((num_segs, 4), i8),
        seg_t=np.zeros((num_segs, 2)), counts=np.zeros(2, i8), info=np.zeros(8, i8), info_t=np.zeros(1))
    width = max(int(packed.n.max(initial=0)), 1)
    pt = core.Parts(
        key=np.zeros(slots, i8), label=np.zeros(slots, i8), prog=np.zeros(slots, i8), ptr=np.zeros(slots, i8),
        npool=np.zeros(slots, i8), ready=np.zeros(slots), produced=np.zeros(slots), host=np.zeros(slots),
        start=np.zeros(slots), end=np.zeros(slots), remote=np.zeros(slots, np.bool_),
        over=np.zeros(slots, np.bool_), steady=np.zeros(slots, np.bool_), pool=np.zeros((slots, width), i8),
        ends=np.zeros((slots, width)), qstart=np.zeros((slots, width)), qbehind=np.zeros((slots, width), i8),
        free=np.arange(slots, dtype=i8)[::-1].copy(), nfree=np.array([slots], i8),
        carry=np.zeros((R, slots), i8), ncarry=np.zeros(R, i8), scratch=np.zeros((3, slots), i8),
        heads=np.zeros(slots), pool_dep=np.zeros(slots * width), pool_q=np.zeros(slots * width, i8),
        pool_i=np.zeros(slots * width, i8), cuts=np.zeros(2 + 2 * int(infl_cap.max(initial=0))),
        rank_ptr=np.stack([np.zeros(R, i8), np.full(R, -1, i8)]))
    return st, pt


def _config(settings: RunSettings, detail: bool, stop_above_s: float) -> np.ndarray:
    cfg = np.zeros(9)
    cfg[core.H], cfg[core.SYNC_S], cfg[core.P2P_S] = settings.host_launch_s, settings.host_sync_s, settings.p2p_s
    cfg[core.P2P_BYTES], cfg[core.P2P_HOST_S] = settings.p2p_bytes, settings.p2p_host_s
    cfg[core.P2P_INTRA], cfg[core.PP_ASYNC] = settings.p2p_tier == "intra", "pp" in settings.mechanisms
    cfg[core.DETAIL], cfg[core.STOP_ABOVE] = detail, stop_above_s
    return cfg


# ---- the simulation ----------------------------------------------------------------------------------------------------
def action_time_s(parts: Sequence[Sequence[Segment]], settings: RunSettings = RunSettings()) -> float:
    """Seconds one compute action takes on an idle rank whose inputs are ready: one segment list, or the two parts
    of an OVERLAP_F_B pair (the layout search's closed-form estimate prices layers with it)."""
    return action_times_s([parts], settings)[0]


def action_times_s(actions: Sequence[Sequence[Sequence[Segment] | Repeated]],
                   settings: RunSettings = RunSettings()) -> list[float]:
    """:func:`action_time_s` of each action, in one pass (the programs packed once)."""
    phases: list[Sequence[Segment] | Repeated] = []
    first = [0]
    for parts in actions:
        for p in parts:  # each part is a stage's forward
            phases += [p, (), (), ()]
        first.append(first[-1] + len(parts))
    S = first[-1]
    packed = _pack_programs(phases, [0.0] * S, settings)
    progs = np.arange(S, dtype=np.int64) * 4
    st, pt = _buffers(1, S, 1, len(packed.classes), [progs], [np.zeros(S, np.int64)], [0], packed, settings,
                      False, max(np.diff(first), default=1))
    out = np.zeros(len(actions))
    status = core.run_actions(packed.programs, _no_lists(S), st, pt, _config(settings, False, float("inf")),
                              np.array(first, np.int64), out)
    if status != core.OK:
        raise PlanError("timeline: an action could not finish (a simulator bug)")
    return out.tolist()


def _no_lists(n: int) -> core.Actions:
    """The lists of one rank that has no actions, over ``n`` stages of one micro-batch (:func:`action_time_s`)."""
    i8 = np.int64
    zero = np.zeros(0, i8)
    return core.Actions(off=np.zeros(2, i8), kind=zero, n=zero, key0=zero, key1=zero, label0=zero, label1=zero,
                        steady=np.zeros(0, np.bool_), next_pair=np.zeros(0, np.bool_), owner=np.full(n, -1, i8),
                        recv_idx=np.full(2 * n, -1, i8), send_of=np.full(4 * n, -1, i8), s_key=zero, s_text=zero,
                        s_index=zero, win_lo=np.zeros(1, i8), win_hi=np.full(1, -1, i8))


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
    S = len(stages)
    lists = pack_actions(actions, S)
    R, M = len(actions), lists.num_microbatches
    phases = [stage.phase(kind) for stage in stages for kind in KINDS]
    packed = _pack_programs(phases, [s.activation_bytes for s in stages], settings)
    cfg = _config(settings, detail, stop_above_s)
    slots = 8 * R
    while True:
        st, pt = _buffers(R, S, M, len(packed.classes), lists.part_progs, lists.part_kinds, lists.sends, packed,
                          settings, detail, slots)
        status = core.run(packed.programs, lists.actions, st, pt, cfg, S, M)
        if status != core.NO_SLOT:
            break
        slots *= 2  # more parts of overlapped pairs in flight at once than the first guess
    if status != core.OK:
        raise _failure(status, st, pt, lists, S, M)
    return _timeline(st, lists, packed, [tuple(p) for p in phases], S, M)


def _key_text(key: int, kinds: Sequence[str], S: int, M: int) -> str:
    """``{stage}{kind}{mb}`` of a key of the loop (kind ``kinds[key // (S·M)]``)."""
    return f"{(key // M) % S}{kinds[key // (S * M)]}{key % M}"


def _failure(status: int, st: core.State, pt: core.Parts, lists: PackedLists, S: int, M: int) -> MoeplanError:
    """The error of a run that stopped (module docstring, "Errors")."""
    info = st.info.tolist()
    if status == core.EXCEEDED:
        return StepExceeded(float(st.info_t[0]))
    if status == core.DEADLOCK:
        r, i, sk = info[0], info[1], info[2]
        return PlanError(f"schedule deadlock: rank {r} action {lists.rank_texts[r][i]!r} waits on "
                         f"'{_key_text(sk, ('SEND_F', 'SEND_B'), S, M)}' (rank {lists.owner.get((sk // M) % S)}), "
                         f"which can never run")
    if status in (core.NO_LOCAL, core.NO_RECV):
        r, i = info[3], info[4]
        label = lists.rank_texts[r][i]
        if status == core.NO_LOCAL:
            return PlanError(f"schedule deadlock: rank {r} action {label!r} waits on "
                             f"'{_key_text(info[0], KINDS, S, M)}' (rank {r}), which can never run")
        return PlanError(f"rank {r} action {label!r}: needs {info[1]}{('RECV_F', 'RECV_B')[info[0]]}{info[2]} "
                         f"earlier in its rank's list")
    r = info[0]
    left = ", ".join(lists.texts[pt.label[p]] for p in pt.carry[r, :pt.ncarry[r]])
    return PlanError(f"timeline: rank {r} could not finish {left} (a simulator bug)")


def _peak(times: np.ndarray, deltas: np.ndarray) -> float:
    """Max live activation bytes of one rank's (time, ±bytes) changes; frees first at equal times."""
    order = np.lexsort((deltas, times))
    running = np.cumsum(deltas[order])  # a sequential sum, as the changes happen
    return float(max(0.0, running.max(initial=0.0)))


def _timeline(st: core.State, lists: PackedLists, packed: _Packed, programs: list[tuple[Segment, ...]], S: int,
              M: int) -> Timeline:
    n = len(lists.part_progs)
    count = int(st.counts[0])
    ev, ev_t = st.ev[:count], st.ev_t[:count]
    rank_end = [0.0] * n
    ends = np.full(n, -np.inf)
    np.maximum.at(ends, ev[:, 0], ev_t[:, 1])
    for r, e in enumerate(ends.tolist()):
        if e > 0.0:
            rank_end[r] = e
    step = max(rank_end, default=0.0)
    stats_all = st.stats.tolist()
    stats = [{packed.classes[c]: stats_all[r][c] for c in st.stat_order[r, :st.stat_n[r]].tolist()}
             for r in range(n)]
    busy, host_wait = st.rf[:, core.BUSY].tolist(), st.rf[:, core.HOST_WAIT].tolist()
    waits = [sum(v[1] for v in s.values()) + hw for s, hw in zip(stats, host_wait)]
    bubbles = tuple(max(0.0, 1.0 - (b + w) / step) if step > 0 else 0.0 for b, w in zip(busy, waits))
    per_rank = tuple(MappingProxyType({c: CommStats(*v) for c, v in s.items()}) for s in stats)
    classes = sorted({c for s in stats for c in s} | {"pp"})
    mean = MappingProxyType({c: CommStats(*(sum(s.get(c, [0.0] * 6)[i] for s in stats) / max(1, n)
                                            for i in range(6))) for c in classes})
    peaks = tuple(_peak(st.live[o:o + k, 0], st.live[o:o + k, 1])
                  for o, k in zip(st.live_off.tolist(), st.live_n.tolist()))
    tier_busy = tuple(MappingProxyType({t: st.tb[st.tb_off[2 * r + j]:st.tb_off[2 * r + j] + st.tb_n[2 * r + j]]
                                        for j, t in enumerate(TIERS)}) for r in range(n))
    first_f, last_b = st.first_f.tolist(), st.last_b.tolist()
    first = tuple(MappingProxyType({s: first_f[r][s] for s in st.ff_order[r, :st.ff_n[r]].tolist()})
                  for r in range(n))
    last = tuple(MappingProxyType({s: last_b[r][s] for s in st.lb_order[r, :st.lb_n[r]].tolist()})
                 for r in range(n))
    recvs = lists.recvs
    records = Records(events=ev, event_times=ev_t, recvs=recvs[:, :2],
                      recv_times=np.stack([st.send_start[recvs[:, 2]], st.send_end[recvs[:, 2]]], axis=1),
                      segments=st.seg[:st.counts[1]], segment_times=st.seg_t[:st.counts[1]], texts=lists.texts,
                      programs=programs)
    return Timeline(
        step_time_s=step, rank_end_s=tuple(rank_end), busy_s=tuple(busy), bubble_per_rank=bubbles,
        bubble=sum(bubbles) / max(1, n), peak_activation_bytes=peaks, comm=mean, comm_per_rank=per_rank,
        host_wait_s=tuple(host_wait), tier_busy=tier_busy, first_forward_s=first, last_backward_end_s=last,
        records=records)
