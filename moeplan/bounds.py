"""Lower bounds on the simulated step time, for the layout search to prune with (docs/step-model.md §7).

A bound here is never above the step time ``passes/simulate.py`` predicts for the same (layout, strategy): a layout
whose bound is not below the best step found so far is never simulated, and the search reports the least bound of
what it did not simulate. Every term is something the timeline (cost_models/timeline.py) cannot finish faster than:

- **Compute stream.** A rank's compute segments run one at a time at their uncontended seconds (contention only
  slows them), and a blocking collective holds the stream for its whole time. Outside an ``OVERLAP_F_B`` pair a
  collective blocks unless it is ``native`` or its ``async_by`` mechanism is on; inside one nothing blocks, so
  when the strategy pairs forwards with backwards (``fb`` on a schedule of ``FB_PAIRED``) no collective is counted.
- **Pipeline fill and drain.** Rank ``r``'s first compute action is a forward of a stage ``s ≥ s_min(r)``, its
  lowest stage (``r`` under both placements), which needs the same micro-batch's forward through every stage below
  it: the rank cannot start before ``head_r``, the forward floors of stages ``0 … s_min(r) − 1``. When its last
  input-gradient action (``I``, or ``B`` on a schedule that does not split the backward) ends, every forward and
  input gradient of the rank has run, and that micro-batch's gradient still has to pass stages ``s_min(r) − 1 …
  0``: ``tail_r``, their backward floors. Rank 0 then runs its optimizer step. So the step is at least
  ``head_r + work_r(F, I) + tail_r + opt_0``, and at least ``head_r + work_r(F, I, W) + opt_r`` (its own optimizer
  after its own last weight gradient).
- **Links.** Bulk transfers on one link tier of a rank queue one after another and DP collectives only fill the
  tier's idle gaps, so the step is at least the tier's bulk seconds plus, under ``dp`` overlap, the DP collectives
  on it. (Priority transfers — PP sends, the EP count exchange — may overlap bulk ones and are left out.)
- **DP and optimizer.** Without ``dp`` overlap the rank's DP collectives run after its last backward, and every
  rank ends with its optimizer step (:func:`~moeplan.cost_models.step.optimizer_s`).

Recompute adds forward work to the backward; :func:`plan_bound` counts the whole-layer mode the memory plan chose
per rank (none for a per-tensor mode: recompute and swap only add time, so the bound stays one),
:func:`layout_bound` (before any plan exists) counts none. Without the stage split, :func:`layout_bound` bounds the
stages below rank ``r`` by the first ``s_min(r)`` pieces (each stage holds at least one) and spreads the work over
the ranks by water-filling: ``max_r (c_r + w_r)`` over any split ``Σ w_r = W`` is at least the level ``L`` with
``Σ_r max(0, L − c_r) = W``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from moeplan.actions import placement_of, stage_rank
from moeplan.cost_models.memory import MODES
from moeplan.cost_models.step import dp_collectives, optimizer_s, recompute_segments
from moeplan.ir import kind_of
from moeplan.mechanisms import FB_PAIRED
from moeplan.state import LayerCost, PlanState, Recompute, Segment, Strategy

SPLIT_BACKWARD = frozenset({"zero-bubble", "zbv", "dualpipev"})
"""Schedules whose backward runs as separate input- and weight-gradient actions (passes/schedule.py): their drain
chain is input gradients only."""


@dataclass(frozen=True)
class Floors:
    """One layer for one micro-batch on one device, seconds no simulation of it can beat (module docstring): the
    compute stream's forward, input-gradient and weight-gradient floors, the redone forward per recompute mode, and
    the bulk transfers per link tier (forward and backward, without recompute)."""

    fwd: float
    bwd_input: float
    bwd_weight: float
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


def floors(cost: LayerCost, strategy: Strategy) -> Floors:
    """:class:`Floors` of one layer's program under ``strategy``."""
    prog = cost.program
    segs = prog.fwd + prog.bwd_input + prog.bwd_weight
    bulk = [s.comm for s in segs if s.comm is not None and not s.host_sync]
    return Floors(fwd=_stream_s(prog.fwd, strategy), bwd_input=_stream_s(prog.bwd_input, strategy),
                  bwd_weight=_stream_s(prog.bwd_weight, strategy),
                  redo={m: _stream_s(recompute_segments(cost, m), strategy) for m in MODES},
                  intra=sum(c.busy_s("intra") for c in bulk), inter=sum(c.busy_s("inter") for c in bulk))


