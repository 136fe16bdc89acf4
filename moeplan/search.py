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
   docs/step-model.md §7). Only the options whose estimate floor (:func:`moeplan.estimate.estimate_floor`) could
   put them among those step 5 simulates are estimated in full: the same choice as estimating them all.
5. **Evaluate** the ``candidates`` best estimates (those whose memory estimate fits first) with the full pipeline
   in parallel processes and rank them by simulated step time, holding only the ``keep`` fastest whole (memory does
   not grow with the number evaluated). Their simulated steps over their estimates measure how far the estimate is
   off per schedule class; then up to ``candidates`` **follow-ups**, the options whose estimate so corrected beats
   the best step found (:func:`moeplan.search_eval._follow_ups`), go through too. A follow-up whose bound is not
   below the ``keep``-th best step found so far is pruned: skipped, stopped before the simulation once
   ``plan-memory`` has fixed its stages and recompute (:func:`moeplan.bounds.plan_bound`, a tighter bound), or
   stopped during it as soon as a rank's compute runs past that step (the step can only be longer). Each worker has
   one in flight, so the next one sent sees the best step found so far. A candidate the memory pass finds
   infeasible is retried without ``fb`` when the overlap set was chosen automatically (``fb`` keeps one more
   micro-batch in flight), else counted (a typed :class:`moeplan.layout.Rejection`) and dropped.
6. **Exact** (``candidates=None``): after the best estimates, every other option in order of its bound until the
   next bound is not below the best step: what is left provably cannot beat it. Otherwise the result reports the
   least bound of the options left unsimulated, so the caller knows how far from the optimum the best can be.

This module enumerates, checks and pairs the options (steps 1–3) and runs the search; steps 4–6 (the closed-form
screening of each option and the evaluation of the best in a pool of forked workers) are in moeplan/search_eval.py.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from moeplan.compiler import DEFAULT_PIPELINE, Pipeline
from moeplan.cost_models.dispatch import hierarchical_valid
from moeplan.cost_models.layer_program import ep_transfer, expert_group
from moeplan.cost_models.memory import gib_text
from moeplan.errors import InfeasibleError, LayoutError, LoadError, PlanError
from moeplan.estimate import slot_weights, stage_params, static_bytes
from moeplan.ir import ModelGraph, named_layers
from moeplan.layout import Layout, Rejection, check_fixed_degrees, check_layout, layout_rejection
from moeplan.load_model import LoadModel
from moeplan.mechanisms import mechanism
from moeplan.passes.schedule import schedule_fits
from moeplan.runtimes import RUNTIMES, Setup
from moeplan.search_eval import _SHARED, Evaluated, Progress, _estimate_and_evaluate, _lean, _Screen, _shape_tasks, pool
from moeplan.spec import ModelSpec
from moeplan.state import Dispatcher, Mechanism, Precision, ScheduleKind, Strategy
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
    load: LoadModel | None = None
    """A load trace (``--expert-load``): every MoE layout is priced with the busiest EP rank's load under the
    ``place-experts`` pass's policy (moeplan.load_model); None: balanced routing."""


@dataclass(frozen=True)
class SearchResult:
    """The ``keep`` fastest evaluated layouts, best first (only those are kept whole: any number of candidates
    fits in bounded memory), rejections counted by reason, how many layouts were enumerated, how many (layout,
    strategy) options there were, how many the full pipeline simulated or refused (``num_evaluated``) and how many
    were pruned (never simulated: their lower bound was not below the step to beat then), and ``bound_s``: the
    least lower bound of the options left unsimulated and unpruned (``inf`` when none is left: then the best is the
    optimum of the whole space under the cost model), ``num_open`` how many such options there are (what
    ``--exact`` would have to simulate, at most), ``simulation_s`` the mean seconds one option took through the
    full pipeline in this search (0 when none was simulated to the end) and ``workers`` the processes it ran in."""

    ranked: tuple[Evaluated, ...]
    rejected: Counter  # Rejection.reason (a code of moeplan.layout.REASONS) -> count
    num_enumerated: int
    num_evaluated: int
    num_options: int = 0
    num_pruned: int = 0
    bound_s: float = float("inf")
    num_open: int = 0
    simulation_s: float = 0.0
    workers: int = 1

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


