"""The EP MoE block's debts of issue 12 (moeplan/runtime/expert_parallel.py), each against the single-process run.

1. Auxiliary-loss scaling. Megatron-LM's rule: the load-balance loss is computed per micro-batch and its gradient
   scaled like the LM loss (``MoEAuxLossAutoScaler.set_loss_scale(1/num_microbatches)`` in
   megatron/core/pipeline_parallel/schedules.py, then the DP mean). The single-process reference therefore
   accumulates the global batch's micro-batches with ``loss/n`` and the routers' ``aux_loss_scale = 1/n``. With
   ``num_microbatches > 1`` per DP rank the unscaled gradient (scale 1, the old runtime) is off; the scaled one
   matches in loss and in every gradient over DP 2, CP 2 and TP 2 layouts.
2. Expert-TP in Megatron-LM's order (all-to-all first, then the etp all-gather): the EP all-to-all carries each
   rank's own routed rows only — the same bytes at etp 2 as at etp 1, where gathering over etp first sent etp
   times as many — with unchanged losses and gradients.
3. Shared experts beside the dispatch (``shared-expert`` overlap): the same losses, gradients and tallied bytes,
   and the shared experts run after the token all-to-all is posted and before it is waited for.
"""
from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch

from moeplan.compile import compile_model
from moeplan.plan import save_plan
from moeplan.runtime.data import global_batch
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.targets import load_target

from test_executor import LR, launch_function  # noqa: E402

STEPS = 3
COEFF = 0.01  # the auxiliary loss weight of both sides
MICRO_BATCH = 2  # the aux loss is per micro-batch, so every layout here uses the same micro-batch size
TOL = 1e-4
SPEC = load_spec("tiny-pangu")
SHARED = frozenset({"shared-expert"})

#: name -> (devices, fixed degrees, overlap, legacy: run the routers with the old unscaled aux gradient)
LAYOUTS_2 = {
    "dp2_ep2": (dict(tp=1, cp=1, ep=2), None, False),
    "dp2_ep2_unscaled": (dict(tp=1, cp=1, ep=2), None, True),
    "dp2_ep2_shared_overlap": (dict(tp=1, cp=1, ep=2), SHARED, False),
    "cp2_ep2": (dict(tp=1, cp=2, ep=2), None, False),
}
LAYOUTS_4 = {
    "tp2_ep2_etp2": (dict(tp=2, cp=1, ep=2, etp=2), None, False),
    "tp2_ep2_etp1": (dict(tp=2, cp=1, ep=2, etp=1), None, False),
    "tp2_ep2_etp2_shared_overlap": (dict(tp=2, cp=1, ep=2, etp=2), SHARED, False),
}


def make_plan(devices: int, degrees: dict, overlap: frozenset | None):
    """A tiny-pangu plan (pp 1, no recompute); ``overlap`` replaces the plan's mechanisms (the cpu target does not
    offer ``shared-expert`` to the planner yet, so it is set on the compiled plan)."""
    fixed = Fixed(global_batch=8, seq_len=64, pp=1, micro_batch=MICRO_BATCH, recompute="none", overlap=frozenset(),
                  **degrees)
    plan = compile_model(spec=SPEC, target=load_target("cpu", devices_per_node=4), num_devices=devices, fixed=fixed,
                         workers=1, candidates=1).plan
    if not overlap:
        return plan
    return plan.model_copy(update={"comm": plan.comm.model_copy(update={"overlap": sorted(overlap)})})


