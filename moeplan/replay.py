"""Replay a saved plan: rebuild the compiler state of its decisions on freshly traced and sharded costs, re-simulate
it (``moeplan simulate``), or record its step action by action for the views and ``moeplan compare``
(:func:`plan_timeline`). Reads only the plan; the compile driver (moeplan/compile.py) is not involved.
"""
from __future__ import annotations

from typing import NamedTuple

from moeplan.cost_models.step import run_settings, stage_programs
from moeplan.cost_models.timeline import simulate
from moeplan.cost_models.timeline_types import StageProgram, Timeline
from moeplan.passes.shard import ShardPass
from moeplan.passes.simulate import SimulatePass
from moeplan.plan import Plan, PlanLayerDecisions
from moeplan.state import (ExpertPlacement, GroupChoice, MemoryPlan, OpDecision, PlanState, Precision, Schedule,
                           StageMemory, StagePlan, Strategy)
from moeplan.trace import trace_model


def _state_decisions(d: PlanLayerDecisions) -> GroupChoice:
    return GroupChoice(d.chunk, d.kind, tuple(d.recomputed), tuple(d.swapped), d.kept_bytes, d.swapped_bytes,
                       d.recompute_s, d.remade_bytes, d.recompute_flops,
                       tuple(OpDecision(o.op, o.label, o.decision, o.saved_bytes, o.flag) for o in d.ops))


def strategy_of(plan: Plan) -> Strategy:
    return Strategy(schedule=plan.schedule.kind, dispatcher=plan.comm.dispatcher,
                    overlap=frozenset(plan.comm.overlap), recompute=plan.memory.recompute,
                    recompute_modules=tuple(plan.memory.recompute_modules),
                    precision=Precision(**plan.memory.precision.model_dump()))


def state_from_plan(plan: Plan) -> PlanState:
    """Rebuild the plan's decisions on freshly traced and sharded costs (for re-simulation)."""
    spec = plan.model.spec
    state = PlanState(graph=trace_model(spec, seq_len=plan.layout.seq_len), target=plan.target,
                      layout=plan.layout.as_layout(), strategy=strategy_of(plan))
    state = ShardPass().run(state)
    stages = StagePlan(chunks=tuple(tuple(tuple(c) for c in r) for r in plan.stages.chunks),
                       chunk_time_s=tuple(tuple(r) for r in plan.stages.chunk_time_s),
                       imbalance=plan.stages.imbalance, empty_layers=tuple(plan.stages.empty_layers),
                       reason=plan.stages.reason, placement=plan.stages.placement)
    memory = MemoryPlan(budget_bytes=plan.memory.budget_bytes, stages=tuple(
        StageMemory(pp_rank=m.pp_rank, recompute=m.recompute, params_bytes=m.params_bytes,
                    grads_bytes=m.grads_bytes, optimizer_bytes=m.optimizer_bytes,
                    activation_bytes=m.activation_bytes, workspace_bytes=m.workspace_bytes,
                    working_set_bytes=m.working_set_bytes, comm_buffer_bytes=m.comm_buffer_bytes,
                    runtime_bytes=m.runtime_bytes, allocator_bytes=m.allocator_bytes,
                    gathered_bytes=m.gathered_bytes, in_flight_microbatches=m.in_flight_microbatches,
                    decisions=tuple(_state_decisions(d) for d in m.decisions),
                    exposed_swap_s=tuple((x[0], x[1]) for x in m.exposed_swap_s), solve_status=m.solve_status,
                    solve_gap=m.solve_gap, solve_reason=m.solve_reason) for m in plan.memory.ranks))
    return state.with_(stages=stages, memory=memory,
                       experts=ExpertPlacement(shards=tuple(tuple(s) for s in plan.experts.shards),
                                               groups_aligned=plan.experts.groups_aligned),
                       schedule=Schedule(kind=plan.schedule.kind,
                                         actions=tuple(tuple(a) for a in plan.schedule.actions)))


def resimulate(plan: Plan) -> PlanState:
    """Re-simulate a saved plan's decisions; returns the state with a fresh prediction."""
    return SimulatePass().run(state_from_plan(plan))


class SimulatedStep(NamedTuple):
    """A saved plan's step as simulated: the compiler state rebuilt from the plan (:func:`state_from_plan`), the
    program of each pipeline stage (``cost_models.step.stage_programs``) and the :class:`Timeline`."""

    state: PlanState
    programs: list[StageProgram]
    timeline: Timeline


def plan_timeline(plan: Plan) -> SimulatedStep:
    """The simulated step of a saved plan's schedule, every action and segment recorded
    (``simulate(..., detail=True)``: :class:`~moeplan.cost_models.timeline_types.Event` per action,
    :class:`~moeplan.cost_models.timeline_types.SegmentEvent` per compute segment and collective, seconds from the step
    start). The DP collectives and the optimizer step that follow the pipeline are not in it (passes/simulate.py
    prices them apart). Raises PlanError when the schedule does not simulate."""
    state = state_from_plan(plan)
    programs, _ = stage_programs(state)
    return SimulatedStep(state, programs, simulate(state.schedule.actions, stages=programs,
                                                   settings=run_settings(state), detail=True))
