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
from typing import Mapping

from moeplan.cost_models.memory import model_state_bytes
from moeplan.cost_models.timeline import action_time_s, concat_segments
from moeplan.ir import LayerKind, ModelGraph
from moeplan.layout import Layout
from moeplan.passes.partition_stages import split_runs
from moeplan.passes.plan_memory import MODES, saved_bytes
from moeplan.passes.schedule import FB_PAIRED, Placement, in_flight_bound, placement_of, stage_rank
from moeplan.passes.shard import layer_cost
from moeplan.passes.simulate import adam_s, beside_compute, dp_sync_s, recompute_work
from moeplan.state import Dispatcher, LayerCost, LayerProgram, ScheduleKind, Strategy
from moeplan.targets import Target

@dataclass(frozen=True)
class ModelCost:
    """The whole model (every slot once) for one micro-batch on one device, each layer priced on an idle rank by the
    timeline: forward, input gradient, weight gradient and (under ``fb``) forwards overlapped with backwards, in
    seconds; per recompute mode the forward work redone (seconds) and the activation bytes kept."""

    fwd: float
    bwd_input: float
    bwd_weight: float
    pair: float
    recompute_s: Mapping[str, float]
    act_bytes: Mapping[str, float]
    pair_edge: float = 0.0  # under fb, the first layer's extra once per pair action: model_cost
    bwd_busy_s: Mapping[str, float] = field(default_factory=dict)  # per link tier: seconds its backward holds it


def model_cost(graph: ModelGraph, layout: Layout, target: Target, dispatcher: Dispatcher, overlap: frozenset,
                counts: Counter, cache: dict) -> ModelCost:
    """:class:`ModelCost` of the slots ``counts``. ``cache`` keeps each kind's layer cost and timeline prices per
    what they depend on: (tp, cp, micro-batch) for a layer without routed experts, also (ep, etp, dispatcher) for
    one with them.

    A stage runs its layers back to back, and across an ``fb`` pair the timeline overlaps one layer's collectives
    with the next layer's compute. So under ``fb`` a kind's pair is priced as its steady increment, half what two
    more layers add to a pair of two on an idle rank (past the first layer's transient), and the first layer's
    extra (two layers less twice the increment) is charged once per pair action (``pair_edge``, of the most
    common kind). Forwards and backwards
    alone are priced one layer at a time."""
    f = i = w = pair = 0.0
    redo = dict.fromkeys(MODES, 0.0)
    act = dict.fromkeys(MODES, 0.0)
    busy = {"intra": 0.0, "inter": 0.0}
    edges: dict[LayerKind, float] = {}
    for kind, n in counts.items():
        key, priced = layer_prices(graph, kind, layout, target, dispatcher, cache)
        if ("kind", key, overlap) not in cache:
            cache[("kind", key, overlap)] = _kind_prices(key, priced[0].program, target, overlap, cache)
        lf, li, lw, lp, edges[kind], lbusy = cache[("kind", key, overlap)]
        f, i, w, pair = f + n * lf, i + n * li, w + n * lw, pair + n * lp
        for tier, secs in lbusy.items():
            busy[tier] += n * secs
        for m in MODES:
            redo[m] += n * priced[1][m]
            act[m] += n * priced[2][m]
    return ModelCost(f, i, w, pair, redo, act, edges[max(counts, key=counts.__getitem__)], busy)


def _kind_prices(key: tuple, prog: LayerProgram, target: Target, overlap: frozenset, cache: dict
                 ) -> tuple[float, float, float, float, float, dict[str, float]]:
    """One layer's (forward, input gradient, weight gradient, pair increment, pair edge, backward busy seconds per
    link tier) under ``overlap`` (:func:`model_cost`). The timeline prices depend only on the mechanisms the
    layer's collectives name (``async_by``) and on fb, so they are kept per those."""
    used = overlap & ({s.async_by for s in prog.fwd + prog.bwd_input} | {"fb"})
    if ("timeline", key, used) not in cache:
        settings = beside_compute(target, overlap)
        lf, li, lw = (action_time_s([x], settings) for x in (prog.fwd, prog.bwd_input, prog.weight_alone))
        if "fb" in overlap:  # t(n): a pair of n layers; the increment from 2 to 4 layers, past the first's transient
            two, four = (action_time_s([concat_segments([prog.fwd] * n), concat_segments([prog.backward] * n)],
                                       settings) for n in (2, 4))
            step = (four - two) / 2
            cache[("timeline", key, used)] = (lf, li, lw, step, two - 2 * step)
        else:  # without fb a pair is its forward, then its backward
            cache[("timeline", key, used)] = (lf, li, lw, lf + li + lw, 0.0)
    comms = [x.comm for x in prog.bwd_input + prog.bwd_weight if x.comm is not None]
    return (*cache[("timeline", key, used)], {t: sum(c.busy_s(t) for c in comms) for t in ("intra", "inter")})


def layer_prices(graph: ModelGraph, kind: LayerKind, layout: Layout, target: Target, dispatcher: Dispatcher,
            cache: dict) -> tuple[tuple, tuple[LayerCost, dict[str, float], dict[str, float]]]:
    """(cache key, (layer cost, recompute seconds per mode, activation bytes per mode)) of one layer kind, priced
    once per what it depends on (:func:`model_cost`)."""
    lg = graph.layer(kind)
    key = (kind, layout.tp, layout.cp, layout.micro_batch) + (
        (layout.ep, layout.etp, dispatcher) if lg.expert_param_count else ())
    if key not in cache:
        lc = layer_cost(lg, spec=graph.spec, layout=layout, target=target, dispatcher=dispatcher,
                        op_times=cache.setdefault("op_times", {}))
        cache[key] = (lc, {m: recompute_work(lc, m)[0] for m in MODES}, {m: saved_bytes(lc, m) for m in MODES})
    return key, cache[key]


