"""The tracer: graph structure, per-node costs measured on meta, hints, and agreement with the closed form."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moeplan.describe import traced_flops_per_token
from moeplan.errors import SpecError
from moeplan.flops import count_params, flops_per_token, flops_per_token_with_mtp
from moeplan.ir import LayerKind, OpKind, ShardHint
from moeplan.models import build_layer
from moeplan.spec import load_spec
from moeplan.trace import _example_inputs, representative_layer, trace_model

SEQ = 64


@pytest.fixture(scope="module")
def graph(tiny):
    return trace_model(tiny, seq_len=SEQ)


def _op(layer, name):
    return next(o for o in layer.ops if o.name == name)


def test_sequence_kinds_and_empty(tiny, graph):
    assert graph.layer_sequence == (LayerKind.EMBEDDING, LayerKind.DENSE, LayerKind.MOE, LayerKind.MOE,
                                    LayerKind.MOE, LayerKind.MTP, LayerKind.MTP_HEAD, LayerKind.HEAD)
    assert set(graph.layers) == set(graph.layer_sequence) | {LayerKind.EMPTY}
    empty = graph.layer(LayerKind.EMPTY)
    assert empty.gm is None and empty.ops == () and empty.input_bytes == SEQ * tiny.hidden_size * 2
    assert graph.layer(LayerKind.EMBEDDING).input_bytes == SEQ * 8  # int64 token ids
    for kind in graph.layer_sequence:
        layer = graph.layer(kind)
        assert isinstance(layer.gm, torch.fx.GraphModule)
        assert [o.name for o in layer.ops] == [n.name for n in layer.gm.graph.nodes
                                               if n.op not in ("placeholder", "output", "get_attr")]
        assert all(o.layer_kind == kind for o in layer.ops)
        assert [n.meta["moeplan"] for n in layer.gm.graph.nodes if "moeplan" in n.meta] == list(layer.ops)
    assert trace_model(tiny, seq_len=SEQ) is graph  # cached


@pytest.mark.parametrize("seq_len", [0, -1, 2.5])
def test_bad_seq_len_is_a_spec_error(tiny, seq_len):
    with pytest.raises(SpecError, match="seq_len="):
        trace_model(tiny, seq_len=seq_len)


@pytest.mark.parametrize("kind", [LayerKind.DENSE, LayerKind.MOE, LayerKind.MTP, LayerKind.HEAD])
def test_node_flops_sum_to_the_whole_layer_count(tiny, graph, kind):
    """Per-node fwd/dX/dW (attention un-halved) add up to one FlopCounterMode over the whole layer on meta."""
    module = build_layer(tiny, representative_layer(tiny, kind), device="meta", dtype=torch.bfloat16)
    inputs = tuple(t.requires_grad_() if t.is_floating_point() else t for t in _example_inputs(tiny, kind, SEQ))
    with FlopCounterMode(display=False) as fwd:
        out = module(*inputs)
    wrt = [t for t in inputs if t.requires_grad] + list(module.parameters())
    with FlopCounterMode(display=False) as bwd:
        torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
    ops = graph.layer(kind).ops
    assert sum(o.fwd_flops * (2 if o.causal else 1) for o in ops) == fwd.get_total_flops()
    assert sum(o.bwd_input_flops * (2 if o.causal else 1) + o.bwd_weight_flops for o in ops) == bwd.get_total_flops()


def test_linear_and_attention_annotations(tiny, graph):
    moe = graph.layer(LayerKind.MOE)
    q_b = _op(moe, "attn_q_b")
    n_qk = tiny.num_heads * tiny.qk_head_dim
    assert q_b.op_kind == OpKind.MATMUL and q_b.matmul_mnk == (SEQ, n_qk, tiny.q_lora_rank)
    assert q_b.fwd_flops == q_b.bwd_input_flops == q_b.bwd_weight_flops == 2 * SEQ * n_qk * tiny.q_lora_rank
    assert q_b.param_count == n_qk * tiny.q_lora_rank and q_b.saved_inputs == ("attn_q_a_norm",)
    core = _op(moe, "attn_core")
    full = 2 * SEQ * SEQ * tiny.num_heads * (tiny.qk_head_dim + tiny.v_head_dim)
    assert core.op_kind == OpKind.ATTENTION and core.causal
    assert core.fwd_flops == full / 2 and core.bwd_input_flops == full and core.bwd_weight_flops == 0
    assert len(core.saved_inputs) == 3  # q, k, v; internally: output + logsumexp (+ rng state)
    assert core.saved_bytes >= core.output_bytes + tiny.num_heads * SEQ * 4


def test_saved_tensors_and_views(tiny, graph):
    dense = graph.layer(LayerKind.DENSE)
    norm = _op(dense, "input_norm")
    assert norm.op_kind == OpKind.NORM and norm.saved_inputs == ("hidden",) and norm.saved_bytes == SEQ * 4
    view = next(o for o in dense.ops if o.name.startswith("transpose"))
    assert view.bytes_read == view.bytes_written == 0 and view.output_bytes > 0
    moe = graph.layer(LayerKind.MOE)
    experts = next(o for o in moe.ops if o.op_kind == OpKind.GROUPED_MATMUL)
    routed = SEQ * tiny.top_k
    assert experts.matmul_mnk == (routed // tiny.num_experts, tiny.moe_ffn_size, tiny.hidden_size)
    assert experts.fwd_flops == 2 * 3 * routed * tiny.hidden_size * tiny.moe_ffn_size
    # production kernels (a fused SwiGLU): the gate/up output and the activation output; eager: w1 x, w3 x, silu,
    # product (bf16)
    assert experts.saved_bytes == 3 * routed * tiny.moe_ffn_size * 2
    assert experts.saved_act_input_bytes == 2 * routed * tiny.moe_ffn_size * 2
    assert experts.saved_gemm_input_bytes == routed * tiny.moe_ffn_size * 2
    assert experts.eager_saved_bytes == 4 * routed * tiny.moe_ffn_size * 2
    silu, mul = _op(dense, "silu"), _op(dense, "mul")  # the dense SwiGLU: the product keeps gate and up
    assert silu.saved_inputs == () and silu.eager_saved_inputs == ("mlp_w1",)
    assert mul.saved_inputs == ("mlp_w1", "mlp_w3") and set(mul.eager_saved_inputs) == {"mlp_w3", "silu"}
    combine = next(o for o in moe.ops if o.op_kind == OpKind.COMBINE)
    assert combine.saved_bytes == 0 and combine.eager_saved_bytes > 0  # no expert outputs kept in production
    assert moe.saved_bytes() > dense.saved_bytes() > 0


def test_shard_hints_and_op_kinds(graph):
    moe = graph.layer(LayerKind.MOE)
    hints = {o.module_path: o.shard for o in moe.ops}
    assert hints["attn.q_a"] == hints["attn.kv_a"] == hints["attn.rope_k"] == ShardHint.REPLICATED
    assert hints["attn.q_b"] == hints["attn.core"] == hints["attn.o_proj"] == hints["mlp.shared.w2"] == ShardHint.TP
    assert hints["mlp.experts"] == hints["mlp.dispatch"] == hints["mlp.combine"] == ShardHint.EXPERT
    assert hints["input_norm"] == hints["mlp.router"] == ShardHint.SP
    kinds = [o.op_kind for o in moe.ops]
    for kind in (OpKind.ATTENTION, OpKind.ROUTER, OpKind.DISPATCH, OpKind.GROUPED_MATMUL, OpKind.COMBINE):
        assert kinds.count(kind) == 1
    head = graph.layer(LayerKind.HEAD)
    assert [o.op_kind for o in head.ops].count(OpKind.LOSS) == 1
    assert _op(head, "output").shard == ShardHint.TP and _op(head, "norm").shard == ShardHint.SP


def test_layer_parameter_counts_add_up(tiny, graph):
    counts = count_params(tiny)
    main = [k for k in graph.layer_sequence if k not in (LayerKind.MTP, LayerKind.MTP_HEAD)]
    assert sum(graph.layer(k).param_count for k in main) == counts.total
    assert sum(graph.layer(k).activated_param_count for k in main) == counts.activated
    mtp, mtp_head = graph.layer(LayerKind.MTP), graph.layer(LayerKind.MTP_HEAD)
    assert mtp.param_count + mtp_head.param_count == counts.mtp
    assert mtp.shared_param_count == mtp_head.shared_param_count == tiny.vocab_size * tiny.hidden_size
    moe = graph.layer(LayerKind.MOE)
    assert moe.expert_param_count == tiny.num_experts * 3 * tiny.hidden_size * tiny.moe_ffn_size
    assert sum(o.param_count for o in moe.ops) == moe.param_count


@pytest.mark.parametrize("name", ["deepseek-v3", "pangu-ultra-moe-718b", "pangu-pro-moe-72b"])
def test_traced_flops_agree_with_closed_form(name):
    spec = load_spec(name)
    graph = trace_model(spec, seq_len=4096)
    traced, closed = traced_flops_per_token(graph), flops_per_token(spec, seq_len=4096)
    assert abs(traced / closed - 1) < 0.01
    with_mtp = traced_flops_per_token(graph, include_mtp=True)
    assert abs(with_mtp / flops_per_token_with_mtp(spec, seq_len=4096) - 1) < 0.01
    assert (with_mtp > traced) == (spec.num_mtp_layers > 0)


def test_kernel_counts_match_an_eager_run(tiny, graph):
    """The per-node aten-op counts add up to about what eager PyTorch dispatches for the whole layer (each node runs
    alone on fresh leaves, so a few views and copies differ), and the backward counts cover autograd's per-node
    work, fan-out additions and one AccumulateGrad per parameter."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    layer = build_layer(tiny, representative_layer(tiny, LayerKind.DENSE), device="meta", dtype=torch.bfloat16)
    (x,) = _example_inputs(tiny, LayerKind.DENSE, SEQ)
    x.requires_grad_(True)
    with Count() as fwd:
        out = layer(x)
    grad = torch.ones_like(out)
    with Count() as bwd:
        out.backward(grad)
    dense = graph.layer(LayerKind.DENSE)
    assert abs(sum(o.fwd_kernels for o in dense.ops) - fwd.n) <= 0.15 * fwd.n
    traced_bwd = (sum(o.bwd_input_kernels + o.bwd_weight_kernels for o in dense.ops) + dense.grad_fanout_adds
                  + dense.param_tensor_count)
    assert abs(traced_bwd - bwd.n) <= 0.15 * bwd.n
    q_b = _op(graph.layer(LayerKind.MOE), "attn_q_b")
    assert q_b.fwd_kernels >= 1 and q_b.bwd_input_kernels >= 1 and q_b.bwd_weight_kernels >= 1
    assert dense.param_tensor_count == sum(1 for _ in layer.parameters())
    assert dense.grad_fanout_adds >= 2  # the residual stream feeds a norm and an add, twice


