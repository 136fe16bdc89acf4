"""Compile a model for a target into a Plan: trace, search layouts, run the pass pipeline, build the plan (a saved
plan is replayed by moeplan/replay.py).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

from moeplan import __version__
from moeplan.compiler import DEFAULT_PIPELINE, Pipeline
from moeplan.mechanisms import ordered
from moeplan.passes.shard import ShardPass
from moeplan.passes.simulate import SimulatePass
from moeplan.plan import (SCHEMA_VERSION, Plan, PlanCollective, PlanComm, PlanCommClass, PlanExpertLoad, PlanExperts,
                          PlanLayerCost, PlanLayerDecisions, PlanLayerLoad, PlanLayout, PlanMemory, PlanModel,
                          PlanOpDecision, PlanPrecision, PlanPrediction, PlanProvenance, PlanRankMemory,
                          PlanRebalance, PlanSchedule, PlanSharding, PlanStages)
from moeplan.search import Fixed, SearchResult, search
from moeplan.search_eval import Evaluated, Progress
from moeplan.spec import ModelSpec
from moeplan.state import CommOp, GroupChoice, PlanState
from moeplan.targets import Target
from moeplan.trace import trace_model


@dataclass(frozen=True)
class CompileResult:
    plan: Plan
    result: SearchResult
    compile_s: float


def compile_model(*, spec: ModelSpec, target: Target, num_devices: int, fixed: Fixed,
                  pipeline: str | Pipeline = DEFAULT_PIPELINE, candidates: int | None = 4, workers: int | None = None,
                  keep: int = 1, progress: Progress | None = None, ray: str | None = None) -> CompileResult:
    """Trace ``spec``, search layouts for ``num_devices`` devices of ``target`` and return the best plan;
    ``result.ranked`` holds the ``keep`` fastest of those evaluated (``candidates``: how many best estimates go
    through the full pipeline; None: the exact search of moeplan.search). ``pipeline``: a :class:`Pipeline` or its
    text; the plan records it as ``str(pipeline)``. ``progress``, ``ray``: the search's (moeplan.search.search).

    Raises SpecError / LayoutError / PlanError for bad input and InfeasibleError when no layout fits in memory.
    """
    t0 = time.perf_counter()
    if not isinstance(pipeline, Pipeline):
        pipeline = Pipeline.parse(pipeline)  # reject a bad pipeline before any work
    # the plan's spec states the shape it is compiled for (load_plan checks they agree)
    spec = spec.with_shape(seq_len=fixed.seq_len, global_batch=fixed.global_batch)
    graph = trace_model(spec, seq_len=fixed.seq_len)
    trace_s = time.perf_counter() - t0
    result = search(graph=graph, target=target, num_devices=num_devices, fixed=fixed, pipeline=pipeline,
                    candidates=candidates, workers=workers, keep=keep, progress=progress, ray=ray)
    best = result.ranked[0].state
    balanced = balanced_step_s(best) if best.load is not None else None
    compile_s = time.perf_counter() - t0
    plan = plan_from_state(result.ranked[0], pipeline=str(pipeline), compile_s=compile_s, trace_s=trace_s,
                           balanced_step_s=balanced)
    return CompileResult(plan=plan, result=result, compile_s=compile_s)


def balanced_step_s(state: PlanState) -> float:
    """The step of ``state``'s plan under balanced routing, seconds: every decision kept (stages, placement, memory
    plan, schedule), the layer costs priced again without the load trace (``expert_load = expert_replication =
    1``) and the step simulated again. What the plan's ``experts.load.balanced_step_s`` says, so that the step
    against it is what the imbalance costs."""
    balanced = replace(state.layout, expert_load=1.0, expert_replication=1.0)
    again = SimulatePass().run(ShardPass().run(state.with_(layout=balanced, load=None)))
    return again.prediction.step_time_s  # type: ignore[union-attr]


def _collective(c: CommOp) -> PlanCollective:
    return PlanCollective(comm_class=c.comm_class, kind=c.kind, phase=c.phase, bytes=c.bytes,
                          group_size=c.group_size, tier=c.tier, time_s=c.time_s, wire_intra_bytes=round(c.wire_intra_bytes),
                          wire_inter_bytes=round(c.wire_inter_bytes))


def _plan_decisions(d: GroupChoice) -> PlanLayerDecisions:
    return PlanLayerDecisions(chunk=d.chunk, kind=d.kind, recomputed=list(d.rerun), swapped=list(d.swapped),
                              kept_bytes=d.kept_bytes, swapped_bytes=d.swapped_bytes, recompute_s=d.recompute_s,
                              remade_bytes=d.remade_bytes, recompute_flops=d.recompute_flops,
                              ops=[PlanOpDecision(op=o.op, label=o.label, decision=o.decision,
                                                  saved_bytes=o.saved_bytes, flag=o.flag) for o in d.ops])


def _plan_rebalance(st: PlanState) -> PlanRebalance | None:
    """The priced rebalances of the state's load (cost_models/rebalance.py); None when the placement stays."""
    from moeplan.cost_models.rebalance import rebalance_cost
    from moeplan.expert_load import moe_layer_name

    placed, model = st.experts.load, st.load  # type: ignore[union-attr]
    r = placed.rebalancing  # type: ignore[union-attr]
    if r is None:
        return None
    spec = st.graph.spec
    names = [moe_layer_name(spec, i) for i in model.trace.layers]  # type: ignore[union-attr]
    stage_layers = [[j for j, name in enumerate(names) if any(name in chunk for chunk in rank)]
                    for rank in st.stages.chunks]  # type: ignore[union-attr]
    costs = [rebalance_cost(spec=spec, layout=st.layout, target=st.target, precision=st.strategy.precision,
                            stage_layers=stage_layers, sent=sent, received=received)
             for sent, received in zip(r.sent, r.received)]
    k = max(len(costs), 1)
    return PlanRebalance(every=r.every, threshold=r.threshold, rebalances=len(costs),
                         moved_experts=sum(r.moved_experts) / k, sent_bytes=sum(c.sent_bytes for c in costs) / k,
                         seconds=sum(c.seconds for c in costs) / k, migrate_s=sum(c.migrate_s for c in costs) / k,
                         per_step_s=sum(c.seconds for c in costs) / r.window_steps)


