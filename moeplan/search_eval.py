"""Steps 4–6 of the layout search (moeplan/search.py, whose module docstring describes them): the options grouped
by layer-cost shape (:func:`_shape_key`) are floored and bounded in closed form in worker processes, and estimated
where their floor could make them count (:func:`_floor_shape`, :func:`_estimate_shape`, :class:`_Screen`; an exact
search too: its first simulations are the best estimates, the rest go in bound order); the best estimates, the follow-ups
(:func:`_follow_ups`) or, for an exact search, every option whose bound is below the best step go through the full
pipeline (:func:`_evaluate`, :func:`_estimate_and_evaluate`), which keeps the fastest (:class:`_Outcome`). Here
too: what the workers read (``_SHARED``, set before they fork), the pool of forked workers (:class:`_Pool`;
:func:`pool` chooses it or the Ray cluster's, moeplan/ray_pool.py) and what evaluating an option gives
(:class:`Evaluated`, :class:`Pruned`).
"""
from __future__ import annotations

import gc
import heapq
import os
import signal
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from functools import cached_property
from multiprocessing import get_context
from typing import Callable, Iterable, Iterator, Literal

from moeplan.actions import placement_of
from moeplan.bounds import SPLIT_BACKWARD, PieceSums, dp_floor_s, floors, layout_bound, piece_sums, plan_bound
from moeplan.compiler import Pipeline, run_pipeline
from moeplan.cost_models.step import norm_s
from moeplan.cost_models.timeline import StepExceeded
from moeplan.errors import InfeasibleError, LayoutError
from moeplan.estimate import ModelCost, estimate_floor, estimate_memory, estimate_step, layer_prices, model_cost
from moeplan.ir import LayerKind, ModelGraph
from moeplan.layout import Layout, Rejection
from moeplan.mechanisms import FB_PAIRED
from moeplan.passes.partition_stages import SLOT_KINDS
from moeplan.ray_pool import RayPool
from moeplan.runtimes import RUNTIMES, Setup
from moeplan.state import PlanState, Strategy
from moeplan.targets import Target


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


def _evaluate(args: tuple[Layout, Strategy, Pipeline, bool, float]) -> Evaluated | Rejection | Pruned:
    """Run the full pipeline on one option. ``beat``: the best step found so far; when the pipeline ends with
    ``simulate``, a plan whose lower bound is not below it stops before the simulation (a :class:`Pruned`)."""
    layout, strategy, pipeline, auto_overlap, beat = args
    graph, target = _SHARED["graph"], _SHARED["target"]
    passes, simulate = pipeline.split_final("simulate")
    tries = [strategy]
    if auto_overlap and "fb" in strategy.overlap:
        tries.append(replace(strategy, overlap=strategy.overlap - {"fb"}))
    for attempt in tries:
        try:
            state, timings = run_pipeline(PlanState(graph=graph, target=target, layout=layout, strategy=attempt,
                                                    load=_SHARED.get("load")), passes)
            refused = _runtime_rejection(state)
            if refused is not None:  # a combination the target's runtime refuses once the recompute modes are chosen
                error = refused
                continue
            if simulate is not None and state.memory is not None:
                bound = plan_bound(state)
                if bound >= beat:
                    return Pruned(bound)
                try:
                    state, last = run_pipeline(state, (replace(simulate, stop_above_s=beat),))
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


@dataclass(frozen=True)
class SearchProgress:
    """Where a running search stands (``search(progress=…)``): ``phase`` ``estimate`` (every option priced in
    closed form) or ``simulate`` (the best ones through the full pipeline); ``options`` to search, how many the
    full pipeline ``simulated`` (or refused) so far and how many a lower bound ``pruned``, of ``to_simulate``
    chosen so far, and the best step simulated so far (``inf`` before the first), seconds."""

    phase: Literal["estimate", "simulate"]
    options: int
    simulated: int = 0
    pruned: int = 0
    to_simulate: int = 0
    best_s: float = float("inf")


