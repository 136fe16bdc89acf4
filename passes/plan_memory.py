"""Pass ``plan-memory``: what each PP rank keeps for backward, recomputes or swaps to host, so that it fits.

``Strategy.recompute`` (``--recompute``) names the mode; ``auto`` picks, per rank, the cheapest whole-layer mode that
fits. Whole-layer modes, cheapest first: ``none`` (keep every saved tensor), ``selective`` (recompute norms,
activation functions and core attention — Megatron-LM selective recompute, arXiv 2205.05198 §5), ``full`` (keep
only each layer's input; Chen et al. arXiv 1604.06174). Per-tensor modes (docs/memory.md): ``mindspeed`` (MindSpeed's
``--recompute-norm --recompute-activation-function``: norms and SwiGLU activations re-run, their inputs kept),
``modules`` (Megatron-LM's ``--recompute-modules``, ``Strategy.recompute_modules``: the ops of the named modules
re-run, cost_models/saved_tensors.py ``module_ops``),
``ilp-no-swap`` and ``ilp`` (the optimal keep / recompute / swap per saved tensor, per (VPP chunk, layer kind), by
moeplan/memory_ilp.py; ``ilp-no-swap`` never swaps).

A rank's memory is every term of cost_models/memory.py (model states by the recipe's precision, the activations
at the fullest point of its action list from the ``schedule`` pass, the backward working set, the largest op
workspace, communication buffers, the runtime's bytes and the allocator's share): the same model the layout
search's estimate prices with. The budget (:func:`~moeplan.cost_models.memory.budget_bytes`) is ``budget_gib``
when set (``--memory-budget``; never above the device's memory), else ``budget_fraction`` of the device's memory.

Raises InfeasibleError, naming the per-device memory needed and the budget, when even full recompute (or the fixed
mode) does not fit; PlanError for a budget above the device's memory.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from moeplan.cost_models.memory import (MODES, Overheads, budget_bytes, device_memory, gib_text, in_flight_vectors,
                                        overheads, rank_parts, with_overheads)
from moeplan.cost_models.saved_tensors import LayerTensors, layer_tensors, module_ops
from moeplan.cost_models.sharding import op_times_s
from moeplan.errors import InfeasibleError, PlanError
from moeplan.ir import kind_of
from moeplan.memory_ilp import Group, RankProblem, choice_of, evaluate, solve, working_set
from moeplan.state import LayerCost, MemoryPlan, PlanState, Recompute, StageMemory
from moeplan.targets import Target


@dataclass(frozen=True)
class PlanMemoryPass:
    """Pick, per PP rank, the cheapest of no / selective / full recompute whose memory fits the budget."""

    name: ClassVar[str] = "plan-memory"
    requires: ClassVar[tuple[str, ...]] = ("sharding", "stages", "schedule")
    provides: ClassVar[tuple[str, ...]] = ("memory",)
    budget_fraction: float = 1.0
    """Fraction (0–1) of the device's memory the plan may use."""
    budget_gib: float = 0.0
    """Device memory the plan may use, GiB (2^30 bytes), at most the device's; 0: ``budget_fraction`` of it
    (``--memory-budget``)."""
    time_limit_s: float = 2.0
    """Seconds each ILP solve may take; past it the solver's best solution is used (the greedy one when it has
    none), and the plan marks the rank ``heuristic`` with the gap."""
    enforce: bool = True
    """False: never raise; a rank that fits under no allowed mode gets the last one tried (full, or the fixed
    mode), and the plan's memory says it does not fit."""

    def budget(self, target: Target) -> float:
        """Bytes per device the plan may fill. Raises PlanError for a bad option or a budget above the device's
        memory."""
        if not 0 < self.budget_fraction <= 1 or self.budget_gib < 0 or self.time_limit_s <= 0:
            raise PlanError(f"plan-memory{{budget_fraction={self.budget_fraction},budget_gib={self.budget_gib},"
                            f"time_limit_s={self.time_limit_s}}}: budget_fraction must be in (0, 1], "
                            f"time_limit_s > 0, budget_gib >= 0")
        try:
            return budget_bytes(target, self.budget_gib, self.budget_fraction)
        except ValueError as e:
            raise PlanError(str(e)) from None

    def run(self, state: PlanState) -> PlanState:
        assert state.sharding is not None and state.stages is not None and state.schedule is not None
        budget = self.budget(state.target)
        lay, asked = state.layout, state.strategy.recompute
        actions = state.schedule.actions
        modes = MODES if asked == "auto" else (asked,)
        over = overheads(lay, state.strategy, state.target, hidden_size=state.graph.spec.hidden_size)
        tensors: dict = {}
        stages = []
        for r in range(lay.pp):
            for mode in modes:  # cheapest first; stop at the first that fits
                mem = (rank_memory(state, r, mode, actions[r], over) if mode in MODES else
                       op_rank_memory(state, r, mode, actions[r], budget, self.time_limit_s, tensors, over))
                if mem.total_bytes <= budget:
                    break
            else:
                if not self.enforce:
                    stages.append(mem)
                    continue
                with_what = "even with full recompute" if asked == "auto" else f"with recompute {asked!r}"
                raise InfeasibleError(
                    f"memory: pp rank {r} needs {gib_text(mem.total_bytes)} per device {with_what} "
                    f"({lay.short()}); the budget is {gib_text(budget)}", needs_bytes=mem.total_bytes)
            stages.append(mem)
        return state.with_(memory=MemoryPlan(stages=tuple(stages), budget_bytes=budget))


