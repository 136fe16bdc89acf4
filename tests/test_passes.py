"""Golden tests per pass on tiny-pangu: each pass's decision checked against numbers derived independently."""
import pytest

from moeplan.compiler import Pipeline, run_pipeline
from moeplan.cost_models.sharding import op_scale
from moeplan.cost_models.timeline_types import RunSettings
from moeplan.errors import InfeasibleError, PlanError
from moeplan.flops import flops_per_token
from moeplan.ir import LayerKind, named_layers
from moeplan.layout import Layout
from moeplan.passes.partition_stages import PartitionStagesPass, piece_time_s
from moeplan.passes.place_experts import PlaceExpertsPass
from moeplan.passes.plan_memory import PlanMemoryPass
from moeplan.passes.schedule import SchedulePass
from moeplan.passes.shard import ShardPass
from moeplan.spec import load_spec
from moeplan.state import PlanState, Strategy
from moeplan.targets import load_target
from moeplan.trace import trace_model

SPEC = load_spec("tiny-pangu")
GRAPH = trace_model(SPEC, seq_len=SPEC.seq_len)
CPU = load_target("cpu", devices_per_node=8)


def lay(**kw):
    base = dict(tp=1, pp=1, vpp=1, ep=1, etp=1, cp=1, dp=1, micro_batch=1, global_batch=8, seq_len=64)
    base.update(kw)
    return Layout(**base)


def state(**kw):
    return PlanState(graph=GRAPH, target=CPU, layout=lay(**kw))


def test_shard_scales_work_and_inserts_collectives():
    one = ShardPass().run(state()).sharding.layer_costs
    two = ShardPass().run(state(tp=2, etp=2)).sharding.layer_costs
    for kind in (LayerKind.DENSE, LayerKind.MOE):
        lg = GRAPH.layer(kind)
        expect = sum(op_scale(o, lay(tp=2, etp=2)) * (o.fwd_flops + o.bwd_input_flops + o.bwd_weight_flops)
                     for o in lg.ops)
        assert two[kind].executed_flops == pytest.approx(expect)
        assert two[kind].executed_flops < one[kind].executed_flops
        assert one[kind].comm == ()
    dense_tp = [c for c in two[LayerKind.DENSE].comm if c.comm_class == "tp"]
    # attention block and MLP block: all-gather + reduce-scatter, forward and backward; the MLP's column linears
    # gather their input again in backward (they keep the sequence-parallel slice)
    assert sorted((c.kind, c.phase) for c in dense_tp) == sorted(
        [(k, p) for k in ("all_gather", "reduce_scatter") for p in ("fwd", "bwd")] * 2 + [("all_gather", "bwd")])
    attn_ag, mlp_ag = [c for c in dense_tp if c.kind == "all_gather" and c.phase == "fwd"]
    assert CPU.dtype_bytes == 4  # the cpu emulator trains in fp32: message bytes are fp32
    assert mlp_ag.bytes == 1 * 64 * SPEC.hidden_size * 4 // 2  # b·s·h·4 / sp
    latents = SPEC.q_lora_rank + SPEC.kv_lora_rank + SPEC.qk_rope_head_dim  # MLA gathers its latents
    assert attn_ag.bytes == 1 * 64 * latents * 4 // 2


def test_shard_ep_dispatch_combine_and_params():
    st = ShardPass().run(state(dp=2, ep=2)).sharding.layer_costs[LayerKind.MOE]
    a2a = [c for c in st.comm if c.kind == "all_to_all"]
    assert len(a2a) == 5 and all(c.group_size == 2 for c in a2a)  # counts; dispatch + combine, fwd and bwd
    assert a2a[0].phase == "fwd" and a2a[0].bytes == 8 * SPEC.num_experts  # int64 count per expert
    assert a2a[1].bytes == 64 * SPEC.hidden_size * CPU.dtype_bytes * SPEC.top_k
    # the program: router → counts (the host waits) → dispatch → experts → combine → unpermute, in that order
    names = [s.name for s in st.program.fwd]
    assert names.index("route") < names.index("ep_counts") < names.index("dispatch") < names.index("experts") \
        < names.index("combine") < names.index("unpermute")
    counts = st.program.fwd[names.index("ep_counts")]
    assert counts.host_sync and st.program.fwd[names.index("dispatch")].async_by == "shared-expert"
    experts = st.program.fwd[names.index("experts")]
    assert names.index("dispatch") in experts.after
    lg = GRAPH.layer(LayerKind.MOE)
    assert st.expert_params == lg.expert_param_count // 2
    assert st.params == lg.param_count - lg.expert_param_count + lg.expert_param_count // 2


