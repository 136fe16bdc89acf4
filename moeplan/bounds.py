"""Lower bounds on the simulated step time, for the layout search to prune with (docs/step-model.md §7).

A bound here is never above the step time ``passes/simulate.py`` predicts for the same (layout, strategy): a layout
whose bound is not below the best step found so far is never simulated, and the search reports the least bound of
what it did not simulate. Every term is something the timeline (cost_models/timeline.py) cannot finish faster than:

- **Compute stream.** A rank's compute segments run one at a time at their uncontended seconds (contention only
  slows them), and a blocking collective holds the stream for its whole time. Outside an ``OVERLAP_F_B`` pair a
  collective blocks unless it is ``native`` or its ``async_by`` mechanism is on; inside one nothing blocks, so
  when the strategy pairs forwards with backwards (``fb`` on a schedule of ``FB_PAIRED``) no collective is counted.
- **Chains.** A part that overlaps no other (every part, unless the strategy pairs forwards with backwards) runs
  its segments in list order: a compute segment after the stream segment before it and after its ``after``
  inputs, a collective once its inputs are there. So from its first to its last segment on the stream it takes at
  least the longest chain of segments each waiting for the one before (:func:`chain_s`; a collective the compute
  waits for counts whole, where the stream floor counts none of an asynchronous one), and such parts of a rank do
  not overlap on its stream. A layer's forward, input-gradient and whole-backward floors are its chains
  (:func:`floors`); the whole backward as the stage program runs it, each dW right after the dX it needs.
- **Pipeline fill and drain.** Rank ``r``'s first compute action is a forward of a stage ``s ≥ s_min(r)``, its
  lowest stage (``r`` under both placements), which needs the same micro-batch's forward through every stage below
  it: the rank cannot start before ``head_r``, the forward floors of stages ``0 … s_min(r) − 1``. When its last
  input-gradient action (``I``, or ``B`` on a schedule that does not split the backward) ends, every forward and
  input gradient of the rank has run, and that micro-batch's gradient still has to pass stages ``s_min(r) − 1 …
  0``: ``tail_r``, their backward floors. Rank 0 then runs its optimizer step. So the step is at least
  ``head_r + work_r(F, I) + tail_r + opt_0``, and at least ``head_r + work_r(F, I, W) + opt_r`` (its own optimizer
  after its own last weight gradient).
- **Whole pieces.** Every stage holds at least one whole piece (a layer, the embedding or a head), so no rank
  holds less than its pieces' floors. Under the loop placement rank 0 holds the first piece and rank ``pp − 1`` the
  last one (on stage ``pp·vpp − 1``, after the first ``pp − 1`` pieces' forwards, as above), each with one other
  piece per other chunk, at least the ``vpp − 1`` lightest of the pieces between them. Under the V placement rank 0
  holds both the first and the last piece. A heavy output head on a balanced split is what water-filling misses.
- **Links.** Bulk transfers on one link tier of a rank queue one after another and DP collectives only fill the
  tier's idle gaps, so the step is at least the tier's bulk seconds plus, under ``dp`` overlap, the DP collectives
  on it. (Priority transfers — PP sends, the EP count exchange — may overlap bulk ones and are left out.)
- **DP and optimizer.** Without ``dp`` overlap the rank's DP collectives run after its last backward, and every
  rank ends with its optimizer step (:func:`~moeplan.cost_models.step.optimizer_s`). With it, a stage's gradient
  reduce-scatters cannot start before its last backward, and queue on their link tier
  (:func:`~moeplan.cost_models.step.dp_exposure`): those of the rank's lowest stage, whose last backward ends
  after every forward and input gradient of the rank, follow ``head_r + work_r(F, I)`` (:func:`dp_tail_s`). Before
  the stage split a stage's collectives are at least those of one piece alone (times grow with the bytes), so
  :func:`layout_bound` counts the least over the pieces (:func:`dp_floor_s`): after the rank's own last backward
  under ``dp`` overlap, and once per chunk of the rank without it.

Recompute adds forward work to the backward; :func:`plan_bound` counts the whole-layer mode the memory plan chose
per rank, or under a per-tensor mode the seconds its decisions re-run and the swap the host link does not hide
(compute segments of the stage's program); :func:`layout_bound` (before any plan exists) counts none. Without the
stage split, :func:`layout_bound` bounds the stages below rank ``r`` by the first ``s_min(r)`` pieces (each stage
holds at least one) and spreads the work over the ranks by water-filling: ``max_r (c_r + w_r)`` over any split
``Σ w_r = W`` is at least the level ``L`` with ``Σ_r max(0, L − c_r) = W``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from moeplan.cost_models.memory import MODES, state_bytes_per_param
from moeplan.cost_models.step import (DpCollective, dp_collectives, layer_backward, optimizer_s,
                                      recompute_segments, stage_dp_collectives)
from moeplan.ir import kind_of
from moeplan.layout import Layout
from moeplan.mechanisms import FB_PAIRED
from moeplan.state import LayerCost, PlanState, Recompute, Segment, Strategy
from moeplan.targets import Target

SPLIT_BACKWARD = frozenset({"zero-bubble", "zbv", "dualpipev"})
"""Schedules whose backward runs as separate input- and weight-gradient actions (passes/schedule.py): their drain
chain is input gradients only."""


@dataclass(frozen=True)
class Floors:
    """One layer for one micro-batch on one device, seconds no simulation of it can beat (module docstring): the
    compute stream's forward, input-gradient (``I``), weight-gradient (``W`` alone) and whole-backward (``B``: dX
    with each dW right after what it needs) floors, the redone forward per recompute mode, and the bulk transfers per
    link tier (forward and backward, without recompute)."""

    fwd: float
    bwd_input: float
    bwd_weight: float
    backward: float
    redo: dict[str, float]
    intra: float
    inter: float


def _stream_s(segs: Sequence[Segment], strategy: Strategy) -> float:
    """Compute seconds plus the collectives that hold the compute stream (module docstring)."""
    paired = "fb" in strategy.overlap and strategy.schedule in FB_PAIRED
    t = 0.0
    for s in segs:
        if s.kind == "compute":
            t += s.seconds
        elif not paired and s.async_by != "native" and (s.async_by is None or s.async_by not in strategy.overlap):
            t += s.seconds
    return t


def chain_s(segs: Sequence[Segment], strategy: Strategy) -> float:
    """Seconds a part of ``segs`` that overlaps no other part needs from its first to its last segment on the compute
    stream, at least (module docstring, "Chains"): the longest chain of segments, each waiting for the one before,
    that starts and ends on the stream. A segment waits for those in its ``after`` and, on the stream (compute, or a
    collective that blocks), for the stream segment before it."""
    mechanisms = strategy.overlap
    best = [-1.0] * len(segs)  # the longest chain from a stream segment that ends with segment i; −1: none
    top, last = 0.0, -1
    for i, seg in enumerate(segs):
        base = max((best[j] for j in seg.after), default=-1.0)
        stream = seg.kind == "compute" or (seg.async_by != "native" and (seg.async_by is None
                                                                          or seg.async_by not in mechanisms))
        if stream:
            if last >= 0 and best[last] > base:
                base = best[last]
            best[i] = seg.seconds + max(base, 0.0)
            top, last = max(top, best[i]), i
        elif base >= 0:
            best[i] = seg.seconds + base
    return top


def floors(cost: LayerCost, strategy: Strategy) -> Floors:
    """:class:`Floors` of one layer's program under ``strategy``: its forward, input-gradient and whole-backward
    chains (:func:`chain_s`) unless the strategy pairs forwards with backwards (then the stream floors)."""
    prog = cost.program
    segs = prog.fwd + prog.bwd_input + prog.bwd_weight
    bulk = [s.comm for s in segs if s.comm is not None and not s.host_sync]
    paired = "fb" in strategy.overlap and strategy.schedule in FB_PAIRED
    floor = _stream_s if paired else chain_s
    return Floors(fwd=floor(prog.fwd, strategy), bwd_input=floor(prog.bwd_input, strategy),
                  bwd_weight=_stream_s(prog.bwd_weight, strategy),
                  backward=floor(layer_backward(cost, "none", weight=True), strategy),
                  redo={m: _stream_s(recompute_segments(cost, m), strategy) for m in MODES},
                  intra=sum(c.busy_s("intra") for c in bulk), inter=sum(c.busy_s("inter") for c in bulk))


def _drain(f: Floors, mode: Recompute, split: bool) -> float:
    """Floor of one layer's backward action on the drain chain: its input gradient (its whole backward when the
    schedule does not split them) with the forward redone before it."""
    return (f.bwd_input if split else f.backward) + f.redo[mode]


def _weight(f: Floors, split: bool) -> float:
    """What a split schedule's backward adds per micro-batch to :func:`_drain`'s input gradient, at least: its
    weight gradient, or, for a micro-batch whose backward runs whole (``B``), what ``B`` adds to ``I``; 0 unsplit."""
    return max(0.0, min(f.bwd_weight, f.backward - f.bwd_input)) if split else 0.0


def water_level(costs: Sequence[float], work: float) -> float:
    """The least ``max_r (costs[r] + w_r)`` over ``w_r ≥ 0`` with ``Σ w_r = work`` (module docstring); ``costs``
    ascending (prefix sums are)."""
    acc = 0.0
    n = len(costs)
    for i in range(n):
        acc += costs[i]
        level = (work + acc) / (i + 1)
        if i + 1 == n or level <= costs[i + 1]:
            return level
    raise ValueError("costs: must not be empty")


@dataclass(frozen=True)
class PieceSums:
    """The model's pieces in pipeline order, for :func:`layout_bound`: prefix sums of their forward floors
    (``head[r]``: the first ``r`` pieces) and of their forward plus drain floors, and per micro-batch the whole
    model's forward + input-gradient work (with the weight gradient when the schedule does not split it), its
    whole work, and its bulk seconds per link tier; the whole work of the first and of the last piece, and prefix
    sums of the others' whole work in ascending order (``middle[k]``: the ``k`` lightest)."""

    head: tuple[float, ...]
    head_tail: tuple[float, ...]
    fi: float
    total: float
    tiers: tuple[float, float]
    first: float
    last: float
    middle: tuple[float, ...]


