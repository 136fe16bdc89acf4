"""Architecture search (``moeplan explore``, docs/explore.md): which model of a given size trains fastest here.

A SPACE file names a base model, the values each architecture field may take and the constraints an architecture
must meet. Every combination is built and checked as a :class:`~moeplan.spec.ModelSpec`, counted
(:func:`~moeplan.flops.count_params`) and kept when it meets the constraints. Then:

1. **Shortlist.** The layout search's estimate (:func:`~moeplan.search.rank_by_estimate`, every layout, estimated
   as far as the floors require: docs/search.md §1) runs on three representatives: the base model and the smallest
   and largest architectures by total parameters. The best ``screen_layouts`` (layout, strategy) options of each,
   together, are the shortlist.
2. **Screen.** Each architecture gets the best estimate over the shortlist options valid for it
   (:func:`~moeplan.estimate.estimate_step`; a layer kind is traced once per set of the fields it depends on and its
   prices are reused by every architecture that differs only in layer counts). What an architecture gets here is
   the screen's figure; a layout outside the shortlist is never considered for it. Options are estimated in order of
   their estimate floor (:func:`~moeplan.estimate.estimate_floor`) until the floor passes the best estimate that
   fits: the same best as estimating them all.
3. **Verify.** The ``verify`` best by screened tokens/s are compiled with the full pipeline and the default layout
   search (:func:`~moeplan.compile.compile_model`), one compile per worker process (or Ray worker), reported as each
   finishes, and the gap between the two figures is reported.
"""
from __future__ import annotations

import itertools
import math
import re
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError, model_validator

from moeplan.errors import MoeplanError, SpecError
from moeplan.files import read_yaml
from moeplan.flops import count_params, flops_per_token
from moeplan.ir import LayerKind, ModelGraph, named_layers
from moeplan.layout import Layout, layout_rejection
from moeplan.spec import ModelSpec, load_spec
from moeplan.state import Strategy
from moeplan.targets import Target

#: fields a SPACE may vary (the issue's list: layers, hidden, heads, MLA ranks or GQA groups, experts, top-k,
#: expert FFN, shared experts, dense leading layers, MTP depth, vocab)
CHOICE_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "q_lora_rank", "kv_lora_rank",
                 "num_experts", "top_k", "moe_ffn_size", "num_shared_experts", "num_dense_layers", "num_mtp_layers",
                 "vocab_size")
#: fields that only count layers: architectures differing in these alone share every traced layer and its prices
_COUNT_FIELDS = frozenset({"name", "num_layers", "num_dense_layers", "num_mtp_layers"})
#: fields the dense, embedding and head pieces do not depend on
_EXPERT_FIELDS = frozenset({"num_experts", "top_k", "moe_ffn_size", "num_shared_experts", "shared_ffn_size",
                            "router", "routing", "num_expert_groups", "topk_groups", "router_scale",
                            "norm_topk_prob", "capacity_factor"})
_EXPERT_FREE = (LayerKind.EMBEDDING, LayerKind.DENSE, LayerKind.HEAD, LayerKind.MTP_HEAD, LayerKind.EMPTY)


MAX_COMBINATIONS = 100_000
"""Most architectures a space may hold (the product of its choices' counts): screening runs about 16 architectures a
second on a 2-core machine (the shipped Pangu space, 14,550 combinations, about 15 minutes), so this bound is
about two hours; a larger space is refused when it is read, before anything is listed."""
StrictNumber = StrictInt | StrictFloat
"""A number as YAML writes it: an int or a float, never a string ("64") or a bool."""


def _bounded(counts: dict[str, int]) -> None:
    """Refuse a space of more than :data:`MAX_COMBINATIONS` (``counts``: values per varied field)."""
    total = math.prod(counts.values())
    if total > MAX_COMBINATIONS:
        raise ValueError(f"{total:,} combinations of {', '.join(counts)}; a space may hold at most "
                         f"{MAX_COMBINATIONS:,} (docs/explore.md): narrow a range or give it a step")


