"""The runtime's memory meters against the plan's per-rank memory terms (issue 32, item 4c; docs/memory.md §8).

tiny-pangu on 2 gloo ranks, DP 2 and PP 2, 2 steps each: the model states each rank measures
(moeplan.runtime.metrics.model_state_bytes: parameters, gradients, optimizer) against ``memory.ranks[r]``, equal
to the byte but for one step count per bucket, so a change of the runtime or of the model breaks the test:

- parameters: 4 bytes each, a tied copy once on its owner's rank;
- gradients: every ``.grad`` plus DistributedAdamW's flat fp32 gradient shards (``FlatParams.grad``, 4/dp);
- optimizer: master shard, norm-weight shard and both moments (4 + 4 + 8 bytes per parameter over dp).

Plus a single-process check that the saved-activation meter counts the working set a whole-layer recompute
re-makes.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from moeplan.compile import compile_model
from moeplan.plan import Plan, save_plan
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.targets import load_target

from test_executor import LR, launch_function  # noqa: E402

STATE_STEPS = 2
LAYOUTS = {"dp2": dict(pp=1, tp=1, cp=1, ep=1), "pp2": dict(pp=2, vpp=1, tp=1, cp=1, ep=1)}
FIELDS = ("params_bytes", "grads_bytes", "optimizer_bytes")


def make_plan(layout: dict) -> Plan:
    fixed = Fixed(global_batch=4, seq_len=64, micro_batch=1, recompute="none", **layout)
    return compile_model(spec=load_spec("tiny-pangu"), target=load_target("cpu"), num_devices=2, fixed=fixed,
                         workers=1, candidates=1).plan


def train_states(paths: list[str], steps: int, data: str) -> list[list[dict[int, tuple[int, int, int]]]]:
    """Entry point of one rank: per plan, per step, global rank -> (params, grads, optimizer) bytes."""
    import torch.distributed as dist

    from moeplan.plan import load_plan
    from moeplan.runtime.request import RunRequest
    from moeplan.runtime.worker import train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        return [[{r.rank: tuple(getattr(r, f) for f in FIELDS) for r in rec.ranks}
                 for rec in train(load_plan(p), RunRequest(plan=p, steps=steps, data=data, lr=LR),
                                  device=torch.device("cpu"))] for p in paths]
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {name: make_plan(layout) for name, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def measured(plans, tmp_path_factory, data_file) -> dict[str, list[dict[int, tuple[int, int, int]]]]:
    root = tmp_path_factory.mktemp("memory_meters")
    paths = []
    for name, plan in plans.items():
        save_plan(plan, root / f"{name}.yaml")
        paths.append(str(root / f"{name}.yaml"))
    return dict(zip(plans, launch_function(train_states, 2, paths, STATE_STEPS, data_file)[0]))


def _pp_rank(plan: Plan, rank: int) -> int:
    from moeplan.runtime.groups import rank_coords

    return rank_coords(plan.layout, rank).pp_rank


def _cases(plans, measured):
    for name, plan in plans.items():
        for rank, states in measured[name][-1].items():
            yield name, plan, rank, _pp_rank(plan, rank), dict(zip(FIELDS, states))


def test_every_step_measures_the_states(measured):
    for name, steps in measured.items():
        assert len(steps) == STATE_STEPS
        assert steps[0] == steps[-1], name  # allocated once: the same bytes after every optimizer step
        assert all(b > 0 for ranks in steps for states in ranks.values() for b in states)


def test_measured_states_equal_the_plans(plans, measured):
    """The plan's model states are the runtime's, term by term: 4-byte weights and gradients, the optimizer's fp32
    gradient, master and norm-weight shards and both moments, the MTP's tied weights once on their owner's rank
    (targets/cpu.yaml ``runtime``; cost_models/memory.py). One step count per bucket is the only difference."""
    for name, plan, rank, pp, got in _cases(plans, measured):
        for field in FIELDS:
            assert got[field] == pytest.approx(getattr(plan.memory.ranks[pp], field), rel=1e-3), (name, rank, field)


def test_model_state_bytes_counts_each_storage_once():
    from moeplan.runtime.metrics import model_state_bytes

    w = torch.zeros(10, 4)
    grad = torch.zeros(40)
    assert model_state_bytes([w, w.t(), w[0]], [grad, grad[:5], None, w], [grad.view(4, 10), torch.zeros(3)]) \
        == (160, 160, 12)


def test_full_recompute_meters_the_working_set():
    """A layer under full recompute holds in its backward what it holds without recompute: the meter counts what
    the recompute re-made while autograd holds it (not the transients the stopped forward had alive, nor the
    layer's input again), and nothing once the backward is done (selective too)."""
    from moeplan.models import build_layer
    from moeplan.runtime.executor import recompute_call
    from moeplan.runtime.metrics import SavedActivationMeter

    torch.manual_seed(0)
    layer = build_layer(load_spec("tiny-pangu"), "layers.1")
    peaks = {}
    for mode in ("none", "full", "selective"):
        meter = SavedActivationMeter(list(layer.parameters()))
        x = torch.randn(2, 64, 64, requires_grad=True)
        with meter.hooks():
            out = recompute_call(mode, meter)("layers.1", layer, (x,))
        meter.reset_peak()
        out.sum().backward()
        peaks[mode] = meter.peak_bytes
        assert meter.live_bytes == 0, mode
    assert peaks["full"] == peaks["none"]


def test_state_fields_survive_the_gather_and_the_jsonl():
    import json

    from moeplan.runtime.metrics import RankStep, StepRecord, rank_step_from_vector, rank_step_vector

    step = RankStep(rank=0, pp_rank=0, action_s={}, comm_s={}, comm_bytes={}, peak_saved_bytes=7, cpu_s=1.0,
                    params_bytes=11, grads_bytes=22, optimizer_bytes=33)
    back = rank_step_from_vector(rank_step_vector(step))
    assert (back.params_bytes, back.grads_bytes, back.optimizer_bytes) == (11, 22, 33)
    record = StepRecord(step=1, loss=1.0, step_time_s=1.0, tokens_per_s=1.0, grad_norm=1.0, ranks=(back,), host=None)
    assert StepRecord.from_json(record.to_json()).ranks[0].optimizer_bytes == 33
    old = json.loads(record.to_json())
    for field in FIELDS:  # metrics written before the fields
        del old["ranks"][0][field]
    assert StepRecord.from_json(json.dumps(old)).ranks[0].params_bytes == -1
