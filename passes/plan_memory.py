"""Pass ``plan-memory``: what each PP rank keeps for backward, recomputes or swaps to host, so that it fits.

``Strategy.recompute`` (``--recompute``) names the mode; ``auto`` picks, per rank, the cheapest whole-layer mode that
fits. Whole-layer modes, cheapest first: ``none`` (keep every saved tensor), ``selective`` (recompute norms,
activation functions and core attention — Megatron-LM selective recompute, arXiv 2205.05198 §5), ``full`` (keep
only each layer's input; Chen et al. arXiv 1604.06174). Per-tensor modes (docs/memory.md): ``mindspeed`` (MindSpeed's
``--recompute-norm --recompute-activation-function``: norms and SwiGLU activations re-run, their inputs kept),
``ilp-no-swap`` and ``ilp`` (the optimal keep / recompute / swap per saved tensor, per (VPP chunk, layer kind), by
moeplan/memory_ilp.py; ``ilp-no-swap`` never swaps).

A rank's memory is its model states (cost_models/memory.py, distributed optimizer) plus its activations at the
fullest point of its action list from the ``schedule`` pass (which it requires: the in-flight micro-batches are the
schedule's) plus the largest op workspace plus one layer's backward working set (what it re-makes; per-tensor
modes add its swapped tensors fetched back and the next layer's prefetched: moeplan/memory_ilp.py). The
budget is ``budget_gib`` when set, else ``budget_fraction`` of the target's usable device memory.

Raises InfeasibleError, naming the per-device memory needed, when even full recompute (or the fixed mode) does not
fit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

from moeplan.cost_models.memory import model_state_bytes, peak_live_bytes
from moeplan.cost_models.saved_tensors import LayerTensors, layer_tensors
from moeplan.errors import InfeasibleError, PlanError
from moeplan.memory_ilp import Group, RankProblem, choice_of, evaluate, solve
from moeplan.ir import kind_of
from moeplan.state import LayerCost, MemoryPlan, PlanState, Recompute, StageMemory

MODES: tuple[Recompute, ...] = ("none", "selective", "full")
GIB = 1024**3


def saved_bytes(cost: LayerCost, mode: Recompute) -> int:
    """Activation bytes one micro-batch keeps on one device for this layer under whole-layer ``mode``."""
    return {"none": cost.saved_bytes, "selective": cost.saved_selective_bytes, "full": cost.saved_full_bytes}[mode]


@dataclass(frozen=True)
class PlanMemoryPass:
    """Pick, per PP rank, the cheapest of no / selective / full recompute whose memory fits the budget."""

    name: ClassVar[str] = "plan-memory"
    requires: ClassVar[tuple[str, ...]] = ("sharding", "stages", "schedule")
    provides: ClassVar[tuple[str, ...]] = ("memory",)
    budget_fraction: float = 1.0
    """Fraction of the target's usable device memory the plan may use."""
    budget_gib: float = 0.0
    """Device memory the plan may use, GiB (2^30 bytes); 0: ``budget_fraction`` of the usable memory
    (``--memory-budget``)."""
    time_limit_s: float = 2.0
    """Seconds each ILP solve may take; past it the solver's best solution is used (the greedy one when it has
    none), and the plan marks the rank ``heuristic`` with the gap."""
    enforce: bool = True
    """False: never raise; a rank that fits under no allowed mode gets the last one tried (full, or the fixed
    mode), and the plan's memory says it does not fit (to price a published layout whose memory tricks moeplan
    does not model yet)."""

    def run(self, state: PlanState) -> PlanState:
        assert state.sharding is not None and state.stages is not None and state.schedule is not None
        if self.budget_fraction <= 0 or self.budget_gib < 0 or self.time_limit_s <= 0:
            raise PlanError(f"plan-memory{{budget_fraction={self.budget_fraction},budget_gib={self.budget_gib},"
                            f"time_limit_s={self.time_limit_s}}}: budget_fraction and time_limit_s must be > 0, "
                            f"budget_gib >= 0")
        budget = self.budget_gib * GIB or state.target.usable_memory_bytes * self.budget_fraction
        lay, asked = state.layout, state.strategy.recompute
        actions = state.schedule.actions
        modes = MODES if asked == "auto" else (asked,)
        tensors: dict = {}
        stages = []
        for r in range(lay.pp):
            for mode in modes:  # cheapest first; stop at the first that fits
                mem = (rank_memory(state, r, mode, actions[r]) if mode in MODES else
                       op_rank_memory(state, r, mode, actions[r], budget, self.time_limit_s, tensors))
                if mem.total_bytes <= budget:
                    break
            else:
                if not self.enforce:
                    stages.append(mem)
                    continue
                with_what = "even with full recompute" if asked == "auto" else f"with recompute {asked!r}"
                raise InfeasibleError(
                    f"memory: pp rank {r} needs {mem.total_bytes / GIB:.1f} GiB per device {with_what} "
                    f"({lay.short()}); {state.target.name} allows {budget / GIB:.1f} GiB", needs_bytes=mem.total_bytes)
            stages.append(mem)
        return state.with_(memory=MemoryPlan(stages=tuple(stages), budget_bytes=budget))