class Choices(BaseModel):
    """The values each varied field takes (positive integers, no repeats); a field left out keeps the base's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: list[StrictInt] | None = None
    hidden_size: list[StrictInt] | None = None
    num_heads: list[StrictInt] | None = None
    num_kv_heads: list[StrictInt] | None = None
    q_lora_rank: list[StrictInt] | None = None
    kv_lora_rank: list[StrictInt] | None = None
    num_experts: list[StrictInt] | None = None
    top_k: list[StrictInt] | None = None
    moe_ffn_size: list[StrictInt] | None = None
    num_shared_experts: list[StrictInt] | None = None
    num_dense_layers: list[StrictInt] | None = None
    num_mtp_layers: list[StrictInt] | None = None
    vocab_size: list[StrictInt] | None = None

    @model_validator(mode="before")
    @classmethod
    def _ranges(cls, data: object) -> object:
        """``{min: a, max: b, step: s}`` (inclusive, step default 1) stands for ``[a, a+s, ..., <= b]``."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, v in data.items():
            if isinstance(v, dict):
                if set(v) - {"min", "max", "step"} or not {"min", "max"} <= set(v) or not all(
                        isinstance(x, int) and not isinstance(x, bool) for x in v.values()):
                    raise ValueError(f"{name}: a range is {{min: int, max: int, step: int}} (step optional)")
                step = v.get("step", 1)
                if step <= 0 or v["max"] < v["min"]:
                    raise ValueError(f"{name}: a range needs min <= max and step > 0")
                out[name] = range(v["min"], v["max"] + 1, step)
        _bounded({n: len(v) for n, v in out.items() if isinstance(v, (list, range))})  # before a list is made
        return {n: list(v) if isinstance(v, range) else v for n, v in out.items()}

    @model_validator(mode="after")
    def _check(self) -> "Choices":
        for name in CHOICE_FIELDS:
            values = getattr(self, name)
            if values is None:
                continue
            if not values:
                raise ValueError(f"{name}: give at least one value")
            zero_ok = name in ("num_shared_experts", "num_dense_layers", "num_mtp_layers", "q_lora_rank")
            bad = next((v for v in values if v < 0 or (v == 0 and not zero_ok)), None)
            if bad is not None:
                raise ValueError(f"{name}: {bad} must be {'>= 0' if zero_ok else '> 0'}")
            if len(set(values)) != len(values):
                raise ValueError(f"{name}: values must not repeat")
        return self

    def varied(self) -> dict[str, list[int]]:
        return {n: list(getattr(self, n)) for n in CHOICE_FIELDS if getattr(self, n) is not None}


class Constraints(BaseModel):
    """What an architecture must meet: total and activated parameters in billions (``[min, max]``, MTP modules
    excluded, as published counts are) and alignment rules (``multiple_of: {hidden_size: 256}``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    total_params_b: tuple[StrictNumber, StrictNumber] | None = None
    activated_params_b: tuple[StrictNumber, StrictNumber] | None = None
    multiple_of: dict[str, StrictInt] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> "Constraints":
        for name in ("total_params_b", "activated_params_b"):
            r = getattr(self, name)
            if r is not None and not 0 <= r[0] <= r[1]:
                raise ValueError(f"{name}: [{r[0]}, {r[1]}] must be [min, max] with 0 <= min <= max")
        for k, v in self.multiple_of.items():
            if k not in ModelSpec.model_fields or ModelSpec.model_fields[k].annotation is not int:
                raise ValueError(f"multiple_of: {k!r} is not an integer model field")
            if v <= 0:
                raise ValueError(f"multiple_of.{k}: {v} must be > 0")
        return self


class Space(BaseModel):
    """A SPACE file (docs/explore.md): ``name``, ``base`` (a registry name or model file), ``choices``,
    ``constraints``, ``seq_len`` and ``global_batch`` (default: the base's) and ``screen_layouts`` (options kept per
    representative for the screen)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    base: str = Field(min_length=1)
    choices: Choices
    constraints: Constraints = Constraints()
    seq_len: StrictInt | None = Field(default=None, gt=0)
    global_batch: StrictInt | None = Field(default=None, gt=0)
    screen_layouts: StrictInt = Field(default=100, gt=0)