def test_partition_places_every_layer_once_in_order():
    s = PartitionStagesPass().run(ShardPass().run(state(pp=2, vpp=2, dp=1, global_batch=8)))
    plan = s.stages
    order = [n for stage in range(4) for n in plan.stage_layers(stage) if not n.startswith("empty.")]
    assert order == [n for n, _ in named_layers(SPEC)]
    times = [t for r in plan.chunk_time_s for t in r]
    assert plan.imbalance == pytest.approx(max(times) / (sum(times) / len(times)) - 1)
    costs = s.sharding.layer_costs
    settings = RunSettings(mechanisms=frozenset())  # the state's strategy overlaps nothing
    stage0 = sum(piece_time_s(costs[k], settings) for n, k in named_layers(SPEC) if n in plan.stage_layers(0))
    assert plan.chunk_time_s[0][0] == pytest.approx(stage0)
    assert "mtp.0 on stage" in plan.reason


def test_place_experts_contiguous():
    s = PlaceExpertsPass().run(ShardPass().run(state(dp=4, ep=4)))
    assert s.experts.shards == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_plan_memory_picks_cheapest_fitting_mode():
    base = SchedulePass().run(PartitionStagesPass().run(ShardPass().run(state(pp=2))))
    roomy = PlanMemoryPass().run(base).memory
    assert all(m.recompute == "none" for m in roomy.stages)
    need_none = max(m.total_bytes for m in roomy.stages)
    from moeplan.passes.plan_memory import rank_memory
    acts = base.schedule.actions
    sel = max(rank_memory(base, r, "selective", acts[r]).total_bytes for r in range(2))
    fullm = max(rank_memory(base, r, "full", acts[r]).total_bytes for r in range(2))
    assert fullm < sel < need_none
    budget_frac = (sel + fullm) / 2 / CPU.memory_bytes  # full fits, selective does not on the larger rank
    tight = PlanMemoryPass(budget_fraction=budget_frac).run(base).memory
    assert "full" in {m.recompute for m in tight.stages}
    with pytest.raises(InfeasibleError, match=r"needs [\d.]+ GiB per device even with full recompute") as info:
        PlanMemoryPass(budget_fraction=fullm / 4 / CPU.memory_bytes).run(base)
    # the figure as a number, for the search: the first rank that fits under no mode, at full recompute
    assert info.value.needs_bytes == rank_memory(base, 0, "full", acts[0]).total_bytes
    # in flight on rank 0 of 1F1B with 8 micro-batches and pp 2: 2 micro-batches
    assert roomy.stages[0].in_flight_microbatches == 2 and roomy.stages[1].in_flight_microbatches == 1
    # a fixed mode is honoured, and refused with the mode named when it does not fit
    fixed = PlanMemoryPass().run(base.with_(strategy=Strategy(recompute="full"))).memory
    assert {m.recompute for m in fixed.stages} == {"full"}
    with pytest.raises(InfeasibleError, match="with recompute 'none'"):
        PlanMemoryPass(budget_fraction=budget_frac).run(base.with_(strategy=Strategy(recompute="none")))
    loose = PlanMemoryPass(budget_fraction=budget_frac, enforce=False).run(base.with_(strategy=Strategy(
        recompute="none"))).memory  # priced anyway, the excess visible
    assert max(m.total_bytes for m in loose.stages) > loose.budget_bytes


def test_simulate_prediction_consistent():
    passes = Pipeline.parse("shard,partition-stages,place-experts,schedule,plan-memory,simulate").passes
    s, timings = run_pipeline(state(pp=2, dp=2, ep=2, global_batch=8), passes)
    p = s.prediction
    tokens = 8 * 64
    assert p.tokens_per_s == pytest.approx(tokens / p.step_time_s)
    assert p.mfu == pytest.approx(flops_per_token(SPEC, seq_len=64) * tokens / (p.step_time_s * 4 * CPU.cube_flops))
    assert 0 < p.bubble < 1 and p.hfu > p.mfu  # HFU counts MTP, router and recompute
    assert [t.name for t in timings] == [c.name for c in passes]
    comm = p.comm
    assert set(comm) >= {"ep", "pp", "dp"} and comm["ep"]["total_s"] > 0
    assert comm["ep"]["overlap_rate"] == pytest.approx(1 - comm["ep"]["exposed_s"] / comm["ep"]["total_s"])
    assert p.exposed_comm_s["ep"] == comm["ep"]["exposed_s"]