def recompute_working_set(layers: Sequence[LayerCost], mode: Recompute) -> int:
    """Bytes one layer's backward re-makes under whole-layer ``mode`` (the largest of ``layers``): what it keeps
    under ``none`` less what ``mode`` keeps. Charged on top of the in-flight activations, as the per-tensor
    modes charge theirs (moeplan/memory_ilp.py), so the two families are priced alike."""
    return max([0, *(saved_bytes(lc, "none") - saved_bytes(lc, mode) for lc in layers)])


def rank_memory(state: PlanState, rank: int, mode: Recompute, actions: tuple[str, ...]) -> StageMemory:
    """Memory of one device of PP rank ``rank`` under whole-layer ``mode`` (bytes)."""
    assert state.sharding is not None and state.stages is not None
    spec, costs = state.graph.spec, state.sharding.layer_costs
    chunks = [[costs[kind_of(spec, n)] for n in names] for names in state.stages.chunks[rank]]
    stage_bytes = {state.stages.stage_of(rank, c): sum(saved_bytes(lc, mode) for lc in lcs)
                   for c, lcs in enumerate(chunks)}
    params, grads, opt, workspace = _model_states(state, rank)
    act, in_flight = peak_live_bytes(actions, stage_bytes)
    act += recompute_working_set([lc for lcs in chunks for lc in lcs], mode)
    return StageMemory(pp_rank=rank, recompute=mode, params_bytes=params, grads_bytes=grads, optimizer_bytes=opt,
                       activation_bytes=act, workspace_bytes=workspace, in_flight_microbatches=in_flight)


MINDSPEED_RECOMPUTED = frozenset({"norm", "SwiGLU activation", "shared expert SwiGLU activation"})
"""Ops ``mindspeed`` re-runs: MindSpeed-LLM ``--recompute-norm`` and ``--recompute-activation-function``."""


def _model_states(state: PlanState, rank: int) -> tuple[float, float, float, int]:
    """(params, grads, optimizer bytes, largest op workspace) of one device of PP rank ``rank``."""
    assert state.sharding is not None and state.stages is not None
    lay, spec, costs = state.layout, state.graph.spec, state.sharding.layer_costs
    lcs = [costs[kind_of(spec, n)] for names in state.stages.chunks[rank] for n in names]
    ms = model_state_bytes(dense_params=sum(lc.params - lc.expert_params for lc in lcs),
                           expert_params=sum(lc.expert_params for lc in lcs), dense_dp=lay.dp * lay.cp,
                           expert_dp=lay.expert_dp)
    return ms.params_bytes, ms.grads_bytes, ms.optimizer_bytes, max([0, *(lc.workspace_bytes for lc in lcs)])


