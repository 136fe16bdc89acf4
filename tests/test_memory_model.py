"""The device memory model (cost_models/memory.py, docs/memory.md §6–§7): model states by the recipe's precision,
FSDP, communication buffers, the budget, Megatron-LM's recompute modules, FP8 storage, and the search's estimate
equal to the ``plan-memory`` pass on every rank."""
from __future__ import annotations

from collections import Counter

import pytest

from moeplan.compile import compile_model
from moeplan.compiler import DEFAULT_PIPELINE, Pipeline, run_pipeline, with_option
from moeplan.cost_models.memory import (GIB, budget_bytes, comm_buffer_bytes, deepep_bytes, fsdp_gathered_bytes,
                                        fsdp_state_bytes, model_state_bytes)
from moeplan.cost_models.saved_tensors import module_ops
from moeplan.cost_models.step import dp_collectives, step_sync_groups
from moeplan.errors import InfeasibleError, PlanError
from moeplan.estimate import estimate_memory, model_cost
from moeplan.ir import LayerKind, named_layers
from moeplan.layout import Layout
from moeplan.passes.plan_memory import _tensors
from moeplan.plan import MEMORY_TERMS
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.state import PlanState, Precision, Strategy
from moeplan.targets import RuntimeSupport, load_target
from moeplan.trace import trace_model
from test_cli import assert_one_line_error, moeplan
from test_output import piped

TINY = load_spec("tiny-pangu")
UP_TO_MEMORY = "shard,partition-stages,place-experts,schedule,plan-memory{enforce=false}"