# ---- the rank side ---------------------------------------------------------------------------------------------------
def rank_main(jobs: list[tuple[str, bool]], steps: int, data: str, order_paths: list[str]) -> tuple[list, list]:
    """Entry point of one rank: :func:`train_and_capture` of each (plan path, legacy) job, then
    :func:`moe_op_order` of each plan of ``order_paths``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        return ([train_and_capture(path, legacy, steps, data) for path, legacy in jobs],
                [moe_op_order(path) for path in order_paths])
    finally:
        dist.destroy_process_group()


def train_and_capture(path: str, legacy: bool, steps: int, data: str) -> dict:
    """Train ``steps`` steps of the plan at ``path`` with the aux loss on (``legacy``: the routers' aux gradient
    unscaled, as before the fix); per step the loss, this rank's gradients reduced as the optimizer reduces them
    (SUM over dp_cp / expert_dp, ÷ dp) just before the update, and the step's in-layer CommLog bytes."""
    from moeplan.plan import load_plan
    from moeplan.runtime.build import rank_parameters
    from moeplan.runtime.data import load_tokens
    from moeplan.runtime.expert_parallel import ParallelRouter
    from moeplan.runtime.request import RunRequest
    from moeplan.runtime.worker import run_one_step, setup_rank

    plan = load_plan(path)
    setup = setup_rank(plan, RunRequest(plan=path, steps=steps, data=data, lr=LR), device=torch.device("cpu"),
                       aux_loss_coeff=COEFF)
    if legacy:
        for m in _modules(setup.modules):
            if isinstance(m, ParallelRouter):
                m.aux_loss_scale = 1.0
    params = rank_parameters(setup.modules, plan.model.spec)
    grads, comm = [], []
    update = setup.optimizer.step

    def capture_then_update():
        grads.append(_reduced(params, setup.groups, plan.layout.dp))
        comm.append({"/".join(k): v for k, v in setup.layer_log.bytes.items()})
        return update()

    setup.optimizer.step = capture_then_update
    tokens = load_tokens(data)
    losses = [run_one_step(plan, setup, tokens, step).loss for step in range(steps)]
    return dict(losses=losses, grads=grads, comm=comm)


def _modules(modules):
    return [m for layers in modules.values() for m in layers.modules()]


def _reduced(params, groups, dp: int) -> dict[str, tuple]:
    import torch.distributed as dist

    out = {}
    for p in params:
        grad = p.param.grad.detach().clone() if p.param.grad is not None else torch.zeros_like(p.param)
        group = groups.expert_dp if p.expert else groups.dp_cp
        if group is not None:
            dist.all_reduce(grad, group=group)
        out[p.name] = (p.shard, grad / dp)
    return out


# ---- the single-process reference ------------------------------------------------------------------------------------
def reference_run(tokens: torch.Tensor, steps: int) -> dict:
    """MoEModel with the aux loss on, the global batch accumulated over its ``n`` micro-batches as ``loss/n`` with
    the routers' ``aux_loss_scale = 1/n`` (Megatron-LM's rule); AdamW and clipping as the runtime. Per step the
    mean loss and the gradients before the update."""
    from moeplan.models import MoEModel, Router

    model = MoEModel(SPEC, seed=0, aux_loss_coeff=COEFF)
    n = 8 // MICRO_BATCH
    for m in model.modules():
        if isinstance(m, Router):
            m.aux_loss_scale = 1.0 / n
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    losses, grads = [], []
    for step in range(steps):
        batch = global_batch(tokens, step=step, global_batch=8, seq_len=64)
        total = 0.0
        for mb in batch.split(MICRO_BATCH):
            loss = model(mb[:, :-1], mb[:, 1:])
            (loss / n).backward()
            total += loss.item() / n
        losses.append(total)
        grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, grads=grads)