def _drain(f: Floors, mode: Recompute, split: bool) -> float:
    """Floor of one layer's backward action on the drain chain: its input gradient (and weight gradient when the
    schedule does not split them) with the forward redone before it."""
    return f.bwd_input + f.redo[mode] + (0.0 if split else f.bwd_weight)


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
    whole work, and its bulk seconds per link tier."""

    head: tuple[float, ...]
    head_tail: tuple[float, ...]
    fi: float
    total: float
    tiers: tuple[float, float]


def piece_sums(pieces: Sequence[Floors], strategy: Strategy) -> PieceSums:
    """:class:`PieceSums` of ``pieces`` (floors in pipeline order) under ``strategy``'s schedule."""
    split = strategy.schedule in SPLIT_BACKWARD
    head, head_tail = [0.0], [0.0]
    for p in pieces:
        head.append(head[-1] + p.fwd)
        head_tail.append(head_tail[-1] + p.fwd + _drain(p, "none", split))
    fwd = head[-1]
    return PieceSums(head=tuple(head), head_tail=tuple(head_tail),
                     fi=fwd + sum(p.bwd_input + (0.0 if split else p.bwd_weight) for p in pieces),
                     total=fwd + sum(p.bwd_input + p.bwd_weight for p in pieces),
                     tiers=(sum(p.intra for p in pieces), sum(p.inter for p in pieces)))


def layout_bound(sums: PieceSums, *, pp: int, num_microbatches: int, opt_floor_s: float) -> float:
    """Seconds no plan of a (layout, strategy) can beat, before its stages are split (module docstring): ``sums``
    of the model's pieces under the strategy, ``opt_floor_s`` what every rank's optimizer step takes at least."""
    m = num_microbatches
    return max(water_level(sums.head_tail[:pp], m * sums.fi) + opt_floor_s,
               water_level(sums.head[:pp], m * sums.total) + opt_floor_s,
               m * sums.tiers[0] / pp, m * sums.tiers[1] / pp)


def plan_bound(state: PlanState) -> float:
    """Seconds the simulation of ``state`` (after ``plan-memory``: stages, schedule and recompute decided) cannot
    beat (module docstring)."""
    assert state.sharding and state.stages and state.memory
    lay, spec, strategy = state.layout, state.graph.spec, state.strategy
    m, split, pp = lay.num_microbatches, strategy.schedule in SPLIT_BACKWARD, lay.pp
    placement = placement_of(strategy.schedule)
    per_kind = {k: floors(c, strategy) for k, c in state.sharding.layer_costs.items()}
    mode = [state.memory.stages[r].recompute for r in range(pp)]
    stage_f, stage_d = [], []  # per pipeline stage: forward and drain floors
    for s in range(pp * lay.vpp):
        r = stage_rank(s, pp=pp, placement=placement)
        fl = [per_kind[kind_of(spec, n)] for n in state.stages.stage_layers(s)]
        stage_f.append(sum(f.fwd for f in fl))
        stage_d.append(sum(_drain(f, mode[r] if mode[r] in MODES else "none", split) for f in fl))
    overlap_dp = "dp" in strategy.overlap
    opt = [optimizer_s(state, r) for r in range(pp)]
    best = 0.0
    for r in range(pp):
        fl = [per_kind[kind_of(spec, n)] for chunk in state.stages.chunks[r] for n in chunk]
        fi = sum(f.fwd + f.bwd_input + f.redo.get(mode[r], 0.0) + (0.0 if split else f.bwd_weight) for f in fl)
        weight = sum(f.bwd_weight for f in fl) if split else 0.0
        head, tail = sum(stage_f[:r]), sum(stage_d[:r])
        dp = dp_collectives(state, r)
        post = opt[r] + (0.0 if overlap_dp else sum(o.time_s for o in dp))
        tiers = [m * sum(getattr(f, t) for f in fl) + (sum(o.time_s for o in dp if o.tier == t) if overlap_dp
                                                       else 0.0) for t in ("intra", "inter")]
        best = max(best, head + m * fi + tail + opt[0], head + m * (fi + weight) + post, *tiers)
    return best
