"""Layout search: enumerate layouts and strategies, prune cheaply, run the pass pipeline on the best survivors
(docs/architecture.md §4).

1. **Enumerate** every (tp, cp, pp, vpp, ep, etp, micro_batch) whose product with dp fits the device count, within
   the degrees the user fixed; ``etp`` is ``tp`` (expert-TP) or 1 (TP-extend-EP).
2. **Prune** by the layout rules (moeplan.layout.check_layout) and a static memory lower bound (model states of
   the average stage, no activations), counting rejections by reason.
3. **Strategies** of each survivor: every schedule the target's runtime executes that fits (pp, vpp, micro-batches)
   (passes/schedule.py), the dispatcher (``auto``: the one whose EP dispatch is fastest for the layout), and the
   overlap mechanisms (``auto``: every one the target's runtime runs that applies: ``shared-expert`` with shared
   experts and EP, ``fb`` on the schedules that pair a forward with a backward). Fixed choices are honoured.
4. **Estimate and bound** each (layout, strategy) in closed form: :func:`estimate_step` from per-layer costs
   from ``shard`` (cached per tp, cp, ep, etp, micro-batch, dispatcher), each layer's forward, backward and
   overlapped forward-backward pair priced on an idle rank by the timeline, the recompute mode the memory estimate
   needs, the slowest chunk of the best stage split, the schedule's bubble and the DP and optimizer tail
   (docs/step-model.md §4); and a lower bound no plan of the option can beat (moeplan/bounds.py,
   docs/step-model.md §7).
5. **Evaluate** the ``candidates`` best estimates (those whose memory estimate fits first) with the full pipeline
   in parallel processes and rank them by simulated step time, holding only the ``keep`` fastest whole (memory does
   not grow with the number evaluated). Their simulated steps over their estimates measure how far the estimate is
   off per schedule class; then up to ``candidates`` **follow-ups**, the options whose estimate so corrected beats
   the best step found (:func:`_follow_ups`), go through too. A follow-up whose bound is not below the ``keep``-th
   best step found so far is pruned: skipped, stopped before the simulation once ``plan-memory`` has fixed its
   stages and recompute (:func:`moeplan.bounds.plan_bound`, a tighter bound), or stopped during it as soon as a
   rank's compute runs past that step (the step can only be longer). Each worker has one in flight, so the next
   one sent sees the best step found so far. A candidate the memory pass finds infeasible is retried
   without ``fb`` when the overlap set was chosen automatically (``fb`` keeps one more micro-batch in flight), else
   counted (a typed :class:`Rejected`) and dropped.
6. **Exact** (``candidates=None``): after the best estimates, every other option in order of its bound until the
   next bound is not below the best step: what is left provably cannot beat it. Otherwise the result reports the
   least bound of the options left unsimulated, so the caller knows how far from the optimum the best can be.
"""
from __future__ import annotations

import gc
import heapq
import os
import re
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import lru_cache
from multiprocessing import get_context
from typing import Iterable, Iterator, Mapping

from moeplan.bounds import SPLIT_BACKWARD, PieceSums, floors, layout_bound, piece_sums, plan_bound
from moeplan.compiler import parse_pipeline, run_pipeline
from moeplan.cost_models.dispatch import hierarchical_valid
from moeplan.cost_models.layer_program import ep_transfer, expert_group
from moeplan.cost_models.memory import model_state_bytes
from moeplan.cost_models.timeline import StepExceeded, action_time_s, concat_segments
from moeplan.errors import InfeasibleError, LayoutError
from moeplan.ir import LayerKind, ModelGraph, named_layers
from moeplan.layout import Layout, check_layout
from moeplan.passes.partition_stages import SLOT_KINDS, split_runs
from moeplan.passes.plan_memory import MODES, saved_bytes
from moeplan.passes.schedule import FB_PAIRED, Placement, in_flight_bound, placement_of, schedule_fits, stage_rank
from moeplan.passes.simulate import adam_s, beside_compute, dp_sync_s, norm_s, recompute_work
from moeplan.passes.shard import layer_cost
from moeplan.state import Dispatcher, LayerCost, LayerProgram, Mechanism, PlanState, ScheduleKind, Strategy
from moeplan.targets import Target