def piece_sums(pieces: Sequence[Floors], strategy: Strategy) -> PieceSums:
    """:class:`PieceSums` of ``pieces`` (floors in pipeline order) under ``strategy``'s schedule."""
    split = strategy.schedule in SPLIT_BACKWARD
    head, head_tail = [0.0], [0.0]
    for p in pieces:
        head.append(head[-1] + p.fwd)
        head_tail.append(head_tail[-1] + p.fwd + _drain(p, "none", split))
    fwd = head[-1]
    work = [p.fwd + _drain(p, "none", split) + _weight(p, split) for p in pieces]
    middle = [0.0]
    for w in sorted(work[1:-1]):
        middle.append(middle[-1] + w)
    return PieceSums(head=tuple(head), head_tail=tuple(head_tail),
                     fi=fwd + sum(_drain(p, "none", split) for p in pieces),
                     total=sum(work), tiers=(sum(p.intra for p in pieces), sum(p.inter for p in pieces)),
                     first=work[0] if work else 0.0, last=work[-1] if len(work) > 1 else 0.0, middle=tuple(middle))


def _end_ranks(sums: PieceSums, *, pp: int, vpp: int, v_shape: bool, m: int) -> float:
    """Seconds the ranks that hold the first and the last piece cannot finish their micro-batches' work in
    (module docstring, "Whole pieces"); 0 with one PP rank (the whole work covers it)."""
    if pp == 1:
        return 0.0
    if v_shape:  # rank 0 holds stage 0 and the last stage
        return m * (sums.first + sums.last)
    others = sums.middle[min(vpp - 1, len(sums.middle) - 1)]  # one piece per other chunk, none the first or last
    return max(m * (sums.first + others), sums.head[pp - 1] + m * (sums.last + others))