Progress = Callable[[SearchProgress], None]


def _estimate_and_evaluate(options: list[tuple[Layout, Strategy, tuple[float, float]]], slots: list[LayerKind],
                           weights: tuple[float, ...], target: Target, pipeline: Pipeline, candidates: int | None,
                           workers: int | None, keep: int, *, auto_overlap: bool,
                           progress: Progress | None = None, ray: str | None = None) -> _Outcome:
    """Steps 4–6 of the module docstring in one pool of worker processes: the options of one layer-cost shape
    (:func:`_shape_key`) are priced, floored, bounded and, where needed, estimated together (:class:`_Screen`); the
    best estimates go through the full pipeline, then the follow-ups (:func:`_follow_ups`) or (``candidates=None``)
    every option whose bound is below the best step found, in bound order. The ``keep`` fastest evaluated are held
    whole, the others dropped as they arrive (memory does not grow with the number evaluated). What is sent depends
    only on results, never on the order they arrive in: the same plan for any number of workers, local or on the
    Ray cluster at ``ray`` (:func:`pool`). ``progress`` is called as it goes (:class:`SearchProgress`), in this
    process."""
    tasks = _shape_tasks(options, slots, weights)
    out = _Outcome(keep)
    told = progress or (lambda _: None)
    planned = 0

    def tell() -> None:
        told(SearchProgress("simulate", len(options), out.sent, out.pruned, planned, out.best_s))

    told(SearchProgress("estimate", len(options)))
    with pool(workers, ray) as workers_pool:
        out.workers = workers_pool.workers
        screen = _Screen(workers_pool, tasks)
        # exact: the best estimates start it (a step to beat early), then every option in bound order, whose
        # bounds the floor phase gave: no other estimate is needed
        order = screen.best(candidates if candidates is not None else max(keep, 4))
        first = [screen.item(i) for i in order]
        planned = len(first)
        tell()
        # the first ones are simulated in full, whatever arrives first: what they measure decides the follow-ups
        starts = [(lay, st, pipeline, auto_overlap, float("inf")) for _, _, lay, st in first]
        for (est, _, _, st), r in zip(first, workers_pool.imap(_evaluate, starts)):
            out.add(r, est[1], _estimate_class(st))
            tell()
        if candidates is None:  # exact: in bound order; none of the rest can beat the best once a bound does not
            started = set(order)
            then = sorted((screen.item(i) for i in range(len(screen.at)) if i not in started), key=lambda x: x[1])
            left = []
        else:
            chosen, others = screen.follow_ups(out, set(order), limit=candidates)
            then, left = [screen.item(i) for i in chosen], [screen.item(i) for i in others]
        del order, screen
        planned += len(then)
        sent: deque[tuple[float, tuple[str, bool]]] = deque()  # (estimate, class) of each option in flight

        def sends() -> Iterator[tuple[Layout, Strategy, str, bool, float]]:
            for i, (key, bound, lay, st) in enumerate(then):
                if bound >= out.beat_s:
                    if candidates is None:  # in bound order: every later one is out too
                        out.pruned += len(then) - i
                        return
                    out.pruned += 1
                    continue
                sent.append((key[1] if key else 0.0, _estimate_class(st)))  # unestimated (exact): no ratio
                yield lay, st, pipeline, auto_overlap, out.beat_s

        for r in workers_pool.imap(_evaluate, sends()):
            est, cls = sent.popleft()
            out.add(r, est, cls)
            tell()
        # the rest stay unsimulated: the least bound of those that could win
        out.pruned += sum(1 for x in left if x[1] >= out.beat_s)
        out.bound_s = min((x[1] for x in left if x[1] < out.beat_s), default=float("inf"))
        out.open = sum(1 for x in left if x[1] < out.beat_s)
    tell()
    return out