def rank_chunks(state: PlanState, rank: int) -> list[list[LayerCost]]:
    """The layer costs of each VPP chunk of PP rank ``rank``."""
    assert state.sharding is not None and state.stages is not None
    spec, costs = state.graph.spec, state.sharding.layer_costs
    return [[costs[kind_of(spec, n)] for n in names] for names in state.stages.chunks[rank]]


def _stages(state: PlanState, rank: int) -> list[int]:
    assert state.stages is not None
    return [state.stages.stage_of(rank, c) for c in range(len(state.stages.chunks[rank]))]


def rank_memory(state: PlanState, rank: int, mode: Recompute, actions: tuple[str, ...],
                over: Overheads | None = None) -> StageMemory:
    """Memory of one device of PP rank ``rank`` under whole-layer ``mode`` (cost_models/memory.py); ``over``: the
    layout's overheads, when already priced."""
    if over is None:
        over = overheads(state.layout, state.strategy, state.target, hidden_size=state.graph.spec.hidden_size)
    return device_memory(rank, rank_chunks(state, rank), in_flight_vectors(actions, _stages(state, rank)),
                         mode=mode, layout=state.layout, precision=state.strategy.precision, target=state.target,
                         over=over)


MINDSPEED_RECOMPUTED = frozenset({"norm", "SwiGLU activation", "shared expert SwiGLU activation"})
"""Ops ``mindspeed`` re-runs: MindSpeed-LLM ``--recompute-norm`` and ``--recompute-activation-function``."""


def rank_problem(state: PlanState, rank: int, mode: Recompute, actions: tuple[str, ...], budget: float,
                 tensors: dict, over: Overheads) -> tuple[RankProblem, StageMemory]:
    """The :class:`RankProblem` of PP rank ``rank`` (its groups, in-flight vectors and the bytes ``budget``
    leaves for activations and the working set once every other term is counted) and the rank's memory without
    activations (model states, workspace)."""
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
    parts = rank_parts(rank_chunks(state, rank), layout=state.layout, precision=state.strategy.precision,
                       target=state.target, modes=())
    ms, workspace, gathered = parts.states, parts.workspace, parts.gathered
    vectors = in_flight_vectors(actions, _stages(state, rank))
    static = StageMemory(pp_rank=rank, recompute=mode, params_bytes=ms.params_bytes, grads_bytes=ms.grads_bytes,
                         optimizer_bytes=ms.optimizer_bytes, activation_bytes=0.0, workspace_bytes=workspace,
                         in_flight_microbatches=max((sum(v) for v in vectors), default=0), gathered_bytes=gathered)
    return RankProblem(tuple(g for g in groups if g.layer.tensors), vectors,
                       over.activation_budget(budget, ms.total_bytes, workspace + gathered),
                       state.layout.num_microbatches,
                       state.target.host_bandwidth_bytes_per_s if mode == "ilp" else None), static


def _tensors(state: PlanState, kind, cache: dict) -> LayerTensors:  # noqa: ANN001
    if kind not in cache:
        lg = state.graph.layer(kind)
        cache[kind] = layer_tensors(lg, spec=state.graph.spec, layout=state.layout, target=state.target,
                                    dispatcher=state.strategy.dispatcher,
                                    fp8_act_input=state.strategy.precision.fp8_activation_input,
                                    times=op_times_s(lg, layout=state.layout, target=state.target))
    return cache[kind]


def op_rank_memory(state: PlanState, rank: int, mode: Recompute, actions: tuple[str, ...], budget: float,
                   time_limit_s: float, tensors: dict, over: Overheads) -> StageMemory:
    """Memory of one device of PP rank ``rank`` under a per-tensor mode (module docstring), its decisions and
    the solver's status."""
    problem, static = rank_problem(state, rank, mode, actions, budget, tensors, over)
    if mode in ("mindspeed", "modules"):  # fixed decisions: nothing solved, so no solver status
        modules = state.strategy.recompute_modules
        choices = tuple(choice_of(g, module_ops(g.layer, modules) if mode == "modules" else
                                  {o.name for o in g.layer.ops if o.label in MINDSPEED_RECOMPUTED}, set())
                        for g in problem.groups)
        _, peak, exposed = evaluate(problem, choices)
        work = working_set(choices)
        return with_overheads(replace(static, activation_bytes=peak - work, working_set_bytes=work,
                                      decisions=choices, exposed_swap_s=exposed), over)
    sol = solve(problem, time_limit_s=time_limit_s)
    work = working_set(sol.choices)
    return with_overheads(replace(static, activation_bytes=sol.peak_bytes - work, working_set_bytes=work,
                                  decisions=sol.choices, exposed_swap_s=sol.exposed_swap_s,
                                  solve_status=sol.status, solve_gap=sol.gap if sol.gap != float("inf") else -1.0,
                                  solve_reason=sol.reason), over)