def load_space(path: str | Path) -> Space:
    """Read and validate a SPACE YAML (:func:`moeplan.files.read_yaml`, a safe loader). Raises SpecError with one
    line naming the field, the value and the rule (a missing file, bad YAML, an unknown field, a bad value, a base
    model that does not load)."""
    data = read_yaml(path, field="space", error=SpecError)
    if not isinstance(data, dict):
        raise SpecError(f"space={str(path)!r}: must be a mapping with name, base and choices")
    try:
        space = Space.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        value = first.get("input")
        msg = re.sub(r"^Value error, ", "", first["msg"])
        raise SpecError(f"space.{loc}={value!r}: {msg}".replace("\n", " ")) from None
    base = load_spec(space.base)  # SpecError names the base
    for name in space.choices.varied():
        if name in ("num_kv_heads",) and base.attention != "gqa" or \
                name in ("q_lora_rank", "kv_lora_rank") and base.attention != "mla":
            raise SpecError(f"space.choices.{name}: the base {space.base!r} has {base.attention} attention")
    return space


# ---- architectures -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Architecture:
    """One point of the space: its spec, the varied values and its parameter counts (elements, MTP excluded)."""

    spec: ModelSpec
    values: tuple[tuple[str, int], ...]
    total_params: int
    activated_params: int


@dataclass(frozen=True)
class Architectures:
    """The architectures that meet the constraints and, per reason, how many combinations did not."""

    kept: tuple[Architecture, ...]
    rejected: Counter
    combinations: int


def _spec_reason(err: SpecError | ValidationError) -> str:
    """What a combination broke, without its figures (what :class:`Architectures` counts by): the spec rule's
    ``reason``, or the field and pydantic's message for a field constraint."""
    if isinstance(err, ValidationError):
        first = err.errors()[0]
        cause = first.get("ctx", {}).get("error")
        if not isinstance(cause, SpecError):
            return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
        err = cause
    return err.reason or str(err)


def architectures(space: Space) -> Architectures:
    """Every combination of the choices, built on the base, checked and counted; kept when it meets the constraints.

    The shared-expert width follows the expert width (``shared_ffn_size = num_shared_experts · moe_ffn_size``) when
    either is varied and the base has shared experts."""
    base = load_spec(space.base).with_shape(seq_len=space.seq_len, global_batch=space.global_batch)
    data = base.model_dump()
    varied = space.choices.varied()
    names = list(varied)
    cons = space.constraints
    kept: list[Architecture] = []
    rejected: Counter = Counter()
    total = 0
    for combo in itertools.product(*(varied[n] for n in names)):
        total += 1
        values = dict(zip(names, combo))
        bad = next((k for k, m in cons.multiple_of.items() if values.get(k, data[k]) % m), None)
        if bad is not None:
            rejected[f"{bad} not a multiple of {cons.multiple_of[bad]}"] += 1
            continue
        upd = {**data, **values}
        if ("num_shared_experts" in values or "moe_ffn_size" in values) and base.num_shared_experts:
            upd["shared_ffn_size"] = upd["num_shared_experts"] * upd["moe_ffn_size"]
        upd["name"] = space.name + "-" + "-".join(f"{SHORT_NAMES[k]}{v}" for k, v in values.items())
        try:
            spec = ModelSpec.model_validate(upd)
        except (SpecError, ValidationError) as e:
            rejected[_spec_reason(e)] += 1
            continue
        pc = count_params(spec)
        for rng, n, what in ((cons.total_params_b, pc.total, "total"), (cons.activated_params_b, pc.activated,
                                                                         "activated")):
            if rng is not None and not rng[0] <= n / 1e9 <= rng[1]:
                rejected[f"{what} parameters outside [{rng[0]:g}, {rng[1]:g}] B"] += 1
                break
        else:
            kept.append(Architecture(spec, tuple(values.items()), pc.total, pc.activated))
    return Architectures(tuple(kept), rejected, total)


SHORT_NAMES = {"num_layers": "L", "hidden_size": "h", "num_heads": "a", "num_kv_heads": "g", "q_lora_rank": "q",
          "kv_lora_rank": "kv", "num_experts": "E", "top_k": "k", "moe_ffn_size": "f", "num_shared_experts": "s",
          "num_dense_layers": "d", "num_mtp_layers": "mtp", "vocab_size": "V"}


