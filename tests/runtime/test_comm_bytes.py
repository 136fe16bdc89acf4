"""Measured bytes per link tier against the plan (issue 12: "measured inter-node and intra-node bytes per step equal
the plan's prediction within 1% for every dispatcher").

4 gloo ranks emulate 2 nodes × 2 (target cpu with ``devices_per_node=2``), EP 4 over both nodes. The plan prices
balanced routing, so the runs use ``--force-balanced-routing`` (random router scores: each token's experts are a
uniform random 2-subset of the 8) and compare the mean over ranks and steps of the EP bytes each rank sent over each
tier (moeplan.runtime.parallel.CommLog, written to the metrics JSONL) with ``plan.prediction.comm["ep"]``. With
1024 tokens a rank and micro-batch, 4 MoE layers, 4 ranks and 6 steps the sampling error of the mean is about 0.3%.
"""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch

from moeplan.compile import compile_model
from moeplan.plan import save_plan
from moeplan.runtime.compare import read_records
from moeplan.runtime.expert_parallel import ParallelRouter
from moeplan.runtime.metrics import RankStep, StepRecord, rank_step_from_vector, rank_step_vector
from moeplan.runtime.request import RunRequest
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.targets import load_target

from test_executor import launch_function  # noqa: E402

DISPATCHERS = ("flat", "hierarchical", "dedup")
SEQ, STEPS = 512, 6


def make_plan(dispatcher: str):
    return compile_model(spec=load_spec("tiny-pangu"), target=load_target("cpu", devices_per_node=2), num_devices=4,
                         fixed=Fixed(global_batch=8, seq_len=SEQ, pp=1, tp=1, cp=1, ep=4, micro_batch=2,
                                     dispatcher=dispatcher, recompute="none"),
                         workers=1, candidates=1).plan


def train_balanced(paths: list[str], steps: int, data: str) -> None:
    """Entry point of one rank: train each plan with forced balanced routing, metrics next to the plan."""
    import torch.distributed as dist

    from moeplan.plan import load_plan
    from moeplan.runtime.worker import train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        for path in paths:
            request = RunRequest(plan=path, steps=steps, data=data, metrics=path + ".jsonl",
                                 force_balanced_routing=True)
            train(load_plan(path), request, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_file) -> dict[str, tuple[object, list[StepRecord]]]:
    """Dispatcher -> (plan, step records of its run)."""
    folder = tmp_path_factory.mktemp("comm_bytes")
    plans = {name: make_plan(name) for name in DISPATCHERS}
    paths = []
    for name, plan in plans.items():
        paths.append(str(folder / f"{name}.yaml"))
        save_plan(plan, paths[-1])
    launch_function(train_balanced, 4, paths, STEPS, data_file)
    return {name: (plans[name], read_records(path + ".jsonl")) for name, path in zip(DISPATCHERS, paths)}


def _mean(records: list[StepRecord], cls: str, tier: str) -> float:
    values = [r.comm_tier_bytes.get(cls, {}).get(tier, 0) for rec in records for r in rec.ranks]
    return sum(values) / len(values)


@pytest.mark.parametrize("name", DISPATCHERS)
def test_measured_bytes_per_tier_match_the_plan(runs, name):
    plan, records = runs[name]
    assert plan.target.dtype_bytes == 4  # the fp32 runtime sends what the fp32 plan prices
    predicted = plan.prediction.comm["ep"]
    for tier, want in (("intra", predicted.intra_bytes), ("inter", predicted.inter_bytes)):
        got = _mean(records, "ep", tier)
        assert want > 0 and abs(got - want) / want < 0.01, (tier, got, want)


def test_hierarchical_inter_node_bytes_do_not_depend_on_routing(runs):
    """The gathers over the nodes carry every token: the same bytes on every rank and step, as planned."""
    plan, records = runs["hierarchical"]
    assert {r.comm_tier_bytes["ep"]["inter"] for rec in records for r in rec.ranks} == {
        plan.prediction.comm["ep"].inter_bytes}


@pytest.mark.parametrize("name", ("hierarchical", "dedup"))
def test_node_groups_are_timed_as_ep(runs, name):
    """The collectives on the dispatchers' node groups are EP traffic, not "other"."""
    _, records = runs[name]
    assert all("other" not in r.comm_s and r.comm_s.get("ep", 0) > 0 for rec in records for r in rec.ranks)


def test_forced_balanced_routing_ignores_the_input_and_passes_the_gradient():
    """Identical tokens all pick the same experts from the gate; with the switch their experts are spread evenly
    (8 experts, 4000 tokens × 2: each expert's share within 10% of 1/8), and the gate still gets a gradient."""
    spec = load_spec("tiny-pangu")
    router = ParallelRouter(spec, None, aux_loss_coeff=0.0)
    x = torch.ones((4000, spec.hidden_size))
    assert router(x, len(x))[0].unique().numel() == spec.top_k
    router.force_balanced = True
    torch.manual_seed(0)
    idx, gates = router(x, len(x))
    share = torch.bincount(idx.flatten(), minlength=spec.num_experts) / idx.numel()
    assert (share - 1 / spec.num_experts).abs().max() < 0.1 / spec.num_experts
    assert (idx[:, 0] != idx[:, 1]).all()
    gates.sum().backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0


def test_run_request_carries_the_switch():
    request = RunRequest(plan="p.yaml", steps=3, force_balanced_routing=True)
    assert "--force-balanced-routing" in request.cli_args()
    assert RunRequest.model_validate_json(request.model_dump_json()) == request
    assert "--force-balanced-routing" not in RunRequest(plan="p.yaml", steps=3).cli_args()


def test_tier_bytes_survive_the_gather_and_the_jsonl():
    step = RankStep(rank=1, pp_rank=0, action_s={"F": 0.5}, comm_s={"ep": 0.1}, comm_bytes={"ep": 100},
                    peak_saved_bytes=7, cpu_s=1.0, comm_tier_bytes={"ep": {"intra": 12, "inter": 34}})
    back = rank_step_from_vector(rank_step_vector(step))
    assert back.comm_tier_bytes == {"ep": {"intra": 12, "inter": 34}}
    record = StepRecord(step=1, loss=1.0, step_time_s=1.0, tokens_per_s=1.0, grad_norm=1.0, ranks=(back,), host=None)
    assert StepRecord.from_json(record.to_json()).ranks[0].comm_tier_bytes == back.comm_tier_bytes
    old = json.loads(record.to_json())
    del old["ranks"][0]["comm_tier_bytes"]  # metrics written before the field
    assert StepRecord.from_json(json.dumps(old)).ranks[0].comm_tier_bytes == {}