@dataclass(frozen=True)
class Fixed:
    """Degrees the user fixed (None = searched). ``global_batch`` and ``seq_len`` are always given."""

    global_batch: int
    seq_len: int
    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    ep: int | None = None
    etp: int | None = None
    cp: int | None = None
    micro_batch: int | None = None
    schedule: ScheduleKind | None = None
    dispatcher: Dispatcher | None = None
    overlap: frozenset[Mechanism] | None = None
    recompute: str = "auto"


@dataclass(frozen=True)
class Evaluated:
    state: PlanState
    pass_s: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class Rejected:
    """A candidate the full pipeline refused: the countable reason, the one-line message, and for a memory
    rejection the bytes per device of the first PP rank that fit under no recompute mode (at the last one tried)."""

    reason: str
    message: str
    needs_bytes: float | None = None


@dataclass(frozen=True)
class Pruned:
    """A candidate the full pipeline stopped early: before simulating, when its plan's lower bound
    (:func:`moeplan.bounds.plan_bound`, seconds) was not below the best step found when it was sent, or during the
    simulation, as soon as a rank's compute ran past that step (``bound_s``: that rank's clock)."""

    bound_s: float


@dataclass(frozen=True)
class SearchResult:
    """The ``keep`` fastest evaluated layouts, best first (only those are kept whole: any number of candidates
    fits in bounded memory), rejections counted by reason, how many layouts were enumerated, how many (layout,
    strategy) options there were, how many the full pipeline simulated or refused (``num_evaluated``) and how many
    were pruned (never simulated: their lower bound was not below the step to beat then), and ``bound_s``: the
    least lower bound of the options left unsimulated and unpruned (``inf`` when none is left: then the best is the
    optimum of the whole space under the cost model)."""

    ranked: tuple[Evaluated, ...]
    rejected: Counter  # reason -> count
    num_enumerated: int
    num_evaluated: int
    num_options: int = 0
    num_pruned: int = 0
    bound_s: float = float("inf")

    @property
    def gap(self) -> float:
        """How much faster than the best found an option left unsimulated could be, at most: ``best / bound_s −
        1`` (≤ 0: the best is provably the optimum)."""
        return self.ranked[0].state.prediction.step_time_s / self.bound_s - 1  # type: ignore[union-attr]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(fixed: int | None, options: list[int]) -> list[int]:
    return [fixed] if fixed is not None else options


