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
4. **Estimate and bound** each (layout, strategy) in closed form: :func:`moeplan.estimate.estimate_step` from
   per-layer costs from ``shard`` (cached per tp, cp, ep, etp, micro-batch, dispatcher), each layer's forward,
   backward and overlapped forward-backward pair priced on an idle rank by the timeline, the recompute mode the
   memory estimate needs, the slowest chunk of the best stage split, the schedule's bubble and the DP and optimizer
   tail (docs/step-model.md §4); and a lower bound no plan of the option can beat (moeplan/bounds.py,
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
   counted (a typed :class:`moeplan.layout.Rejection`) and dropped.
6. **Exact** (``candidates=None``): after the best estimates, every other option in order of its bound until the
   next bound is not below the best step: what is left provably cannot beat it. Otherwise the result reports the
   least bound of the options left unsimulated, so the caller knows how far from the optimum the best can be.
"""
from __future__ import annotations

import gc
import heapq
import os
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing import get_context
from typing import Iterable, Iterator

from moeplan.bounds import SPLIT_BACKWARD, PieceSums, floors, layout_bound, piece_sums, plan_bound
from moeplan.compiler import DEFAULT_PIPELINE, parse_pipeline, run_pipeline
from moeplan.cost_models.dispatch import hierarchical_valid
from moeplan.cost_models.layer_program import ep_transfer, expert_group
from moeplan.cost_models.memory import gib_text
from moeplan.cost_models.step import norm_s
from moeplan.cost_models.timeline import StepExceeded
from moeplan.errors import InfeasibleError, LayoutError, PlanError
from moeplan.estimate import (ModelCost, estimate_memory, estimate_step, layer_prices, model_cost, slot_weights,
                              stage_params, static_bytes)
from moeplan.ir import LayerKind, ModelGraph, named_layers
from moeplan.layout import Layout, Rejection, check_fixed_degrees, check_layout, layout_rejection
from moeplan.passes.partition_stages import SLOT_KINDS
from moeplan.passes.schedule import schedule_fits
from moeplan.mechanisms import FB_PAIRED, mechanism
from moeplan.state import Dispatcher, Mechanism, PlanState, Precision, ScheduleKind, Strategy
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
    dp_shard: int | None = None
    search_fsdp: bool = False
    """With ``dp_shard`` None: also try each layout fully sharded (``dp_shard = dp``) where the runtime has FSDP
    (``--dp-shard auto``). Off by default: it doubles the options, and the MoE recipes this planner targets run
    ZeRO-1."""
    schedule: ScheduleKind | None = None
    dispatcher: Dispatcher | None = None
    overlap: frozenset[Mechanism] | None = None
    recompute: str = "auto"
    precision: Precision = Precision()
    recompute_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class Evaluated:
    state: PlanState
    pass_s: tuple[tuple[str, float], ...]


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
    rejected: Counter  # Rejection.reason (a code of moeplan.layout.REASONS) -> count
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


def enumerate_layouts(*, graph: ModelGraph, num_devices: int, devices_per_node: int, fixed: Fixed,
                      fsdp: bool = False) -> list[Layout]:
    """All layouts within the fixed degrees (unchecked: see :func:`check`); ``fsdp``: the runtime shards with FSDP,
    so each layout is also tried fully sharded (``dp_shard = dp``)."""
    spec = graph.spec
    slots = len(named_layers(spec))
    out = []
    for tp in _choices(fixed.tp, [d for d in _divisors(num_devices) if d <= devices_per_node]):
        for cp in _choices(fixed.cp, [c for c in (1, 2, 4, 8) if num_devices % (tp * c) == 0]):
            for pp in _choices(fixed.pp, [p for p in _divisors(num_devices // (tp * cp)) if p <= slots]):
                if num_devices % (tp * cp * pp):
                    continue
                dp = num_devices // (tp * cp * pp)
                vpps = [v for v in (1, 2, 3, 4) if v == 1 or (pp > 1 and pp * v <= slots)]
                eps = [e for e in _divisors(dp * cp) if not spec.num_experts or spec.num_experts % e == 0] \
                    if spec.is_moe else [1]
                for vpp in _choices(fixed.vpp, vpps):
                    for ep in _choices(fixed.ep, eps):
                        for etp in _choices(fixed.etp, sorted({1, tp}) if spec.is_moe else [tp]):
                            for mb in _choices(fixed.micro_batch, [1, 2, 4]):
                                for shard in _choices(fixed.dp_shard, [1, dp] if fsdp and dp > 1 else [1]):
                                    out.append(Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, cp=cp, dp=dp,
                                                      micro_batch=mb, global_batch=fixed.global_batch,
                                                      seq_len=fixed.seq_len, dp_shard=shard))
    return out


def check(layout: Layout, *, graph: ModelGraph, num_devices: int, devices_per_node: int, num_slots: int) -> None:
    """check_layout with the model's numbers; raises LayoutError."""
    spec = graph.spec
    check_layout(layout, num_devices=num_devices, devices_per_node=devices_per_node, num_heads=spec.num_heads,
                 num_kv_heads=spec.num_kv_heads, num_experts=spec.num_experts, num_layer_slots=num_slots)


def strategies(layout: Layout, *, graph: ModelGraph, target: Target, fixed: Fixed,
               cache: dict | None = None) -> list[Strategy]:
    """The strategies searched for ``layout`` (module docstring, step 3); ``cache`` keeps the dispatcher choice
    per (tp, cp, ep, etp, micro-batch) across layouts."""
    caps = target.runtime
    kinds = [fixed.schedule] if fixed.schedule else list(caps.schedules)
    kinds = [k for k in kinds if layout.pp > 1 or k == "1f1b"]
    kinds = [k for k in kinds if schedule_fits(k, pp=layout.pp, vpp=layout.vpp,
                                               num_microbatches=layout.num_microbatches).fits]
    dispatcher = fixed.dispatcher or _cheapest_dispatcher(layout, graph, target, cache)
    ep = expert_group(layout)[0] > 1
    out = []
    for kind in kinds:
        if fixed.overlap is not None:
            overlap = fixed.overlap
        else:
            overlap = frozenset(m for m in caps.mechanisms() if _applies(m, kind, layout, graph, ep))
        out.append(Strategy(schedule=kind, dispatcher=dispatcher, overlap=overlap, recompute=fixed.recompute,
                            precision=fixed.precision, recompute_modules=fixed.recompute_modules))  # type: ignore[arg-type]
    return out


def _applies(name: str, kind: str, layout: Layout, graph: ModelGraph, ep: bool) -> bool:
    """Whether overlap mechanism ``name`` has anything to overlap under schedule ``kind`` (``ep``: the layout's expert
    group spans more than one device; moeplan/mechanisms.py). Raises ValueError for an unregistered name."""
    return mechanism(name).applies(kind, layout, graph.spec, ep)


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


def _evaluate(args: tuple[Layout, Strategy, str, bool, float]) -> Evaluated | Rejection | Pruned:
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
        except InfeasibleError as e:  # figure: bytes per device of the first PP rank that fit under no recompute mode
            error = Rejection("memory", e.needs_bytes, str(e))
            continue
        except LayoutError as e:
            return e.rejection if isinstance(e.rejection, Rejection) else Rejection("pass", None, str(e))
        return Evaluated(state=state, pass_s=tuple((t.name, t.seconds) for t in timings))
    return error


def _check_fixed(fixed: Fixed, target: Target, num_devices: int) -> None:
    """Refuse a device count or fixed degrees that fit no layout (:func:`moeplan.layout.check_fixed_degrees`), and a
    fixed schedule, dispatcher or mechanism the target's runtime does not execute."""
    check_fixed_degrees(num_devices, tp=fixed.tp, cp=fixed.cp, pp=fixed.pp, ep=fixed.ep)
    caps = target.runtime
    if ((fixed.dp_shard or 1) > 1 or fixed.search_fsdp) and not caps.fsdp:
        raise LayoutError(f"dp_shard={fixed.dp_shard or 'auto'}: the runtime behind target {target.name} has no FSDP "
                          f"(ZeRO-1 only); use --dp-shard 1")
    for name, chosen, allowed in (("schedule", [fixed.schedule] if fixed.schedule else [], caps.schedules),
                                   ("dispatcher", [fixed.dispatcher] if fixed.dispatcher else [], caps.dispatchers),
                                   ("overlap", sorted(fixed.overlap or ()), caps.mechanisms())):
        bad = [c for c in chosen if c not in allowed]
        if bad:
            raise LayoutError(f"{name}={bad[0]!r}: the runtime behind target {target.name} executes only "
                              f"{', '.join(allowed) or 'none'}")


PLAN_DECISIONS = ("sharding", "stages", "experts", "schedule", "memory", "prediction")
"""What a compiled plan holds, each provided by a pass of the pipeline (moeplan.compile.plan_from_state)."""


def check_pipeline(pipeline: str) -> None:
    """Raise PlanError unless ``pipeline`` parses and its passes provide every decision of a plan (the search ranks
    layouts by the ``simulate`` pass's step time, and a plan holds all of :data:`PLAN_DECISIONS`)."""
    provided = {d for p in parse_pipeline(pipeline) for d in p.provides}
    missing = [d for d in PLAN_DECISIONS if d not in provided]
    if missing:
        raise PlanError(f"pipeline={pipeline!r}: a compiled plan needs {', '.join(missing)}, which no pass of it "
                        f"provides (the default: {DEFAULT_PIPELINE})")


@dataclass
class Options:
    """What the search prices: every (layout, strategy, stage params) that passed the checks and whose model
    states fit (``options``), the layouts enumerated, the count of the others per reason code, and one rejection
    per reason: the first seen, or for ``model-states`` the least bytes per device."""

    options: list[tuple[Layout, Strategy, tuple[float, float]]]
    layouts: list[Layout]
    rejected: Counter
    examples: dict[str, Rejection]


def build_options(*, graph: ModelGraph, target: Target, num_devices: int, fixed: Fixed, budget: float) -> Options:
    """Steps 1–3 of the module docstring: enumerate the layouts, check them, drop those whose model states and
    fixed overheads do not fit ``budget`` (bytes per device), and pair each with its strategies."""
    dpn = target.devices_per_node
    rejected: Counter = Counter()
    cache: dict = {}
    params_of: dict[tuple[int, int, int], tuple[float, float]] = {}
    counts = Counter(k for _, k in named_layers(graph.spec))
    examples: dict[str, Rejection] = {}

    def reject(r: Rejection) -> None:
        rejected[r.reason] += 1
        if r.reason not in examples or (r.reason == "model-states" and r.figure < examples[r.reason].figure):
            examples[r.reason] = r

    spec = graph.spec
    layouts = enumerate_layouts(graph=graph, num_devices=num_devices, devices_per_node=dpn, fixed=fixed,
                                fsdp=target.runtime.fsdp and fixed.search_fsdp)
    options: list[tuple[Layout, Strategy, tuple[float, float]]] = []
    for lay in layouts:
        refused = layout_rejection(lay, num_devices=num_devices, devices_per_node=dpn, num_heads=spec.num_heads,
                                   num_kv_heads=spec.num_kv_heads, num_experts=spec.num_experts,
                                   num_layer_slots=sum(counts.values()))
        if refused is not None:
            reject(refused)
            continue
        pkey = (lay.tp, lay.pp, lay.ep)  # what stage_params depends on
        params = params_of.get(pkey)
        if params is None:
            params = params_of[pkey] = stage_params(lay, graph, counts)
        # a lower bound for every strategy: the flat dispatcher holds no DeepEP buffers
        static = static_bytes(lay, params, target, Strategy(precision=fixed.precision), hidden_size=spec.hidden_size)
        if static > budget:
            reject(Rejection("model-states", static, f"memory: {lay.short()} needs {gib_text(static)} per device "
                                                     f"for model states and overheads alone; the budget is "
                                                     f"{gib_text(budget)}"))
            continue
        found = strategies(lay, graph=graph, target=target, fixed=fixed, cache=cache)
        if not found:
            m = lay.num_microbatches
            reject(Rejection("schedule", m, f"schedule: no schedule searched fits pp, vpp and the {m} micro-batches "
                                            f"of {lay.short()}"))
        options += [(lay, st, params) for st in found]
    return Options(options, layouts, rejected, examples)


def pipeline_budget(pipeline: str, target: Target) -> float:
    """The bytes per device a plan may fill under ``pipeline``: its ``plan-memory`` pass's budget (``--memory-budget``
    or the device's memory), which every memory check of the search uses. Raises PlanError for a budget above the
    device's memory."""
    from moeplan.passes.plan_memory import PlanMemoryPass

    found = [p for p in parse_pipeline(pipeline) if isinstance(p, PlanMemoryPass)]
    return (found[0] if found else PlanMemoryPass()).budget(target)


def rank_by_estimate(*, graph: ModelGraph, target: Target, options: list[tuple[Layout, Strategy, tuple[float, float]]],
                     budget: float, workers: int | None = None
                     ) -> list[tuple[tuple[bool, float], float, Layout, Strategy]]:
    """Step 4 alone: every option's (sort key, lower bound, layout, strategy), best estimate first (those whose
    memory estimate fits ``budget`` before those that do not)."""
    slots = [k for _, k in named_layers(graph.spec)]
    _SHARED["graph"], _SHARED["target"], _SHARED["budget"] = _lean(graph), target, budget
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
    ``keep``: how many of the evaluated ones the result holds whole (the rest are counted, not kept). Raises
    PlanError if the pipeline cannot make a plan (:func:`check_pipeline`), LayoutError if no layout is valid (the
    most common reason, with the counts of the others), and InfeasibleError (with the smallest per-device memory
    seen) if every valid layout runs out of memory."""
    check_pipeline(pipeline)
    _check_fixed(fixed, target, num_devices)
    budget = pipeline_budget(pipeline, target)
    built = build_options(graph=graph, target=target, num_devices=num_devices, fixed=fixed, budget=budget)
    options, rejected, layouts = built.options, built.rejected, built.layouts
    if not options and "model-states" not in rejected:
        if fixed.schedule is not None and "schedule" in rejected:
            raise LayoutError(f"schedule={fixed.schedule!r}: fits none of the {len(layouts)} layouts (pp, vpp and "
                              f"micro-batches: passes/schedule.py)")
        raise _none_valid(layouts, rejected, built.examples)
    slots = [k for _, k in named_layers(graph.spec)]
    weights = slot_weights(graph, slots)
    _SHARED["graph"], _SHARED["target"], _SHARED["budget"] = _lean(graph), target, budget  # what forked workers read
    try:
        out = _estimate_and_evaluate(options, slots, weights, target, pipeline, candidates, workers, keep,
                                     auto_overlap=fixed.overlap is None)
    finally:
        _SHARED.clear()
    rejected.update(r.reason for r in out.refused)
    ranked = out.ranked()
    if not ranked:
        _raise_infeasible(budget, built.examples.get("model-states"), layouts, out.refused)
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
    refused: list[Rejection] = field(default_factory=list)
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

    def add(self, r: Evaluated | Rejection | Pruned, estimate_s: float, cls: tuple[str, bool]) -> None:
        """Count ``r``, the result of the option estimated at ``estimate_s`` seconds in class ``cls``."""
        self.sent += not isinstance(r, Pruned)
        if isinstance(r, Evaluated) and estimate_s > 0:
            ratio = r.state.prediction.step_time_s / estimate_s  # type: ignore[union-attr]
            self.ratios[cls] = min(self.ratios.get(cls, ratio), ratio)
        if isinstance(r, Rejection):
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
    _SHARED["counts"], _SHARED["weights"], _SHARED["slots"] = Counter(slots), weights, tuple(slots)
    _SHARED["slot_flags"] = tuple(int(k in SLOT_KINDS) for k in slots)
    return list(groups.values())


def _shape_key(layout: Layout, strategy: Strategy) -> tuple:
    """What the layer costs depend on: (tp, cp, ep, etp, micro-batch, dispatcher, the recipe's precision), and under
    FSDP the degrees its per-layer collectives and resharding depend on (dp_shard, dp, pp)."""
    fsdp = (layout.dp_shard, layout.dp, layout.pp) if layout.dp_shard > 1 else ()
    return (layout.tp, layout.cp, layout.ep, layout.etp, layout.micro_batch, strategy.dispatcher,
            strategy.precision, fsdp)


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
            cost = costs[st.overlap] = model_cost(graph, lay, target, st.dispatcher, st.overlap, counts, cache,
                                                  st.precision)
        memory = estimate_memory(lay, st, cost, kinds=slots, target=target, budget=_SHARED["budget"],
                                 hidden_size=graph.spec.hidden_size)
        est = estimate_step(lay, st, cost, weights=_SHARED["weights"], slots=_SHARED["slot_flags"], params=params,
                            target=target, memory=memory)
        skey = (st.overlap, st.schedule in FB_PAIRED, st.schedule in SPLIT_BACKWARD)
        if skey not in sums:
            per_kind = {}
            for k in counts:
                key, (lc, _) = layer_prices(graph, k, lay, target, st.dispatcher, cache,
                                            st.precision)
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


def _none_valid(layouts: list[Layout], rejected: Counter, examples: dict[str, Rejection]) -> LayoutError:
    """The error when every layout broke a rule: the most common rejection's message, how many layouts it refused
    and the counts of the other reasons."""
    if not layouts:
        return LayoutError("layout: no layout was enumerated")
    (top, count), *others = rejected.most_common()
    n = len(layouts)
    share = ("the only layout" if n == 1 else f"every one of the {n} layouts" if count == n else
             f"{count} of {n} layouts")
    rest = "".join(f"; {k} × {examples[r].summary}" for r, k in others)
    return LayoutError(f"{examples[top].message} ({share}{rest})", rejection=examples[top])


def _raise_infeasible(budget: float, static: Rejection | None, layouts: list[Layout], refused: list[Rejection]
                      ) -> None:
    """No layout survived: raise InfeasibleError naming the least per-device memory any layout would need
    (``static``: the model-states rejection with the least bytes, if any) and the budget (bytes), or LayoutError
    when the passes refused every option for another reason."""
    needs = [r.figure for r in refused if r.reason == "memory" and r.figure is not None]
    if needs:
        raise InfeasibleError(f"memory: no layout fits; the best of {len(layouts)} needs {gib_text(min(needs))} "
                              f"per device, the budget is {gib_text(budget)}", needs_bytes=min(needs))
    if static is not None:
        raise InfeasibleError(f"memory: no layout of {len(layouts)} fits; the best needs at least "
                              f"{gib_text(static.figure)} per device for model states and overheads alone, "
                              f"the budget is {gib_text(budget)}", needs_bytes=static.figure)
    raise LayoutError(f"layout: none of {len(layouts)} layouts is valid: "
                      f"{refused[0].message if refused else 'none was left to simulate'}",
                      rejection=refused[0] if refused else None)
