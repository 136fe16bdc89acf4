"""The model family: tiny-pangu trains on CPU, pieces are deterministic, routing and dispatch are right."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moeplan.errors import SpecError
from moeplan.flops import count_params
from moeplan.models import (GroupedExperts, MoE, MoEModel, RMSNorm, TokenPermute, TokenUnpermute, build_layer,
                            expert_capacity, group_limited_experts, init_weights_, layer_names, moge_experts,
                            parse_layer_name, tied_parameters)
from moeplan.models.layers import _RMSNormFunction
from moeplan.ir import LayerKind
from moeplan.spec import load_spec
from moeplan.trace import LeafTracer


def _batch(vocab: int, *, batch: int = 2, seq: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def test_tiny_forward_backward_reaches_every_parameter(tiny):
    model = MoEModel(tiny, seed=0)
    tokens, labels = _batch(tiny.vocab_size)
    losses = model.losses(tokens, labels)
    loss = losses.total(0.3)
    loss.backward()
    assert torch.isfinite(loss)
    assert abs(losses.main.item() - math.log(tiny.vocab_size)) < 0.1  # near-uniform logits at init
    assert len(losses.mtp) == tiny.num_mtp_layers
    assert loss.item() == pytest.approx(losses.main.item() + 0.3 * losses.mtp[0].item(), rel=1e-6)
    assert torch.equal(model(tokens, labels), loss.detach())
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()
               or p.grad.abs().sum() == 0]
    assert missing == []


def test_pieces_reproduce_the_full_model_weights(tiny):
    model = MoEModel(tiny, seed=7)
    assert {n for n, _ in model.named_parameters()} >= {"embedding.word.weight", "head.output.weight"}
    for name in layer_names(tiny):
        piece = build_layer(tiny, name, seed=7)
        for local, param in piece.named_parameters():
            assert torch.equal(param, model.get_parameter(f"{name}.{local}")), f"{name}.{local}"
    other = build_layer(tiny, "layers.1", seed=8)
    assert not torch.equal(other.attn.q_a.weight, model.get_parameter("layers.1.attn.q_a.weight"))


def test_mtp_copies_are_tied_and_named(tiny):
    assert tied_parameters(tiny) == (("mtp.0.embedding.word.weight", "embedding.word.weight"),
                                     ("mtp_head.0.output.weight", "head.output.weight"))
    model = MoEModel(tiny)
    assert model.mtp[0].embedding.word.weight is model.embedding.word.weight
    assert model.mtp_head[0].output.weight is model.head.output.weight


def test_expert_slice_matches_the_full_layer(tiny):
    full = build_layer(tiny, "layers.2", seed=5).mlp.experts
    part = GroupedExperts(num_experts=3, hidden=tiny.hidden_size, ffn=tiny.moe_ffn_size, equal_split=False,
                          first_expert=2)
    init_weights_(part, prefix="layers.2.mlp.experts", seed=5)
    for name in ("w1", "w2", "w3"):
        assert torch.equal(getattr(part, name), getattr(full, name)[2:5])


def test_layer_names_and_kinds(tiny):
    names = layer_names(tiny, num_empty=1)
    assert names == ("embedding", "layers.0", "layers.1", "layers.2", "layers.3", "mtp.0", "mtp_head.0", "head",
                     "empty.0")
    assert [parse_layer_name(tiny, n)[0] for n in names] == [
        LayerKind.EMBEDDING, LayerKind.DENSE, LayerKind.MOE, LayerKind.MOE, LayerKind.MOE, LayerKind.MTP,
        LayerKind.MTP_HEAD, LayerKind.HEAD, LayerKind.EMPTY]
    for bad in ("layers.4", "mtp.1", "decoder", "layers.x"):
        with pytest.raises(SpecError, match="layer="):
            build_layer(tiny, bad)


def test_718b_builds_on_meta_with_exact_counts():
    spec = load_spec("pangu-ultra-moe-718b")
    model = MoEModel(spec, device="meta")
    counts = count_params(spec)
    assert sum(p.numel() for p in model.parameters()) == counts.total + counts.mtp
    assert model.layers[10].mlp.experts.w1.shape == (256, 7680, 2048)


def test_traced_layer_equals_eager(tiny):
    for name, inputs in (("layers.2", (torch.randn(2, 16, tiny.hidden_size),)),
                         ("mtp.0", (torch.randn(2, 16, tiny.hidden_size), _batch(256, seq=16)[0])),
                         ("head", (torch.randn(2, 16, tiny.hidden_size), _batch(256, seq=16)[1]))):
        layer = build_layer(tiny, name)
        gm = torch.fx.GraphModule(layer, LeafTracer().trace(layer))
        torch.testing.assert_close(gm(*inputs), layer(*inputs))


# ---- routing -------------------------------------------------------------------------------------------------------
def test_moge_picks_top_k_over_groups_in_every_group():
    scores = torch.rand(50, 16, generator=torch.Generator().manual_seed(0)).softmax(-1)
    idx = moge_experts(scores, top_k=8, num_groups=4)
    per_group = torch.stack([(idx // 4 == g).sum(-1) for g in range(4)], dim=-1)
    assert (per_group == 2).all()
    for g in range(4):  # the chosen two are the group's two best
        best = scores[:, 4 * g:4 * g + 4].topk(2).indices + 4 * g
        chosen = idx[idx // 4 == g].view(50, 2)
        assert torch.equal(chosen.sort(-1).values, best.sort(-1).values)


def test_moge_router_in_a_model(make_spec):
    spec = make_spec(router="softmax", routing="moge", num_expert_groups=2, top_k=4)
    moe = build_layer(spec, "layers.1").mlp
    idx, gates = moe.router(torch.randn(40, spec.hidden_size))
    assert ((idx < 4).sum(-1) == 2).all() and ((idx >= 4).sum(-1) == 2).all()
    assert torch.allclose(gates.sum(-1), torch.full((40,), spec.router_scale))


def test_group_limited_routing_matches_brute_force():
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(30, 16, generator=gen)
    idx = group_limited_experts(scores, top_k=4, num_groups=4, topk_groups=2)
    for t in range(30):
        group_score = scores[t].view(4, 4).topk(2).values.sum(-1)
        groups = set(group_score.topk(2).indices.tolist())
        allowed = torch.tensor([e for e in range(16) if e // 4 in groups])
        expected = allowed[scores[t, allowed].topk(4).indices]
        assert set(idx[t].tolist()) == set(expected.tolist())


# ---- dispatch and experts ------------------------------------------------------------------------------------------
def _naive_moe(moe: MoE, x: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """Slot by slot in token order; an expert past its capacity drops the slot."""
    idx, gates = moe.router(x)
    ex, out = moe.experts, torch.zeros_like(x)
    seen = [0] * ex.num_experts
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            seen[e] += 1
            if capacity is None or seen[e] <= capacity:
                y = (torch.nn.functional.silu(x[t] @ ex.w1[e]) * (x[t] @ ex.w3[e])) @ ex.w2[e]
                out[t] += gates[t, j] * y
    return out + moe.shared(x)


@pytest.mark.parametrize("capacity_factor", [None, 0.5, 2.0])
def test_moe_matches_naive_reference(make_spec, capacity_factor):
    spec = make_spec(capacity_factor=capacity_factor)
    moe = build_layer(spec, "layers.1", seed=2).mlp
    x = torch.randn(48, spec.hidden_size, generator=torch.Generator().manual_seed(4))
    cap = None if capacity_factor is None else expert_capacity(num_slots=48 * spec.top_k,
                                                               num_experts=spec.num_experts,
                                                               capacity_factor=capacity_factor)
    torch.testing.assert_close(moe(x.unsqueeze(0)).squeeze(0), _naive_moe(moe, x, cap), rtol=1e-5, atol=1e-6)


def test_capacity_drops_tokens_over_capacity():
    permute = TokenPermute(num_experts=4, capacity_factor=1.0)
    x = torch.randn(8, 6)
    idx = torch.tensor([[0, 1]] * 8)  # every token to experts 0 and 1: 8 slots each, capacity ceil(16/4) = 4
    rows, tokens_per_expert, row_of_slot = permute(x, idx)
    assert rows.shape == (16, 6) and tokens_per_expert.tolist() == [4, 4, 0, 0]
    assert (row_of_slot.view(8, 2)[4:] == 16).all()  # tokens 4..7 dropped
    assert torch.equal(rows[:4], x[:4]) and torch.equal(rows[4:8], x[:4]) and (rows[8:] == 0).all()
    out = TokenUnpermute()(rows * 10, row_of_slot, torch.ones(8, 2))
    assert torch.equal(out[:4], 20 * x[:4]) and (out[4:] == 0).all()


def test_grouped_experts_batched_path_equals_per_expert_loop():
    loop = GroupedExperts(num_experts=4, hidden=8, ffn=6, equal_split=False)
    init_weights_(loop, prefix="e", seed=0)
    batched = GroupedExperts(num_experts=4, hidden=8, ffn=6, equal_split=True)
    batched.load_state_dict(loop.state_dict())
    rows, counts = torch.randn(20, 8), torch.full((4,), 5)
    torch.testing.assert_close(batched(rows, counts), loop(rows, counts))


def test_rms_norm_backward_is_exact():
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNormFunction.apply(a, b, 1e-6), (x, w))
    norm = RMSNorm(8, eps=1e-6).double()
    torch.testing.assert_close(norm(x), nn.functional.rms_norm(x, (8,), norm.weight, 1e-6))


def test_aux_loss_trains_the_router_only_through_backward(make_spec):
    x = torch.randn(1, 32, 64, generator=torch.Generator().manual_seed(0))
    grads, outs = [], []
    for coeff in (0.0, 0.1):
        layer = build_layer(make_spec(), "layers.1", seed=1, aux_loss_coeff=coeff)
        out = layer(x)
        out.sum().backward()
        grads.append(layer.mlp.router.gate.weight.grad)
        outs.append(out.detach())
    assert torch.equal(outs[0], outs[1]) and not torch.allclose(grads[0], grads[1])


@pytest.mark.parametrize("changes", [
    dict(attention="gqa", num_heads=4, num_kv_heads=2, head_dim=16, q_lora_rank=0, kv_lora_rank=0,
         qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0, router="softmax", routing="moge",
         num_expert_groups=2, num_mtp_layers=0, sandwich_norm=False, tie_embeddings=True),
    dict(q_lora_rank=0, routing="group_limited", num_expert_groups=4, topk_groups=2, capacity_factor=1.25),
])
def test_model_variants_train(make_spec, changes):
    spec = make_spec(**changes)
    model = MoEModel(spec, seed=0)
    tokens, labels = _batch(spec.vocab_size, seq=32)
    loss = model(tokens, labels)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
    counts = count_params(spec)
    assert sum(p.numel() for p in model.parameters()) == counts.total + counts.mtp