def enumerate_layouts(*, graph: ModelGraph, num_devices: int, devices_per_node: int, fixed: Fixed) -> list[Layout]:
    """All layouts within the fixed degrees (unchecked: see :func:`check`)."""
    spec = graph.spec
    slots = len(named_layers(spec))
    out = []
    for tp in _choices(fixed.tp, [d for d in _divisors(num_devices) if d <= devices_per_node]):
        for cp in _choices(fixed.cp, [c for c in (1, 2, 4, 8) if num_devices % (tp * c) == 0]):
            for pp in _choices(fixed.pp, [p for p in _divisors(num_devices // (tp * cp)) if p <= slots]):
                if num_devices % (tp * cp * pp):
                    continue
                dp = num_devices // (tp * cp * pp)
                vpps = [v for v in (1, 2, 3, 4) if pp * v <= slots and (v == 1 or pp > 1)]
                eps = [e for e in _divisors(dp * cp) if not spec.num_experts or spec.num_experts % e == 0] \
                    if spec.is_moe else [1]
                for vpp in _choices(fixed.vpp, vpps):
                    for ep in _choices(fixed.ep, eps):
                        for etp in _choices(fixed.etp, sorted({1, tp}) if spec.is_moe else [tp]):
                            for mb in _choices(fixed.micro_batch, [1, 2, 4]):
                                out.append(Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, cp=cp, dp=dp,
                                                  micro_batch=mb, global_batch=fixed.global_batch,
                                                  seq_len=fixed.seq_len))
    return out


def check(layout: Layout, *, graph: ModelGraph, num_devices: int, devices_per_node: int, num_slots: int) -> None:
    """check_layout with the model's numbers; raises LayoutError."""
    spec = graph.spec
    check_layout(layout, num_devices=num_devices, devices_per_node=devices_per_node, num_heads=spec.num_heads,
                 num_kv_heads=spec.num_kv_heads, num_experts=spec.num_experts, num_layer_slots=num_slots)


def rejection_reason(err: Exception) -> str:
    """A countable reason: the message with its numbers and parentheticals removed."""
    text = re.sub(r"\([^)]*\)", "", str(err))
    text = re.sub(r"=\S+", "", text, count=1)
    return re.sub(r"\s+", " ", re.sub(r"\d+", "N", text)).strip()


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
        key, priced = _priced(graph, kind, layout, target, dispatcher, cache)
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


def _priced(graph: ModelGraph, kind: LayerKind, layout: Layout, target: Target, dispatcher: Dispatcher,
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
      (1F1B ``(pp−1)(F+B)``, interleaved ``/vpp``, the zero-bubble family ``(pp−1)(F+I−W)`` per chunk);
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
    modes = MODES if strategy.recompute == "auto" else (strategy.recompute,)
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


def strategies(layout: Layout, *, graph: ModelGraph, target: Target, fixed: Fixed,
               cache: dict | None = None) -> list[Strategy]:
    """The strategies searched for ``layout`` (module docstring, step 3); ``cache`` keeps the dispatcher choice
    per (tp, cp, ep, etp, micro-batch) across layouts."""
    caps = target.runtime
    kinds = [fixed.schedule] if fixed.schedule else list(caps.schedules)
    kinds = [k for k in kinds if layout.pp > 1 or k == "1f1b"]
    kinds = [k for k in kinds if schedule_fits(k, pp=layout.pp, vpp=layout.vpp,
                                               num_microbatches=layout.num_microbatches) is None]
    dispatcher = fixed.dispatcher or _cheapest_dispatcher(layout, graph, target, cache)
    ep = expert_group(layout)[0] > 1
    out = []
    for kind in kinds:
        if fixed.overlap is not None:
            overlap = fixed.overlap
        else:
            overlap = frozenset(m for m in caps.overlap if _applies(m, kind, layout, graph, ep))
        out.append(Strategy(schedule=kind, dispatcher=dispatcher, overlap=overlap,
                            recompute=fixed.recompute))  # type: ignore[arg-type]
    return out


def _applies(mechanism: str, kind: str, layout: Layout, graph: ModelGraph, ep: bool) -> bool:
    """Whether overlap ``mechanism`` has anything to overlap under schedule ``kind`` (``ep``: the layout's expert
    group spans more than one device)."""
    if mechanism == "shared-expert":
        return ep and graph.spec.num_shared_experts > 0
    if mechanism == "fb":
        return kind in FB_PAIRED and layout.num_microbatches > layout.pp
    if mechanism == "pp":
        return layout.pp > 1
    return layout.dp * layout.cp > 1


def _cheapest_dispatcher(layout: Layout, graph: ModelGraph, target: Target, cache: dict | None = None) -> Dispatcher:
    """The dispatcher (of those the target's runtime executes) whose forward dispatch is fastest; ``flat`` without
    EP or when nothing else fits."""
    n, stride = expert_group(layout)
    if not graph.spec.is_moe or n == 1:
        return "flat"
    key = ("dispatcher", layout.tp, layout.cp, layout.ep, layout.etp, layout.micro_batch)
    if cache is not None and key in cache:
        return cache[key]
    best, best_t = "flat", float("inf")
    for d in target.runtime.dispatchers:
        if d == "hierarchical" and not hierarchical_valid(group_size=n, stride=stride,
                                                          devices_per_node=target.devices_per_node):
            continue
        op = ep_transfer(graph.spec, layout, target, d, "fwd", dispatch_direction=True)
        t = op.time_s if op is not None else 0.0
        if t < best_t - 1e-12:
            best, best_t = d, t
    if cache is not None:
        cache[key] = best
    return best  # type: ignore[return-value]


def _evaluate(args: tuple[Layout, Strategy, str, bool, float]) -> Evaluated | Rejected | Pruned:
    """Run the full pipeline on one option. ``beat``: the best step found so far; when the pipeline ends with
    ``simulate``, a plan whose lower bound is not below it stops before the simulation (a :class:`Pruned`)."""
    layout, strategy, pipeline, auto_overlap, beat = args
    graph, target = _SHARED["graph"], _SHARED["target"]
    passes = parse_pipeline(pipeline)
    split = len(passes) - 1 if passes[-1].name == "simulate" else len(passes)
    tries = [strategy]
    if auto_overlap and "fb" in strategy.overlap:
        tries.append(replace(strategy, overlap=strategy.overlap - {"fb"}))
    for attempt in tries:
        try:
            state, timings = run_pipeline(PlanState(graph=graph, target=target, layout=layout, strategy=attempt),
                                          passes[:split])
            if split < len(passes) and state.memory is not None:
                bound = plan_bound(state)
                if bound >= beat:
                    return Pruned(bound)
                try:
                    state, last = run_pipeline(state, (replace(passes[split], stop_above_s=beat),))
                except StepExceeded as e:
                    return Pruned(e.at_s)
                timings += last
        except InfeasibleError as e:
            error = Rejected("memory: plan exceeds device memory under every recompute mode", str(e), e.needs_bytes)
            continue
        except LayoutError as e:
            return Rejected(rejection_reason(e), str(e))
        return Evaluated(state=state, pass_s=tuple((t.name, t.seconds) for t in timings))
    return error


def _check_fixed(fixed: Fixed, target: Target) -> None:
    """Refuse a fixed schedule, dispatcher or mechanism the target's runtime does not execute."""
    caps = target.runtime
    for name, chosen, allowed in (("schedule", [fixed.schedule] if fixed.schedule else [], caps.schedules),
                                   ("dispatcher", [fixed.dispatcher] if fixed.dispatcher else [], caps.dispatchers),
                                   ("overlap", sorted(fixed.overlap or ()), caps.overlap)):
        bad = [c for c in chosen if c not in allowed]
        if bad:
            raise LayoutError(f"{name}={bad[0]!r}: the runtime behind target {target.name} executes only "
                              f"{', '.join(allowed) or 'none'}")


_NO_MEMORY = "memory: model states exceed device memory"


@dataclass
class Options:
    """What the search prices: every (layout, strategy, stage params) that passed the checks and whose model
    states fit (``options``), the layouts enumerated, the count of the others per reason, the first check error
    and the least model-state bytes of a layout that did not fit (``inf`` when none failed on memory)."""

    options: list[tuple[Layout, Strategy, tuple[float, float]]]
    layouts: list[Layout]
    rejected: Counter
    first_error: LayoutError | None
    min_static: float


def slot_weights(graph: ModelGraph, slots: list[LayerKind]) -> tuple[float, ...]:
    """Forward + backward FLOPs of each slot: what :func:`rank_load` splits."""
    per = {k: graph.layer(k).fwd_flops + graph.layer(k).bwd_flops for k in set(slots)}
    return tuple(per[k] for k in slots)


def build_options(*, graph: ModelGraph, target: Target, num_devices: int, fixed: Fixed) -> Options:
    """Steps 1–3 of the module docstring: enumerate the layouts, check them, drop those whose model states do not
    fit, and pair each with its strategies."""
    dpn = target.devices_per_node
    rejected: Counter = Counter()
    cache: dict = {}
    params_of: dict[tuple[int, int, int], tuple[float, float]] = {}
    counts = Counter(k for _, k in named_layers(graph.spec))
    first_error: LayoutError | None = None
    min_static = float("inf")
    layouts = enumerate_layouts(graph=graph, num_devices=num_devices, devices_per_node=dpn, fixed=fixed)
    options: list[tuple[Layout, Strategy, tuple[float, float]]] = []
    for lay in layouts:
        try:
            check(lay, graph=graph, num_devices=num_devices, devices_per_node=dpn, num_slots=sum(counts.values()))
        except LayoutError as e:
            first_error = first_error or e
            rejected[rejection_reason(e)] += 1
            continue
        pkey = (lay.tp, lay.pp, lay.ep)  # what stage_params depends on
        params = params_of.get(pkey)
        if params is None:
            params = params_of[pkey] = stage_params(lay, graph, counts)
        static = static_bytes(lay, params)
        if static > target.usable_memory_bytes:
            min_static = min(min_static, static)
            rejected[_NO_MEMORY] += 1
            continue
        found = strategies(lay, graph=graph, target=target, fixed=fixed, cache=cache)
        if not found:
            rejected["schedule: no schedule the target runs fits pp, vpp and the micro-batches"] += 1
        options += [(lay, st, params) for st in found]
    return Options(options, layouts, rejected, first_error, min_static)


def rank_by_estimate(*, graph: ModelGraph, target: Target, options: list[tuple[Layout, Strategy, tuple[float, float]]],
                     workers: int | None = None) -> list[tuple[tuple[bool, float], float, Layout, Strategy]]:
    """Step 4 alone: every option's (sort key, lower bound, layout, strategy), best estimate first (those whose
    memory estimate fits before those that do not)."""
    slots = [k for _, k in named_layers(graph.spec)]
    _SHARED["graph"], _SHARED["target"] = _lean(graph), target
    try:
        tasks = _shape_tasks(options, slots, slot_weights(graph, slots))
        with _Pool(workers) as pool:
            return _estimate_all(pool, tasks)
    finally:
        _SHARED.clear()


def _estimate_all(pool: "_Pool", tasks: list[list[tuple[Layout, Strategy, tuple[float, float]]]]
                  ) -> list[tuple[tuple[bool, float], float, Layout, Strategy]]:
    """:func:`_estimate_shape` of every task in ``pool``, flattened and sorted by sort key (best first)."""
    scored = [x for part in pool.map(_estimate_shape, tasks, chunksize=max(1, len(tasks) // 16)) for x in part]
    scored.sort(key=lambda x: x[0])
    return scored


def search(*, graph: ModelGraph, target: Target, num_devices: int, fixed: Fixed, pipeline: str,
           candidates: int | None = 4, workers: int | None = None, keep: int = 1) -> SearchResult:
    """Find the fastest layouts; see the module docstring. ``candidates``: how many of the best estimates go through
    the full pipeline; None: every option whose lower bound is below the ``keep``-th best step found (exact).
    ``keep``: how many of the evaluated ones the result holds whole (the rest are counted, not kept). Raises LayoutError if no layout is valid, and InfeasibleError
    (with the smallest per-device memory seen) if every valid layout runs out of memory."""
    _check_fixed(fixed, target)
    built = build_options(graph=graph, target=target, num_devices=num_devices, fixed=fixed)
    options, rejected, layouts = built.options, built.rejected, built.layouts
    if not options and built.first_error is not None and not rejected.get(_NO_MEMORY):
        raise built.first_error
    if not options and fixed.schedule is not None and not rejected.get(_NO_MEMORY):
        raise LayoutError(f"schedule={fixed.schedule!r}: fits none of the {len(layouts)} layouts (pp, vpp and "
                          f"micro-batches: passes/schedule.py)")
    slots = [k for _, k in named_layers(graph.spec)]
    weights = slot_weights(graph, slots)
    _SHARED["graph"], _SHARED["target"] = _lean(graph), target  # what forked workers read
    try:
        out = _estimate_and_evaluate(options, slots, weights, target, pipeline, candidates, workers, keep,
                                     auto_overlap=fixed.overlap is None)
    finally:
        _SHARED.clear()
    rejected.update(r.reason for r in out.refused)
    ranked = out.ranked()
    if not ranked:
        _raise_infeasible(target, built.min_static, layouts, out.refused)
    return SearchResult(ranked=tuple(ranked), rejected=rejected, num_enumerated=len(layouts),
                        num_evaluated=out.sent, num_options=len(options), num_pruned=out.pruned,
                        bound_s=out.bound_s)


def _estimate_and_evaluate(options: list[tuple[Layout, Strategy, tuple[float, float]]], slots: list[LayerKind],
                           weights: tuple[float, ...], target: Target, pipeline: str, candidates: int | None,
                           workers: int | None, keep: int, *, auto_overlap: bool) -> _Outcome:
    """Steps 4–6 of the module docstring in one pool of worker processes: the options of one layer-cost shape
    (:func:`_shape_key`) are priced, estimated and bounded together; the best estimates go through the full
    pipeline, then the follow-ups (:func:`_follow_ups`) or (``candidates=None``) every option whose bound is below
    the best step found, in bound order. The ``keep`` fastest evaluated are held whole, the others dropped as they
    arrive (memory does not grow with the number evaluated). What is sent depends only on results, never on the
    order they arrive in: the same plan for any number of workers."""
    tasks = _shape_tasks(options, slots, weights)
    out = _Outcome(keep)
    with _Pool(workers) as pool:
        scored = _estimate_all(pool, tasks)
        first = scored[:candidates if candidates is not None else max(keep, 4)]
        rest = scored[len(first):]
        del scored
        # the first ones are simulated in full, whatever arrives first: what they measure decides the follow-ups
        for (est, _, _, st), r in zip(first, pool.imap(_evaluate, [(lay, st, pipeline, auto_overlap, float("inf"))
                                                                     for _, _, lay, st in first])):
            out.add(r, est[1], _estimate_class(st))
        if candidates is None:  # exact: in bound order; none of the rest can beat the best once a bound does not
            then, left = sorted(rest, key=lambda x: x[1]), []
        else:
            then, left = _follow_ups(rest, out, limit=candidates)
        del rest
        sent: deque[tuple[float, tuple[str, bool]]] = deque()  # (estimate, class) of each option in flight

        def sends() -> Iterator[tuple[Layout, Strategy, str, bool, float]]:
            for i, ((_, est), bound, lay, st) in enumerate(then):
                if bound >= out.beat_s:
                    if candidates is None:  # in bound order: every later one is out too
                        out.pruned += len(then) - i
                        return
                    out.pruned += 1
                    continue
                sent.append((est, _estimate_class(st)))
                yield lay, st, pipeline, auto_overlap, out.beat_s

        for r in pool.imap(_evaluate, sends()):
            est, cls = sent.popleft()
            out.add(r, est, cls)
        # the rest stay unsimulated: the least bound of those that could win
        out.pruned += sum(1 for x in left if x[1] >= out.beat_s)
        out.bound_s = min((x[1] for x in left if x[1] < out.beat_s), default=float("inf"))
    return out


def _estimate_class(strategy: Strategy) -> tuple[str, bool]:
    """What an estimate's error is measured per (:func:`_follow_ups`): the schedule, and whether its forwards and
    backwards run as overlapped pairs (docs/step-model.md §4: the closed form misses how pairs wait on each
    other)."""
    return strategy.schedule, "fb" in strategy.overlap and strategy.schedule in FB_PAIRED


def _follow_ups(rest: list[tuple[tuple[bool, float], float, Layout, Strategy]], out: "_Outcome", *, limit: int
                ) -> tuple[list, list]:
    """(the options to simulate next, the others): at most ``limit`` of those whose memory estimate fits, least
    corrected estimate first, each below the best step simulated so far.

    The correction is measured, not assumed: each simulated option gives its step over its estimate, and an
    option's estimate is scaled by the least such ratio seen in its class (:func:`_estimate_class`), by none while
    its class has no simulation. So a class the estimate favours wrongly (say, one 20% optimistic) stops crowding
    out the others once its first options are simulated, and a class not simulated yet gets a look when its best
    estimate beats the best step."""
    ranked = sorted(((x[0][1] * out.ratio(_estimate_class(x[3])), i) for i, x in enumerate(rest) if not x[0][0]))
    chosen = {i for corrected, i in ranked[:limit] if corrected < out.beat_s}
    return [rest[i] for _, i in ranked[:limit] if i in chosen], [x for i, x in enumerate(rest) if i not in chosen]


@dataclass
class _Outcome:
    """What the evaluation loop has so far: the ``keep`` fastest (a heap whose top is the slowest of them), the
    refusals, how many options the full pipeline simulated or refused (``sent``) and how many a bound pruned (before
    or inside the pipeline), and the least bound left."""

    keep: int
    best: list[tuple[float, int, Evaluated]] = field(default_factory=list)
    refused: list[Rejected] = field(default_factory=list)
    sent: int = 0
    pruned: int = 0
    bound_s: float = float("inf")
    ratios: dict[tuple[str, bool], float] = field(default_factory=dict)  # per estimate class: :meth:`ratio`

    @property
    def beat_s(self) -> float:
        """The step an option must beat to enter the ``keep`` fastest: the slowest of them once there are
        ``keep``, else ``inf``."""
        return -self.best[0][0] if len(self.best) >= self.keep else float("inf")

    def ratio(self, cls: tuple[str, bool]) -> float:
        """The least simulated-over-estimated step seen in ``cls``; 1 (the estimate as it is) while it has none."""
        return self.ratios.get(cls, 1.0)

    def add(self, r: Evaluated | Rejected | Pruned, estimate_s: float, cls: tuple[str, bool]) -> None:
        """Count ``r``, the result of the option estimated at ``estimate_s`` seconds in class ``cls``."""
        self.sent += not isinstance(r, Pruned)
        if isinstance(r, Evaluated) and estimate_s > 0:
            ratio = r.state.prediction.step_time_s / estimate_s  # type: ignore[union-attr]
            self.ratios[cls] = min(self.ratios.get(cls, ratio), ratio)
        if isinstance(r, Rejected):
            self.refused.append(r)
        elif isinstance(r, Pruned):
            self.pruned += 1
        else:
            item = (-r.state.prediction.step_time_s, -self.sent, r)  # type: ignore[union-attr]
            if len(self.best) < self.keep:
                heapq.heappush(self.best, item)
            elif item[:2] > self.best[0][:2]:
                heapq.heapreplace(self.best, item)

    def ranked(self) -> list[Evaluated]:
        return [e for _, _, e in sorted(self.best, key=lambda x: x[:2], reverse=True)]


_SHARED: dict = {}
"""The traced graph (without fx modules), the target, the slot counts per kind and the slots' weights of the running
search: set before the worker processes fork, so tasks carry only layouts and strategies."""


def _lean(graph: ModelGraph) -> ModelGraph:
    return replace(graph, layers={k: replace(v, gm=None) for k, v in graph.layers.items()})


def _shape_tasks(options: list[tuple[Layout, Strategy, tuple[float, float]]], slots: list[LayerKind],
                 weights: tuple[float, ...]) -> list[list[tuple[Layout, Strategy, tuple[float, float]]]]:
    """The options grouped by layer-cost shape (one :func:`_estimate_shape` task each); sets what the workers read
    besides the graph and the target."""
    groups: dict[tuple, list[tuple[Layout, Strategy, tuple[float, float]]]] = {}
    for opt in options:
        groups.setdefault(_shape_key(opt[0], opt[1]), []).append(opt)
    _SHARED["counts"], _SHARED["weights"], _SHARED["slots"] = Counter(slots), weights, slots
    _SHARED["slot_flags"] = tuple(int(k in SLOT_KINDS) for k in slots)
    return list(groups.values())


def _shape_key(layout: Layout, strategy: Strategy) -> tuple:
    """What the layer costs depend on: (tp, cp, ep, etp, micro-batch, dispatcher)."""
    return (layout.tp, layout.cp, layout.ep, layout.etp, layout.micro_batch, strategy.dispatcher)


def _estimate_shape(options: list[tuple[Layout, Strategy, tuple[float, float]]]
                    ) -> list[tuple[tuple[bool, float], float, Layout, Strategy]]:
    """(sort key, lower bound, layout, strategy) of each option of one layer-cost shape: the sort key puts the
    options whose memory estimate fits first, then orders by estimated step; the bound is
    :func:`moeplan.bounds.layout_bound`."""
    graph, target, counts, slots = _SHARED["graph"], _SHARED["target"], _SHARED["counts"], _SHARED["slots"]
    cache = _SHARED.setdefault("costs", {})  # per process: forked workers each keep their own
    out = []
    costs: dict[frozenset, ModelCost] = {}  # the options of one shape differ in their overlap sets only
    sums: dict[tuple, PieceSums] = {}
    opt_floor = norm_s(options[0][0].world_size, target)
    for lay, st, params in options:
        cost = costs.get(st.overlap)
        if cost is None:
            cost = costs[st.overlap] = model_cost(graph, lay, target, st.dispatcher, st.overlap, counts, cache)
        est = estimate_step(lay, st, cost, weights=_SHARED["weights"], slots=_SHARED["slot_flags"], params=params,
                            target=target)
        skey = (st.overlap, st.schedule in FB_PAIRED, st.schedule in SPLIT_BACKWARD)
        if skey not in sums:
            per_kind = {}
            for k in counts:
                key, (lc, _, _) = _priced(graph, k, lay, target, st.dispatcher, cache)
                if (key, skey[:2]) not in cache:
                    cache[(key, skey[:2])] = floors(lc, st)
                per_kind[k] = cache[(key, skey[:2])]
            sums[skey] = piece_sums([per_kind[k] for k in slots], st)
        bound = layout_bound(sums[skey], pp=lay.pp, num_microbatches=lay.num_microbatches, opt_floor_s=opt_floor)
        out.append(((not est.fits, est.step_s), bound, lay, st))
    return out


class _Pool:
    """``map`` / ``imap`` in forked worker processes (``workers`` of them, default the CPU count), or in this process
    for one worker; the pool starts at the first call with more than one task."""

    def __init__(self, workers: int | None) -> None:
        self.workers = workers or os.cpu_count() or 1
        self.pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> "_Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            gc.unfreeze()  # a long-lived caller (a benchmark, the tests) can collect it again

    def map(self, fn, tasks: list, chunksize: int = 1) -> list:  # type: ignore[no-untyped-def]
        if self.workers <= 1 or len(tasks) <= 1:
            return [fn(t) for t in tasks]
        return list(self._executor().map(fn, tasks, chunksize=chunksize))

    def imap(self, fn, tasks: Iterable) -> Iterator:  # type: ignore[no-untyped-def]
        """``fn`` of each task, in order, with at most two tasks per worker submitted and not yet consumed (so
        results the caller drops do not pile up, and ``tasks``, read lazily, may depend on the results so far)."""
        if self.workers <= 1:
            yield from (fn(t) for t in tasks)
            return
        pending: deque = deque()
        for t in tasks:
            pending.append(self._executor().submit(fn, t))
            if len(pending) >= self.workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def _executor(self) -> ProcessPoolExecutor:
        if self.pool is None:
            # what exists now (torch, the traced graph) outlives the workers: freezing it keeps their collections
            # from traversing it and their pages shared (the fork recipe of the gc module's docs)
            gc.freeze()
            self.pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=get_context("fork"))
        return self.pool


def _raise_infeasible(target: Target, min_static: float, layouts: list[Layout], refused: list[Rejected]) -> None:
    """No layout survived: raise InfeasibleError naming the least per-device memory any layout would need."""
    gib, allowed = 1024**3, target.usable_memory_bytes / 1024**3
    needs = [r.needs_bytes for r in refused if r.needs_bytes is not None]
    if needs:
        raise InfeasibleError(f"memory: no layout fits; the best of {len(layouts)} needs {min(needs) / gib:.1f} GiB "
                              f"per device, {target.name} allows {allowed:.1f} GiB", needs_bytes=min(needs))
    if min_static < float("inf"):
        raise InfeasibleError(f"memory: no layout of {len(layouts)} fits; the best needs at least "
                              f"{min_static / gib:.1f} GiB per device for model states alone, {target.name} "
                              f"allows {allowed:.1f} GiB", needs_bytes=min_static)
    raise LayoutError(f"layout: none of {len(layouts)} layouts is valid: "
                      f"{refused[0].message if refused else 'none left'}")
