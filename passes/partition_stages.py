"""Pass ``partition-stages``: layers onto PP × VPP chunks, minimising the slowest chunk.

The pieces, in pipeline order, are the embedding, the decoder layers, each MTP module as two pieces (its block and
its logits + loss, so the MTP "layer" can be split across stages, as Pangu Ultra MoE does — arXiv 2505.04519 §4)
and the head with the loss. The pieces fill pipeline stages 0, 1, … in order; stage ``c·pp + r`` is chunk ``c`` of
PP rank ``r`` (Megatron's interleaved placement), or, for the V-shaped schedules (ZB-V, DualPipeV), stage ``r`` and
``2·pp − 1 − r`` are the two chunks of rank ``r`` (passes/schedule.py). Each piece costs its forward + backward
time on one micro-batch including its in-layer communication (``shard``'s LayerCost, no recompute yet).

Min-max contiguous partition: the optimum is one of the O(n²) contiguous sums, and the greedy fill (fill a chunk
until the bound would be exceeded) tells whether a bound is feasible (the linear partition problem, Skiena, *The
Algorithm Design Manual* §8.5). The search bisects between a lower bound and a feasible sum, and snaps both ends to
contiguous sums without listing them: a feasible fill's largest run is a sum no larger than the probe, and an
infeasible fill names the least bound at which any of its runs would take one more piece (below it every fill is
the same). Each fill finds its run ends by binary search on prefix sums, O(chunks · log n). Chunks left empty by
the greedy fill are split off the largest chunks, which never raises the maximum.

V placement (ZB-V, DualPipeV) puts both ends of the pipeline on rank 0 — the embedding's stage and the head's — and
stage ``r`` with stage ``2·pp − 1 − r`` on rank ``r``, so the min-max split can leave one rank with two heavy
chunks: in the steady state a rank runs each of its chunks once per micro-batch, and the busiest rank sets the pace.
:func:`balance_ranks` then moves pieces off the busiest rank's stages while that lowers its total. (With the loop
placement of interleaving the min-max split is kept: its ranks' totals differ by at most the chunk granularity.)

Empty layers (MindSpeed ``--noop-layers``, docs/references.md §3.4): runtimes such as MindSpeed-LLM need the same number of
decoder layers (dense, MoE, MTP block) in every chunk. The uniform mode gives every chunk ``capacity`` slots and
solves the same min-max problem with at most ``capacity`` decoder layers per chunk; the chunks that hold the
embedding, the MTP logits or the head take fewer real layers and the rest of their slots become zero-cost empty
layers — the padding is what lets the heavy non-layer pieces sit on lighter chunks. ``capacity`` is the fewest
slots that hold every decoder layer, ceil(layers / chunks). ``auto`` keeps the uniform split when its slowest chunk
is within 1% of the free optimum, else the free split (Megatron-LM's ``--pipeline-model-parallel-layout`` expresses
uneven chunks), and the reason says which and what equal counts would cost.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from typing import ClassVar, Literal, Sequence

import numpy as np

from moeplan.actions import Placement, placement_of, stage_of, stage_rank
from moeplan.cost_models.step import beside_compute
from moeplan.cost_models.timeline import action_times_s
from moeplan.cost_models.timeline_types import RunSettings
from moeplan.errors import LayoutError
from moeplan.ir import LayerKind, named_layers
from moeplan.state import LayerCost, PlanState, StagePlan

SLOT_KINDS = frozenset({LayerKind.DENSE, LayerKind.MOE, LayerKind.MTP})
UNIFORM_TOLERANCE = 0.01  # auto mode: accept equal layer counts when the slowest chunk is at most 1% slower


def piece_time_s(cost: LayerCost, settings: RunSettings = RunSettings(mechanisms=frozenset())) -> float:
    """Seconds of one layer's forward and full backward for one micro-batch, its collectives beside or blocking
    its compute as ``settings`` say (cost_models/timeline.py). Under ``fb`` the steady state pairs one micro-batch's
    forward with another's backward, so a layer costs what its busiest resource holds: its compute, slowed for as
    long as its collectives can run beside it, or one link tier's collectives. Otherwise its forward and its
    backward on an idle rank, one after the other. The default settings overlap nothing: compute plus every
    collective."""
    return piece_times_s([cost], settings)[0]


def piece_times_s(costs: Sequence[LayerCost], settings: RunSettings = RunSettings(mechanisms=frozenset())
                  ) -> list[float]:
    """:func:`piece_time_s` of each cost, the timeline run once for them all."""
    if "fb" in settings.mechanisms:
        out = []
        for cost in costs:
            segs = cost.program.fwd + cost.program.backward
            comms = [x.comm for x in segs if x.comm is not None]
            tiers = [sum(c.busy_s(t) for c in comms) for t in ("intra", "inter")]
            compute = sum(x.seconds for x in segs if x.kind == "compute")
            out.append(max(compute + settings.compute_slowdown * min(compute, max(tiers)), *tiers))
        return out
    times = action_times_s([a for c in costs for a in ([c.program.fwd], [c.program.backward])], settings)
    return [times[2 * i] + times[2 * i + 1] for i in range(len(costs))]


@dataclass(frozen=True)
class Partition:
    """A contiguous split (:func:`min_max_partition`): ``status`` ``"split"`` with ``runs``, the pieces per run in
    order; ``"infeasible"`` when no split keeps every run within the slot capacity, with ``reason``."""

    status: Literal["split", "infeasible"]
    runs: tuple[int, ...] = ()
    reason: str = ""


def min_max_partition(times: list[float], num_chunks: int, *, slots: list[int] | None = None,
                      capacity: int | None = None) -> Partition:
    """Split ``times`` into ``num_chunks`` non-empty contiguous runs minimising the largest sum.

    With ``slots`` and ``capacity`` a run may hold at most ``capacity`` slots (the greedy feasibility test stays
    exact: both sums are additive and monotone, so the longest feasible first run never hurts); the split is
    ``infeasible`` when the capacity makes it impossible. Raises LayoutError if there are fewer items than chunks.
    """
    n = len(times)
    if n < num_chunks:
        raise LayoutError(f"chunks={num_chunks}: more pipeline chunks than the {n} layers to place")
    cap = capacity if capacity is not None else n
    if slots is not None and (max(slots) > cap or sum(slots) > cap * num_chunks):
        return Partition("infeasible", reason=f"{sum(slots)} slots (at most {max(slots)} per piece) do not fit "
                                              f"{num_chunks} runs of {cap}")
    prefix = [0.0, *accumulate(times)]
    slot_prefix = [0, *accumulate(slots)] if slots is not None and capacity is not None else None
    runs, worst, _ = _greedy(prefix, slot_prefix, float("inf"), cap)
    if len(runs) > num_chunks:
        return Partition("infeasible", reason=f"the pieces' order needs {len(runs)} runs of at most {cap} slots, "
                                              f"more than {num_chunks}")
    lo, hi = max(max(times), prefix[-1] / num_chunks), worst  # the optimum lies in [lo, hi]; hi is feasible
    probe = lo
    while lo < hi:
        got, worst, above = _greedy(prefix, slot_prefix, probe, cap)
        if len(got) > num_chunks:
            lo = above  # every bound below ``above`` fills the same (too many) runs
        elif worst < hi:
            hi = worst  # feasible, and its largest run is a contiguous sum <= probe
        else:
            break
        probe = (lo + hi) / 2
    runs, _, _ = _greedy(prefix, slot_prefix, hi, cap)
    # split one piece off the run with the largest sum among those of length > 1 (the first such), until every
    # chunk has a run; ``split`` holds each run's sum, -1 for a single piece
    ends = list(accumulate(runs))
    split = [sum(times[e - r:e]) if r > 1 else -1.0 for r, e in zip(runs, ends)]
    while len(runs) < num_chunks:
        k = split.index(max(split))
        runs[k:k + 1] = [runs[k] - 1, 1]
        ends[k:k + 1] = [ends[k] - 1, ends[k]]
        split[k:k + 1] = [sum(times[ends[k] - runs[k]:ends[k]]) if runs[k] > 1 else -1.0, -1.0]
    return Partition("split", tuple(runs))


def balance_ranks(times: Sequence[float], runs: Sequence[int], *, pp: int, placement: Placement,
                  slots: Sequence[int] | None = None, capacity: int | None = None) -> list[int]:
    """Lower the busiest PP rank's total (the sum of its chunks, stages placed ``loop`` or ``v``) of a contiguous
    split (``runs``: pieces per stage, in stage order). Local search: move one piece from a stage of the busiest rank
    to any other stage, shifting the boundaries between them by one piece (every stage stays contiguous and
    non-empty, and holds at most ``capacity`` decoder slots when given); of the moves that lower the busiest rank's
    total, take the one with the least (busiest rank, slowest stage, sum of squared rank totals); repeat until none
    does. Deterministic; at most ``len(times)·len(runs)`` moves."""
    n, k = len(times), len(runs)
    prefix = np.concatenate(([0.0], np.cumsum(times)))
    slot_prefix = np.concatenate(([0], np.cumsum(slots))) if slots is not None and capacity is not None else None
    owner = np.zeros((k, pp))
    owner[np.arange(k), [stage_rank(s, pp=pp, placement=placement) for s in range(k)]] = 1.0
    bounds = np.concatenate(([0], np.cumsum(runs)))
    j = np.arange(k + 1)

    def keys(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        stage = prefix[b[:, 1:]] - prefix[b[:, :-1]]
        rank = stage @ owner
        return rank.max(axis=1).round(12), stage.max(axis=1).round(12), (rank * rank).sum(axis=1).round(12)

    best = keys(bounds[None])[0][0]
    for _ in range(n * k):
        rank_t = (prefix[bounds[1:]] - prefix[bounds[:-1]]) @ owner
        srcs = np.flatnonzero(owner[:, int(rank_t.argmax())])
        # every (src, dst) move, src ascending then dst ascending: the boundaries between them shift one piece
        src = np.repeat(srcs, k - 1)
        dst = np.concatenate([np.delete(np.arange(k), s) for s in srcs])
        lo, hi = np.minimum(src, dst)[:, None], np.maximum(src, dst)[:, None]
        between = (j > lo) & (j <= hi)
        cand = bounds + np.where(dst > src, -1, 1)[:, None] * between
        ok = (np.diff(cand, axis=1) > 0).all(axis=1)
        if slot_prefix is not None:
            ok &= ((slot_prefix[cand[:, 1:]] - slot_prefix[cand[:, :-1]]) <= capacity).all(axis=1)
        busiest, slowest, spread = keys(cand)
        ok &= busiest < best
        if not ok.any():
            break
        pick = np.flatnonzero(ok)[np.lexsort((spread[ok], slowest[ok], busiest[ok]))[0]]
        best, bounds = busiest[pick], cand[pick]
    return np.diff(bounds).tolist()


def _greedy(prefix: list[float], slot_prefix: list[int] | None, bound: float, capacity: int
            ) -> tuple[list[int], float, float]:
    """Fill runs in order, each as long as its sum stays within ``bound`` and its slots within ``capacity`` (a
    run holds at least one piece; ``slot_prefix`` None: no capacity). Returns (run lengths, the largest run's
    sum, the least bound above ``bound`` at which some run would take one more piece: inf when only the capacity
    stops them)."""
    n = len(prefix) - 1
    runs, worst, above, start = [], 0.0, float("inf"), 0
    limit = bound * (1 + 1e-12)
    while start < n:
        base = prefix[start]
        end = bisect_right(prefix, base + limit, start + 1) - 1
        if end == start:
            end += 1
        if slot_prefix is not None:
            by_slots = bisect_right(slot_prefix, slot_prefix[start] + capacity, start + 1) - 1
            if by_slots <= end:
                end = by_slots
            elif end < n:
                above = min(above, prefix[end + 1] - base)
        elif end < n and prefix[end + 1] - base < above:
            above = prefix[end + 1] - base
        if prefix[end] - base > worst:
            worst = prefix[end] - base
        runs.append(end - start)
        start = end
    return runs, worst, above


@dataclass(frozen=True)
class PartitionStagesPass:
    """Assign layers to PP × VPP chunks (see the module docstring)."""

    name: ClassVar[str] = "partition-stages"
    requires: ClassVar[tuple[str, ...]] = ("sharding",)
    provides: ClassVar[tuple[str, ...]] = ("stages",)
    layer_layout: Literal["auto", "free", "uniform"] = "auto"
    """``uniform``: every chunk holds the same number of decoder-layer slots (dense, MoE, MTP block), padded with
    empty layers; ``free``: any contiguous split; ``auto``: uniform when its slowest chunk is within
    ``UNIFORM_TOLERANCE`` of the free optimum."""

    def run(self, state: PlanState) -> PlanState:
        assert state.sharding is not None
        pp, vpp = state.layout.pp, state.layout.vpp
        layers = named_layers(state.graph.spec)
        costs = state.sharding.layer_costs
        settings = beside_compute(state.target, state.strategy.overlap)
        per_kind = dict(zip(costs, piece_times_s(list(costs.values()), settings)))
        times = [per_kind[k] for _, k in layers]
        slots = [int(k in SLOT_KINDS) for _, k in layers]
        placement = placement_of(state.strategy.schedule)
        runs, capacity, note = split_runs(times, slots, pp=pp, vpp=vpp, placement=placement,
                                          layer_layout=self.layer_layout)
        stage_names, stage_times, empties, start = [], [], [], 0
        for r in runs:
            names = [n for n, _ in layers[start:start + r]]
            if capacity is not None:
                names = _pad(names, capacity - sum(slots[start:start + r]), empties)
            stage_names.append(names)
            stage_times.append(sum(times[start:start + r]))
            start += r
        at = [[stage_of(r, c, pp=pp, placement=placement) for c in range(vpp)] for r in range(pp)]
        chunks = tuple(tuple(tuple(stage_names[s]) for s in row) for row in at)
        chunk_t = tuple(tuple(stage_times[s] for s in row) for row in at)
        mean = sum(stage_times) / len(stage_times)
        imbalance = max(stage_times) / mean - 1 if mean > 0 else 0.0
        reason = _reason(stage_names, pp, placement, imbalance, empties, capacity, note)
        return state.with_(stages=StagePlan(chunks=chunks, chunk_time_s=chunk_t, imbalance=imbalance,
                                            empty_layers=tuple(empties), reason=reason, placement=placement))


def split_runs(times: list[float], slots: list[int], *, pp: int, vpp: int, placement: Placement,
               layer_layout: Literal["auto", "free", "uniform"] = "auto") -> tuple[list[int], int | None, str]:
    """(run lengths of the ``pp·vpp`` stages in pipeline order, decoder slots per chunk when the split is uniform
    else None, a note on what equal counts would cost) for pieces of ``times`` seconds of which ``slots`` are
    decoder layers (module docstring). Raises LayoutError for ``uniform`` when the slots cannot be spread evenly,
    or when there are fewer pieces than chunks."""
    free = list(_partition(tuple(times), pp * vpp, None, None).runs)  # without a capacity every split is feasible
    if placement == "v":
        free = balance_ranks(times, free, pp=pp, placement=placement)
    if layer_layout == "free":
        return free, None, ""
    split, cap = _uniform(times, slots, pp * vpp)
    if split.status == "infeasible":
        if layer_layout == "uniform":
            raise LayoutError(f"layer_layout='uniform': {sum(slots)} decoder layers cannot be spread "
                              f"{cap} per chunk over {pp * vpp} chunks")
        return free, None, ""
    uniform = list(split.runs)
    if placement == "v":
        uniform = balance_ranks(times, uniform, pp=pp, placement=placement, slots=slots, capacity=cap)
    slowdown = _max_run(times, uniform) / _max_run(times, free) - 1
    if layer_layout == "uniform" or slowdown <= UNIFORM_TOLERANCE:
        return uniform, cap, ""
    return free, None, (f"equal counts ({cap} per chunk, {cap * pp * vpp - sum(slots)} empty layers) would make the "
                        f"slowest chunk {slowdown:+.1%} slower")


def _max_run(times: list[float], runs: list[int]) -> float:
    starts = [0, *accumulate(runs)][:-1]
    return max(sum(times[s:s + r]) for s, r in zip(starts, runs))


def _uniform(times: list[float], slots: list[int], num_chunks: int) -> tuple[Partition, int]:
    """The best partition with the fewest decoder slots per chunk that can hold them all, ceil(slots / chunks)
    (more slots would be a different split, not padding), and that slot count; ``infeasible`` if the capacity is
    too small for the pieces' order."""
    cap = -(-sum(slots) // num_chunks)
    return _partition(tuple(times), num_chunks, tuple(slots), cap), cap


@lru_cache(maxsize=4096)
def _partition(times: tuple[float, ...], num_chunks: int, slots: tuple[int, ...] | None, capacity: int | None
               ) -> Partition:
    """:func:`min_max_partition`, kept per arguments (a :class:`Partition` is immutable): the layout search splits
    the same pieces for every (pp, vpp) of one chunk count and for both placements (moeplan/estimate.py), and
    the free and the uniform split of each."""
    return min_max_partition(list(times), num_chunks, slots=None if slots is None else list(slots),
                             capacity=capacity)


def _pad(names: list[str], missing: int, empties: list[str]) -> list[str]:
    """Insert ``missing`` empty layers after the chunk's last decoder layer (before any head)."""
    new = []
    for _ in range(missing):
        new.append(f"empty.{len(empties)}")
        empties.append(new[-1])
    heads = [i for i, n in enumerate(names) if n in ("head",) or n.startswith("mtp_head.")]
    at = heads[0] if heads else len(names)
    return names[:at] + new + names[at:]


def _reason(stage_names: list[list[str]], pp: int, placement: Placement, imbalance: float, empties: list[str],
            capacity: int | None, note: str) -> str:
    def where(prefix: str) -> str:
        return "; ".join(f"{n} on stage {s} (pp rank {stage_rank(s, pp=pp, placement=placement)}, chunk "
                         f"{int(s >= pp) if placement == 'v' else s // pp})"
                         for s, names in enumerate(stage_names) for n in names if n.startswith(prefix))

    parts = [p for p in (where("mtp."), where("mtp_head.")) if p]
    if capacity is None:
        parts.append("no empty layers: uneven decoder-layer counts per chunk (Megatron-LM "
                     "--pipeline-model-parallel-layout)" + (f"; {note}" if note else ""))
    elif empties:
        parts.append(f"{capacity} decoder-layer slots per chunk; {len(empties)} empty layer(s) fill the chunks that "
                     f"hold the embedding, MTP or head: {where('empty.')}")
    else:
        parts.append(f"{capacity} decoder-layer slots per chunk; no empty layers needed")
    return "; ".join(parts) + f"; slowest chunk {imbalance:+.1%} over the mean"