# ---- screening -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Screened:
    """The screen's figure for one architecture (``index`` into :attr:`Architectures.kept`): ``status`` "ok" with
    the best shortlist option's layout, strategy and estimate, or "no-layout" with the reason and no figures."""

    index: int
    status: Literal["ok", "no-layout"]
    reason: str = ""
    layout: Layout | None = None
    strategy: Strategy | None = None
    step_s: float = float("inf")
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    memory_bytes: float = 0.0
    fits: bool = False


@dataclass(frozen=True)
class Verified:
    """The full pipeline's figures for a screened architecture: ``status`` "ok" (the default compile's plan) or
    "failed" (its one-line error)."""

    index: int
    status: Literal["ok", "failed"]
    reason: str = ""
    layout: Layout | None = None
    strategy: Strategy | None = None
    step_s: float = float("inf")
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    peak_memory_bytes: float = 0.0
    compile_s: float = 0.0


@dataclass
class ExploreResult:
    """Everything ``moeplan explore`` reports: the architectures, the shortlist, one :class:`Screened` per kept
    architecture, the verified ones (best screened first) and the seconds each phase took."""

    space: Space
    target: Target
    num_devices: int
    archs: Architectures
    screened: list[Screened]
    shortlist: tuple[tuple[Layout, Strategy], ...]
    verified: list[Verified] = field(default_factory=list)
    screen_s: float = 0.0
    verify_s: float = 0.0

    def ranked(self) -> list[Screened]:
        """The screened architectures with a figure, highest tokens/s first (those whose memory estimate fits
        before those that do not)."""
        return sorted((s for s in self.screened if s.status == "ok"), key=lambda s: (not s.fits, -s.tokens_per_s))


_GRAPHS: dict = {}
"""Per worker process: traced layers by (kind, the fields they depend on), and the search's pricing caches by
signature (every field but the layer counts)."""


def _signature(spec: ModelSpec) -> tuple:
    return tuple(sorted((k, v) for k, v in spec.model_dump().items() if k not in _COUNT_FIELDS))


def _graph(spec: ModelSpec) -> ModelGraph:
    """The traced model of ``spec`` from per-kind traces shared across architectures (fx modules dropped)."""
    from moeplan.trace import layer_sequence, trace_layer

    sequence = layer_sequence(spec)
    sig = _signature(spec)
    layers = {}
    for kind in [*dict.fromkeys(sequence), LayerKind.EMPTY]:
        key = (kind, tuple(kv for kv in sig if kv[0] not in _EXPERT_FIELDS) if kind in _EXPERT_FREE else sig)
        if key not in _GRAPHS:
            _GRAPHS[key] = replace(trace_layer(spec, kind, seq_len=spec.seq_len), gm=None)
        layers[kind] = _GRAPHS[key]
    return ModelGraph(spec=spec, seq_len=spec.seq_len, layers=MappingProxyType(layers), layer_sequence=sequence)


