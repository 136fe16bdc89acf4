"""Pass ``plan-memory`` v1: per PP rank, the cheapest recompute mode that fits the device memory.

``Strategy.recompute`` (``--recompute``) fixes the mode for every rank (``none``, ``selective``, ``full``), so a
published recipe can be reproduced; ``auto`` picks per rank. Modes, cheapest first: ``none`` (keep every saved tensor), ``selective`` (recompute norms, activation functions and
core attention — MindSpeed ``--recompute-norm`` / ``--recompute-activation-function``, Megatron-LM selective
recompute, arXiv 2205.05198 §5), ``full`` (keep only each layer's input; Chen et al. arXiv 1604.06174). A rank's
memory is its model states (cost_models/memory.py, distributed optimizer) plus the peak of live activations
walked over the rank's action list from the ``schedule`` pass (which it requires: the in-flight micro-batches are
the schedule's) plus the largest op workspace. The per-operator keep/recompute/swap ILP
replaces this pass later (docs/architecture.md §4).

Raises InfeasibleError, naming the per-device memory needed, when even full recompute (or the fixed mode) does not
fit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moeplan.cost_models.memory import model_state_bytes, peak_live_bytes
from moeplan.errors import InfeasibleError
from moeplan.ir import kind_of
from moeplan.state import LayerCost, MemoryPlan, PlanState, Recompute, StageMemory

MODES: tuple[Recompute, ...] = ("none", "selective", "full")
GIB = 1024**3


def saved_bytes(cost: LayerCost, mode: Recompute) -> int:
    """Activation bytes one micro-batch keeps on one device for this layer under ``mode``."""
    return {"none": cost.saved_bytes, "selective": cost.saved_selective_bytes, "full": cost.saved_full_bytes}[mode]


@dataclass(frozen=True)
class PlanMemoryPass:
    """Pick, per PP rank, the cheapest of no / selective / full recompute whose memory fits the budget."""

    name: ClassVar[str] = "plan-memory"
    requires: ClassVar[tuple[str, ...]] = ("sharding", "stages", "schedule")
    provides: ClassVar[tuple[str, ...]] = ("memory",)
    budget_fraction: float = 1.0
    """Fraction of the target's usable device memory the plan may use."""
    enforce: bool = True
    """False: never raise; a rank that fits under no allowed mode gets the last one tried (full, or the fixed
    mode), and the plan's memory says it does not fit (to price a published layout whose memory tricks moeplan
    does not model yet)."""

    def run(self, state: PlanState) -> PlanState:
        assert state.sharding is not None and state.stages is not None and state.schedule is not None
        budget = state.target.usable_memory_bytes * self.budget_fraction
        lay, asked = state.layout, state.strategy.recompute
        actions = state.schedule.actions
        modes = MODES if asked == "auto" else (asked,)
        stages = []
        for r in range(lay.pp):
            for mode in modes:  # cheapest first; stop at the first that fits
                mem = rank_memory(state, r, mode, actions[r])
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


def rank_memory(state: PlanState, rank: int, mode: Recompute, actions: tuple[str, ...]) -> StageMemory:
    """Memory of one device of PP rank ``rank`` under ``mode`` (bytes)."""
    assert state.sharding is not None and state.stages is not None
    lay, spec, costs = state.layout, state.graph.spec, state.sharding.layer_costs
    dense = expert = 0.0
    workspace = 0
    stage_bytes = {}
    for c, names in enumerate(state.stages.chunks[rank]):
        layer_costs = [costs[kind_of(spec, n)] for n in names]
        dense += sum(lc.params - lc.expert_params for lc in layer_costs)
        expert += sum(lc.expert_params for lc in layer_costs)
        workspace = max([workspace, *(lc.workspace_bytes for lc in layer_costs)])
        stage_bytes[state.stages.stage_of(rank, c)] = sum(saved_bytes(lc, mode) for lc in layer_costs)
    ms = model_state_bytes(dense_params=dense, expert_params=expert, dense_dp=lay.dp * lay.cp,
                           expert_dp=lay.expert_dp)
    act, in_flight = peak_live_bytes(actions, stage_bytes)
    return StageMemory(pp_rank=rank, recompute=mode, params_bytes=ms.params_bytes, grads_bytes=ms.grads_bytes,
                       optimizer_bytes=ms.optimizer_bytes, activation_bytes=act, workspace_bytes=workspace,
                       in_flight_microbatches=in_flight)