def test_eager_saved_set_and_integer_bytes(tiny, graph):
    moe = graph.layer(LayerKind.MOE)
    core = _op(moe, "attn_core")
    probs = tiny.num_heads * SEQ * SEQ * 2  # bf16 s×s probabilities per head, kept by the math path
    assert core.eager_saved_bytes >= probs > core.saved_bytes
    router = next(o for o in moe.ops if o.op_kind == OpKind.ROUTER)
    assert 0 < router.saved_fixed_bytes <= router.saved_bytes  # the top-k indices are int64
    assert router.output_fixed_bytes >= SEQ * tiny.top_k * 8
    loss = next(o for o in graph.layer(LayerKind.HEAD).ops if o.op_kind == OpKind.LOSS)
    assert loss.saved_fixed_bytes == loss.saved_bytes >= SEQ * tiny.vocab_size * 4  # fp32 log-probabilities


@pytest.mark.parametrize("routing,top_k", [("group_limited", 2), ("moge", 4)])
def test_router_saves_what_backward_holds_every_time(make_spec, routing, top_k):
    """The group scores behind a grouped top-k are freed with their branch: the router keeps its fp32 scores
    (sigmoid output), the chosen indices (for the gather) and the renormalisation's operands, and nothing else —
    the same bytes on every trace (storage addresses are reused once a branch is freed)."""
    from moeplan.trace import trace_layer

    spec = make_spec(routing=routing, num_experts=8, top_k=top_k, num_expert_groups=4, topk_groups=2)
    seen = set()
    for _ in range(3):
        trace_layer(spec, LayerKind.DENSE, seq_len=SEQ)  # frees storages between the router traces
        router = next(o for o in trace_layer(spec, LayerKind.MOE, seq_len=SEQ).ops if o.op_kind == OpKind.ROUTER)
        seen.add(router.saved_bytes)
    k, e = spec.top_k, spec.num_experts
    assert seen == {SEQ * e * 4 + SEQ * k * 8 + SEQ * k * 4 + SEQ * 4}  # scores, indices, gates, their sum