def test_pipeline_order_is_checked():
    with pytest.raises(PlanError, match="needs sharding"):
        Pipeline.parse("partition-stages,shard")
    with pytest.raises(PlanError, match="unknown pass"):
        Pipeline.parse("shard,nope")


def test_a_pipeline_prints_back_and_changes_as_an_object():
    text = ("shard,partition-stages{layer_layout=free},place-experts,schedule,"
            "plan-memory{budget_fraction=0.9,enforce=false},simulate")
    p = Pipeline.parse(text)
    assert str(p) == text and Pipeline.parse(str(p)) == p
    q = p.with_option("plan-memory", "budget_gib", 2.5).with_option("plan-memory", "enforce", True)
    assert str(q) == text.replace("enforce=false}", "enforce=true,budget_gib=2.5}") and str(p) == text
    assert (q.passes[4].budget_gib, q.passes[4].enforce, q.passes[4].budget_fraction) == (2.5, True, 0.9)
    body, last = q.split_final("simulate")
    assert last is q.passes[-1] and body == q.passes[:-1] and q.split_final("shard") == (q.passes, None)
    with pytest.raises(PlanError, match="has no place-experts pass"):
        Pipeline.parse("shard").with_option("place-experts", "policy", "x")
    with pytest.raises(PlanError, match="'nope' is not an option of plan-memory"):
        p.with_option("plan-memory", "nope", 1)
    # issue 34: nan and inf are no option's value (budget_gib=nan ended in "needs 0.0 GiB", time_limit_s=nan ran)
    for option in ("budget_fraction=inf", "budget_fraction=nan", "budget_gib=nan", "time_limit_s=nan",
                   "time_limit_s=-inf"):
        with pytest.raises(PlanError, match=rf"pipeline=plan-memory\{{{option}\}}: must be a finite number"):
            Pipeline.parse(f"shard,partition-stages,place-experts,schedule,plan-memory{{{option}}}")


def test_partition_uniform_pads_with_empty_layers():
    sharded = ShardPass().run(state(pp=2, vpp=2))
    plan = PartitionStagesPass(layer_layout="uniform").run(sharded).stages
    slot_prefixes = ("layers.", "mtp.", "empty.")
    counts = {sum(n.startswith(slot_prefixes) for n in plan.stage_layers(s)) for s in range(4)}
    real = SPEC.num_layers + SPEC.num_mtp_layers
    capacity = -(-real // 4)
    assert counts == {capacity} and len(plan.empty_layers) == 4 * capacity - real
    assert "empty layer(s) fill the chunks" in plan.reason
    free = PartitionStagesPass(layer_layout="free").run(sharded).stages
    assert free.empty_layers == () and max(t for r in free.chunk_time_s for t in r) <= max(
        t for r in plan.chunk_time_s for t in r) + 1e-12


def test_simulate_optimizer_tail_on_an_eager_target():
    """On the eager cpu target the optimizer tail adds the runtime's per-tensor and per-buffer kernels and, with
    more than one rank, the clipping norm's all-reduce; an "op" target with the same figures has neither kernels."""
    from moeplan.cost_models import step as sim
    from moeplan.cost_models.comm import collective_time_s

    ready, _ = run_pipeline(state(pp=2), Pipeline.parse("shard,partition-stages,place-experts,schedule,plan-memory").passes)
    op_target = CPU.model_copy(update=dict(launch=CPU.launch.model_copy(update=dict(granularity="op"))))
    eager_s = sim.optimizer_s(ready, 0)
    op_s = sim.optimizer_s(ready.with_(target=op_target), 0)
    names = [n for chunk in ready.stages.chunks[0] for n in chunk]
    tensors = sum(GRAPH.layer(k).param_tensor_count for n, k in named_layers(SPEC) if n in names)
    kernels = tensors * sim.OPTIMIZER_KERNELS_PER_TENSOR + sim.OPTIMIZER_BUFFERS * sim.OPTIMIZER_KERNELS_PER_BUFFER
    assert eager_s - op_s == pytest.approx(kernels * CPU.launch.forward_kernel_s)
    norm = collective_time_s(kind="all_reduce", bytes=sim.NORM_BYTES, group_size=2, tier="intra", target=CPU)
    params = sum(ready.sharding.layer_costs[k].params for n, k in named_layers(SPEC) if n in names)
    adam = params * sim.ADAM_BYTES_PER_PARAM * CPU.dtype_bytes / 2 / (CPU.hbm_bandwidth_bytes_per_s
                                                                      * CPU.efficiency.memory)
    assert op_s == pytest.approx(norm + adam) and norm > 0  # pp 2, dp 1: no gradient reduction, one norm