@dataclass(frozen=True)
class Strategies:
    """The strategies searched for a layout (:func:`strategies`). ``refused``: when a fixed ``--overlap`` was left
    out under a schedule that fits because the target's runtime refuses it there, the first such refusal (a
    ``runtime`` rejection naming the mechanism and the runtime's rule), else None."""

    found: list[Strategy]
    refused: Rejection | None = None


def strategies(layout: Layout, *, graph: ModelGraph, target: Target, fixed: Fixed,
               cache: dict | None = None) -> Strategies:
    """The strategies searched for ``layout`` (module docstring, step 3); ``cache`` keeps the dispatcher choice
    per (tp, cp, ep, etp, micro-batch) across layouts."""
    caps = target.runtime
    kinds = [fixed.schedule] if fixed.schedule else list(caps.schedules)
    kinds = [k for k in kinds if layout.pp > 1 or k == "1f1b"]
    kinds = [k for k in kinds if schedule_fits(k, pp=layout.pp, vpp=layout.vpp,
                                               num_microbatches=layout.num_microbatches).fits]
    dispatcher = fixed.dispatcher or _cheapest_dispatcher(layout, graph, target, cache)
    ep = expert_group(layout)[0] > 1
    rt = RUNTIMES.get(caps.name or "")
    out, refused = [], None
    for kind in kinds:
        if fixed.overlap is not None:
            overlap = fixed.overlap
        else:
            overlap = frozenset(m for m in caps.overlap if _applies(m, kind, layout, graph, ep))
        if rt is not None:  # what the target's runtime refuses in this setup is not searched
            setup = Setup.of(layout, kind, dispatcher, overlap)
            if fixed.overlap is not None and (found := rt.refusals(setup)):
                refused = refused or Rejection("runtime", None, f"runtime: {rt.title} refuses overlap "
                                                                f"{found[0].mechanism} under {kind} on "
                                                                f"{layout.short()}: {found[0].reason}")
                continue
            overlap = rt.allowed(setup)
        out.append(Strategy(schedule=kind, dispatcher=dispatcher, overlap=overlap, recompute=fixed.recompute,
                            precision=fixed.precision, recompute_modules=fixed.recompute_modules))  # type: ignore[arg-type]
    return Strategies(out, refused)


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
    key = ("dispatcher", layout.tp, layout.cp, layout.ep, layout.etp, layout.micro_batch, layout.expert_load)
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


def _check_fixed(fixed: Fixed, target: Target, num_devices: int, spec: ModelSpec) -> None:
    """Refuse a device count or fixed degrees that fit no layout (:func:`moeplan.layout.check_fixed_degrees`), a
    fixed ep that does not divide the routed experts, a fixed vpp the fixed schedule never runs, and a fixed
    schedule, dispatcher or mechanism the target's runtime does not execute."""
    check_fixed_degrees(num_devices, tp=fixed.tp, cp=fixed.cp, pp=fixed.pp, ep=fixed.ep)
    if fixed.ep is not None and spec.num_experts and spec.num_experts % fixed.ep:
        raise LayoutError(f"ep={fixed.ep}: the routed experts ({spec.num_experts}) must be divisible by ep (each EP "
                          f"rank holds the same number of {spec.name}'s experts)")
    if fixed.schedule is not None and fixed.vpp is not None:
        pp = fixed.pp or 2  # the vpp rules hold for any pp the search could pick (interleaved: pp >= 2)
        fit = schedule_fits(fixed.schedule, pp=pp, vpp=fixed.vpp, num_microbatches=4 * pp * fixed.vpp)
        if not fit.fits:
            given = f"vpp={fixed.vpp}" + (f", pp={fixed.pp}" if fixed.pp else "")
            raise LayoutError(f"schedule={fixed.schedule!r}: {fit.reason}; given {given}")
    caps = target.runtime
    if ((fixed.dp_shard or 1) > 1 or fixed.search_fsdp) and not caps.fsdp:
        raise LayoutError(f"dp_shard={fixed.dp_shard or 'auto'}: the runtime behind target {target.name} has no FSDP "
                          f"(ZeRO-1 only); use --dp-shard 1")
    for name, chosen, allowed in (("schedule", [fixed.schedule] if fixed.schedule else [], caps.schedules),
                                   ("dispatcher", [fixed.dispatcher] if fixed.dispatcher else [], caps.dispatchers),
                                   ("overlap", sorted(fixed.overlap or ()), caps.overlap)):
        bad = [c for c in chosen if c not in allowed]
        if bad:
            raise LayoutError(f"{name}={bad[0]!r}: the runtime behind target {target.name} executes only "
                              f"{', '.join(allowed) or 'none'}")


