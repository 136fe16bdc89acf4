"""Numerics of the parallel layers: one forward/backward of a whole stage stack (pp = 1) on gloo against the
single-process MoEModel, float64, same seed and data.

Two process worlds are started once per module (2 and 4 ranks, torch.multiprocessing, forked from test_executor's fork
server); each runs several layouts in turn, rebuilding groups and modules per layout. Every rank compares its loss
with the reference loss of its micro-batch and every gradient it holds — the TP-replicated gradients first summed over
TP (the step's flat all-reduce, moeplan.runtime.parallel.all_reduce_grads), then dense gradients summed over dp_cp,
expert gradients over expert_dp, both divided by dp (the contract of moeplan.runtime.tensor_parallel.ParallelHead) —
with the matching shard of the reference gradient (mean loss over the DP micro-batches).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeplan.compile import compile_model
from moeplan.errors import PlanError
from moeplan.models import DEFAULT_MTP_WEIGHT, ModelLosses, MoEModel
from moeplan.plan import Plan
from moeplan.runtime.build import LayerDict, build_rank_modules, rank_parameters, tp_replicated_params
from moeplan.ir import LayerKind, named_layers
from moeplan.models import TokenPermute
from moeplan.runtime.expert_parallel import capacity_keep
from moeplan.runtime.parallel import CommLog, all_reduce_grads
from moeplan.runtime.context_parallel import cp_positions, local_positions
from moeplan.runtime.groups import check_layout_for_runtime, group_ranks, make_groups, rank_coords
from moeplan.search import Fixed
from moeplan.spec import ModelSpec, load_spec
from moeplan.targets import load_target

from test_executor import forkserver  # noqa: E402

SEED = 3
TOL = 1e-5
TINY = load_spec("tiny-pangu")
# capacity factor (drop-and-pad), softmax router, group-limited routing, auxiliary loss
TINY_DROP = TINY.model_copy(update=dict(capacity_factor=1.0, router="softmax", routing="group_limited",
                                        num_expert_groups=4, topk_groups=2))
# GQA with one KV head (replicated k/v projections under TP), MoGE routing, drop-and-pad
TINY_GQA = TINY.model_copy(update=dict(attention="gqa", num_kv_heads=1, head_dim=16, q_lora_rank=0, kv_lora_rank=0,
                                       qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0, routing="moge",
                                       num_expert_groups=2, capacity_factor=1.5, sandwich_norm=False))


@dataclass(frozen=True)
class Case:
    name: str
    plan: Plan
    aux_loss_coeff: float = 0.0


def _plan(spec: ModelSpec, devices: int, **degrees: int) -> Plan:
    spec = ModelSpec.model_validate(spec.model_dump())  # re-validate the edited copies
    degrees = dict(dict(pp=1, vpp=1, micro_batch=2), **degrees)
    fixed = Fixed(global_batch=8, seq_len=32, **degrees)
    return compile_model(spec=spec, target=load_target("cpu", devices_per_node=4), num_devices=devices,
                         fixed=fixed, workers=1).plan


def _cases_2() -> list[Case]:
    return [Case("tp2_sp", _plan(TINY, 2, tp=2, etp=2, ep=1, cp=1)),
            Case("tp2_extend_ep", _plan(TINY, 2, tp=2, etp=1, ep=1, cp=1)),
            Case("ep2_dp2", _plan(TINY, 2, tp=1, etp=1, ep=2, cp=1)),
            Case("cp2", _plan(TINY, 2, tp=1, etp=1, ep=1, cp=2)),
            Case("ep2_cp2_drop_grouplimited_aux", _plan(TINY_DROP, 2, tp=1, etp=1, ep=2, cp=2), aux_loss_coeff=0.01),
            Case("pp2_vpp2", _plan(TINY, 2, tp=1, etp=1, ep=1, cp=1, pp=2, vpp=2, micro_batch=1))]


def _cases_4() -> list[Case]:
    return [Case("tp2_etp2_ep2_dp2", _plan(TINY, 4, tp=2, etp=2, ep=2, cp=1)),
            Case("gqa_moge_drop_tp2_cp2_ep2", _plan(TINY_GQA, 4, tp=2, etp=1, ep=2, cp=2), aux_loss_coeff=0.01),
            Case("tp4_etp2", _plan(TINY, 4, tp=4, etp=2, ep=1, cp=1))]  # etp groups inside the TP group


# ---- the rank side ---------------------------------------------------------------------------------------------------
def _batch(spec: ModelSpec, plan: Plan, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    lay = plan.layout
    gen = torch.Generator().manual_seed(100 + dp_rank)
    seq = torch.randint(0, spec.vocab_size, (lay.micro_batch, lay.seq_len + 1), generator=gen)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _stage_loss(layers, spec: ModelSpec, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Chain one stage holding every layer, as MoEModel.losses does."""
    hidden = layers["embedding"](tokens)
    for i in range(spec.num_layers):
        hidden = layers[f"layers.{i}"](hidden)
    mtp_losses, mtp_hidden = [], hidden
    for j in range(spec.num_mtp_layers):
        mtp_hidden = layers[f"mtp.{j}"](mtp_hidden, tokens)
        mtp_losses.append(layers[f"mtp_head.{j}"](mtp_hidden, labels))
    return ModelLosses(main=layers["head"](hidden, labels), mtp=tuple(mtp_losses)).total(DEFAULT_MTP_WEIGHT)