def _per_param(**prec) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per parameter for 1 dense parameter over a DP group of 8."""
    ms = model_state_bytes(dense_params=1.0, expert_params=0.0, dense_dp=8, expert_dp=1, param_bytes=2,
                           precision=Precision(**prec))
    return ms.params_bytes, ms.grads_bytes, ms.optimizer_bytes


def test_model_states_follow_megatrons_flags():
    """Megatron-LM's bytes per parameter (docs/memory.md §6): 6 + 12/d by default, 4 + 12/d with bf16 gradients,
    6 + 8/d with bf16 moments, 18 without the distributed optimizer; an fp32 model has no master copy unless its
    runtime copies anyway (moeplan's, with its fp32 gradient and norm-weight shards)."""
    assert _per_param() == (2, 4, 12 / 8)
    assert _per_param(grad_dtype="bf16") == (2, 2, 12 / 8)
    assert _per_param(moments_dtype="bf16") == (2, 4, 8 / 8)
    assert sum(_per_param(distributed_optimizer=False)) == 18
    fp32 = model_state_bytes(dense_params=1.0, expert_params=0.0, dense_dp=8, expert_dp=1, param_bytes=4)
    assert (fp32.params_bytes, fp32.grads_bytes, fp32.optimizer_bytes) == (4, 4, 8 / 8)
    ours = model_state_bytes(dense_params=1.0, expert_params=0.0, dense_dp=8, expert_dp=1, param_bytes=4,
                             runtime=RuntimeSupport(master_copy="always", grad_shard_copy=True,
                                                    norm_weight_shard=True))
    assert (ours.params_bytes, ours.grads_bytes, ours.optimizer_bytes) == (4, 4 + 4 / 8, 16 / 8)
    experts = model_state_bytes(dense_params=0.0, expert_params=1.0, dense_dp=8, expert_dp=2, param_bytes=2)
    assert experts.optimizer_bytes == 12 / 2  # routed experts shard over the expert-DP group


def test_fsdp_shards_every_state_and_gathers_two_layers_or_the_stage():
    lay = Layout(tp=1, pp=1, vpp=1, ep=2, etp=1, cp=2, dp=8, micro_batch=1, global_batch=16, seq_len=64, dp_shard=4)
    assert (lay.fsdp_group, lay.expert_fsdp_group) == (8, 4)
    ms = fsdp_state_bytes(dense_params=8.0, expert_params=4.0, layout=lay, precision=Precision())
    assert (ms.params_bytes, ms.grads_bytes, ms.optimizer_bytes) == (4 * 2, 4 * 2, 8 * 2)  # 1 + 1 parameters
    h100 = load_target("h100")
    state = run_pipeline(PlanState(graph=trace_model(TINY, seq_len=64), target=h100, layout=lay, strategy=Strategy()),
                         Pipeline.parse("shard").passes)[0]
    costs = state.sharding.layer_costs
    layers = [costs[LayerKind.MOE]] * 3 + [costs[LayerKind.DENSE]]
    params = sorted((lc.params for lc in layers), reverse=True)
    assert fsdp_gathered_bytes(layers, lay, Precision(), h100) == (params[0] + params[1]) * 2 + params[0] * 4
    pp2 = Layout(**{**lay.__dict__, "pp": 2, "dp": 4, "dp_shard": 4})  # under PP the stage stays gathered and
    assert fsdp_gathered_bytes(layers, pp2, Precision(), h100) == sum(params) * (2 + 4)  # accumulates its grads
    moe = costs[LayerKind.MOE]  # each layer gathers before its forward and backward and reduce-scatters after
    kinds = Counter((c.kind, c.phase) for c in moe.comm if c.comm_class == "dp")
    assert kinds == {("all_gather", "fwd"): 2, ("all_gather", "bwd"): 2, ("reduce_scatter", "bwd"): 2}
    assert sum(s.name.startswith("fsdp_") for s in moe.program.fwd + moe.program.bwd_input) == 6


def test_fsdp_under_pp_syncs_once_per_step_as_torch_pipelining_does():
    """torch.distributed.pipelining runs every stage backward without gradient sync or resharding and
    reduce-scatters after the last micro-batch: no per-layer FSDP collective, one reduce-scatter and one all-gather
    per chunk over the FSDP groups, whatever the number of micro-batches."""
    lay = Layout(tp=1, pp=2, vpp=1, ep=2, etp=1, cp=1, dp=4, micro_batch=1, global_batch=16, seq_len=64, dp_shard=4)
    assert step_sync_groups(lay) == ((4, 1), (2, 2))
    assert step_sync_groups(Layout(**{**lay.__dict__, "pp": 1, "dp": 8, "dp_shard": 8})) == ((1, 1), (1, 2))
    assert step_sync_groups(Layout(**{**lay.__dict__, "dp_shard": 1})) == ((4, 1), (2, 2))  # ZeRO-1: expert-DP
    out = {}
    for gb in (16, 64):
        layout = Layout(**{**lay.__dict__, "global_batch": gb})
        state = run_pipeline(PlanState(graph=trace_model(TINY, seq_len=64), target=load_target("h100"),
                                       layout=layout, strategy=Strategy()), Pipeline.parse(DEFAULT_PIPELINE).passes)[0]
        costs = state.sharding.layer_costs.values()
        assert not any(c.comm_class == "dp" for lc in costs for c in lc.comm)
        assert not any(s.name.startswith("fsdp_") for lc in costs for s in lc.program.fwd + lc.program.bwd_input)
        dp = [dp_collectives(state, r) for r in range(lay.pp)]
        assert [sorted(o.kind for o in ops) for ops in dp] == [["all_gather", "all_gather", "reduce_scatter",
                                                                 "reduce_scatter"]] * 2
        out[gb] = state.prediction.comm["dp"]["total_s"]
    assert out[16] == pytest.approx(out[64], rel=1e-12)  # 4x the micro-batches, the same FSDP traffic


def test_deepep_buffers_are_deepeps_size_hints():
    """DeepEP v1.2.1's size hints as Megatron-LM asks for them (docs/targets.md): DeepSeek-V3 at EP 64 over 8
    nodes, Qwen3-235B at EP 32 over 4, plus the 32 MiB workspace."""
    assert deepep_bytes(hidden_size=7168, group_size=64, stride=1, devices_per_node=8) == \
        377_677_824 + 367_550_720 + 2**25
    assert deepep_bytes(hidden_size=4096, group_size=32, stride=1, devices_per_node=8) == \
        236_117_504 + 105_109_120 + 2**25
    lay = Layout(tp=1, pp=1, vpp=1, ep=8, etp=1, cp=1, dp=8, micro_batch=1, global_batch=8, seq_len=64)
    h100 = load_target("h100")
    per = h100.memory_overheads
    flat = comm_buffer_bytes(lay, Strategy(dispatcher="flat"), h100, hidden_size=64)
    assert flat == 2 * per.communicator_bytes + 7 * per.all_to_all_peer_bytes  # dp and ep groups; 7 NVLink peers
    dedup = comm_buffer_bytes(lay, Strategy(dispatcher="dedup"), h100, hidden_size=64)
    assert dedup == 2 * per.communicator_bytes + deepep_bytes(hidden_size=64, group_size=8, stride=1,
                                                              devices_per_node=8)


def test_the_budget_is_never_above_the_device_and_every_check_quotes_it(tmp_path):
    h100 = load_target("h100")
    assert budget_bytes(h100) == h100.memory_bytes
    assert budget_bytes(h100, 60) == 60 * GIB
    with pytest.raises(ValueError, match="must not exceed the device memory of h100"):
        budget_bytes(h100, 500)
    err = moeplan("compile", "tiny-pangu", "--target", "h100", "--devices", "8", "--memory-budget", "500")
    assert_one_line_error(err, 2, "memory_budget=500.0")
    assert "device memory of h100" in err.stderr
    with pytest.raises(PlanError, match="must not exceed"):
        compile_model(spec=TINY, target=h100, num_devices=8, workers=1, fixed=Fixed(global_batch=8, seq_len=64),
                      pipeline=with_option(DEFAULT_PIPELINE, "plan-memory", "budget_gib", 500))
    # a budget below what the model states and the overheads take refuses every layout before any is priced
    with pytest.raises(InfeasibleError, match=r"model states and overheads alone, the budget is 1\.0 GiB"):
        compile_model(spec=TINY, target=h100, num_devices=8, workers=1, fixed=Fixed(global_batch=8, seq_len=64),
                      pipeline=with_option(DEFAULT_PIPELINE, "plan-memory", "budget_gib", 1.0))


@pytest.mark.parametrize("target, layout, strategy", [
    ("h100", dict(tp=1, pp=2, vpp=1, ep=2, etp=1, cp=1, dp=4, micro_batch=1), Strategy("1f1b")),
    ("h100", dict(tp=2, pp=2, vpp=2, ep=2, etp=1, cp=1, dp=2, micro_batch=1),
     Strategy("interleaved", overlap=frozenset({"fb"}))),
    ("h800", dict(tp=1, pp=2, vpp=2, ep=4, etp=1, cp=1, dp=4, micro_batch=1),
     Strategy("dualpipev", dispatcher="dedup", overlap=frozenset({"fb", "pp"}))),
    ("h100", dict(tp=1, pp=4, vpp=2, ep=1, etp=1, cp=1, dp=2, micro_batch=1), Strategy("zbv")),
    ("ascend-910b", dict(tp=1, pp=2, vpp=1, ep=2, etp=1, cp=2, dp=2, micro_batch=2), Strategy("1f1b")),
    ("cpu", dict(tp=1, pp=2, vpp=2, ep=1, etp=1, cp=1, dp=2, micro_batch=1), Strategy("interleaved")),
])
def test_the_search_estimate_equals_the_memory_pass_on_every_rank(target, layout, strategy):
    """One model: the estimate splits the stages and counts the micro-batches in flight as the passes do, so it
    prices every rank as ``plan-memory`` does, the same bytes under the same recompute mode (docs/memory.md §6)."""
    tgt = load_target(target)
    graph = trace_model(TINY, seq_len=64)
    lay = Layout(**layout, global_batch=32, seq_len=64)
    budget = budget_bytes(tgt)
    kinds = tuple(k for _, k in named_layers(TINY))
    cost = model_cost(graph, lay, tgt, strategy.dispatcher, strategy.overlap, Counter(kinds), {}, strategy.precision)
    est = estimate_memory(lay, strategy, cost, kinds=kinds, target=tgt, budget=budget, hidden_size=TINY.hidden_size)
    state = run_pipeline(PlanState(graph=graph, target=tgt, layout=lay, strategy=strategy),
                         Pipeline.parse(UP_TO_MEMORY).passes)[0]
    for e, p in zip(est.ranks(), state.memory.stages, strict=True):
        assert e.recompute == p.recompute and e.in_flight_microbatches == p.in_flight_microbatches
        for _, f in MEMORY_TERMS:
            assert getattr(e, f) == pytest.approx(getattr(p, f), rel=1e-12), f
    assert est.peak_bytes == pytest.approx(max(p.total_bytes for p in state.memory.stages), rel=1e-12)


def _layer_tensors(target: str, kind: LayerKind, **precision):
    tgt = load_target(target, training_dtype="fp8" if precision.pop("fp8", False) else None)
    lay = Layout(tp=1, pp=1, vpp=1, ep=1, etp=1, cp=1, dp=1, micro_batch=1, global_batch=8, seq_len=64)
    state = run_pipeline(PlanState(graph=trace_model(TINY, seq_len=64), target=tgt, layout=lay,
                                   strategy=Strategy(precision=Precision(**precision))), Pipeline.parse("shard").passes)[0]
    return _tensors(state, kind, {})


def test_megatron_recompute_modules_rerun_their_ops():
    """Each of Megatron-LM's recompute modules re-runs its own ops (cost_models/saved_tensors.py module_ops)."""
    moe = _layer_tensors("h100", LayerKind.MOE)
    label = {o.name: o.label for o in moe.ops}
    assert {label[n] for n in module_ops(moe, {"core_attn"})} == {"core attention"}
    assert {label[n] for n in module_ops(moe, {"layernorm"})} == {"norm"}
    up = {label[n] for n in module_ops(moe, {"mla_up_proj"})}
    assert {"q latent norm", "kv latent norm", "q up-projection", "kv up-projection", "rotary (q)",
            "rotary (k)"} <= up and "core attention" not in up and "o-projection" not in up
    assert {label[n] for n in module_ops(moe, {"moe_act"})} == {"routed experts SwiGLU activation"}
    whole = {label[n] for n in module_ops(moe, {"moe"})}
    assert {"router and probabilities", "permute and dispatch", "combine and unpermute", "shared expert up"} <= whole
    assert {label[n] for n in module_ops(moe, {"shared_experts"})} == {
        "shared expert gate", "shared expert up", "shared expert down", "shared expert SwiGLU activation"}
    assert not module_ops(moe, {"mlp"})  # Megatron-LM's mlp is the dense MLP only
    dense = _layer_tensors("h100", LayerKind.DENSE)
    assert {o.label for o in dense.ops if o.name in module_ops(dense, {"mlp"})} == {
        "FFN gate", "FFN up", "FFN down", "SwiGLU activation"}
    assert not module_ops(_layer_tensors("cpu", LayerKind.MOE), {"moe_act"})  # the eager experts are one op


def test_fp8_keeps_what_only_gemms_save_at_half():
    """Under FP8 a GEMM keeps an FP8 copy of its input: a tensor only GEMMs keep weighs half, one an op in bf16
    keeps too weighs 1.5 times; --fp8-activation-input halves the SwiGLU's input as well."""
    def weights(**kw) -> dict[str, int]:
        return {t.name: t.bytes for t in _layer_tensors("h100", LayerKind.DENSE, **kw).tensors}

    bf16, fp8, act = weights(), weights(fp8=True), weights(fp8=True, fp8_activation_input=True)
    assert fp8["mul"] == bf16["mul"] / 2  # the SwiGLU output: only the down projection keeps it
    assert fp8["mlp_w1"] == bf16["mlp_w1"] and act["mlp_w1"] == bf16["mlp_w1"] / 2  # the SwiGLU's input
    assert fp8["input_norm"] == bf16["input_norm"] / 2  # only the q / kv down projections keep it
    assert fp8["hidden"] == bf16["hidden"]  # the norm keeps the layer input in bf16


def test_the_plan_lists_every_term_and_the_headroom():
    plan = compile_model(spec=TINY, target=load_target("h100"), num_devices=8, workers=1,
                         fixed=Fixed(global_batch=8, seq_len=64, tp=1, pp=2, ep=2)).plan
    for m in plan.memory.ranks:
        assert m.total_bytes == pytest.approx(sum(getattr(m, f) for _, f in MEMORY_TERMS), abs=len(MEMORY_TERMS))
        assert m.runtime_bytes == plan.target.memory_overheads.runtime_bytes > 0 and m.comm_buffer_bytes > 0
        assert m.allocator_bytes == pytest.approx(0.15 * (m.activation_bytes + m.working_set_bytes
                                                         + m.workspace_bytes + m.gathered_bytes), abs=1)
    assert plan.memory.budget_bytes == plan.target.memory_bytes
    out = piped("compile", "tiny-pangu", "--target", "h100", "--devices", "8", "--tp", "1", "--pp", "2",
                "--ep", "2", "--global-batch", "8", "--grad-dtype", "bf16")
    assert out.returncode == 0 and "headroom" in out.stdout and "grads bf16" in out.stdout