PLAN_DECISIONS = ("sharding", "stages", "experts", "schedule", "memory", "prediction")
"""What a compiled plan holds, each provided by a pass of the pipeline (moeplan.compile.plan_from_state)."""


def check_pipeline(pipeline: Pipeline) -> None:
    """Raise PlanError unless the passes of ``pipeline`` provide every decision of a plan (the search ranks layouts
    by the ``simulate`` pass's step time, and a plan holds all of :data:`PLAN_DECISIONS`)."""
    missing = [d for d in PLAN_DECISIONS if d not in pipeline.provides]
    if missing:
        raise PlanError(f"pipeline={str(pipeline)!r}: a compiled plan needs {', '.join(missing)}, which no pass of it "
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


def build_options(*, graph: ModelGraph, target: Target, num_devices: int, fixed: Fixed, budget: float,
                  placing: tuple = ("contiguous", 0)) -> Options:
    """Steps 1–3 of the module docstring: enumerate the layouts, check them, drop those whose model states and
    fixed overheads do not fit ``budget`` (bytes per device), and pair each with its strategies. With a load trace
    (``fixed.load``) each MoE layout carries the busiest EP rank's load and the replicas' memory under ``placing``,
    the ``place-experts`` pass's (policy, replica slots, rebalancing): :func:`expert_placing`."""
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
        if refused is None and fixed.load is not None and spec.is_moe:
            try:
                priced = fixed.load.at(lay.expert_shards, *placing)
                lay = replace(lay, expert_load=priced.expert_load, expert_replication=priced.expert_replication)
            except LoadError as e:
                refused = Rejection("expert-load", lay.expert_shards, str(e))
        if refused is not None:
            reject(refused)
            continue
        pkey = (lay.tp, lay.pp, lay.ep, lay.expert_replication)  # what stage_params depends on
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
        if not found.found:
            m = lay.num_microbatches
            reject(found.refused or Rejection("schedule", m, f"schedule: no schedule searched fits pp, vpp and the "
                                                             f"{m} micro-batches of {lay.short()}"))
        options += [(lay, st, params) for st in found.found]
    return Options(options, layouts, rejected, examples)


def expert_placing(pipeline: Pipeline) -> tuple[str, int, int, float]:
    """The ``place-experts`` pass's (policy, replica slots, rebalance_every, rebalance_threshold) in ``pipeline``
    (the pass's defaults without one): the arguments of moeplan.load_model.LoadModel.at after the shard count."""
    from moeplan.passes.place_experts import PlaceExpertsPass

    found = [p for p in pipeline.passes if isinstance(p, PlaceExpertsPass)]
    return (found[0] if found else PlaceExpertsPass()).placing


def pipeline_budget(pipeline: Pipeline, target: Target) -> float:
    """The bytes per device a plan may fill under ``pipeline``: its ``plan-memory`` pass's budget (``--memory-budget``
    or the device's memory), which every memory check of the search uses. Raises PlanError for a budget above the
    device's memory."""
    from moeplan.passes.plan_memory import PlanMemoryPass

    found = [p for p in pipeline.passes if isinstance(p, PlanMemoryPass)]
    return (found[0] if found else PlanMemoryPass()).budget(target)


def rank_by_estimate(*, graph: ModelGraph, target: Target, options: list[tuple[Layout, Strategy, tuple[float, float]]],
                     budget: float, workers: int | None = None, ray: str | None = None, first: int | None = None
                     ) -> list[tuple[tuple[bool, float], float, Layout, Strategy]]:
    """Step 4 alone: every option's (sort key, lower bound, layout, strategy), best estimate first (those whose
    memory estimate fits ``budget`` before those that do not); with ``first``, only the first ``first`` of that
    list, estimating only the options whose estimate floor could put them there (moeplan/search_eval.py
    ``_Screen``)."""
    slots = [k for _, k in named_layers(graph.spec)]
    _SHARED["graph"], _SHARED["target"], _SHARED["budget"] = _lean(graph), target, budget
    try:
        tasks = _shape_tasks(options, slots, slot_weights(graph, slots))
        with pool(workers, ray) as workers_pool:
            screen = _Screen(workers_pool, tasks)
            order = screen.ranked() if first is None else screen.best(first)
            return [screen.item(i) for i in order]  # type: ignore[misc]
    finally:
        _SHARED.clear()


def search(*, graph: ModelGraph, target: Target, num_devices: int, fixed: Fixed, pipeline: Pipeline,
           candidates: int | None = 4, workers: int | None = None, keep: int = 1,
           progress: Progress | None = None, ray: str | None = None) -> SearchResult:
    """Find the fastest layouts; see the module docstring. ``candidates``: how many of the best estimates go through
    the full pipeline; None: every option whose lower bound is below the ``keep``-th best step found (exact).
    ``keep``: how many of the evaluated ones the result holds whole (the rest are counted, not kept).
    ``progress``: called with a moeplan.search_eval.SearchProgress as the search goes, in this process. ``ray``:
    evaluate on the Ray cluster at this address instead of ``workers`` forked processes (moeplan/ray_pool.py: the
    same plan). Raises PlanError if the pipeline cannot make a plan (:func:`check_pipeline`), LayoutError if no
    layout is valid (the most common reason, with the counts of the others), and InfeasibleError (with the
    smallest per-device memory seen) if every valid layout runs out of memory."""
    check_pipeline(pipeline)
    _check_fixed(fixed, target, num_devices, graph.spec)
    budget = pipeline_budget(pipeline, target)
    placing = expert_placing(pipeline)
    if (placing[0] != "contiguous" or placing[2]) and fixed.load is None:
        what = f"policy={placing[0]}" if placing[0] != "contiguous" else f"rebalance_every={placing[2]}"
        raise PlanError(f"place-experts{{{what}}}: places experts by their load, which needs a load trace "
                        f"(--expert-load FILE)")
    built = build_options(graph=graph, target=target, num_devices=num_devices, fixed=fixed, budget=budget,
                          placing=placing)
    options, rejected, layouts = built.options, built.rejected, built.layouts
    if not options and "model-states" not in rejected:
        if fixed.schedule is not None and "schedule" in rejected:
            raise LayoutError(f"schedule={fixed.schedule!r}: fits none of the {len(layouts)} layouts (pp, vpp and "
                              f"micro-batches: passes/schedule.py)")
        raise _none_valid(layouts, rejected, built.examples)
    slots = [k for _, k in named_layers(graph.spec)]
    weights = slot_weights(graph, slots)
    _SHARED["graph"], _SHARED["target"], _SHARED["budget"] = _lean(graph), target, budget  # what forked workers read
    _SHARED["load"] = fixed.load
    try:
        out = _estimate_and_evaluate(options, slots, weights, target, pipeline, candidates, workers, keep,
                                     auto_overlap=fixed.overlap is None, progress=progress, ray=ray)
    finally:
        _SHARED.clear()
    rejected.update(r.reason for r in out.refused)
    ranked = out.ranked()
    if not ranked:
        _raise_infeasible(budget, built.examples.get("model-states"), layouts, out.refused)
    return SearchResult(ranked=tuple(ranked), rejected=rejected, num_enumerated=len(layouts),
                        num_evaluated=out.sent, num_options=len(options), num_pruned=out.pruned,
                        bound_s=out.bound_s, num_open=out.open,
                        simulation_s=out.evaluated_s / out.simulated if out.simulated else 0.0,
                        workers=out.workers)


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
