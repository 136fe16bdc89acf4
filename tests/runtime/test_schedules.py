"""The runtime executes the zero-bubble, ZB-V and DualPipeV action lists of a plan (PP 2, VPP 2), in the plan's order
and with the V-shaped stage placement of ZB-V and DualPipeV (rank r holds stages r and 2·pp − 1 − r): over 20 steps
(6 for the variants ``EXTRAS``) the per-step loss matches the single-process run of the same model, seed and data
to 1e-4 relative.

One 2-rank gloo job trains every plan in turn; each rank also records the (kind, stage, micro-batch) of every action
its executor dispatches, which must be its plan's action list with each ``OVERLAP_F_B`` pair as its F then its B
(the pair's halves run overlapped, moeplan.runtime.overlap).
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from moeplan.actions import parse_action
from moeplan.compile import compile_model
from moeplan.errors import PlanError
from moeplan.plan import Plan, PlanSchedule, save_plan
from moeplan.runtime.build import stage_ids
from moeplan.runtime.launch import check_runnable
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.targets import load_target

from test_executor import LR, METER_EVERY, _assert_close, launch_function, steps_of

#: name -> schedule compiled; ``dualpipev_pairs`` is DualPipeV with fb overlap (its OVERLAP_F_B pairs kept),
#: ``zbv_recompute`` ZB-V with full recompute on PP rank 0 (I and W split) and selective on rank 1 (one-pass I)
SCHEDULES = {"zero_bubble": "zero-bubble", "zbv": "zbv", "dualpipev": "dualpipev", "dualpipev_pairs": "dualpipev",
             "zbv_recompute": "zbv"}
#: issue 12 names the three schedules (test_executor.STEPS steps each); the two variants run test_executor.SHORT_STEPS (steps_of)
EXTRAS = {"dualpipev_pairs", "zbv_recompute"}


def make_plan(schedule: str, *, pairs: bool = False, recompute: tuple[str, str] | None = None) -> Plan:
    """A tiny-pangu plan on 2 devices, PP 2 × VPP 2, 4 micro-batches of 2 sequences (DualPipeV needs m ≥ 2·pp);
    ``pairs``: with ``fb`` overlap (DualPipeV keeps its OVERLAP_F_B pairs), else without; ``recompute`` overrides the
    mode of each PP rank."""
    plan = compile_model(spec=load_spec("tiny-pangu"), target=load_target("cpu"), num_devices=2,
                         fixed=Fixed(global_batch=8, seq_len=64, pp=2, vpp=2, tp=1, cp=1, micro_batch=2,
                                     schedule=schedule, overlap=frozenset({"fb"} if pairs else ())),
                         workers=1, candidates=1).plan
    if recompute is not None:
        ranks = [r.model_copy(update={"recompute": mode}) for r, mode in zip(plan.memory.ranks, recompute)]
        plan = plan.model_copy(update={"memory": plan.memory.model_copy(update={"ranks": ranks})})
    return plan


def expected_order(actions: list[str]) -> list[tuple[str, int, int]]:
    """What the executor dispatches for one step: the actions in list order, a pair as its F then its B."""
    return [(p.kind, p.stage, p.microbatch) for a in map(parse_action, actions) for p in a.parts or (a,)]


def train_and_record(paths: list[str], steps: list[int], data: str
                     ) -> list[tuple[list[float], list[tuple[str, int, int]]]]:
    """Entry point of one rank: train plan ``i`` for ``steps[i]`` steps, in turn; per plan, (per-step losses,
    actions dispatched in step 1)."""
    import torch.distributed as dist

    from moeplan.plan import load_plan
    from moeplan.runtime.executor import PipelineExecutor
    from moeplan.runtime.request import RunRequest
    from moeplan.runtime.worker import train

    torch.set_num_threads(1)
    dispatched: list[tuple[str, int, int]] = []
    original = PipelineExecutor._dispatch

    def record(self, kind: str, stage: int, mb: int) -> None:
        dispatched.append((kind, stage, mb))
        original(self, kind, stage, mb)

    def record_pair(self, f, b) -> None:  # an OVERLAP_F_B pair run overlapped (moeplan.runtime.overlap)
        dispatched.extend([(f.kind, f.stage, f.microbatch), (b.kind, b.stage, b.microbatch)])
        original_pair(self, f, b)

    original_pair = PipelineExecutor._overlapped
    PipelineExecutor._dispatch, PipelineExecutor._overlapped = record, record_pair
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        out = []
        for path, n in zip(paths, steps):
            plan = load_plan(path)
            dispatched.clear()
            records = train(plan, RunRequest(plan=path, steps=n, data=data, lr=LR, meter_every=METER_EVERY),
                            device=torch.device("cpu"))
            per_step = len(dispatched) // n
            out.append(([r.loss for r in records], dispatched[:per_step]))
        return out
    finally:
        dist.destroy_process_group()
        PipelineExecutor._dispatch, PipelineExecutor._overlapped = original, original_pair


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {name: make_plan(kind, pairs=name.endswith("_pairs"),
                            recompute=("full", "selective") if name.endswith("_recompute") else None)
            for name, kind in SCHEDULES.items()}


@pytest.fixture(scope="module")
def runs(plans, tmp_path_factory, data_file) -> dict[str, dict[int, tuple]]:
    folder = tmp_path_factory.mktemp("schedules")
    paths = []
    for name, plan in plans.items():
        save_plan(plan, folder / f"{name}.yaml")
        paths.append(str(folder / f"{name}.yaml"))
    results = launch_function(train_and_record, 2, paths, [steps_of(name, EXTRAS) for name in plans], data_file)
    return {name: {rank: results[rank][i] for rank in results} for i, name in enumerate(plans)}


def test_plans_have_the_schedules_and_placements(plans):
    assert {n: (p.schedule.kind, p.stages.placement) for n, p in plans.items()} == {
        "zero_bubble": ("zero-bubble", "loop"), "zbv": ("zbv", "v"), "dualpipev": ("dualpipev", "v"),
        "dualpipev_pairs": ("dualpipev", "v"), "zbv_recompute": ("zbv", "v")}
    kinds = {parse_action(a).kind for p in plans.values() for acts in p.schedule.actions for a in acts}
    assert {"I", "W", "B", "OVERLAP_F_B"} <= kinds


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_loss_matches_single_process(runs, reference, name):
    _assert_close(runs[name][0][0], reference, steps_of(name, EXTRAS))



@pytest.mark.parametrize("name", list(SCHEDULES))
def test_executor_runs_the_plan_order(runs, plans, name):
    for rank, (_, dispatched) in runs[name].items():
        assert dispatched == expected_order(plans[name].schedule.actions[rank])


def test_v_placement_stages(plans):
    plan = plans["zbv"]
    assert [stage_ids(plan, r) for r in range(2)] == [[0, 3], [1, 2]]
    assert [plan.stages.rank_of(s) for s in range(4)] == [0, 1, 1, 0]
    assert [stage_ids(plans["zero_bubble"], r) for r in range(2)] == [[0, 2], [1, 3]]
    assert "head" in plan.stages.chunks[0][1]  # the last stage (with the loss) is on rank 0


def test_v_plans_are_runnable(plans):
    for plan in plans.values():
        check_runnable(plan, world_size=2, need_backend=False)


def test_refuses_send_between_stages_on_one_rank(plans):
    plan = plans["zbv"]  # stages 1 and 2 are both on rank 1: a p2p between them is not a pipeline schedule
    acts = [list(a) for a in plan.schedule.actions]
    acts[1].insert(acts[1].index("1F0") + 1, "1SEND_F0")
    bad = plan.model_copy(update={"schedule": PlanSchedule.of(plan.schedule.kind, acts)})
    with pytest.raises(PlanError, match=r"1SEND_F0 and 2RECV_F0 must each appear 0 time"):
        check_runnable(bad, world_size=2, need_backend=False)


def test_refuses_a_missing_backward(plans):
    plan = plans["dualpipev"]
    acts = [[a for a in r if a != "3B1"] for r in plan.schedule.actions]
    bad = plan.model_copy(update={"schedule": PlanSchedule.of(plan.schedule.kind, acts)})
    with pytest.raises(PlanError, match=r"schedule.actions\[0\]: stage 3 micro-batch 1 has 1 F, 0 B"):
        check_runnable(bad, world_size=2, need_backend=False)