def in_flight_vectors(actions: tuple[str, ...], stages: list[int]) -> tuple[tuple[int, ...], ...]:
    """The distinct counts of micro-batches in flight per chunk (``stages[c]``: chunk c's pipeline stage) after
    each forward of one rank's action list, without those another one covers (every count ≤ its counts)."""
    from moeplan.cost_models.timeline import compute_parts

    where = {s: c for c, s in enumerate(stages)}
    live = [0] * len(stages)
    seen: set[tuple[int, ...]] = set()
    for text in actions:
        for a in compute_parts(text):
            if a.kind == "F":
                live[where[a.stage]] += 1
                seen.add(tuple(live))
            elif a.kind in ("B", "W"):
                live[where[a.stage]] -= 1
    return tuple(sorted(v for v in seen if not any(w != v and all(x >= y for x, y in zip(w, v)) for w in seen)))


def rank_problem(state: PlanState, rank: int, mode: Recompute, actions: tuple[str, ...], budget: float,
                 tensors: dict) -> tuple[RankProblem, tuple[float, float, float, int]]:
    """The :class:`RankProblem` of PP rank ``rank`` (its groups, in-flight vectors and the bytes ``budget``
    leaves for activations once the model states and the largest op workspace are counted) and those (params,
    grads, optimizer, workspace bytes); ``tensors`` caches each kind's :class:`LayerTensors`."""
    assert state.sharding is not None and state.stages is not None
    spec, stages = state.graph.spec, state.stages
    groups = []
    for c, names in enumerate(stages.chunks[rank]):
        counts: dict = {}
        for n in names:
            k = kind_of(spec, n)
            counts[k] = counts.get(k, 0) + 1
        for k, n in counts.items():
            groups.append(Group(c, n, _tensors(state, k, tensors)))
    static = _model_states(state, rank)
    vectors = in_flight_vectors(actions, [stages.stage_of(rank, c) for c in range(len(stages.chunks[rank]))])
    return RankProblem(tuple(g for g in groups if g.layer.tensors), vectors, budget - sum(static),
                       state.layout.num_microbatches,
                       state.target.host_bandwidth_bytes_per_s if mode == "ilp" else None), static


def _tensors(state: PlanState, kind, cache: dict) -> LayerTensors:  # noqa: ANN001
    if kind not in cache:
        from moeplan.passes.shard import op_times_s

        lg = state.graph.layer(kind)
        cache[kind] = layer_tensors(lg, spec=state.graph.spec, layout=state.layout, target=state.target,
                                    dispatcher=state.strategy.dispatcher,
                                    times=op_times_s(lg, layout=state.layout, target=state.target))
    return cache[kind]


def op_rank_memory(state: PlanState, rank: int, mode: Recompute, actions: tuple[str, ...], budget: float,
                   time_limit_s: float, tensors: dict) -> StageMemory:
    """Memory of one device of PP rank ``rank`` under a per-tensor mode (module docstring), its decisions and
    the solver's status."""
    problem, (params, grads, opt, workspace) = rank_problem(state, rank, mode, actions, budget, tensors)
    memory = dict(pp_rank=rank, recompute=mode, params_bytes=params, grads_bytes=grads, optimizer_bytes=opt,
                  workspace_bytes=workspace, in_flight_microbatches=max((sum(v) for v in problem.in_flight), default=0))
    if mode == "mindspeed":  # fixed decisions: nothing solved, so no solver status
        choices = tuple(choice_of(g, {o.name for o in g.layer.ops if o.label in MINDSPEED_RECOMPUTED}, set())
                        for g in problem.groups)
        _, peak, exposed = evaluate(problem, choices)
        return StageMemory(**memory, activation_bytes=peak, decisions=choices, exposed_swap_s=exposed)
    sol = solve(problem, time_limit_s=time_limit_s)
    return StageMemory(**memory, activation_bytes=sol.peak_bytes, decisions=sol.choices,
                       exposed_swap_s=sol.exposed_swap_s, solve_status=sol.status,
                       solve_gap=sol.gap if sol.gap != float("inf") else -1.0, solve_reason=sol.reason)