def _plan_load(st: PlanState, balanced_step_s: float | None) -> PlanExpertLoad | None:
    """The plan's record of the load trace the state was priced with (None without one)."""
    placed, model = st.experts.load if st.experts else None, st.load
    if placed is None or model is None:
        return None
    steps = model.trace.steps[model.window[0]:model.window[1]]  # type: ignore[index]
    return PlanExpertLoad(trace=model.path, source=model.trace.source, window=[steps[0], steps[-1]],
                          policy=placed.policy, replicas=placed.replicas,  # type: ignore[arg-type]
                          balanced_step_s=balanced_step_s if balanced_step_s is not None else 0.0,
                          layers=[PlanLayerLoad(layer=x.layer, shards=[list(s) for s in x.shards],
                                                imbalance=x.imbalance, balancedness=x.balancedness, cv=x.cv)
                                  for x in placed.layers], rebalance=_plan_rebalance(st))


def plan_from_state(ev: Evaluated, *, pipeline: str, compile_s: float, trace_s: float = 0.0,
                    balanced_step_s: float | None = None) -> Plan:
    """Build the Plan of a fully compiled state; ``balanced_step_s``: with a load trace, the step of the same plan
    under balanced routing (:func:`balanced_step_s`)."""
    st = ev.state
    assert st.sharding and st.stages and st.experts and st.memory and st.schedule and st.prediction
    lay, spec, pred = st.layout, st.graph.spec, st.prediction
    return Plan(
        schema_version=SCHEMA_VERSION,
        model=PlanModel(name=spec.name, fingerprint=spec.fingerprint(), spec=spec),
        target=st.target,
        layout=PlanLayout(tp=lay.tp, pp=lay.pp, vpp=lay.vpp, ep=lay.ep, etp=lay.etp, cp=lay.cp, dp=lay.dp,
                          micro_batch=lay.micro_batch, global_batch=lay.global_batch, seq_len=lay.seq_len,
                          num_devices=lay.world_size, num_microbatches=lay.num_microbatches,
                          sequence_parallel=lay.sequence_parallel, tp_extend_ep=lay.tp_extend_ep,
                          dp_shard=lay.dp_shard, expert_load=lay.expert_load,
                          expert_replication=lay.expert_replication),
        stages=PlanStages(placement=st.stages.placement, chunks=[[list(c) for c in r] for r in st.stages.chunks],
                          chunk_time_s=[list(r) for r in st.stages.chunk_time_s], imbalance=st.stages.imbalance,
                          empty_layers=list(st.stages.empty_layers), reason=st.stages.reason),
        sharding=PlanSharding(
            expert_shards=lay.expert_shards, expert_dp=lay.expert_dp, p2p=_collective(st.sharding.p2p),
            layers={k.value: PlanLayerCost(fwd_s=c.fwd_s, bwd_input_s=c.bwd_input_s, bwd_weight_s=c.bwd_weight_s,
                                           params=c.params, saved_bytes=c.saved_bytes,
                                           collectives=[_collective(x) for x in c.comm])
                    for k, c in st.sharding.layer_costs.items()}),
        experts=PlanExperts(shards=[list(s) for s in st.experts.shards], groups_aligned=st.experts.groups_aligned,
                            load=_plan_load(st, balanced_step_s)),
        memory=PlanMemory(budget_bytes=round(st.memory.budget_bytes), recompute=st.strategy.recompute,
                          recompute_modules=list(st.strategy.recompute_modules),
                          precision=PlanPrecision(**asdict(st.strategy.precision)), ranks=[
            PlanRankMemory(pp_rank=m.pp_rank, recompute=m.recompute, params_bytes=round(m.params_bytes),
                           grads_bytes=round(m.grads_bytes), optimizer_bytes=round(m.optimizer_bytes),
                           activation_bytes=round(m.activation_bytes), workspace_bytes=round(m.workspace_bytes),
                           working_set_bytes=round(m.working_set_bytes), comm_buffer_bytes=round(m.comm_buffer_bytes),
                           runtime_bytes=round(m.runtime_bytes), allocator_bytes=round(m.allocator_bytes),
                           gathered_bytes=round(m.gathered_bytes), total_bytes=round(m.total_bytes), in_flight_microbatches=m.in_flight_microbatches,
                           decisions=[_plan_decisions(d) for d in m.decisions],
                           exposed_swap_s=[list(x) for x in m.exposed_swap_s], solve_status=m.solve_status,
                           solve_gap=m.solve_gap, solve_reason=m.solve_reason)
            for m in st.memory.stages]),
        schedule=PlanSchedule.of(st.schedule.kind, st.schedule.actions),
        comm=PlanComm(dispatcher=st.strategy.dispatcher,
                      overlap=ordered(st.strategy.overlap)),
        prediction=PlanPrediction(step_time_s=pred.step_time_s, tokens_per_s=pred.tokens_per_s, mfu=pred.mfu,
                                  hfu=pred.hfu, bubble=pred.bubble, peak_memory_bytes=[round(b) for b in pred.peak_memory_bytes],
                                  exposed_comm_s=dict(pred.exposed_comm_s),
                                  model_flops_per_step=pred.model_flops_per_step,
                                  comm={c: PlanCommClass(**{**v, "intra_bytes": round(v["intra_bytes"]),
                                                             "inter_bytes": round(v["inter_bytes"])})
                                        for c, v in pred.comm.items()},
                                  host_wait_s=pred.host_wait_s, optimizer_s=pred.optimizer_s),
        provenance=PlanProvenance(moeplan_version=__version__, pipeline=pipeline,
                                  pass_s={"trace": trace_s, **dict(ev.pass_s)}, compile_s=compile_s))