def _screen_group(task: tuple[list[tuple[int, ModelSpec]], list[tuple[Layout, Strategy]], Target, int]
                  ) -> list[Screened]:
    """Screen architectures of one signature (module docstring, step 2)."""
    from moeplan.passes.partition_stages import SLOT_KINDS
    from moeplan.cost_models.memory import budget_bytes
    from moeplan.estimate import (estimate_floor, estimate_memory, estimate_step, model_cost, slot_weights, stage_params,
                                  static_bytes)
    from moeplan.search_eval import _shape_key

    group, shortlist, target, num_devices = task
    budget = budget_bytes(target)
    cache: dict = {}  # prices of this signature's layers, shared by its architectures
    out = []
    for index, spec in group:
        graph = _graph(spec)
        slots = [k for _, k in named_layers(spec)]
        counts = Counter(slots)
        weights, flags = slot_weights(graph, slots), tuple(int(k in SLOT_KINDS) for k in slots)
        tokens = spec.global_batch * spec.seq_len
        model_flops = flops_per_token(spec, seq_len=spec.seq_len) * tokens
        params_of: dict = {}
        costs: dict = {}
        reasons: Counter = Counter()
        floors = []  # (estimate floor, position, ...): estimate_floor, below any estimate of the option
        for lay, st in shortlist:
            rejection = layout_rejection(lay, num_devices=num_devices, devices_per_node=target.devices_per_node,
                                         num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                                         num_experts=spec.num_experts, num_layer_slots=len(slots))
            if rejection is not None:
                reasons[rejection.summary] += 1
                continue
            pkey = (lay.tp, lay.pp, lay.ep)
            params = params_of.get(pkey) or params_of.setdefault(pkey, stage_params(lay, graph, counts))
            if static_bytes(lay, params, target, st, hidden_size=spec.hidden_size) > budget:
                reasons["model states exceed device memory"] += 1
                continue
            ckey = (_shape_key(lay, st), st.overlap)
            cost = costs.get(ckey) or costs.setdefault(
                ckey, model_cost(graph, lay, target, st.dispatcher, st.overlap, counts, cache,
                                 st.precision))
            floors.append((estimate_floor(lay, st, cost, params=params, target=target), len(floors), lay, st, cost,
                           params))
        floors.sort(key=lambda x: x[:2])
        # the best is the least (memory estimate does not fit, estimate), then the least such key at the balanced
        # load, then the first in shortlist order; an option whose floor is above a best that fits cannot be it, nor
        # can any after it
        best = None
        for floor, position, lay, st, cost, params in floors:
            if best is not None and not best[0][0] and floor > best[0][1]:
                break
            memory = estimate_memory(lay, st, cost, kinds=tuple(slots), target=target, budget=budget,
                                     hidden_size=spec.hidden_size)
            low = estimate_step(lay, st, cost, weights=weights, slots=flags, params=params, target=target,
                                memory=memory, load=1.0)
            est = estimate_step(lay, st, cost, weights=weights, slots=flags, params=params, target=target,
                                memory=memory)
            key = ((not est.fits, est.step_s), (not low.fits, low.step_s), position)
            if best is None or key < best[:3]:
                best = (*key, est, lay, st)
        if best is None:
            why = reasons.most_common(1)[0][0] if reasons else "empty shortlist"
            out.append(Screened(index, "no-layout", f"no shortlist layout fits ({why})"))
            continue
        est, lay, st = best[3:]
        out.append(Screened(index, "ok", layout=lay, strategy=st, step_s=est.step_s, tokens_per_s=tokens / est.step_s,
                            mfu=model_flops / (est.step_s * num_devices * target.cube_flops),
                            memory_bytes=est.memory_bytes, fits=est.fits))
    return out


def shortlist(specs: list[ModelSpec], *, target: Target, num_devices: int, keep: int,
              workers: int | None = None, ray: str | None = None) -> list[tuple[Layout, Strategy]]:
    """The best ``keep`` (layout, strategy) options by estimate of each representative in ``specs``, in order,
    without repeats (module docstring, step 1); on the Ray cluster at ``ray`` when given."""
    from moeplan.cost_models.memory import budget_bytes
    from moeplan.search import Fixed, build_options, rank_by_estimate
    from moeplan.trace import trace_model

    seen: dict[tuple[Layout, Strategy], None] = {}
    for spec in specs:
        graph = trace_model(spec, seq_len=spec.seq_len)
        fixed = Fixed(global_batch=spec.global_batch, seq_len=spec.seq_len)
        budget = budget_bytes(target)
        built = build_options(graph=graph, target=target, num_devices=num_devices, fixed=fixed, budget=budget)
        ranked = rank_by_estimate(graph=graph, target=target, options=built.options, budget=budget,
                                  workers=workers, ray=ray, first=keep)
        for _, _, lay, st in ranked:
            seen.setdefault((lay, st), None)
    return list(seen)