def _estimate_class(strategy: Strategy) -> tuple[str, bool]:
    """What an estimate's error is measured per (:func:`_follow_ups`): the schedule, and whether its forwards and
    backwards run as overlapped pairs (docs/step-model.md §4: the closed form misses how pairs wait on each
    other)."""
    return strategy.schedule, "fb" in strategy.overlap and strategy.schedule in FB_PAIRED


def _follow_ups(rest: list[tuple[tuple[bool, float], float, Layout, Strategy]], out: "_Outcome", *, limit: int
                ) -> list[int]:
    """The positions in ``rest`` of the options to simulate next: at most ``limit`` of those whose memory estimate
    fits, least corrected estimate first, each below the best step simulated so far.

    The correction is measured, not assumed: each simulated option gives its step over its estimate, and an
    option's estimate is scaled by the least such ratio seen in its class (:func:`_estimate_class`), by none while
    its class has no simulation. So a class the estimate favours wrongly (say, one 20% optimistic) stops crowding
    out the others once its first options are simulated, and a class not simulated yet gets a look when its best
    estimate beats the best step."""
    return [i for corrected, i in _corrected(rest, out)[:limit] if corrected < out.beat_s]


def _corrected(rest: list[tuple[tuple[bool, float], float, Layout, Strategy]], out: "_Outcome"
               ) -> list[tuple[float, int]]:
    """(corrected estimate, position in ``rest``) of each option of ``rest`` whose memory estimate fits, least
    first (:func:`_follow_ups`)."""
    return sorted((x[0][1] * out.ratio(_estimate_class(x[3])), i) for i, x in enumerate(rest) if not x[0][0])


@dataclass
class _Outcome:
    """What the evaluation loop has so far: the ``keep`` fastest (a heap whose top is the slowest of them), the
    refusals, how many options the full pipeline simulated or refused (``sent``) and how many a bound pruned (before
    or inside the pipeline), the least bound left and how many options have a bound below the step to beat
    (``open``), and the seconds the full pipeline took over the plans it simulated to the end."""

    keep: int
    best: list[tuple[float, int, Evaluated]] = field(default_factory=list)
    refused: list[Rejection] = field(default_factory=list)
    sent: int = 0
    pruned: int = 0
    bound_s: float = float("inf")
    open: int = 0  # options left unsimulated whose bound is below the step to beat
    evaluated_s: float = 0.0  # seconds the full pipeline took over the plans it simulated (in the workers)
    simulated: int = 0  # plans it simulated
    workers: int = 1  # the processes that evaluated
    ratios: dict[tuple[str, bool], float] = field(default_factory=dict)  # per estimate class: :meth:`ratio`

    @property
    def beat_s(self) -> float:
        """The step an option must beat to enter the ``keep`` fastest: the slowest of them once there are
        ``keep``, else ``inf``."""
        return -self.best[0][0] if len(self.best) >= self.keep else float("inf")

    @property
    def best_s(self) -> float:
        """The fastest step simulated so far, seconds (``inf`` before the first)."""
        return min((-b[0] for b in self.best), default=float("inf"))

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
            self.simulated += 1
            self.evaluated_s += sum(t for _, t in r.pass_s)
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
    """The options grouped by layer-cost shape (one :func:`_floor_shape` task each); sets what the workers read
    besides the graph and the target, these groups included: a task names its group by position, so the options
    reach a forked worker with the fork (Ray's workers: once, in the object store), not pickled with every task."""
    groups: dict[tuple, list[tuple[Layout, Strategy, tuple[float, float]]]] = {}
    for opt in options:
        groups.setdefault(_shape_key(opt[0], opt[1]), []).append(opt)
    _SHARED["counts"], _SHARED["weights"], _SHARED["slots"] = Counter(slots), weights, tuple(slots)
    _SHARED["slot_flags"] = tuple(int(k in SLOT_KINDS) for k in slots)
    _SHARED["tasks"] = tasks = list(groups.values())
    return tasks


