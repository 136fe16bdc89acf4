"""The timeline simulator's list scheduler (cost_models/timeline.py; the model: its module docstring): how one
rank's compute parts run on its compute stream and link tiers — segment order and the choice among overlapped
parts (:func:`_schedule`, :func:`_run_in_order`), host launches and syncs, the compute slow-down beside collectives
in flight (:func:`_slowdown_s`), the tiers a collective or a SEND claims (:func:`_claim_tiers`, :func:`_issue_comm`,
:func:`_send`), and what each wait of the compute stream is charged to (:func:`_charge_wait`).
"""
from __future__ import annotations

import heapq
from typing import Sequence

from moeplan.cost_models.timeline_state import _Context, _Key, _Part, _State
from moeplan.cost_models.timeline_types import Event, SegmentEvent
from moeplan.errors import PlanError

_EPS = 1e-12


def _slowdown_s(start: float, end: float, intervals: list[tuple[float, float, float]]) -> float:
    """Extra seconds of a compute segment over [start, end]: ∫ σ(t) dt, σ(t) the largest slow-down of the
    collectives ``(begin, end, σ)`` in flight at t (``intervals`` pruned of those that ended before start)."""
    if len(intervals) != 1 or intervals[0][1] <= start:  # one collective still in flight: nothing to prune
        intervals[:] = [iv for iv in intervals if iv[1] > start]
    if not intervals:
        return 0.0
    if len(intervals) == 1:  # the common case
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