def layout_bound(sums: PieceSums, *, pp: int, vpp: int, v_shape: bool, num_microbatches: int,
                 opt_floor_s: float, dp_floor_s: float, overlap_dp: bool) -> float:
    """Seconds no plan of a (layout, strategy) can beat, before its stages are split (module docstring): ``sums``
    of the model's pieces under the strategy, ``pp`` ranks of ``vpp`` stages each (``v_shape``: the V placement
    of zbv and dualpipev), ``opt_floor_s`` what every rank's optimizer step takes at least, ``dp_floor_s`` what a
    stage's DP collectives add after its last backward at least (:func:`dp_floor_s`), ``overlap_dp`` whether
    mechanism ``dp`` is on."""
    m, head = num_microbatches, sums.head[:pp]
    drained = sums.head_tail[:pp]
    if overlap_dp:  # the lowest stage's reduce-scatters follow the rank's forwards and input gradients
        drained = [max(ht, h + dp_floor_s) for h, ht in zip(head, drained)]
    else:  # every chunk's collectives follow the rank's whole work
        head = [h + vpp * dp_floor_s for h in head]
    return max(water_level(drained, m * sums.fi) + opt_floor_s,
               water_level(head, m * sums.total) + opt_floor_s,
               _end_ranks(sums, pp=pp, vpp=vpp, v_shape=v_shape, m=m) + opt_floor_s
               + (0.0 if overlap_dp else vpp * dp_floor_s),
               m * sums.tiers[0] / pp, m * sums.tiers[1] / pp)