def _shape_key(layout: Layout, strategy: Strategy) -> tuple:
    """What the layer costs depend on: (tp, cp, ep, etp, micro-batch, dispatcher, the recipe's precision), under
    FSDP the degrees its per-layer collectives and resharding depend on (dp_shard, dp, pp), and the expert load."""
    fsdp = (layout.dp_shard, layout.dp, layout.pp) if layout.dp_shard > 1 else ()
    return (layout.tp, layout.cp, layout.ep, layout.etp, layout.micro_batch, strategy.dispatcher,
            strategy.precision, fsdp, layout.expert_load, layout.expert_replication)


def _priced(options: list[tuple[Layout, Strategy, tuple[float, float]]]
            ) -> Iterator[tuple[Layout, Strategy, tuple[float, float], ModelCost, float]]:
    """(layout, strategy, parameters, model cost, lower bound) of each option of one layer-cost shape; the bound is
    :func:`moeplan.bounds.layout_bound`."""
    graph, target, counts, slots = _SHARED["graph"], _SHARED["target"], _SHARED["counts"], _SHARED["slots"]
    cache = _SHARED.setdefault("costs", {})  # per process: forked workers each keep their own
    costs: dict[frozenset, ModelCost] = {}  # the options of one shape differ in their overlap sets only
    parts: dict = {}  # so their costs share the layer costs, and the memory parts of them
    sums: dict[tuple, PieceSums] = {}
    dp_floors: dict[tuple, float] = {}
    opt_floor = norm_s(options[0][0].world_size, target)
    for lay, st, params in options:
        cost = costs.get(st.overlap)
        if cost is None:
            cost = costs[st.overlap] = model_cost(graph, lay, target, st.dispatcher, st.overlap, counts, cache,
                                                  st.precision, memory_parts=parts)
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
        overlap_dp = "dp" in st.overlap
        dkey = (lay.dp, lay.pp, lay.dp_shard, overlap_dp)
        if dkey not in dp_floors:
            dp_floors[dkey] = dp_floor_s([layer_prices(graph, k, lay, target, st.dispatcher, cache, st.precision)[1][0]
                                          for k in counts], lay, target, st)
        yield lay, st, params, cost, layout_bound(sums[skey], pp=lay.pp, vpp=lay.vpp,
                                                  v_shape=placement_of(st.schedule) == "v",
                                                  num_microbatches=lay.num_microbatches, opt_floor_s=opt_floor,
                                                  dp_floor_s=dp_floors[dkey], overlap_dp=overlap_dp)


def _estimate_shape(job: tuple[int, tuple[int, ...]]) -> list[tuple[tuple[bool, float], float]]:
    """(sort key, lower bound) of each option ``job`` names, (shape task, positions in it): the sort key puts the
    options whose memory estimate fits first, then orders by estimated step; the bound is
    :func:`moeplan.bounds.layout_bound`."""
    graph, target = _SHARED["graph"], _SHARED["target"]
    task = _SHARED["tasks"][job[0]]
    out = []
    for lay, st, params, cost, bound in _priced([task[j] for j in job[1]]):
        memory = estimate_memory(lay, st, cost, kinds=_SHARED["slots"], target=target, budget=_SHARED["budget"],
                                 hidden_size=graph.spec.hidden_size)
        est = estimate_step(lay, st, cost, weights=_SHARED["weights"], slots=_SHARED["slot_flags"], params=params,
                            target=target, memory=memory)
        out.append(((not est.fits, est.step_s), bound))
    return out


def _floor_shape(task: int) -> list[tuple[float, float]]:
    """(estimate floor, lower bound) of each option of shape task ``task`` (:func:`_shape_tasks`;
    :func:`moeplan.estimate.estimate_floor`, :func:`moeplan.bounds.layout_bound`)."""
    target = _SHARED["target"]
    return [(estimate_floor(lay, st, cost, params=params, target=target), bound)
            for lay, st, params, cost, bound in _priced(_SHARED["tasks"][task])]