def _reduce_grads(params, groups, dp: int) -> None:
    for p in params:
        group = groups.expert_dp if p.expert else groups.dp_cp
        if group is not None:
            dist.all_reduce(p.param.grad, group=group)
        p.param.grad /= dp


def _reference(model: MoEModel, case: Case, dp: int) -> list[float]:
    losses = [model(*_batch(case.plan.model.spec, case.plan, d)) for d in range(dp)]
    (sum(losses) / dp).backward()
    return [x.item() for x in losses]


def _shard_of(model: MoEModel, p, attr: str) -> torch.Tensor:
    full = getattr(model.get_parameter(p.name), attr)
    if p.shard.experts is not None:
        full = full[list(p.shard.experts)]
    return p.shard.take(full)


def _max_rel_err(params, model: MoEModel, attr: str) -> tuple[float, str]:
    worst, worst_name = 0.0, ""
    for p in params:
        ref = _shard_of(model, p, attr)
        err = float((getattr(p.param, attr) - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        if err > worst:
            worst, worst_name = err, p.name
    return worst, worst_name


def _planned_calls(plan: Plan, case: Case) -> dict[str, int]:
    """The collectives the plan prices for one forward and backward of the whole model, by class/kind/phase, plus
    what this test adds: with an auxiliary loss (not a plan option) under TP or CP, each MoE layer gathers its
    expert counts over tp×cp (moeplan.runtime.expert_parallel.ParallelRouter)."""
    calls: dict[str, int] = {}
    for _, kind in named_layers(plan.model.spec):
        for c in plan.sharding.layers[kind.value].collectives:
            key = f"{c.comm_class}/{c.kind}/{c.phase}"
            calls[key] = calls.get(key, 0) + 1
        if case.aux_loss_coeff and plan.layout.tp * plan.layout.cp > 1 and kind in (LayerKind.MOE, LayerKind.MTP):
            calls["ep/all_gather/fwd"] = calls.get("ep/all_gather/fwd", 0) + 1
    return calls


def _check(case: Case, rank: int) -> dict:
    t0 = time.perf_counter()
    plan, spec = case.plan, case.plan.model.spec
    coords, groups = make_groups(plan.layout, rank, timeout=timedelta(seconds=60))
    comm = CommLog()
    modules = build_rank_modules(plan, coords, groups, seed=SEED, device=torch.device("cpu"), dtype=torch.float64,
                                 aux_loss_coeff=case.aux_loss_coeff, comm_log=comm)
    params = rank_parameters(modules, spec)
    model = MoEModel(spec, SEED, dtype=torch.float64, aux_loss_coeff=case.aux_loss_coeff)
    out = dict(init_err=_max_rel_err(params, model, "data")[0], num_params=len(params),
               stages={str(k): list(v.keys()) for k, v in modules.items()})
    if plan.layout.pp > 1:  # pipelines are the executor's: check placement and initial weights only
        return out
    loss = _stage_loss(modules[coords.pp_rank], spec, *_batch(spec, plan, coords.dp_rank))
    loss.backward()
    replicated = tp_replicated_params(modules)
    tp_bytes = all_reduce_grads(replicated, groups.tp)
    _reduce_grads(params, groups, plan.layout.dp)
    ref_losses = _reference(model, case, plan.layout.dp)
    ref_loss = ref_losses[coords.dp_rank]
    worst, worst_name = _max_rel_err(params, model, "grad")
    return dict(out, loss=loss.item(), ref_loss=ref_loss, loss_err=abs(loss.item() - ref_loss) / abs(ref_loss),
                grad_err=worst, worst_param=worst_name, wall_s=time.perf_counter() - t0,
                comm_bytes={"/".join(k): v for k, v in comm.bytes.items()},
                comm_calls={"/".join(k): v for k, v in comm.calls.items()}, planned_calls=_planned_calls(plan, case),
                tp_grad_bytes=tp_bytes,
                replicated_numel=sum(p.numel() for p in replicated))


def _worker(rank: int, world: int, init_file: str, cases: list[Case], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        results = {case.name: _check(case, rank) for case in cases}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _run_world(world: int, cases: list[Case], tmp: Path) -> dict[str, list[dict]]:
    t0 = time.perf_counter()
    mp.start_processes(_worker, args=(world, str(tmp / "init"), cases, str(tmp)), nprocs=world, join=True,
                       start_method=forkserver())
    per_rank = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]
    out = {c.name: [per_rank[r][c.name] for r in range(world)] for c in cases}
    print(f"\n{world}-rank world: {time.perf_counter() - t0:.1f} s wall (spawn + {len(cases)} layouts)")
    for name, ranks in out.items():
        if "loss" not in ranks[0]:
            continue
        print(f"  {name}: loss {ranks[0]['loss']:.6f}, max loss err {max(r['loss_err'] for r in ranks):.2e}, "
              f"max grad err {max(r['grad_err'] for r in ranks):.2e}, {max(r['wall_s'] for r in ranks):.2f} s")
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict[str, list[dict]]:
    return _run_world(2, _cases_2(), tmp_path_factory.mktemp("world2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict[str, list[dict]]:
    return _run_world(4, _cases_4(), tmp_path_factory.mktemp("world4"))


def _assert_matches(ranks: list[dict]) -> None:
    for r, res in enumerate(ranks):
        assert res["init_err"] == 0.0, f"rank {r}: initial weights differ from MoEModel(spec, seed)"
        assert res["loss_err"] < TOL, f"rank {r}: loss {res['loss']} vs reference {res['ref_loss']}"
        assert res["grad_err"] < TOL, f"rank {r}: gradient of {res['worst_param']} off by {res['grad_err']:.2e}"
        assert res["num_params"] > 0


@pytest.mark.parametrize("name", [c for c in ("tp2_sp", "tp2_extend_ep", "ep2_dp2", "cp2",
                                                "ep2_cp2_drop_grouplimited_aux")])
def test_two_rank_layouts_match_single_process(world2, name):
    _assert_matches(world2[name])


@pytest.mark.parametrize("name", ["tp2_etp2_ep2_dp2", "gqa_moge_drop_tp2_cp2_ep2", "tp4_etp2"])
def test_four_rank_layouts_match_single_process(world4, name):
    _assert_matches(world4[name])


def test_pp2_vpp2_ranks_hold_their_chunks_with_the_global_initial_weights(world2):
    ranks, plan = world2["pp2_vpp2"], _plan(TINY, 2, tp=1, etp=1, ep=1, cp=1, pp=2, vpp=2, micro_batch=1)
    for r, res in enumerate(ranks):
        assert res["init_err"] == 0.0
        assert res["stages"] == {str(c * 2 + r): plan.stages.chunks[r][c] for c in range(2)}
    held = [n for res in ranks for names in res["stages"].values() for n in names]
    assert sorted(held) == sorted([n for n, _ in named_layers(TINY)] + plan.stages.empty_layers)


def test_capacity_keep_equals_token_permute():
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 8, (64, 2), generator=gen)
    keep = capacity_keep(idx, num_experts=8, capacity_factor=1.0)
    rows, counts, row_of_slot = TokenPermute(num_experts=8, capacity_factor=1.0)(torch.randn(64, 4), idx)
    assert torch.equal(keep.flatten(), row_of_slot < rows.shape[0])
    assert int(keep.sum()) == int(counts.sum()) < idx.numel()  # some slots are dropped


def test_comm_log_counts_the_documented_collectives(world2):
    b, s, h, k, f64 = 2, 32, 64, 2, 8
    moe_layers, decoder_layers = TINY.num_moe_layers + TINY.num_mtp_layers, TINY.num_layers + TINY.num_mtp_layers
    # EP 2 (dropless): per MoE layer forward, each rank exchanges counts [2 ranks, 4 experts] and dispatches its
    # b·s·k routed rows; the combine returns as many rows as were dispatched, summed over the two ranks
    ranks = world2["ep2_dp2"]
    assert sum(r["comm_bytes"]["ep/all_to_all/fwd"] for r in ranks) == moe_layers * 2 * (2 * 4 * 8
                                                                                       + 2 * b * s * k * h * f64)
    assert all(r["comm_bytes"]["ep/all_to_all/bwd"] == r["comm_bytes"]["ep/all_to_all/fwd"]
               - moe_layers * 2 * 4 * 8 for r in ranks)  # backward: the same rows, no counts exchange
    assert not any(key.startswith(("tp/", "cp/")) for r in ranks for key in r["comm_bytes"])
    # TP 2 + SP: one all-gather of the SP slice [b, s/2, h] per FFN (dense, or the shared expert) and per head
    # (main and MTP), per MLA attention one of its latents [b, s/2, q_lora + kv_lora + rope], plus per head the
    # cross-entropy's one gather of fp32 [b·s, 2] statistics; no per-use gradient all-reduce: the replicated
    # gradients go in one flat all-reduce after backward
    latents = TINY.q_lora_rank + TINY.kv_lora_rank + TINY.qk_rope_head_dim
    for res in world2["tp2_sp"]:
        heads = 1 + TINY.num_mtp_layers
        assert res["comm_bytes"]["tp/all_gather/fwd"] == ((decoder_layers + heads) * b * (s // 2) * h * f64
                                                          + decoder_layers * b * (s // 2) * latents * f64
                                                          + heads * b * s * 2 * 4)
        assert res["comm_calls"]["tp/all_gather/fwd"] == 2 * decoder_layers + 2 * heads
        # backward: the mirror of every forward reduce-scatter, plus the re-gather of the slice the column linears
        # of each FFN and head kept (gather_linears)
        assert res["comm_calls"]["tp/all_gather/bwd"] == (res["comm_calls"]["tp/reduce_scatter/fwd"]
                                                          + decoder_layers + heads)
        assert not any(key.startswith("tp/all_reduce") for key in res["comm_calls"])
        assert res["tp_grad_bytes"] == res["replicated_numel"] * f64 > 0
        # expert-TP after the all-to-all (Megatron-LM's order; the expert group is one rank here, so every routed
        # row stays): per MoE layer the per-expert row counts (int64) and the rank's b·(s/2)·k routed rows gathered
        # over etp
        assert res["comm_bytes"]["ep/all_gather/fwd"] == moe_layers * (b * (s // 2) * k * h + TINY.num_experts) * f64


def test_dp_ranks_see_different_losses(world2):
    ranks = world2["ep2_dp2"]
    assert ranks[0]["ref_loss"] != ranks[1]["ref_loss"]  # the two DP micro-batches differ, so the check has teeth


# ---- pure functions (no processes) -----------------------------------------------------------------------------------
def test_rank_coords_and_groups_follow_megatron_order():
    plan = _plan(TINY, 4, tp=2, etp=1, ep=2, cp=1)  # TP-extend-EP: the expert group is TP × EP = 4 ranks
    lay = plan.layout
    assert [rank_coords(lay, r).expert_rank for r in range(4)] == [0, 1, 2, 3]
    ranks = group_ranks(lay)
    assert ranks.tp == ((0, 1), (2, 3)) and ranks.dp == ((0, 2), (1, 3)) and ranks.expert == ((0, 1, 2, 3),)
    assert ranks.expert_dp == ((0,), (1,), (2,), (3,)) and ranks.pp == ((0,), (1,), (2,), (3,))
    etp = group_ranks(_plan(TINY, 4, tp=2, etp=2, ep=2, cp=1).layout)  # expert-TP: expert group over DP
    assert etp.expert == ((0, 2), (1, 3)) and etp.etp == ((0, 1), (2, 3)) and etp.expert_dp == ((0,), (1,), (2,), (3,))


def test_cp_positions_are_load_balanced_and_cover_the_sequence():
    assert cp_positions(16, cp=2, cp_rank=0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    every = torch.cat([local_positions(16, cp=2, cp_rank=c, tp=2, tp_rank=t) for c in range(2) for t in range(2)])
    assert sorted(every.tolist()) == list(range(16))
    assert local_positions(16, cp=2, cp_rank=1, tp=2, tp_rank=1).tolist() == [8, 9, 10, 11]


def test_runtime_refuses_tp_without_sequence_parallelism():
    layout = _plan(TINY, 2, tp=2, etp=2, ep=1, cp=1).layout.model_copy(update=dict(sequence_parallel=False))
    with pytest.raises(PlanError, match="sequence_parallel=False"):
        check_layout_for_runtime(layout)


def test_layer_dict_is_keyed_by_layer_names():
    layers = LayerDict()
    layers["layers.3"], layers["head"] = torch.nn.Identity(), torch.nn.Identity()
    assert list(layers) == ["layers.3", "head"] and "layers.3" in layers and "layers.4" not in layers
    assert isinstance(layers["layers.3"], torch.nn.Identity) and [n for n, _ in layers.items()] == list(layers.keys())


def test_rank_coords_rejects_rank_outside_layout():
    with pytest.raises(PlanError, match="rank=4"):
        rank_coords(_plan(TINY, 2, tp=2, etp=2, ep=1, cp=1).layout, 4)


@pytest.mark.parametrize("world,name", [("world2", c) for c in ("tp2_sp", "tp2_extend_ep", "ep2_dp2", "cp2",
                                                                  "ep2_cp2_drop_grouplimited_aux")]
                         + [("world4", c) for c in ("tp2_etp2_ep2_dp2", "gqa_moge_drop_tp2_cp2_ep2", "tp4_etp2")])
def test_collectives_run_are_the_ones_the_plan_prices(request, world, name):
    """One forward and backward runs, per (class, kind, phase), as many collectives as the plan's layers list —
    the embeddings' TP reduce-scatter, the cross-entropy's statistics gather, the expert-TP row-count gather and,
    under drop-and-pad, the gather of the chosen experts and the count exchange included, which the plan once left
    out."""
    for res in request.getfixturevalue(world)[name]:
        assert res["planned_calls"] and res["comm_calls"] == res["planned_calls"]