def dp_tail_s(ops: Sequence[DpCollective], *, overlap: bool) -> float:
    """Seconds ``ops`` (one stage's DP collectives) take after the stage's last backward at least (module docstring):
    with ``dp`` overlap its reduce-scatters and all-reduces one after another on each link tier, the busiest tier;
    without it, every collective one after another."""
    if not overlap:
        return sum(o.time_s for o in ops)
    per_tier: dict[str, float] = {}
    for o in ops:
        if o.kind != "all_gather":
            per_tier[o.tier] = per_tier.get(o.tier, 0.0) + o.time_s
    return max(per_tier.values(), default=0.0)


def dp_floor_s(costs: Sequence[LayerCost], layout: Layout, target: Target, strategy: Strategy) -> float:
    """The least :func:`dp_tail_s` of a stage holding any one of the pieces ``costs`` alone (module docstring)."""
    grad_bytes = state_bytes_per_param(target.dtype_bytes, strategy.precision)[1]
    overlap = "dp" in strategy.overlap
    return min((dp_tail_s(stage_dp_collectives(layout, target, 0, dense=c.params - c.expert_params,
                                               expert=c.expert_params, grad_bytes=grad_bytes), overlap=overlap)
                for c in costs), default=0.0)


def plan_bound(state: PlanState) -> float:
    """Seconds the simulation of ``state`` (after ``plan-memory``: stages, schedule and recompute decided) cannot
    beat (module docstring)."""
    assert state.sharding and state.stages and state.memory
    lay, spec, strategy = state.layout, state.graph.spec, state.strategy
    m, split, pp = lay.num_microbatches, strategy.schedule in SPLIT_BACKWARD, lay.pp
    per_kind = {k: floors(c, strategy) for k, c in state.sharding.layer_costs.items()}
    stage_f = [0.0] * (pp * lay.vpp)  # per pipeline stage: forward and drain floors
    stage_d = [0.0] * (pp * lay.vpp)
    fi, weight, fl = [0.0] * pp, [0.0] * pp, [[] for _ in range(pp)]  # per rank: F+I (+W unsplit), W, floors
    for r in range(pp):
        mem = state.memory.stages[r]
        mode = mem.recompute if mem.recompute in MODES else "none"
        for c, names in enumerate(state.stages.chunks[r]):
            s = state.stages.stage_of(r, c)
            layers = [per_kind[kind_of(spec, n)] for n in names]
            fl[r] += layers
            # per-tensor modes: the seconds each layer re-runs, and the swap the host link does not hide, are compute
            # segments of the stage's program (cost_models/step.py stage_program)
            redo = {d.kind: d.recompute_s for d in mem.decisions if d.chunk == c}
            out, back = mem.exposed_swap_s[c] if mem.exposed_swap_s else (0.0, 0.0)
            stage_f[s] = sum(f.fwd for f in layers) + out
            stage_d[s] = (sum(_drain(f, mode, split) for f in layers) + back
                          + sum(redo.get(kind_of(spec, n).value, 0.0) for n in names))
            fi[r] += stage_f[s] + stage_d[s]
            weight[r] += sum(_weight(f, split) for f in layers)
    overlap_dp = "dp" in strategy.overlap
    opt = [optimizer_s(state, r) for r in range(pp)]
    best = 0.0
    for r in range(pp):
        head, tail = sum(stage_f[:r]), sum(stage_d[:r])
        dp = dp_collectives(state, r)
        post = opt[r] + (0.0 if overlap_dp else sum(o.time_s for o in dp))
        tiers = [m * sum(getattr(f, t) for f in fl[r]) + (sum(o.time_s for o in dp if o.tier == t) if overlap_dp
                                                          else 0.0) for t in ("intra", "inter")]
        # under dp overlap the reduce-scatters of stage r (the rank's lowest, under both placements) follow it
        own = dp_tail_s([o for o in dp if o.stage == r], overlap=True) + opt[r] if overlap_dp else 0.0
        best = max(best, head + m * fi[r] + max(tail + opt[0], own), head + m * (fi[r] + weight[r]) + post, *tiers)
    return best
