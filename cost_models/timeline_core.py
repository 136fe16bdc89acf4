"""The timeline simulator's event loop, compiled (cost_models/timeline.py holds the model, the checks of the action
lists and what the loop returns; this module is only the loop).

Every rule is the module docstring of cost_models/timeline.py, step for step: the sweep over the ranks' lists, a
rank's list scheduler (:func:`schedule_parts`: the lone part in order, or the parts of overlapped pairs
interleaved), the host, the compute slow-down beside collectives in flight, the link tiers, the SENDs, and what
each wait of the compute stream is charged to. The loop is written over flat arrays (:class:`Programs`,
:class:`Actions`, :class:`State`, :class:`Parts`: built by cost_models/timeline.py) and compiled with numba's
``njit`` (cached on disk, ``cache=True``: the first run in a fresh checkout compiles it, later processes load it),
so a step of the 718B's 41,472 actions simulates in a tenth of a second instead of the pure-Python loop's seconds.

The arithmetic is the Python loop's, operation for operation in the same order (IEEE doubles, no fast-math), so the
figures are the same bits; ``NUMBA_DISABLE_JIT=1`` runs these functions as plain Python, for a debugger.

Encodings: a compute part's key is ``(kind · S + stage) · M + mb`` (kinds F, B, I, W = 0..3; ``S`` stages, ``M``
micro-batches), a SEND's ``(send_kind · S + stage) · M + mb`` (SEND_F 0, SEND_B 1; a RECV is keyed by its SEND's
kind and its own stage). A time that is not known yet is NaN. Comm classes are integers (``PP`` is the pipeline's),
"none" is −1.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

jit = njit(cache=True, _nrt=False)  # no allocation inside: the arrays are passed without reference counting

EPS = 1e-12
KF, KB, KI, KW = 0, 1, 2, 3  # compute part kinds
A_COMPUTE, A_SEND, A_RECV, A_NOOP = 0, 1, 2, 3  # action kinds
PP = 0  # the pipeline's comm class
# State.rf columns (per rank): compute stream free, host, busy compute, host waits, tier free (intra, inter), the
# priority transfers' tier free (intra, inter)
FREE, HOST, BUSY, HOST_WAIT, TIER_FREE, PRIO_FREE = 0, 1, 2, 3, 4, 6
# State.ri columns: the class each tier is busy with last (intra, inter), the same among priority transfers
TIER_CLS, PRIO_CLS = 0, 2
# Config fields
H, SYNC_S, P2P_S, P2P_BYTES, P2P_HOST_S, P2P_INTRA, PP_ASYNC, DETAIL, STOP_ABOVE = range(9)
# status codes
OK, BLOCKED, NO_LOCAL, NO_RECV, DEADLOCK, UNFINISHED, EXCEEDED, NO_SLOT = range(8)


@intrinsic
def _value(typingctx, x):
    """``x`` with its type only, not its literal value: a constant passed straight to a compiled function makes
    numba compile that function (and everything it calls) once more for the constant's literal type; passed through
    here, one compilation serves every call."""
    def codegen(context, builder, signature, args):
        return context.cast(builder, args[0], signature.args[0], signature.return_type)
    return types.unliteral(x)(x), codegen


class Programs(NamedTuple):
    """Every (stage, pass) segment list, concatenated: program ``g`` (``stage · 4 + kind``) holds segments
    ``off[g]:off[g + 1]``; ``after`` indices (local to the program) of segment ``j`` are ``aidx[aoff[j]:aoff[j + 1]]``."""

    off: np.ndarray
    secs: np.ndarray
    is_comm: np.ndarray
    kernels: np.ndarray
    defer: np.ndarray
    blocking: np.ndarray  # a collective outside a pair blocks compute (its mechanism is off, not native)
    busy_in: np.ndarray  # seconds it holds the intra-node tier (0: not on it)
    busy_out: np.ndarray  # the same, inter-node
    sync: np.ndarray  # host sync (and a priority transfer on the links)
    cls: np.ndarray
    slow: np.ndarray  # the compute slow-down while it is in flight
    wire_in: np.ndarray
    wire_out: np.ndarray
    to_comm: np.ndarray  # compute seconds from the segment to the program's next collective
    aoff: np.ndarray
    aidx: np.ndarray
    act_bytes: np.ndarray  # per stage: activations kept from F to the end of its backward


class Actions(NamedTuple):
    """The ranks' lists, concatenated: rank ``r``'s actions are ``off[r]:off[r + 1]``; per action its kind, part
    count (2 for an OVERLAP_F_B pair), part keys, part labels (text ids), whether it lies in the rank's steady
    window and whether the next compute action is a pair. Also each stage's rank, each RECV's list index (−1:
    none), each compute key's SEND (an index into ``s_*``, −1: none) and each SEND's key, text id and list index."""

    off: np.ndarray
    kind: np.ndarray
    n: np.ndarray
    key0: np.ndarray
    key1: np.ndarray
    label0: np.ndarray
    label1: np.ndarray
    steady: np.ndarray
    next_pair: np.ndarray
    owner: np.ndarray
    recv_idx: np.ndarray
    send_of: np.ndarray
    s_key: np.ndarray
    s_text: np.ndarray
    s_index: np.ndarray
    win_lo: np.ndarray
    win_hi: np.ndarray


class State(NamedTuple):
    """Per-rank clocks and accumulators, the parts' and SENDs' times, and the records the timeline is built from
    (growing lists as a preallocated buffer and a count: ``*_off`` the rank's first slot, ``*_n`` how many)."""

    rf: np.ndarray
    ri: np.ndarray
    stats: np.ndarray  # [rank, class, (total, exposed, steady total, steady exposed, intra bytes, inter bytes)]
    stat_order: np.ndarray  # [rank, j]: the j-th class the rank touched
    stat_n: np.ndarray
    k_end: np.ndarray
    k_start: np.ndarray
    send_end: np.ndarray
    send_start: np.ndarray
    send_ready: np.ndarray
    first_f: np.ndarray  # [rank, stage]
    ff_order: np.ndarray
    ff_n: np.ndarray
    last_b: np.ndarray
    lb_order: np.ndarray
    lb_n: np.ndarray
    live: np.ndarray  # [slot, (time, bytes)]
    live_off: np.ndarray
    live_n: np.ndarray
    tb: np.ndarray  # [slot, (start, end)]: the tiers' busy intervals, per (rank, tier) = rank · 2 + tier
    tb_off: np.ndarray
    tb_n: np.ndarray
    infl: np.ndarray  # [slot, (begin, end, slow-down)]: collectives in flight
    infl_off: np.ndarray
    infl_n: np.ndarray
    ev: np.ndarray  # [i, (rank, text, stream)]: events (stream 0 compute, 1 a SEND)
    ev_t: np.ndarray  # [i, (start, end)]
    seg: np.ndarray  # [i, (rank, text, program, index)]: segment events (detail)
    seg_t: np.ndarray
    counts: np.ndarray  # (events, segment events)
    info: np.ndarray  # what a status other than OK is about (ints)
    info_t: np.ndarray  # (the clock of EXCEEDED)


class Parts(NamedTuple):
    """Compute parts being scheduled, in slots: key, label, program, pointer, ready, produced (a remote input's
    producer end), host cursor, start (−1: not started), end, remote/overlapped/steady flags, the deferrable
    segments pooled, the segments' ends and the queueing of its collectives (start, the class queued behind)."""

    key: np.ndarray
    label: np.ndarray
    prog: np.ndarray
    ptr: np.ndarray
    npool: np.ndarray
    ready: np.ndarray
    produced: np.ndarray
    host: np.ndarray
    start: np.ndarray
    end: np.ndarray
    remote: np.ndarray
    over: np.ndarray
    steady: np.ndarray
    pool: np.ndarray  # [slot, j]
    ends: np.ndarray  # [slot, segment]
    qstart: np.ndarray
    qbehind: np.ndarray
    free: np.ndarray  # stack of free slots
    nfree: np.ndarray
    carry: np.ndarray  # [rank, j]: parts of earlier pairs still running
    ncarry: np.ndarray
    scratch: np.ndarray  # [3, slots]: the parts of a step, of a flush, and the heads' segments
    heads: np.ndarray  # [slots]: the heads' ready times
    pool_dep: np.ndarray  # one schedule's pool of deferrable segments: ready, part, segment
    pool_q: np.ndarray
    pool_i: np.ndarray
    cuts: np.ndarray  # the slow-down's interval cuts
    rank_ptr: np.ndarray  # per rank: the next action of its list, and the SEND it waits on


@jit
def _touch(st, r, c):
    """Record that rank ``r`` touched class ``c`` (the order the per-rank stats are listed in)."""
    for j in range(st.stat_n[r]):
        if st.stat_order[r, j] == c:
            return
    st.stat_order[r, st.stat_n[r]] = c
    st.stat_n[r] += 1


@jit
def _slowdown(st, r, start, end, cuts_buf):
    """Extra seconds of a compute segment over [start, end] beside rank ``r``'s collectives in flight (pruning
    those that ended before ``start``)."""
    o = st.infl_off[r]
    n = st.infl_n[r]
    if n != 1 or st.infl[o, 1] <= start:
        k = 0
        for j in range(n):
            if st.infl[o + j, 1] > start:
                if k != j:
                    st.infl[o + k, 0] = st.infl[o + j, 0]
                    st.infl[o + k, 1] = st.infl[o + j, 1]
                    st.infl[o + k, 2] = st.infl[o + j, 2]
                k += 1
        st.infl_n[r] = k
        n = k
    if n == 0:
        return 0.0
    if n == 1:
        a, b, slow = st.infl[o, 0], st.infl[o, 1], st.infl[o, 2]
        hi = end if end < b else b
        lo = start if start > a else a
        d = hi - lo
        return slow * (d if d > 0.0 else 0.0)
    cuts = cuts_buf
    m = 0
    for j in range(-1, 2 * n + 1):  # start, end, then what begins or ends strictly inside: sorted, without repeats
        t = start if j == -1 else end if j == 0 else st.infl[o + (j - 1) // 2, (j - 1) % 2]
        if j > 0 and not start < t < end:
            continue
        k = m
        while k > 0 and cuts[k - 1] > t:
            k -= 1
        if k > 0 and cuts[k - 1] == t:
            continue
        for x in range(m, k, -1):
            cuts[x] = cuts[x - 1]
        cuts[k] = t
        m += 1
    extra = 0.0
    for c in range(m - 1):
        lo, hi = cuts[c], cuts[c + 1]
        best, found = 0.0, False
        for j in range(n):
            if st.infl[o + j, 0] <= lo and st.infl[o + j, 1] >= hi:
                s = st.infl[o + j, 2]
                if not found or s > best:
                    best, found = s, True
        extra += (hi - lo) * best
    return extra


@jit
def _claim(st, r, b_in, b_out, ready, cls, priority):
    """(start, the class it queued behind or −1) of a transfer of class ``cls`` holding the intra tier ``b_in``
    seconds and the inter tier ``b_out`` (0: not at all) from ``ready``: bulk transfers queue behind the tier's
    earlier ones, a priority one only behind other priority ones, pushing the bulk queue back by its own time."""
    start, behind = ready, -1
    fcol = PRIO_FREE if priority else TIER_FREE
    ccol = PRIO_CLS if priority else TIER_CLS
    for t in range(2):
        b = b_in if t == 0 else b_out
        if b > 0:
            f = st.rf[r, fcol + t]
            if f > start:
                start, behind = f, st.ri[r, ccol + t]
    for t in range(2):
        b = b_in if t == 0 else b_out
        if not b > 0:
            continue
        if priority:
            st.rf[r, PRIO_FREE + t] = start + b
            st.ri[r, PRIO_CLS + t] = cls
            f = st.rf[r, TIER_FREE + t]
            st.rf[r, TIER_FREE + t] = (f if f > start else start) + b
        else:
            st.rf[r, TIER_FREE + t] = start + b
        st.ri[r, TIER_CLS + t] = cls
        j = r * 2 + t
        k = st.tb_off[j] + st.tb_n[j]
        st.tb[k, 0] = start
        st.tb[k, 1] = start + b
        st.tb_n[j] += 1
    return start, behind


@jit
def _seg_event(st, r, text, prog, i, start, end):
    k = st.counts[1]
    st.seg[k, 0], st.seg[k, 1], st.seg[k, 2], st.seg[k, 3] = r, text, prog, i
    st.seg_t[k, 0], st.seg_t[k, 1] = start, end
    st.counts[1] += 1


@jit
def _charge_comm_wait(pg, st, pt, r, p, i, free, until):
    """Charge the compute stream's wait [``free``, ``until``] on collective ``i`` of part ``p``: to the class it
    queued behind on its link until it started, then to its own class."""
    behind = pt.qbehind[p, i]
    start = pt.qstart[p, i] if behind >= 0 else free
    steady = pt.steady[p]
    if behind >= 0 and start > free:
        _touch(st, r, behind)
        mn = until if until < start else start
        wait = mn - free
        st.stats[r, behind, 1] += wait
        if steady:
            st.stats[r, behind, 3] += wait
        free = mn
    if until > free:
        c = pg.cls[pg.off[pt.prog[p]] + i]
        _touch(st, r, c)
        st.stats[r, c, 1] += until - free
        if steady:
            st.stats[r, c, 3] += until - free


@jit
def _charge_input_wait(st, pt, r, p, free, dep):
    """A wait of part ``p`` for its input: the part after its producer on another rank finished is ``pp``'s (the
    rest is the pipeline's bubble)."""
    if pt.remote[p]:
        produced = pt.produced[p]
        wait = dep - (produced if produced > free else free)
        if wait > 0:
            _touch(st, r, _value(PP))
            st.stats[r, PP, 1] += wait
            if pt.steady[p]:
                st.stats[r, PP, 3] += wait


@jit
def _charge_wait(pg, st, pt, r, p, dep_seg, free, dep, parts, nparts):
    """Charge a compute segment's wait ``dep − free`` to what it waited on: a collective (in an overlapped pair,
    while another part has not started for want of its remote input, that stretch is that input's wait), or the
    part's own input."""
    if dep_seg >= 0:
        if not pg.is_comm[pg.off[pt.prog[p]] + dep_seg]:
            return
        late = _value(-1)
        for q in range(nparts):
            o = parts[q]
            if o != p and pt.start[o] < 0 and pt.ready[o] > free:
                if late < 0 or pt.ready[o] > pt.ready[late]:
                    late = o
        if late >= 0:
            ready = pt.ready[late]
            until = ready if ready < dep else dep
            _charge_input_wait(st, pt, r, late, free, until)
            free = until
        if dep > free:
            _charge_comm_wait(pg, st, pt, r, p, dep_seg, free, dep)
        return
    _charge_input_wait(st, pt, r, p, free, dep)


@jit
def _issue_comm(pg, st, pt, cfg, r, p, i, dep, host, free):
    """Put collective ``i`` of part ``p`` on its tiers once its input is there (``dep``) and the host has issued it
    (``host``); (its end, the compute stream's free time, which a blocking collective pushes to its end)."""
    g = pg.off[pt.prog[p]] + i
    blocking = (not pt.over[p]) and pg.blocking[g]
    ready = dep if dep > host else host
    if blocking:
        m = free if free > dep else dep
        if host > m:
            st.rf[r, HOST_WAIT] += host - m
            free = host
        if free > ready:
            ready = free
    c = pg.cls[g]
    start, behind = _claim(st, r, pg.busy_in[g], pg.busy_out[g], ready, c, pg.sync[g])
    if behind >= 0:
        pt.qstart[p, i] = start
        pt.qbehind[p, i] = behind
    secs = pg.secs[g]
    end = start + secs
    _touch(st, r, c)
    st.stats[r, c, 0] += secs
    st.stats[r, c, 4] += pg.wire_in[g]
    st.stats[r, c, 5] += pg.wire_out[g]
    if pt.steady[p]:
        st.stats[r, c, 2] += secs
    slow = pg.slow[g]
    if slow != 0:
        k = st.infl_off[r] + st.infl_n[r]
        st.infl[k, 0], st.infl[k, 1], st.infl[k, 2] = start, end, slow
        st.infl_n[r] += 1
    if blocking and end > free:
        _charge_comm_wait(pg, st, pt, r, p, i, free, end)
        free = end
    return end, free


@jit
def _post(ac, st, cfg, r, index, at):
    """Hold rank ``r``'s compute stream from ``at`` for the p2p post of its action ``index``; its end."""
    seconds = cfg[P2P_HOST_S]
    _touch(st, r, _value(PP))
    st.stats[r, PP, 1] += seconds
    if ac.win_lo[r] <= index <= ac.win_hi[r]:
        st.stats[r, PP, 3] += seconds
    return at + seconds


@jit
def _send(ac, st, cfg, r, s, ready, free):
    """Issue SEND ``s`` of ``ready``-produced data on the PP link (a priority transfer); the compute stream's free
    time (a SEND without mechanism ``pp`` blocks it)."""
    index = ac.s_index[s]
    if cfg[P2P_HOST_S]:
        ready = free = _post(ac, st, cfg, r, index, ready if ready > free else free)
    p2p = cfg[P2P_S]
    intra = cfg[P2P_INTRA] != 0
    b = p2p if p2p > 0 else 0.0
    start, _ = _claim(st, r, b if intra else 0.0, 0.0 if intra else b, ready, _value(PP), _value(True))
    end = start + p2p
    _touch(st, r, _value(PP))
    st.stats[r, PP, 0] += p2p
    st.stats[r, PP, 4 if intra else 5] += cfg[P2P_BYTES]
    steady = ac.win_lo[r] <= index <= ac.win_hi[r]
    if steady:
        st.stats[r, PP, 2] += p2p
    if cfg[PP_ASYNC] == 0 and end > free:
        wait = end - (ready if ready > free else free)
        w = wait if wait > 0.0 else 0.0
        st.stats[r, PP, 1] += w
        if steady:
            st.stats[r, PP, 3] += w
        free = end
    key = ac.s_key[s]
    st.send_end[key], st.send_ready[key], st.send_start[key] = end, ready, start
    k = st.counts[0]
    st.ev[k, 0], st.ev[k, 1], st.ev[k, 2] = r, ac.s_text[s], 1
    st.ev_t[k, 0], st.ev_t[k, 1] = start, end
    st.counts[0] += 1
    return free


@jit
def _finish(pg, ac, st, pt, cfg, r, p, free, S, M):
    """Record a finished part (its end, memory, event) and issue the SEND that carries its output; the compute
    stream's free time."""
    key = pt.key[p]
    kind = key // (S * M)
    stage = (key // M) % S
    start = pt.start[p] if pt.start[p] >= 0 else pt.ready[p]
    end = pt.end[p] if pt.end[p] >= pt.ready[p] else pt.ready[p]
    st.k_end[key], st.k_start[key] = end, start
    act = pg.act_bytes[stage]
    if kind == KF:
        if np.isnan(st.first_f[r, stage]):
            st.first_f[r, stage] = start
            st.ff_order[r, st.ff_n[r]] = stage
            st.ff_n[r] += 1
        k = st.live_off[r] + st.live_n[r]
        st.live[k, 0], st.live[k, 1] = start, act
        st.live_n[r] += 1
    elif kind == KB or kind == KW:
        if np.isnan(st.last_b[r, stage]):
            st.lb_order[r, st.lb_n[r]] = stage
            st.lb_n[r] += 1
        st.last_b[r, stage] = end
        k = st.live_off[r] + st.live_n[r]
        st.live[k, 0], st.live[k, 1] = end, -act
        st.live_n[r] += 1
    k = st.counts[0]
    st.ev[k, 0], st.ev[k, 1], st.ev[k, 2] = r, pt.label[p], 0
    st.ev_t[k, 0], st.ev_t[k, 1] = start, end
    st.counts[0] += 1
    s = ac.send_of[key]
    if s >= 0:
        free = _send(ac, st, cfg, r, s, end, free)
    return free


@jit
def _dep(pg, pt, p, i):
    """(when segment ``i`` of part ``p`` has its inputs, the segment it waits on last, −1 for the part's input)."""
    dep, dep_seg = pt.ready[p], _value(-1)
    g = pg.off[pt.prog[p]] + i
    for a in range(pg.aoff[g], pg.aoff[g + 1]):
        j = pg.aidx[a]
        if pt.ends[p, j] > dep:
            dep, dep_seg = pt.ends[p, j], j
    return dep, dep_seg


@jit
def _run_in_order(pg, ac, st, pt, cfg, r, p, S, M):
    """One part that overlaps nothing: its segments in list order."""
    h, detail = cfg[H], cfg[DETAIL] != 0
    off = pg.off[pt.prog[p]]
    n = pg.off[pt.prog[p] + 1] - off
    free, host, ready = st.rf[r, FREE], pt.host[p], pt.ready[p]
    busy = host_wait = 0.0
    first = -1.0
    for i in range(n):
        g = off + i
        dep, dep_seg = ready, _value(-1)
        for a in range(pg.aoff[g], pg.aoff[g + 1]):
            j = pg.aidx[a]
            if pt.ends[p, j] > dep:
                dep, dep_seg = pt.ends[p, j], j
        if pg.is_comm[g]:
            host += h
            end, free = _issue_comm(pg, st, pt, cfg, r, p, i, dep, host, free)
            if pg.sync[g]:
                host = (host if host >= end else end) + cfg[SYNC_S]
            pt.ends[p, i] = end
            if first < 0:
                first = end - pg.secs[g]
            if detail:
                _seg_event(st, r, pt.label[p], pt.prog[p], i, end - pg.secs[g], end)
            continue
        issue = host + h if pg.kernels[g] else host
        start = free if free >= dep else dep
        if dep > free:
            _charge_wait(pg, st, pt, r, p, dep_seg, free, dep, pt.scratch[0], _value(0))
        if issue > start:
            host_wait += issue - start
            start = issue
        dur = pg.secs[g]
        if st.infl_n[r]:
            dur += _slowdown(st, r, start, start + dur, pt.cuts)
        host += pg.kernels[g] * h
        end = start + dur if start + dur > host else host
        busy += end - start
        free = end
        pt.ends[p, i] = end
        if first < 0:
            first = start
        if detail:
            _seg_event(st, r, pt.label[p], pt.prog[p], i, start, end)
    if n:
        if pt.start[p] < 0:
            pt.start[p] = first
        mx = pt.ends[p, 0]
        for i in range(1, n):
            if pt.ends[p, i] > mx:
                mx = pt.ends[p, i]
        if mx > pt.end[p]:
            pt.end[p] = mx
    st.rf[r, BUSY] += busy
    st.rf[r, HOST_WAIT] += host_wait
    pt.host[p] = host
    st.rf[r, FREE] = free
    if host > st.rf[r, HOST]:
        st.rf[r, HOST] = host
    st.rf[r, FREE] = _finish(pg, ac, st, pt, cfg, r, p, free, S, M)


@jit
def _mark(st, pt, r, p, i, start, end, detail):
    pt.ends[p, i] = end
    if pt.start[p] < 0:
        pt.start[p] = start
    if end > pt.end[p]:
        pt.end[p] = end
    if detail:
        _seg_event(st, r, pt.label[p], pt.prog[p], i, start, end)


@jit
def schedule_parts(pg, ac, st, pt, cfg, r, parts, carry, S, M):
    """List-schedule the parts (slot ids) on rank ``r``'s streams (cost_models/timeline.py's model); the parts left
    unfinished are written to the rank's carry. Returns OK, or UNFINISHED (a simulator bug) when parts are left
    without ``carry``.

    A part's collectives are issued as soon as the compute before them is. Of the parts' next compute segments the
    one that can start first runs, and among those that can start now the one closest to its part's next
    collective; when every part would wait, a deferrable weight gradient that is ready runs instead. With
    ``carry``, scheduling stops as soon as every remaining segment would wait for a collective."""
    nparts = len(parts)
    if nparts == 1 and not pt.over[parts[0]]:
        _run_in_order(pg, ac, st, pt, cfg, r, parts[0], S, M)
        pt.ncarry[r] = 0
        return OK
    h, sync_s, detail = cfg[H], cfg[SYNC_S], cfg[DETAIL] != 0
    free = st.rf[r, FREE]
    pool_dep, pool_q, pool_i = pt.pool_dep, pt.pool_q, pt.pool_i
    npool = 0
    for q in range(nparts):
        p = parts[q]
        for j in range(pt.npool[p]):
            i = pt.pool[p, j]
            pool_dep[npool], pool_q[npool], pool_i[npool] = _dep(pg, pt, p, i)[0], q, i
            npool += 1
    head_dep, head_seg = pt.heads, pt.scratch[2]  # head_seg −2: the part has no next compute segment
    moved = -1  # -1: every part
    inf = np.inf
    while True:
        for q in range(nparts):
            if moved >= 0 and q != moved:
                continue
            p = parts[q]
            off = pg.off[pt.prog[p]]
            n = pg.off[pt.prog[p] + 1] - off
            while pt.ptr[p] < n and (pg.is_comm[off + pt.ptr[p]] or (pt.over[p] and pg.defer[off + pt.ptr[p]])):
                i = pt.ptr[p]
                pt.ptr[p] += 1
                g = off + i
                if not pg.is_comm[g]:
                    pool_dep[npool], pool_q[npool], pool_i[npool] = _dep(pg, pt, p, i)[0], q, i
                    npool += 1
                    pt.pool[p, pt.npool[p]] = i
                    pt.npool[p] += 1
                    continue
                pt.host[p] += h
                end, free = _issue_comm(pg, st, pt, cfg, r, p, i, _dep(pg, pt, p, i)[0], pt.host[p], free)
                if pg.sync[g]:
                    hp = pt.host[p]
                    pt.host[p] = (hp if hp >= end else end) + sync_s
                _mark(st, pt, r, p, i, end - pg.secs[g], end, detail)
            if pt.ptr[p] < n:
                head_dep[q], head_seg[q] = _dep(pg, pt, p, pt.ptr[p])
            else:
                head_seg[q] = -2
            if pt.ptr[p] >= n and pt.npool[p] == 0 and np.isnan(st.k_end[pt.key[p]]):
                free = _finish(pg, ac, st, pt, cfg, r, p, free, S, M)
        floor = free + EPS
        best, best_t, best_key, best_tie = -1, inf, inf, inf
        for q in range(nparts):
            if head_seg[q] == -2:
                continue
            p = parts[q]
            g = pg.off[pt.prog[p]] + pt.ptr[p]
            t = pt.host[p] + h if pg.kernels[g] else pt.host[p]
            if t < free:
                t = free
            if t < head_dep[q]:
                t = head_dep[q]
            key_t = t if t > floor else floor
            tie = pg.to_comm[g]
            if best < 0 or key_t < best_key or (key_t == best_key and tie < best_tie):
                best, best_t, best_key, best_tie = q, t, key_t, tie
        pool_t = inf
        top = -1
        if npool:
            top = 0
            for j in range(1, npool):
                if (pool_dep[j] < pool_dep[top] or (pool_dep[j] == pool_dep[top] and (
                        pool_q[j] < pool_q[top] or (pool_q[j] == pool_q[top] and pool_i[j] < pool_i[top])))):
                    top = j
            pool_t = free
            if pool_dep[top] > pool_t:
                pool_t = pool_dep[top]
            ph = pt.host[parts[pool_q[top]]] + h
            if ph > pool_t:
                pool_t = ph
        if best < 0 and not npool:
            break
        if carry and (pool_t if pool_t < best_t else best_t) > floor:
            break
        if npool and pool_t < best_t - EPS:
            q, i = pool_q[top], pool_i[top]
            npool -= 1
            pool_dep[top], pool_q[top], pool_i[top] = pool_dep[npool], pool_q[npool], pool_i[npool]
            p = parts[q]
            for j in range(pt.npool[p]):
                if pt.pool[p, j] == i:
                    pt.npool[p] -= 1
                    pt.pool[p, j] = pt.pool[p, pt.npool[p]]
                    break
            dep, dep_seg = _dep(pg, pt, p, i)
        else:
            q = best
            p = parts[q]
            i = pt.ptr[p]
            pt.ptr[p] += 1
            dep, dep_seg = head_dep[q], head_seg[q]
        moved = q
        g = pg.off[pt.prog[p]] + i
        issue = pt.host[p] + h if pg.kernels[g] else pt.host[p]
        start = dep if dep > free else free
        if dep > free:
            _charge_wait(pg, st, pt, r, p, dep_seg, free, dep, parts, nparts)
        if issue > start:
            st.rf[r, HOST_WAIT] += issue - start
            start = issue
        dur = pg.secs[g]
        if st.infl_n[r]:
            dur += _slowdown(st, r, start, start + dur, pt.cuts)
        pt.host[p] += pg.kernels[g] * h
        end = start + dur
        if end < pt.host[p]:
            end = pt.host[p]
        st.rf[r, BUSY] += end - start
        free = end
        _mark(st, pt, r, p, i, start, end, detail)
    st.rf[r, FREE] = free
    hmax = st.rf[r, HOST]
    for q in range(nparts):
        if pt.host[parts[q]] > hmax:
            hmax = pt.host[parts[q]]
    st.rf[r, HOST] = hmax
    left = 0
    for q in range(nparts):
        if np.isnan(st.k_end[pt.key[parts[q]]]):
            pt.carry[r, left] = parts[q]
            left += 1
    pt.ncarry[r] = left
    if left and not carry:
        st.info[0] = r
        return UNFINISHED
    return OK


@jit
def _release(pt, parts, r):
    """Return the slots of ``parts`` that are not in rank ``r``'s carry to the free stack."""
    for q in range(len(parts)):
        p = parts[q]
        kept = False
        for j in range(pt.ncarry[r]):
            if pt.carry[r, j] == p:
                kept = True
        if not kept:
            pt.free[pt.nfree[0]] = p
            pt.nfree[0] += 1


@jit
def _flush(pg, ac, st, pt, cfg, r, S, M):
    """Finish what rank ``r``'s earlier pairs left (carry=False)."""
    parts = pt.scratch[1, :pt.ncarry[r]]
    for j in range(pt.ncarry[r]):
        parts[j] = pt.carry[r, j]
    status = schedule_parts(pg, ac, st, pt, cfg, r, parts, _value(False), S, M)
    _release(pt, parts, r)
    return status


@jit
def _new_part(pg, pt, key, label, prog, ready, produced, remote, over, steady, host):
    if pt.nfree[0] == 0:
        return -1
    pt.nfree[0] -= 1
    p = pt.free[pt.nfree[0]]
    pt.key[p], pt.label[p], pt.prog[p], pt.ptr[p], pt.npool[p] = key, label, prog, 0, 0
    pt.ready[p], pt.produced[p], pt.host[p], pt.start[p], pt.end[p] = ready, produced, host, -1.0, 0.0
    pt.remote[p], pt.over[p], pt.steady[p] = remote, over, steady
    n = pg.off[prog + 1] - pg.off[prog]
    pt.ends[p, :n] = 0.0
    pt.qbehind[p, :n] = -1
    return p


@jit
def _input_ready(ac, st, r, key, index, S, M):
    """(status, when the input of part ``key`` is ready, when its producer finished, whether it came from another
    rank): BLOCKED (``st.info[0]``: the SEND) while a remote producer has not been simulated, NO_LOCAL (``info``:
    the part) for a local producer that can never run, NO_RECV (``info``: RECV kind, stage, micro-batch) when the
    RECV is not earlier in the list."""
    kind = key // (S * M)
    stage = (key // M) % S
    mb = key % M
    ready, produced, remote = 0.0, 0.0, False
    if kind != KF:  # B and I need their F, W its I
        k = ((KI if kind == KW else KF) * S + stage) * M + mb
        if np.isnan(st.k_end[k]):
            st.info[0] = k
            return NO_LOCAL, ready, produced, remote
        e = st.k_end[k]
        ready = e if e > ready else ready
    if kind == KW:
        return OK, ready, produced, remote
    peer = stage - 1 if kind == KF else stage + 1
    if 0 <= peer < S:
        if ac.owner[peer] == r:
            k = -1
            if kind == KF:
                if not np.isnan(st.k_end[(KF * S + peer) * M + mb]):
                    k = (KF * S + peer) * M + mb
            else:
                if not np.isnan(st.k_end[(KB * S + peer) * M + mb]):
                    k = (KB * S + peer) * M + mb
                elif not np.isnan(st.k_end[(KI * S + peer) * M + mb]):
                    k = (KI * S + peer) * M + mb
            if k < 0:
                st.info[0] = ((KF if kind == KF else KB) * S + peer) * M + mb
                return NO_LOCAL, ready, produced, remote
            e = st.k_end[k]
            ready = e if e > ready else ready
        else:
            rk = 0 if kind == KF else 1
            at = ac.recv_idx[(rk * S + stage) * M + mb]
            if at < 0 or at > index:
                st.info[0], st.info[1], st.info[2] = rk, stage, mb
                return NO_RECV, ready, produced, remote
            sk = (rk * S + peer) * M + mb
            if np.isnan(st.send_end[sk]):
                st.info[0] = sk
                return BLOCKED, ready, produced, remote
            e = st.send_end[sk]
            ready, produced, remote = (e if e > ready else ready), st.send_ready[sk], True
    return OK, ready, produced, remote


@jit
def _needs_running(ac, pt, r, key, S, M):
    """Whether part ``key`` needs a part in rank ``r``'s carry (its own stage's earlier part, or a local neighbour
    stage's)."""
    kind = key // (S * M)
    stage = (key // M) % S
    mb = key % M
    for j in range(pt.ncarry[r]):
        k2 = pt.key[pt.carry[r, j]]
        kind2 = k2 // (S * M)
        stage2 = (k2 // M) % S
        if k2 % M != mb:
            continue
        if stage2 == stage and ((kind in (KB, KI) and kind2 == KF) or (kind == KW and kind2 == KI)):
            return True
        if kind == KF and stage2 == stage - 1 and kind2 == KF and stage - 1 >= 0 and ac.owner[stage - 1] == r:
            return True
        if kind in (KB, KI) and stage2 == stage + 1 and kind2 in (KB, KI) and stage + 1 < S \
                and ac.owner[stage + 1] == r:
            return True
    return False


@jit
def _step_rank(pg, ac, st, pt, cfg, r, i, S, M):
    """Simulate action ``i`` of rank ``r``; a status (BLOCKED: it waits for another rank)."""
    a = ac.off[r] + i
    kind = ac.kind[a]
    if kind == A_RECV and cfg[P2P_HOST_S]:
        st.rf[r, FREE] = _post(ac, st, cfg, r, i, st.rf[r, FREE])
    if kind != A_COMPUTE:
        return OK
    n = ac.n[a]
    if pt.ncarry[r]:
        if _needs_running(ac, pt, r, ac.key0[a], S, M) or (n > 1 and _needs_running(ac, pt, r, ac.key1[a], S, M)):
            status = _flush(pg, ac, st, pt, cfg, r, S, M)
            if status != OK:
                return status
    status, ready0, produced0, remote0 = _input_ready(ac, st, r, ac.key0[a], i, S, M)
    if status != OK:
        return status
    ready1, produced1, remote1 = 0.0, 0.0, False
    if n > 1:
        status, ready1, produced1, remote1 = _input_ready(ac, st, r, ac.key1[a], i, S, M)
        if status != OK:
            return status
    pair = n > 1
    steady = ac.win_lo[r] <= i <= ac.win_hi[r]
    nc = pt.ncarry[r]
    parts = pt.scratch[0, :nc + n]
    for j in range(nc):
        parts[j] = pt.carry[r, j]
    host = st.rf[r, HOST]
    for j in range(n):
        key = ac.key0[a] if j == 0 else ac.key1[a]
        kind_j = key // (S * M)
        stage = (key // M) % S
        p = _new_part(pg, pt, key, ac.label0[a] if j == 0 else ac.label1[a], stage * 4 + kind_j,
                      ready0 if j == 0 else ready1, produced0 if j == 0 else produced1,
                      remote0 if j == 0 else remote1, pair, steady, host)
        if p < 0:
            return NO_SLOT
        parts[nc + j] = p
    status = schedule_parts(pg, ac, st, pt, cfg, r, parts, pair and ac.next_pair[a], S, M)
    _release(pt, parts, r)
    return status


@jit
def run(pg, ac, st, pt, cfg, S, M):
    """Step every rank through its list until all are done (a status: OK, EXCEEDED with the clock in
    ``st.info_t[0]``, DEADLOCK with the first unfinished rank, its list index and the SEND it waits on in
    ``st.info``, or what a step returned)."""
    R = len(ac.off) - 1
    ptr, blocked_on = pt.rank_ptr[0], pt.rank_ptr[1]
    stop = cfg[STOP_ABOVE]
    while True:
        todo = False
        for r in range(R):
            if ptr[r] < ac.off[r + 1] - ac.off[r]:
                todo = True
        if not todo:
            break
        progressed = 0
        for r in range(R):
            while ptr[r] < ac.off[r + 1] - ac.off[r]:
                status = _step_rank(pg, ac, st, pt, cfg, r, ptr[r], S, M)
                if status == BLOCKED:
                    blocked_on[r] = st.info[0]
                    if pt.ncarry[r]:
                        status = _flush(pg, ac, st, pt, cfg, r, S, M)
                        if status != OK:
                            return status
                        progressed += 1
                    break
                if status != OK:
                    st.info[3], st.info[4] = r, ptr[r]
                    return status
                ptr[r] += 1
                progressed += 1
        if not progressed:
            for r in range(R):
                if ptr[r] < ac.off[r + 1] - ac.off[r]:
                    st.info[0], st.info[1], st.info[2] = r, ptr[r], blocked_on[r]
                    return DEADLOCK
        clock = st.rf[0, FREE]
        for r in range(1, R):
            if st.rf[r, FREE] > clock:
                clock = st.rf[r, FREE]
        if clock > stop:
            st.info_t[0] = clock
            return EXCEEDED
    for r in range(R):
        if pt.ncarry[r]:
            status = _flush(pg, ac, st, pt, cfg, r, S, M)
            if status != OK:
                return status
    return OK


@jit
def run_actions(pg, ac, st, pt, cfg, first, out):
    """Schedule each action ``j`` on an idle rank 0, one independently of the other: its parts are stages
    ``first[j]`` to ``first[j + 1] − 1``, each stage's forward, with inputs ready at 0 (timeline.action_times_s);
    ``out[j]``: when its last part ends. A status."""
    S = len(pg.act_bytes)
    r = _value(0)
    for j in range(len(first) - 1):
        st.rf[0, :] = 0.0
        st.ri[0, :] = -1
        st.stats[0, :, :] = 0.0
        st.stat_n[0] = st.infl_n[0] = st.live_n[0] = st.ff_n[0] = st.lb_n[0] = 0
        st.tb_n[0] = st.tb_n[1] = st.counts[0] = st.counts[1] = 0
        n = first[j + 1] - first[j]
        if n == 0:
            out[j] = 0.0
            continue
        parts = pt.scratch[0, :n]
        for i in range(n):
            s = first[j] + i
            parts[i] = _new_part(pg, pt, s, s, s * 4, _value(0.0), _value(0.0), _value(False), n > 1,
                                 _value(False), _value(0.0))
        status = schedule_parts(pg, ac, st, pt, cfg, r, parts, _value(False), S, _value(1))
        if status != OK:
            return status
        _release(pt, parts, r)
        last = st.k_end[first[j]]
        for s in range(first[j] + 1, first[j + 1]):
            if st.k_end[s] > last:
                last = st.k_end[s]
        out[j] = last
    return OK


@jit
def fill(start, need, a, b):
    """End time of ``need`` seconds of work that starts at ``start`` and uses only the gaps between the intervals
    ``[a[j], b[j]]`` (sorted by start, then end): cost_models/step.py's DP collectives in the links' idle time."""
    t = start
    for j in range(len(a)):
        if b[j] <= t:
            continue
        if a[j] > t:
            gap = a[j] - t
            if gap >= need:
                return t + need
            need -= gap
        t = t if t >= b[j] else b[j]
    return t + need


@jit
def to_comm(off, secs, is_comm, out):
    """Fill ``out``: per segment of each program ``off[g]:off[g + 1]``, the compute seconds from it to the
    program's next collective (infinite when none follows), summed from the program's end."""
    for g in range(len(off) - 1):
        run = np.inf
        for i in range(off[g + 1] - 1, off[g] - 1, -1):
            run = 0.0 if is_comm[i] else run + secs[i]
            out[i] = run
