"""The closed-form step estimate that ranks layouts before the full pipeline (docs/step-model.md §4), and the
per-layer prices it is built from. Used by the layout search (moeplan/search.py) and the architecture screen
(moeplan/explore.py).

Every layer kind is priced on an idle rank by the timeline (:func:`model_cost`): forward, input gradient, weight
gradient and, under ``fb``, the overlapped forward-backward pair; :func:`estimate_step` then adds the pipeline's
pace (the busiest rank's share of the stage split, :func:`rank_load`), the schedule's bubble, the recompute mode
the memory estimate needs and the DP and optimizer tail.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Mapping, Sequence

from moeplan.actions import Placement, placement_of, stage_of, stage_rank
from moeplan.cost_models.memory import (MODES, LayerParts, Overheads, RankParts, layer_parts, layout_states, overheads,
                                        parts_on, state_bytes_per_param)
from moeplan.cost_models.sharding import layer_cost
from moeplan.cost_models.step import adam_s, beside_compute, dp_sync_s, owned_params, recompute_work, replica_reductions, step_sync_groups
from moeplan.cost_models.timeline import Repeated, action_times_s
from moeplan.cost_models.timeline_types import RunSettings
from moeplan.ir import LayerKind, ModelGraph
from moeplan.layout import Layout
from moeplan.mechanisms import FB_PAIRED
from moeplan.passes.partition_stages import SLOT_KINDS, piece_times_s, split_runs
from moeplan.passes.schedule import in_flight_by_rank
from moeplan.state import Dispatcher, LayerCost, LayerProgram, Precision, ScheduleKind, Segment, StageMemory, Strategy
from moeplan.targets import Target

@dataclass(frozen=True)
class ModelCost:
    """The whole model (every slot once) for one micro-batch on one device, each layer priced on an idle rank by the
    timeline: forward, input gradient, weight gradient and (under ``fb``) forwards overlapped with backwards, in
    seconds; per recompute mode the forward work redone (seconds)."""

    fwd: float
    bwd_input: float
    bwd_weight: float
    pair: float
    recompute_s: Mapping[str, float]
    pair_edge: float = 0.0  # under fb, the first layer's extra once per pair action: model_cost
    bwd_busy_s: Mapping[str, float] = field(default_factory=dict)  # per link tier: seconds its backward holds it
    layers: Mapping[LayerKind, LayerCost] = field(default_factory=dict)  # each kind's cost (the memory estimate)
    piece_s: Mapping[LayerKind, float] = field(default_factory=dict)  # what the partition pass splits by: piece_time_s
    memory_parts: dict[tuple, LayerParts] = field(default_factory=dict, compare=False, repr=False)
    """:func:`estimate_memory`'s :class:`~moeplan.cost_models.memory.LayerParts` per (chunk kinds, modes), filled as
    it goes: they depend on ``layers`` alone, so every layout estimated with this cost (or another cost with the same
    ``layers``: :func:`model_cost`) and split alike reuses them (integers: the same figures)."""


def model_cost(graph: ModelGraph, layout: Layout, target: Target, dispatcher: Dispatcher, overlap: frozenset,
               counts: Counter, cache: dict, precision: Precision = Precision(), *,
               memory_parts: dict | None = None) -> ModelCost:
    """:class:`ModelCost` of the slots ``counts``. ``cache`` keeps each kind's layer cost and timeline prices per
    what they depend on: (tp, cp, micro-batch) for a layer without routed experts, also (ep, etp, dispatcher) for
    one with them. ``memory_parts``: the dict the cost fills with :func:`estimate_memory`'s layer parts; the costs
    of one layer-cost shape (the same layer costs, other overlap sets) may share one (default: its own).

    A stage runs its layers back to back, and across an ``fb`` pair the timeline overlaps one layer's collectives
    with the next layer's compute. So under ``fb`` a kind's pair is priced as its steady increment, half what two
    more layers add to a pair of two on an idle rank (past the first layer's transient), and the first layer's
    extra (two layers less twice the increment) is charged once per pair action (``pair_edge``, of the most
    common kind). Forwards and backwards
    alone are priced one layer at a time."""
    f = i = w = pair = 0.0
    redo = dict.fromkeys(MODES, 0.0)
    busy = {"intra": 0.0, "inter": 0.0}
    edges: dict[LayerKind, float] = {}
    layers: dict[LayerKind, LayerCost] = {}
    piece: dict[LayerKind, float] = {}
    kinds = ([LayerKind.EMPTY] if LayerKind.EMPTY in graph.layers else []) + list(counts)  # the partition may pad
    prices = {kind: layer_prices(graph, kind, layout, target, dispatcher, cache, precision) for kind in kinds}
    settings = beside_compute(target, overlap)
    todo = {kind: priced[0] for kind, (key, priced) in prices.items() if ("piece", key, overlap) not in cache}
    for kind, secs in zip(todo, piece_times_s(list(todo.values()), settings)):
        cache[("piece", prices[kind][0], overlap)] = secs
    for kind, (key, priced) in prices.items():  # chunks with empty layers
        layers[kind] = priced[0]
        piece[kind] = cache[("piece", key, overlap)]
    missing = [prices[k] for k in counts if ("kind", prices[k][0], overlap) not in cache]
    if missing:
        _timeline_prices(missing, settings, overlap, cache)
        for key, priced in missing:
            cache[("kind", key, overlap)] = _kind_prices(key, priced[0].program, overlap, cache)
    for kind, n in counts.items():
        key, priced = prices[kind]
        lf, li, lw, lp, edges[kind], lbusy = cache[("kind", key, overlap)]
        f, i, w, pair = f + n * lf, i + n * li, w + n * lw, pair + n * lp
        for tier, secs in lbusy.items():
            busy[tier] += n * secs
        for m in MODES:
            redo[m] += n * priced[1][m]
    return ModelCost(f, i, w, pair, redo, edges[max(counts, key=counts.__getitem__)], busy, layers, piece,
                     {} if memory_parts is None else memory_parts)


def _used(prog: LayerProgram, overlap: frozenset) -> frozenset:
    """The mechanisms of ``overlap`` a layer's timeline prices depend on: those its collectives name (``async_by``),
    and fb."""
    return overlap & ({s.async_by for s in prog.fwd + prog.bwd_input} | {"fb"})


def _timeline_prices(priced: list[tuple[tuple, tuple[LayerCost, dict[str, float]]]], settings: RunSettings,
                     overlap: frozenset, cache: dict) -> None:
    """Fill ``cache[("timeline", key, used)]`` (:func:`_kind_prices`) for each ``(key, (layer cost, _))`` of
    ``priced`` that lacks it, the timeline run once for them all: (forward, input gradient, weight gradient, pair
    increment, pair edge) seconds. Under fb, t(n) is a pair of n layers; the increment is half the step from 2 to 4
    layers, past the first's transient."""
    fb = "fb" in overlap
    todo: dict[tuple, LayerProgram] = {}
    for key, (lc, _) in priced:
        entry = ("timeline", key, _used(lc.program, overlap))
        if entry not in cache:
            todo[entry] = lc.program
    actions: list[list[Sequence[Segment] | Repeated]] = []
    for prog in todo.values():
        actions += [[prog.fwd], [prog.bwd_input], [prog.weight_alone]]
        if fb:
            actions += [[Repeated(prog.fwd, n), Repeated(prog.backward, n)] for n in (2, 4)]
    times = action_times_s(actions, settings) if actions else []
    width = 5 if fb else 3
    for j, entry in enumerate(todo):
        lf, li, lw, *pairs = times[j * width:(j + 1) * width]
        if fb:
            two, four = pairs
            step = (four - two) / 2
            cache[entry] = (lf, li, lw, step, two - 2 * step)
        else:  # without fb a pair is its forward, then its backward
            cache[entry] = (lf, li, lw, lf + li + lw, 0.0)


def _kind_prices(key: tuple, prog: LayerProgram, overlap: frozenset, cache: dict
                 ) -> tuple[float, float, float, float, float, dict[str, float]]:
    """One layer's (forward, input gradient, weight gradient, pair increment, pair edge, backward busy seconds per
    link tier) under ``overlap`` (:func:`model_cost`). The timeline prices depend only on the mechanisms the
    layer's collectives name and on fb, so they are kept per those (:func:`_timeline_prices` fills them)."""
    comms = [x.comm for x in prog.bwd_input + prog.bwd_weight if x.comm is not None]
    return (*cache[("timeline", key, _used(prog, overlap))],
            {t: sum(c.busy_s(t) for c in comms) for t in ("intra", "inter")})


def layer_prices(graph: ModelGraph, kind: LayerKind, layout: Layout, target: Target, dispatcher: Dispatcher,
                 cache: dict, precision: Precision = Precision()) -> tuple[tuple, tuple[LayerCost, dict[str, float]]]:
    """(cache key, (layer cost, recompute seconds per mode)) of one layer kind, priced once per what it depends
    on (:func:`model_cost`): FSDP's collectives also depend on dp_shard and dp·cp, and the recipe's ``precision``."""
    lg = graph.layer(kind)
    fsdp = (layout.dp_shard, layout.dp, layout.pp) if layout.dp_shard > 1 else ()
    key = (kind, layout.tp, layout.cp, layout.micro_batch, precision, fsdp) + (
        (layout.ep, layout.etp, dispatcher, layout.expert_load, layout.expert_replication)
        if lg.expert_param_count else ())
    if key not in cache:
        lc = layer_cost(lg, spec=graph.spec, layout=layout, target=target, dispatcher=dispatcher, precision=precision,
                        op_times=cache.setdefault("op_times", {}))
        cache[key] = (lc, {m: recompute_work(lc, m)[0] for m in MODES})
    return key, cache[key]


def stage_params(layout: Layout, graph: ModelGraph, counts: Counter) -> tuple[float, float]:
    """(dense, routed-expert) parameters per device of an average stage."""
    dense = sum(n * (graph.layer(k).param_count - graph.layer(k).expert_param_count + graph.layer(k).shared_param_count)
                for k, n in counts.items()) / (layout.tp * layout.pp)
    expert = (sum(n * graph.layer(k).expert_param_count for k, n in counts.items()) * layout.expert_replication
              / (layout.ep * layout.tp * layout.pp))
    return dense, expert


def static_bytes(layout: Layout, params: tuple[float, float], target: Target, strategy: Strategy, *,
                 hidden_size: int) -> float:
    """Bytes per device of an average stage's model states (``params`` from :func:`stage_params`) with the
    overheads that do not depend on activations (cost_models/memory.py): a lower bound of the fullest device's
    memory, for the search to drop a layout before pricing it."""
    ms = layout_states(params[0], params[1], layout, strategy.precision, target)
    over = overheads(layout, strategy, target, hidden_size=hidden_size)
    return over.runtime_bytes + over.comm_buffer_bytes + ms.total_bytes


@dataclass(frozen=True)
class Estimate:
    """The closed-form step estimate of one (layout, strategy): seconds, the recompute mode its memory estimate
    needs (the costliest any rank needs), whether every rank fits under some mode, and the fullest rank's bytes
    under its mode (the memory model of the ``plan-memory`` pass, cost_models/memory.py)."""

    step_s: float
    recompute: str
    fits: bool
    memory_bytes: float = 0.0


@dataclass(frozen=True)
class MemoryEstimate:
    """Per PP rank, its memory under the cheapest whole-layer mode that fits the budget (the last one tried when
    none does), as the ``plan-memory`` pass prices it: each rank's parts, in-flight vectors and mode (the terms,
    :meth:`ranks`, are built when asked), whether every rank fits, the fullest rank's bytes and the costliest mode
    any rank needs."""

    parts: tuple[tuple[RankParts, tuple[tuple[int, ...], ...], str], ...]
    over: Overheads
    fits: bool
    peak_bytes: float
    recompute: str

    def ranks(self) -> tuple[StageMemory, ...]:
        """Every term of each rank's device (cost_models/memory.py :class:`~moeplan.cost_models.memory.RankParts`)."""
        return tuple(p.memory(r, v, mode, self.over) for r, (p, v, mode) in enumerate(self.parts))  # type: ignore[arg-type]


def _stage_kinds(layout: Layout, strategy: Strategy, cost: ModelCost, kinds: tuple[LayerKind, ...]
                 ) -> tuple[tuple[LayerKind, ...], ...]:
    """Per pipeline stage, its layers' kinds as the partition pass splits them (passes/partition_stages.py:
    the same piece times, the same split, the same empty layers)."""
    return _split_kinds(kinds, tuple(cost.piece_s[k] for k in kinds), layout.pp, layout.vpp,
                        placement_of(strategy.schedule))


@lru_cache(maxsize=4096)
def _split_kinds(kinds: tuple[LayerKind, ...], times: tuple[float, ...], pp: int, vpp: int, placement: Placement
                 ) -> tuple[tuple[LayerKind, ...], ...]:
    flags = [int(k in SLOT_KINDS) for k in kinds]
    runs, capacity, _ = split_runs(list(times), flags, pp=pp, vpp=vpp, placement=placement)
    out, start = [], 0
    for r in runs:
        part = list(kinds[start:start + r])
        if capacity is not None:
            part += [LayerKind.EMPTY] * (capacity - sum(flags[start:start + r]))
        out.append(tuple(part))
        start += r
    return tuple(out)


def memory_modes(strategy: Strategy) -> tuple[str, ...]:
    """The whole-layer modes :func:`estimate_memory` tries for ``strategy``'s recompute choice, cheapest first."""
    return {"auto": MODES, "ilp": MODES, "ilp-no-swap": MODES, "mindspeed": ("selective",),
            "modules": ("selective",)}.get(strategy.recompute, (strategy.recompute,))


def estimate_memory(layout: Layout, strategy: Strategy, cost: ModelCost, *, kinds: tuple[LayerKind, ...],
                    target: Target, budget: float, hidden_size: int) -> MemoryEstimate:
    """Every PP rank's memory as ``plan-memory`` prices it (cost_models/memory.py), on the stage split the
    partition pass makes and the schedule pass's action lists, under the cheapest whole-layer mode that fits
    ``budget`` (per-tensor modes are estimated by the whole-layer modes: ``mindspeed`` by ``selective``, the ILP
    modes by any of them; the pass decides)."""
    modes = memory_modes(strategy)
    stages = _stage_kinds(layout, strategy, cost, kinds)
    fb = "fb" in strategy.overlap
    vectors = in_flight_by_rank(strategy.schedule, pp=layout.pp, vpp=layout.vpp,
                                num_microbatches=layout.num_microbatches, fb=fb)
    placement = placement_of(strategy.schedule)
    over = overheads(layout, strategy, target, hidden_size=hidden_size)
    ranks, fits, peak, costliest = [], True, 0.0, 0
    parts: dict[tuple, RankParts] = {}  # per distinct chunk layers: ranks of one split share most
    for r in range(layout.pp):
        chunk_kinds = tuple(stages[stage_of(r, c, pp=layout.pp, placement=placement)] for c in range(layout.vpp))
        rp = parts.get(chunk_kinds)
        if rp is None:
            lp = cost.memory_parts.get((chunk_kinds, modes))
            if lp is None:
                lp = cost.memory_parts[(chunk_kinds, modes)] = layer_parts(
                    [[cost.layers[k] for k in ck] for ck in chunk_kinds], modes=modes)
            rp = parts[chunk_kinds] = parts_on(lp, layout, strategy.precision, target)
        for mode in modes:
            total = rp.total(vectors[r], mode, over)
            if total <= budget:
                break
        else:
            fits = False
        peak, costliest = max(peak, total), max(costliest, MODES.index(mode) if mode in MODES else 0)
        ranks.append((rp, vectors[r], mode))
    return MemoryEstimate(tuple(ranks), over, fits, peak, MODES[costliest] if modes[0] in MODES else modes[0])


@lru_cache(maxsize=256)
def rank_load(times: tuple[float, ...], slots: tuple[int, ...], pp: int, vpp: int, placement: Placement) -> float:
    """How much more than the balanced ``sum(times)/pp`` the busiest PP rank computes per micro-batch when the
    pieces (``times``, pipeline order; ``slots``: 1 for a decoder layer) are split into ``pp·vpp`` chunks as the
    partition pass splits them (:func:`~moeplan.passes.partition_stages.split_runs`: equal decoder-layer counts
    or free) and the chunks are placed ``loop`` or ``v`` (passes/schedule.py)."""
    runs, _, _ = split_runs(list(times), list(slots), pp=pp, vpp=vpp, placement=placement)
    load = [0.0] * pp
    start = 0
    for stage, n in enumerate(runs):
        load[stage_rank(stage, pp=pp, placement=placement)] += sum(times[start:start + n])
        start += n
    return max(load) * pp / sum(times)


def estimate_step(layout: Layout, strategy: Strategy, cost: ModelCost, *, weights: tuple[float, ...],
                  slots: tuple[int, ...], params: tuple[float, float], target: Target,
                  memory: MemoryEstimate, load: float | None = None) -> Estimate:
    """Closed-form step estimate (docs/step-model.md §4), for ranking layouts before the full pipeline:

    - **Recompute**: ``memory``'s (:func:`estimate_memory`: the cheapest mode per rank that fits, as the memory
      pass prices it); the redone forward of the costliest mode any rank needs;
    - **Stages**: the pipeline flows at the pace of its busiest rank, so every pass is scaled by that rank's load
      over the balanced ``1/pp`` (:func:`rank_load` of the slots' ``weights``, their forward + backward FLOPs,
      split as the partition pass splits, ``slots`` marking the decoder layers: how uneven the split comes out
      depends on the layers' granularity far more than on the layout), and each
      overlapped pair pays its first layer's extra once (:class:`ModelCost` ``pair_edge``);
    - **Schedule**: ``m`` micro-batches of work (the steady ones as overlapped pairs under ``fb``) plus the bubble
      (1F1B ``(pp−1)(F+B)``, interleaved ``/vpp``, the zero-bubble family ``(pp−1)(F+I−W)`` per chunk); on a
      target whose p2p messages hold the compute stream (``launch.p2p_host_s``), each micro-batch's ``4·(pp·vpp −
      1)`` SENDs and RECVs shared by the ``pp`` ranks;
    - **DP and optimizer**: the DP collectives of the average stage (cost_models/step.py) after the last
      backward; under ``dp`` the reduce-scatters of the ``vpp`` chunks, each started at its chunk's last backward
      (:func:`drain_windows`), as far as they run past the rank's last backward
      (:func:`exposed_reduce_scatter_s`); then the Adam update of the locally owned parameters.

    ``load``: the busiest rank's share over the balanced one instead of :func:`rank_load`'s; the step never
    decreases with it, so ``load=1`` gives a lower bound of the estimate (the architecture screen prunes with it).
    """
    pp, vpp, m = layout.pp, layout.vpp, layout.num_microbatches
    chunks = pp * vpp
    fb = "fb" in strategy.overlap
    mode = memory.recompute
    if load is None:
        load = rank_load(weights, slots, pp, vpp, placement_of(strategy.schedule))
    load /= pp
    f, w = load * cost.fwd, load * cost.bwd_weight
    redo = cost.recompute_s[mode]
    i = load * (cost.bwd_input + redo)
    pair = load * (cost.pair + redo) + vpp * cost.pair_edge  # a micro-batch: vpp pairs on a rank
    pairs = max(0, m - pp) if fb and strategy.schedule in FB_PAIRED else 0
    work = (m - pairs) * (f + i + w) + pairs * pair
    work += m * 4 * (chunks - 1) / pp * target.launch.p2p_host_s  # 0 at pp 1 (vpp is then 1)
    kind = strategy.schedule
    if kind == "1f1b":
        bubble = (pp - 1) * (f + i + w)
    elif kind == "interleaved":
        bubble = (pp - 1) * (f + i + w) / vpp
    else:  # zero-bubble family: (pp − 1)(F + I − W) per chunk
        bubble = (pp - 1) * max(0.0, f + i - w) / vpp
    dense, expert = params
    tail = adam_s(owned_params(layout, dense, expert), target)
    overlap_dp = "dp" in strategy.overlap
    grad_bytes = state_bytes_per_param(target.dtype_bytes, strategy.precision)[1]
    rs_chunk, taken = 0.0, 0.0
    if layout.dp_shard > 1:  # HSDP's replicas all-reduce their shards after the reduce-scatters
        tail += sum(o.time_s for o in replica_reductions(layout, target, 0, dense, expert, grad_bytes))
    for n, (group, stride) in zip((dense, expert), step_sync_groups(layout)):
        if n and group > 1:
            rs, ag, tier = dp_sync_s(n / vpp if overlap_dp else n, group=group, stride=stride, target=target,
                                     grad_bytes=grad_bytes)
            if overlap_dp:
                rs_chunk += rs
                # the backwards' own collectives hold the tier for this share of the drain
                taken = max(taken, min(1.0, cost.bwd_busy_s.get(tier, 0.0) / (cost.bwd_input + redo + cost.bwd_weight)))
            else:
                tail += rs + ag
    if rs_chunk:
        windows = drain_windows(kind, pp=pp, vpp=vpp, chunk_backward_s=(i + w) / vpp)
        tail += exposed_reduce_scatter_s(rs_chunk, [x * (1 - taken) for x in windows])
    return Estimate(step_s=work + bubble + tail, recompute=mode, fits=memory.fits, memory_bytes=memory.peak_bytes)


def estimate_floor(layout: Layout, strategy: Strategy, cost: ModelCost, *, params: tuple[float, float],
                   target: Target) -> float:
    """Seconds no :func:`estimate_step` of this (layout, strategy) can be below, whatever its stage split and memory
    estimate: the estimate with ``load=1`` (the busiest rank computes the balanced share) under the mode of
    :func:`memory_modes` that redoes the least. The estimate never decreases with the load nor with the forward
    work redone (:func:`estimate_step`), so this is a floor without the stage split and the memory estimate, most
    of an estimate's cost: the search estimates in full only the options whose floor could put them among those
    it simulates (moeplan/search_eval.py)."""
    mode = min(memory_modes(strategy), key=cost.recompute_s.__getitem__)
    floor = MemoryEstimate(parts=(), over=Overheads(0.0, 0.0, 0.0), fits=True, peak_bytes=0.0, recompute=mode)
    return estimate_step(layout, strategy, cost, weights=(), slots=(), params=params, target=target, memory=floor,
                         load=1.0).step_s


def drain_windows(kind: ScheduleKind, *, pp: int, vpp: int, chunk_backward_s: float) -> list[float]:
    """Seconds from each chunk's last backward to the end of its rank's backwards: under ``--overlap dp`` the time
    its DP reduce-scatter has to hide in (docs/step-model.md §4). With the ``loop`` placement (interleaved,
    zero-bubble) the last micro-batch goes backward through the chunks one after the other, each through all
    ``pp`` ranks, so ``j·pp`` chunk backwards (``chunk_backward_s`` each) follow the ``j``-th last chunk to finish.
    With the ``v`` placement (ZB-V, DualPipeV) rank ``pp − 1`` holds the two middle stages, so its two chunks end
    one chunk backward apart. 1F1B has one chunk."""
    per = pp * chunk_backward_s if placement_of(kind) == "loop" else chunk_backward_s
    return [j * per for j in range(vpp)]


def exposed_reduce_scatter_s(rs_chunk_s: float, windows: list[float]) -> float:
    """Seconds the per-chunk reduce-scatters (``rs_chunk_s`` each, one link, one after the other) run past the
    rank's last backward, when chunk ``j``'s may start ``windows[j]`` before it."""
    free = float("-inf")
    for start in sorted((-x for x in windows)):
        free = max(free, start) + rs_chunk_s
    return max(0.0, free)


def slot_weights(graph: ModelGraph, slots: list[LayerKind]) -> tuple[float, ...]:
    """Forward + backward FLOPs of each slot: what :func:`rank_load` splits."""
    per = {k: graph.layer(k).fwd_flops + graph.layer(k).bwd_flops for k in set(slots)}
    return tuple(per[k] for k in slots)