# ---- fixtures --------------------------------------------------------------------------------------------------------
def _run(layouts: dict, devices: int, folder, data: str, order: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """One world of ``devices`` ranks: train every layout, then record the op order of the ``order`` layouts.
    (layout -> per-rank results, layout -> rank 0's op order)."""
    jobs = []
    for name, (degrees, overlap, legacy) in layouts.items():
        path = folder / f"{name}.yaml"
        save_plan(make_plan(devices, degrees, overlap), path)
        jobs.append((str(path), legacy))
    ranks = launch_function(rank_main, devices, jobs, STEPS, data, [str(folder / f"{n}.yaml") for n in order])
    return ({name: [ranks[r][0][i] for r in range(devices)] for i, name in enumerate(layouts)},
            dict(zip(order, ranks[0][1])))


@pytest.fixture(scope="module")
def aux_reference(data_file) -> dict:
    return reference_run(torch.from_numpy(np.load(data_file)), STEPS)


@pytest.fixture(scope="module")
def world_2(tmp_path_factory, data_file):
    return _run(LAYOUTS_2, 2, tmp_path_factory.mktemp("debts2"), data_file,
                order=("dp2_ep2_shared_overlap", "dp2_ep2"))


@pytest.fixture(scope="module")
def runs_2(world_2):
    return world_2[0]


@pytest.fixture(scope="module")
def runs_4(tmp_path_factory, data_file):
    return _run(LAYOUTS_4, 4, tmp_path_factory.mktemp("debts4"), data_file)[0]


def _errors(ranks: list[dict], ref: dict) -> tuple[float, float, str]:
    """(max relative loss error over the steps, max relative gradient error over steps, ranks and parameters —
    the max-abs difference over the reference's max-abs — and the worst parameter)."""
    loss_err = max(abs(g - w) / abs(w) for g, w in zip(ranks[0]["losses"], ref["losses"]))
    worst, where = 0.0, ""
    for res in ranks:
        for step, grads in enumerate(res["grads"]):
            for name, (shard, grad) in grads.items():
                full = ref["grads"][step][name]
                want = shard.take(full[list(shard.experts)] if shard.experts is not None else full)
                err = float((grad - want).abs().max() / want.abs().max().clamp_min(1e-30))
                if err > worst:
                    worst, where = err, f"{name} (step {step + 1})"
    print(f"loss err {loss_err:.2e}, grad err {worst:.2e} at {where}")
    return loss_err, worst, where


# ---- 1. auxiliary-loss scaling ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dp2_ep2", "cp2_ep2"])
def test_aux_loss_gradient_matches_single_process_on_two_ranks(runs_2, aux_reference, name):
    loss_err, grad_err, where = _errors(runs_2[name], aux_reference)
    assert loss_err < TOL and grad_err < TOL, (loss_err, grad_err, where)


@pytest.mark.parametrize("name", ["tp2_ep2_etp2", "tp2_ep2_etp1"])
def test_aux_loss_gradient_matches_single_process_on_four_ranks(runs_4, aux_reference, name):
    loss_err, grad_err, where = _errors(runs_4[name], aux_reference)
    assert loss_err < TOL and grad_err < TOL, (loss_err, grad_err, where)


def test_unscaled_aux_gradient_is_off_by_the_micro_batch_count(runs_2, aux_reference):
    """The old runtime's gradient (scale 1 with 2 micro-batches per DP rank) misses the router's gradient by far
    more than the tolerance, so the tests above have teeth."""
    _, grad_err, where = _errors(runs_2["dp2_ep2_unscaled"], aux_reference)
    assert grad_err > 100 * TOL and "router.gate" in where, (grad_err, where)


# ---- 2. expert-TP: all-to-all first, etp all-gather after ------------------------------------------------------------
def _ep_a2a_rows_bytes(ranks: list[dict], phase: str) -> int:
    """EP all-to-all bytes of the step over all ranks, the count exchanges (int64 ``[ranks, local experts]``, one
    per MoE layer and micro-batch: ``8·E`` bytes a rank) taken out."""
    total = sum(r["comm"][0].get(f"ep/all_to_all/{phase}", 0) for r in ranks)
    if phase == "fwd":
        moe_layers = SPEC.num_moe_layers + SPEC.num_mtp_layers
        total -= len(ranks) * moe_layers * (8 // (MICRO_BATCH * 2)) * 8 * SPEC.num_experts
    return total


def test_expert_tp_all_to_all_carries_own_tokens_once(runs_4):
    """Per MoE layer and micro-batch each rank dispatches its own ``b·s/tp`` tokens' k rows and gets as many back
    (fp32): the dispatch and the combine together move ``2·Σ_ranks b·(s/tp)·k·h·4`` bytes, at etp 2 exactly as at
    etp 1; gathering over etp before the all-to-all sent etp times that."""
    moe_layers, micro_batches = SPEC.num_moe_layers + SPEC.num_mtp_layers, 8 // (MICRO_BATCH * 2)
    own_rows = 4 * MICRO_BATCH * 64 // 2 * SPEC.top_k  # over the 4 ranks
    want = moe_layers * micro_batches * 2 * own_rows * SPEC.hidden_size * 4
    for name in ("tp2_ep2_etp2", "tp2_ep2_etp1"):
        ranks = runs_4[name]
        assert _ep_a2a_rows_bytes(ranks, "fwd") == want, name
        assert _ep_a2a_rows_bytes(ranks, "bwd") == want, name
    # EP all-gathers per MoE layer and micro-batch: the aux loss's fp32 expert counts over tp_cp (every layout),
    # and at etp 2 the received int64 counts and the received rows over etp (as many rows as were dispatched)
    events = 4 * moe_layers * micro_batches
    gathered = [sum(r["comm"][0]["ep/all_gather/fwd"] for r in runs_4[name])
                for name in ("tp2_ep2_etp1", "tp2_ep2_etp2")]
    assert gathered[0] == events * 4 * SPEC.num_experts
    assert gathered[1] == events * (4 + 8) * SPEC.num_experts + want // 2


# ---- 3. shared experts beside the dispatch ---------------------------------------------------------------------------
def test_shared_expert_overlap_matches_and_tallies_the_same_bytes(runs_2, runs_4, aux_reference):
    for runs, plain, overlapped in ((runs_2, "dp2_ep2", "dp2_ep2_shared_overlap"),
                                    (runs_4, "tp2_ep2_etp2", "tp2_ep2_etp2_shared_overlap")):
        loss_err, grad_err, where = _errors(runs[overlapped], aux_reference)
        assert loss_err < TOL and grad_err < TOL, (overlapped, loss_err, grad_err, where)
        assert [r["comm"] for r in runs[overlapped]] == [r["comm"] for r in runs[plain]]


def moe_op_order(path: str) -> list[str]:
    """The ops of one forward of the first MoE block of the plan at ``path`` in issue order (a TorchDispatchMode
    records the aten and c10d ops), with markers where the shared experts start and end and where the pending
    token all-to-all is waited for (the ``wait`` of moeplan.runtime.parallel.all_to_all_async, wrapped)."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from moeplan.plan import load_plan
    from moeplan.runtime import expert_parallel
    from moeplan.runtime.build import build_rank_modules
    from moeplan.runtime.groups import make_groups

    events: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            events.append(str(func))
            return func(*args, **(kwargs or {}))

    def post(*args):
        wait = post.inner(*args)

        def marked_wait():
            events.append("wait")
            return wait()
        return marked_wait

    plan = load_plan(path)
    coords, groups = make_groups(plan.layout, dist.get_rank())
    modules = build_rank_modules(plan, coords, groups, seed=0, device=torch.device("cpu"))
    moe = next(m for m in _modules(modules) if isinstance(m, expert_parallel.ParallelMoE))
    moe.shared.register_forward_pre_hook(lambda *_: events.append("shared-start"))
    moe.shared.register_forward_hook(lambda *_: events.append("shared-end"))
    x = torch.randn((MICRO_BATCH, 64 // plan.layout.tp, SPEC.hidden_size),
                    generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)
    post.inner, expert_parallel.all_to_all_async = expert_parallel.all_to_all_async, post
    try:
        with Record():
            moe(x)
    finally:
        expert_parallel.all_to_all_async = post.inner
    return events


def test_shared_experts_run_while_the_token_all_to_all_is_in_flight(world_2):
    """Forward of the MoE block with the overlap: count exchange, token all-to-all posted, shared experts, wait,
    experts, combine. Without it: three synchronous all-to-alls, then the shared experts."""
    on, off = world_2[1]["dp2_ep2_shared_overlap"], world_2[1]["dp2_ep2"]
    for events in (on, off):
        assert sum(e.startswith("c10d.alltoall_base_") for e in events) == 3, events
    counts, tokens, combine = [i for i, e in enumerate(on) if e.startswith("c10d.alltoall_base_")]
    assert tokens < on.index("shared-start") < on.index("shared-end") < on.index("wait") < combine
    assert on.count("wait") == 1 and "wait" not in off
    assert max(i for i, e in enumerate(off) if e.startswith("c10d.alltoall_base_")) < off.index("shared-start")