def explore(space: Space, *, target: Target, num_devices: int, verify: int = 50, workers: int | None = None,
            progress: Callable[[str, int, int], None] | None = None, ray: str | None = None,
            verified: Callable[[Verified, str], None] | None = None) -> ExploreResult:
    """Run the architecture search (module docstring). ``progress(phase, done, total)`` is called as architectures
    are screened ("screen") and verified ("verify"), and ``verified(v, name)`` with each verification and its
    architecture's name as it finishes (they run in parallel, one compile per worker; ``result.verified`` is in
    screened order). ``ray``: every step on the Ray cluster at this address (one connection for the whole search:
    moeplan/ray_pool.py) instead of ``workers`` forked processes. Raises SpecError when no architecture meets the
    constraints."""
    from moeplan.search_eval import pool

    t0 = time.perf_counter()
    archs = architectures(space)
    if not archs.kept:
        why = "; ".join(f"{n} {r}" for r, n in archs.rejected.most_common(3))
        raise SpecError(f"space={space.name!r}: none of the {archs.combinations} combinations meets the "
                        f"constraints ({why})")
    base = load_spec(space.base).with_shape(seq_len=space.seq_len, global_batch=space.global_batch)
    by_size = sorted(archs.kept, key=lambda a: a.total_params)
    reps = list({s.model_dump_json(): s for s in (base, by_size[0].spec, by_size[-1].spec)}.values())
    with pool(workers, ray) if ray is not None else nullcontext():  # under Ray, one connection for every step
        options = shortlist(reps, target=target, num_devices=num_devices, keep=space.screen_layouts,
                            workers=workers, ray=ray)
        groups: dict[tuple, list[tuple[int, ModelSpec]]] = {}
        for i, a in enumerate(archs.kept):
            groups.setdefault(_signature(a.spec), []).append((i, a.spec))
        tasks = [(g, options, target, num_devices) for g in groups.values()]
        screened: list[Screened] = []
        with pool(workers, ray) as screen_pool:
            for part in screen_pool.imap(_screen_group, tasks):
                screened += part
                if progress:
                    progress("screen", len(screened), len(archs.kept))
        result = ExploreResult(space, target, num_devices, archs, sorted(screened, key=lambda s: s.index),
                               shortlist=tuple(options), screen_s=time.perf_counter() - t0)
        t1 = time.perf_counter()
        best = result.ranked()[:verify]
        tasks = [(archs.kept[s.index].spec, s.index, target, num_devices) for s in best]
        with pool(workers, ray) as verify_pool:  # one compile per worker, each in one process
            for v in verify_pool.unordered(_verify, tasks):
                result.verified.append(v)
                if verified:
                    verified(v, archs.kept[v.index].spec.name)
                if progress:
                    progress("verify", len(result.verified), len(best))
        order = {s.index: n for n, s in enumerate(best)}
        result.verified.sort(key=lambda v: order[v.index])
        result.verify_s = time.perf_counter() - t1
    return result


def _verify(task: tuple[ModelSpec, int, Target, int]) -> Verified:
    """The default compile of one screened architecture, in this process (a verification task)."""
    from moeplan.compile import compile_model
    from moeplan.compiler import DEFAULT_PIPELINE
    from moeplan.search import Fixed

    spec, index, target, num_devices = task
    try:
        res = compile_model(spec=spec, target=target, num_devices=num_devices,
                            fixed=Fixed(global_batch=spec.global_batch, seq_len=spec.seq_len),
                            pipeline=DEFAULT_PIPELINE, workers=1)
    except MoeplanError as e:
        return Verified(index, "failed", str(e).splitlines()[0])
    ev = res.result.ranked[0]
    p = ev.state.prediction
    return Verified(index, "ok", layout=ev.state.layout, strategy=ev.state.strategy, step_s=p.step_time_s,
                    tokens_per_s=p.tokens_per_s, mfu=p.mfu, peak_memory_bytes=max(p.peak_memory_bytes),
                    compile_s=res.compile_s)


def pareto(result: ExploreResult) -> list[Screened]:
    """The screened architectures no other beats on both activated parameters (more) and tokens/s (more), by
    increasing activated parameters; those whose memory estimate does not fit are left out."""
    pts = sorted((s for s in result.screened if s.status == "ok" and s.fits),
                 key=lambda s: (-result.archs.kept[s.index].activated_params, -s.tokens_per_s))
    front, best = [], 0.0
    for s in pts:
        if s.tokens_per_s > best:
            front.append(s)
            best = s.tokens_per_s
    return front[::-1]
