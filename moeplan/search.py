"""Layout search: enumerate layouts, prune cheaply, run the pass pipeline on the best survivors (DESIGN §4).

1. **Enumerate** every (tp, cp, pp, vpp, ep, etp, micro_batch) whose product with dp fits the device count, within
   the degrees the user fixed; ``etp`` is ``tp`` (expert-TP) or 1 (TP-extend-EP).
2. **Prune** by the layout rules (moeplan.layout.check_layout) and a static memory lower bound (model states of
   the average stage, no activations), counting rejections by reason.
3. **Estimate** each survivor in closed form: per-layer costs from ``shard`` (cached per tp, cp, ep, etp,
   micro_batch), a perfectly balanced pipeline, the interleaved-1F1B bubble (FACTS §4.3).
4. **Evaluate** the ``candidates`` best estimates with the full pipeline in parallel processes and rank them by
   simulated step time. Layouts the memory pass finds infeasible are counted and dropped.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import get_context

from moeplan.compiler import parse_pipeline, run_pipeline
from moeplan.cost_models.memory import model_state_bytes
from moeplan.errors import InfeasibleError, LayoutError
from moeplan.ir import ModelGraph, named_layers
from moeplan.layout import Layout, check_layout
from moeplan.passes.partition_stages import piece_time_s
from moeplan.passes.shard import layer_cost
from moeplan.state import PlanState
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


@dataclass(frozen=True)
class Evaluated:
    state: PlanState
    pass_s: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class SearchResult:
    ranked: tuple[Evaluated, ...]  # best first
    rejected: Counter  # reason -> count
    num_enumerated: int
    num_evaluated: int


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


def _time_per_microbatch_s(graph: ModelGraph, layout: Layout, target: Target, counts: Counter, cache: dict) -> float:
    """Whole-model layer time for one micro-batch (cached per tp, cp, ep, etp, micro_batch)."""
    key = (layout.tp, layout.cp, layout.ep, layout.etp, layout.micro_batch)
    if key not in cache:
        cache[key] = sum(n * piece_time_s(layer_cost(graph.layer(k), spec=graph.spec, layout=layout, target=target))
                         for k, n in counts.items())
    return cache[key]


def static_bytes(layout: Layout, graph: ModelGraph, counts: Counter) -> float:
    """Model-state bytes per device of an average stage: a lower bound for the fullest stage (no activations)."""
    dense = sum(n * (graph.layer(k).param_count - graph.layer(k).expert_param_count + graph.layer(k).shared_param_count)
                for k, n in counts.items()) / layout.tp
    expert = sum(n * graph.layer(k).expert_param_count for k, n in counts.items()) / (layout.ep * layout.tp)
    return model_state_bytes(dense_params=dense / layout.pp, expert_params=expert / layout.pp,
                             dense_dp=layout.dp * layout.cp, expert_dp=layout.expert_dp).total_bytes


def estimate_step_s(layout: Layout, time_per_microbatch_s: float) -> float:
    """Closed-form step estimate: balanced stages, per-rank time per micro-batch = total / pp, and
    (m + (pp − 1)/vpp) such slots (interleaved 1F1B bubble, FACTS §4.3)."""
    return time_per_microbatch_s / layout.pp * (layout.num_microbatches + (layout.pp - 1) / layout.vpp)


def _evaluate(args: tuple[ModelGraph, Target, Layout, str]) -> Evaluated | str:
    graph, target, layout, pipeline = args
    passes = tuple(cls() for cls in parse_pipeline(pipeline))
    try:
        state, timings = run_pipeline(PlanState(graph=graph, target=target, layout=layout), passes)
    except (InfeasibleError, LayoutError) as e:
        return f"{type(e).__name__}: {e}"
    return Evaluated(state=state, pass_s=tuple((t.name, t.seconds) for t in timings))


def search(*, graph: ModelGraph, target: Target, num_devices: int, fixed: Fixed, pipeline: str,
           candidates: int = 16, workers: int | None = None) -> SearchResult:
    """Find the fastest layouts; see the module docstring. Raises LayoutError if no layout is valid, and
    InfeasibleError (with the smallest per-device memory seen) if every valid layout runs out of memory."""
    dpn = target.devices_per_node
    rejected: Counter = Counter()
    survivors: list[tuple[float, Layout]] = []
    cache: dict = {}
    counts = Counter(k for _, k in named_layers(graph.spec))
    first_error: LayoutError | None = None
    min_static = float("inf")
    layouts = enumerate_layouts(graph=graph, num_devices=num_devices, devices_per_node=dpn, fixed=fixed)
    for lay in layouts:
        try:
            check(lay, graph=graph, num_devices=num_devices, devices_per_node=dpn, num_slots=sum(counts.values()))
        except LayoutError as e:
            first_error = first_error or e
            rejected[rejection_reason(e)] += 1
            continue
        static = static_bytes(lay, graph, counts)
        if static > target.usable_memory_bytes:
            min_static = min(min_static, static)
            rejected["memory: model states exceed device memory"] += 1
            continue
        survivors.append((estimate_step_s(lay, _time_per_microbatch_s(graph, lay, target, counts, cache)), lay))
    if not survivors and first_error is not None and not rejected.get("memory: model states exceed device memory"):
        raise first_error
    survivors.sort(key=lambda x: x[0])
    picked = [lay for _, lay in survivors[:candidates]]
    results = _run_all(graph, target, picked, pipeline, workers)
    ranked = []
    for r in results:
        if isinstance(r, str):
            rejected[rejection_reason(r.split(": ", 1)[1]) if r.startswith("Layout") else "memory: plan exceeds "
                     "device memory under every recompute mode"] += 1
        else:
            ranked.append(r)
    if not ranked:
        _raise_infeasible(target, min_static, layouts, results)
    ranked.sort(key=lambda e: e.state.prediction.step_time_s)
    return SearchResult(ranked=tuple(ranked), rejected=rejected, num_enumerated=len(layouts),
                        num_evaluated=len(picked))


def _run_all(graph: ModelGraph, target: Target, layouts: list[Layout], pipeline: str, workers: int | None) -> list:
    lean = replace(graph, layers={k: replace(v, gm=None) for k, v in graph.layers.items()})
    tasks = [(lean, target, lay, pipeline) for lay in layouts]
    workers = min(workers or os.cpu_count() or 1, len(tasks))
    if workers <= 1:
        return [_evaluate(t) for t in tasks]
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("fork")) as pool:
        return list(pool.map(_evaluate, tasks))


def _raise_infeasible(target: Target, min_static: float, layouts: list[Layout], results: list) -> None:
    """No layout survived: raise InfeasibleError naming the least per-device memory any layout would need."""
    gib, allowed = 1024**3, target.usable_memory_bytes / 1024**3
    needs = [float(m) for r in results if isinstance(r, str) for m in re.findall(r"needs ([\d.]+) GiB", r)]
    if needs:
        raise InfeasibleError(f"memory: no layout fits; the best of {len(layouts)} needs {min(needs):.1f} GiB "
                              f"per device, {target.name} allows {allowed:.1f} GiB")
    if min_static < float("inf"):
        raise InfeasibleError(f"memory: no layout of {len(layouts)} fits; the best needs at least "
                              f"{min_static / gib:.1f} GiB per device for model states alone, {target.name} "
                              f"allows {allowed:.1f} GiB")
    raise LayoutError(f"layout: none of {len(layouts)} layouts is valid: {results[0] if results else 'none left'}")