def stage_params(layout: Layout, graph: ModelGraph, counts: Counter) -> tuple[float, float]:
    """(dense, routed-expert) parameters per device of an average stage."""
    dense = sum(n * (graph.layer(k).param_count - graph.layer(k).expert_param_count + graph.layer(k).shared_param_count)
                for k, n in counts.items()) / (layout.tp * layout.pp)
    expert = sum(n * graph.layer(k).expert_param_count for k, n in counts.items()) / (layout.ep * layout.tp * layout.pp)
    return dense, expert


def static_bytes(layout: Layout, params: tuple[float, float]) -> float:
    """Model-state bytes per device of an average stage (``params`` from :func:`stage_params`): a lower bound for
    the fullest stage (no activations)."""
    return model_state_bytes(dense_params=params[0], expert_params=params[1], dense_dp=layout.dp * layout.cp,
                             expert_dp=layout.expert_dp).total_bytes


@dataclass(frozen=True)
class Estimate:
    """The closed-form step estimate of one (layout, strategy): seconds, the recompute mode its memory estimate
    needs, and whether any mode fits (an estimate: the memory pass decides)."""

    step_s: float
    recompute: str
    fits: bool
    memory_bytes: float = 0.0  # per device, of the average stage under ``recompute``


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
                  load: float | None = None) -> Estimate:
    """Closed-form step estimate (docs/step-model.md §4), for ranking layouts before the full pipeline:

    - **Recompute**: the cheapest mode (or the fixed one) whose memory fits — model states of the average stage
      plus :func:`~moeplan.passes.schedule.in_flight_bound` micro-batch chunks of the average chunk's activations;
    - **Stages**: the pipeline flows at the pace of its busiest rank, so every pass is scaled by that rank's load
      over the balanced ``1/pp`` (:func:`rank_load` of the slots' ``weights``, their forward + backward FLOPs,
      split as the partition pass splits, ``slots`` marking the decoder layers: how uneven the split comes out
      depends on the layers' granularity far more than on the layout), and each
      overlapped pair pays its first layer's extra once (:class:`ModelCost` ``pair_edge``);
    - **Schedule**: ``m`` micro-batches of work (the steady ones as overlapped pairs under ``fb``) plus the bubble
      (1F1B ``(pp−1)(F+B)``, interleaved ``/vpp``, the zero-bubble family ``(pp−1)(F+I−W)`` per chunk); on a
      target whose p2p messages hold the compute stream (``launch.p2p_host_s``), each micro-batch's ``4·(pp·vpp −
      1)`` SENDs and RECVs shared by the ``pp`` ranks;
    - **DP and optimizer**: the DP collectives of the average stage (passes/simulate.py) after the last
      backward; under ``dp`` the reduce-scatters of the ``vpp`` chunks, each started at its chunk's last backward
      (:func:`drain_windows`), as far as they run past the rank's last backward
      (:func:`exposed_reduce_scatter_s`); then the Adam update of the locally owned parameters.

    ``load``: the busiest rank's share over the balanced one instead of :func:`rank_load`'s; the step never
    decreases with it, so ``load=1`` gives a lower bound of the estimate (the architecture screen prunes with it).
    """
    pp, vpp, m = layout.pp, layout.vpp, layout.num_microbatches
    static = static_bytes(layout, params)
    chunks = pp * vpp
    fb = "fb" in strategy.overlap
    held = in_flight_bound(strategy.schedule, pp=pp, vpp=vpp, num_microbatches=m, fb=fb)
    # per-tensor modes are estimated by whole-layer modes (an approximation: ilp's choices include near-equivalents
    # of none, selective and full; mindspeed is closest to selective); plan-memory decides
    modes = {"auto": MODES, "ilp": MODES, "ilp-no-swap": MODES, "mindspeed": ("selective",)}.get(
        strategy.recompute, (strategy.recompute,))
    fits = False
    for mode in modes:
        memory = static + held * cost.act_bytes[mode] / chunks
        if memory <= target.usable_memory_bytes:
            fits = True
            break
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
    tail = adam_s(dense / (layout.dp * layout.cp) + expert / layout.expert_dp, target)
    overlap_dp = "dp" in strategy.overlap
    rs_chunk, taken = 0.0, 0.0
    for n, group, stride in ((dense, layout.dp * layout.cp, layout.tp), (expert, layout.expert_dp, layout.tp * layout.ep)):
        if n and group > 1:
            rs, ag, tier = dp_sync_s(n / vpp if overlap_dp else n, group=group, stride=stride, target=target)
            if overlap_dp:
                rs_chunk += rs
                # the backwards' own collectives hold the tier for this share of the drain
                taken = max(taken, min(1.0, cost.bwd_busy_s.get(tier, 0.0) / (cost.bwd_input + redo + cost.bwd_weight)))
            else:
                tail += rs + ag
    if rs_chunk:
        windows = drain_windows(kind, pp=pp, vpp=vpp, chunk_backward_s=(i + w) / vpp)
        tail += exposed_reduce_scatter_s(rs_chunk, [x * (1 - taken) for x in windows])
    return Estimate(step_s=work + bubble + tail, recompute=mode, fits=fits, memory_bytes=memory)


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