class _Screen:
    """Step 4 on demand: every option's estimate floor and bound at once when first needed (:attr:`floor`:
    :func:`_floor_shape`, no stage split nor memory estimate), its estimate (:func:`_estimate_shape`, which gives its
    bound too) only when asked. Options are numbered in the order of the shape tasks; ``key[i]`` is option ``i``'s
    sort key (memory estimate does not fit, estimated step) once estimated, ``bound[i]`` its bound once floored or
    estimated. :meth:`best` and :meth:`follow_ups` choose exactly what ranking every estimate (:meth:`ranked`)
    would choose: an option left unestimated has a floor, so an estimate, above the last one chosen."""

    def __init__(self, pool: "_Pool | RayPool", tasks: list[list[tuple[Layout, Strategy, tuple[float, float]]]]
                 ) -> None:
        self.pool, self.tasks = pool, tasks
        self.at = [(t, j) for t, task in enumerate(tasks) for j in range(len(task))]  # option -> (task, position)
        self.key: list[tuple[bool, float] | None] = [None] * len(self.at)
        self.bound = [float("nan")] * len(self.at)
        self.estimated = 0

    @cached_property
    def floor(self) -> list[float]:
        """Every option's estimate floor (and, on the way, its bound)."""
        # small chunks: the shapes' costs differ, and a worker's last big chunk kept the other waiting
        rows = [x for part in self.pool.map(_floor_shape, range(len(self.tasks)),
                                            chunksize=max(1, len(self.tasks) // 64)) for x in part]
        self.bound = [x[1] for x in rows]
        return [x[0] for x in rows]

    def item(self, i: int) -> tuple[tuple[bool, float] | None, float, Layout, Strategy]:
        """(sort key or None, bound, layout, strategy) of option ``i``."""
        t, j = self.at[i]
        lay, st, _ = self.tasks[t][j]
        return self.key[i], self.bound[i], lay, st

    def estimate(self, options: Iterable[int]) -> None:
        """Estimate the ``options`` not estimated yet, grouped by their shape tasks, in the pool."""
        groups: dict[int, list[int]] = {}
        for i in options:
            if self.key[i] is None:
                groups.setdefault(self.at[i][0], []).append(i)
        jobs = [(t, tuple(self.at[i][1] for i in ids)) for t, ids in groups.items()]
        parts = self.pool.map(_estimate_shape, jobs, chunksize=max(1, len(jobs) // 16))
        for ids, part in zip(groups.values(), parts):
            for i, x in zip(ids, part):
                self.key[i], self.bound[i] = x[0], x[1]
        self.estimated += sum(map(len, groups.values()))

    def ranked(self) -> list[int]:
        """Every option, estimated (no floors needed), first in sort key, then option order."""
        self.estimate(range(len(self.at)))
        return sorted(range(len(self.at)), key=lambda i: (self.key[i], i))

    def best(self, n: int) -> list[int]:
        """The ``n`` options first in sort key (then option order), estimating in order of floor only those whose
        floor is not above the ``n``-th fitting estimate found (batches of at least 256 until ``n`` fit)."""
        order = sorted(range(len(self.at)), key=self.floor.__getitem__)
        fitting: list[float] = []
        pos = 0
        while pos < len(order):
            if len(fitting) < n:
                end = min(len(order), pos + max(256, pos))
            else:
                end = pos
                while end < len(order) and self.floor[order[end]] <= fitting[n - 1]:
                    end += 1
            if end == pos:
                break
            self.estimate(order[pos:end])
            fitting = sorted(fitting + [k[1] for k in (self.key[i] for i in order[pos:end]) if k and not k[0]])
            pos = end
        done = [i for i, k in enumerate(self.key) if k is not None]
        return sorted(done, key=lambda i: (self.key[i], i))[:n]

    def follow_ups(self, out: "_Outcome", skip: set[int], *, limit: int) -> tuple[list[int], list[int]]:
        """:func:`_follow_ups` of every option but ``skip`` (the options to simulate next, the others), estimating
        those whose floor, corrected as their estimate would be, is not above both the step to beat and the
        ``limit``-th corrected estimate found."""
        rest = [i for i in range(len(self.at)) if i not in skip]
        cls = {i: _estimate_class(self.item(i)[3]) for i in rest}
        while True:
            done = sorted((i for i in rest if self.key[i] is not None), key=lambda i: (self.key[i], i))
            items = [self.item(i) for i in done]
            ranked = _corrected(items, out)
            limit_s = min(out.beat_s, ranked[limit - 1][0] if len(ranked) >= limit else float("inf"))
            todo = [i for i in rest if self.key[i] is None and self.floor[i] * out.ratio(cls[i]) <= limit_s]
            if not todo:
                break
            self.estimate(todo)
        chosen = [done[j] for j in _follow_ups(items, out, limit=limit)]
        taken = set(chosen)
        return chosen, [i for i in rest if i not in taken]


def _ignore_sigint() -> None:
    """A worker's start: Ctrl-C, which a terminal sends to the whole process group, is the parent's to handle (one
    line, exit 130); a worker that took it would print its own traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _runtime_rejection(state: PlanState) -> Rejection | None:
    """The first overlap mechanism of ``state`` its target's runtime refuses now that the memory pass has chosen
    the recompute modes (moeplan/runtimes.py), as a ``runtime`` rejection; None when it runs them all, or has no
    name."""
    rt = RUNTIMES.get(state.target.runtime.name or "")
    if rt is None or state.memory is None:
        return None
    st = state.strategy
    found = rt.refusals(Setup.of(state.layout, st.schedule, st.dispatcher, st.overlap,
                                 tuple(m.recompute for m in state.memory.stages)))
    if not found:
        return None
    return Rejection("runtime", None, f"runtime: {rt.title} refuses overlap {found[0].mechanism}: {found[0].reason}")


def pool(workers: int | None, ray: str | None = None) -> "_Pool | RayPool":
    """Where a search's tasks run: ``workers`` forked processes (:class:`_Pool`), or with ``ray`` the Ray cluster at
    that address (moeplan/ray_pool.py)."""
    if ray is None:
        return _Pool(workers)
    return RayPool(ray, workers, snapshot=lambda: {k: v for k, v in _SHARED.items() if k != "costs"},
                   install=_install)


def _install(data: dict) -> None:
    """In a Ray worker: ``data`` (a search's ``_SHARED`` without the caches) is what its tasks read."""
    _SHARED.clear()
    _SHARED.update(data)


class _Pool:
    """``map`` / ``imap`` in forked worker processes (``workers`` of them, default the CPU count), or in this process
    for one worker; the pool starts at the first call with more than one task."""

    def __init__(self, workers: int | None) -> None:
        self.workers = workers or os.cpu_count() or 1
        self.pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> "_Pool":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=exc_type is not None)  # Ctrl-C, an error: no new task starts
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

    def unordered(self, fn, tasks: list) -> Iterator:  # type: ignore[no-untyped-def]
        """``fn`` of every task, each as soon as it finishes (in order in this process, for one worker)."""
        if self.workers <= 1 or len(tasks) <= 1:
            yield from map(fn, tasks)
            return
        yield from (f.result() for f in as_completed([self._executor().submit(fn, t) for t in tasks]))

    def _executor(self) -> ProcessPoolExecutor:
        if self.pool is None:
            # what exists now (torch, the traced graph) outlives the workers: freezing it keeps their collections
            # from traversing it and their pages shared (the fork recipe of the gc module's docs)
            gc.freeze()
            self.pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=get_context("fork"),
                                            initializer=_ignore_sigint)
        return self.pool
