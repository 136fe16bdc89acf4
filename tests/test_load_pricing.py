"""Pricing imbalanced expert load (docs/load-balance.md): the busiest EP rank's tokens scale the expert ops, the
dispatch and the expert activations; a load trace prices each expert-group size under the placement policy; the
plan records the trace, each layer's placement and imbalance, and the step under balanced routing."""
from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import pytest

from moeplan.cli import main
from moeplan.compile import compile_model
from moeplan.compiler import DEFAULT_PIPELINE, Pipeline
from moeplan.cost_models.sharding import layer_cost, op_times_s
from moeplan.expert_load import LoadTrace, write_trace
from moeplan.export.registry import EXPORTERS, export_plan
from moeplan.ir import LayerKind, ShardHint
from moeplan.layout import Layout
from moeplan.load_model import LoadModel
from moeplan.plan import load_plan, save_plan
from moeplan.replay import resimulate
from moeplan.search import Fixed, build_options
from moeplan.spec import load_spec
from moeplan.targets import load_target
from moeplan.trace import trace_model

TINY_MOE_LAYERS = (1, 2, 3, 4)  # tiny-pangu: layers.1-3 and the MTP block's layer (decoder-layer index 4)


def skewed_trace(steps: int = 12, experts: int = 8, seed: int = 0) -> LoadTrace:
    """Counts drawn per step from a Zipf-like share (expert e ∝ 1/(e+1)), 1024 routed copies per layer and step."""
    rng = np.random.default_rng(seed)
    share = 1 / np.arange(1, experts + 1)
    counts = np.stack([[rng.multinomial(1024, rng.permutation(share) / share.sum() if i % 2 else share / share.sum())
                        for i in range(len(TINY_MOE_LAYERS))] for _ in range(steps)])
    return LoadTrace(model="tiny-pangu", num_experts=experts, layers=TINY_MOE_LAYERS, steps=tuple(range(1, steps + 1)),
                     counts=counts, source="test: Zipf-like draws")


@pytest.fixture(scope="module")
def tiny_graph():
    spec = load_spec("tiny-pangu")
    return trace_model(spec, seq_len=spec.seq_len)


def test_the_busiest_rank_scales_the_expert_ops_the_dispatch_and_their_activations(tiny_graph):
    lay = Layout(tp=1, pp=1, vpp=1, ep=2, etp=1, cp=1, dp=2, micro_batch=1, global_batch=8, seq_len=64)
    heavy = replace(lay, expert_load=2.0)
    lg, cpu = tiny_graph.layer(LayerKind.MOE), load_target("cpu")
    t1, t2 = op_times_s(lg, layout=lay, target=cpu), op_times_s(lg, layout=heavy, target=cpu)
    for op in lg.ops:
        if op.shard == ShardHint.EXPERT:
            assert t2[op.name][0] > t1[op.name][0] or t1[op.name][0] == 0, op.name
        else:
            assert t2[op.name] == t1[op.name], op.name
    c1 = layer_cost(lg, spec=tiny_graph.spec, layout=lay, target=cpu)
    c2 = layer_cost(lg, spec=tiny_graph.spec, layout=heavy, target=cpu)
    a2a = [(x, y) for x, y in zip(c1.comm, c2.comm) if x.kind == "all_to_all" and x.bytes > 8 * 8]
    assert a2a and all(y.bytes == 2 * x.bytes and y.time_s > x.time_s for x, y in a2a)
    assert c2.saved_bytes > c1.saved_bytes and c2.params == c1.params
    copies = layer_cost(lg, spec=tiny_graph.spec, layout=replace(lay, expert_replication=1.5), target=cpu)
    assert copies.expert_params == int(1.5 * c1.expert_params)


def test_each_expert_group_size_is_priced_with_its_own_placement(tiny_graph):
    model = LoadModel(skewed_trace())
    built = build_options(graph=tiny_graph, target=load_target("cpu"), num_devices=8, budget=2**40,
                          fixed=Fixed(global_batch=8, seq_len=64, tp=1, pp=1, load=model), placing=("greedy", 0))
    by_shards = {lay.expert_shards: lay.expert_load for lay, _, _ in built.options}
    assert by_shards[1] == 1.0 and set(by_shards) >= {1, 2, 4, 8}
    for n, f in by_shards.items():
        assert f == pytest.approx(model.at(n, "greedy").expert_load)
    assert by_shards[8] > by_shards[2] > 1.0  # one expert per rank: nothing to balance
    contiguous = model.at(4, "contiguous")
    assert model.at(4, "greedy").expert_load < contiguous.expert_load
    assert contiguous.expert_load == pytest.approx(1 + np.mean([x.imbalance for x in contiguous.layers]))


def test_a_compile_with_a_trace_records_what_it_priced(tmp_path):
    trace = tmp_path / "load.json"
    write_trace(skewed_trace(), trace)
    kw = dict(spec=load_spec("tiny-pangu"), target=load_target("cpu"), num_devices=2,
              fixed=Fixed(global_batch=8, seq_len=64, tp=1, pp=1, ep=2))
    plain = compile_model(**kw).plan
    pipe = Pipeline.parse(DEFAULT_PIPELINE).with_option("place-experts", "policy", "greedy")
    res = compile_model(**{**kw, "fixed": replace(kw["fixed"], load=LoadModel(skewed_trace(), path=str(trace)))},
                        pipeline=pipe)
    plan, load = res.plan, res.plan.experts.load
    assert plain.experts.load is None and plain.layout.expert_load == 1.0
    assert load is not None and load.policy == "greedy" and load.trace == str(trace) and load.window == [1, 12]
    assert [x.layer for x in load.layers] == list(TINY_MOE_LAYERS)
    assert plan.layout.expert_load == pytest.approx(1 + np.mean([x.imbalance for x in load.layers]))
    assert load.balanced_step_s == pytest.approx(plain.prediction.step_time_s, rel=1e-9)
    assert plan.prediction.step_time_s > load.balanced_step_s
    path = tmp_path / "plan.yaml"
    save_plan(plan, path)
    again = load_plan(path)
    assert again == plan and "expert_load" in path.read_text()
    assert resimulate(again).prediction.step_time_s == pytest.approx(plan.prediction.step_time_s, rel=1e-9)
    save_plan(plain, path)
    assert "expert_load" not in path.read_text() and "load:" not in path.read_text()
    for runtime in EXPORTERS:  # no runtime takes a per-layer placement: the exports that place experts say so
        said = [n for n in export_plan(plan, runtime).notes if "experts.load.policy='greedy'" in n]
        assert bool(said) == (runtime != "torch-pipelining"), runtime  # a schedule CSV places no experts
        assert not any("experts.load" in n for n in export_plan(plain, runtime).notes)


def run(monkeypatch, capsys, *args) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["moeplan", *map(str, args)])
    with pytest.raises(SystemExit) as exc:
        main()
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize("case, needle", [
    ("experts", "num_experts"),
    ("policy", "expert_policy"),
    ("window", "expert_load_window"),
    ("no-trace", "needs a load trace"),
])
def test_a_bad_trace_or_policy_is_refused_in_one_line(tmp_path, monkeypatch, capsys, case, needle):
    trace = tmp_path / "load.json"
    t = skewed_trace()
    if case == "experts":
        t = LoadTrace(model="x", num_experts=16, layers=t.layers, steps=t.steps,
                      counts=np.concatenate([t.counts, t.counts], axis=2))
    write_trace(t, trace)
    args = ["compile", "tiny-pangu", "--target", "cpu", "--devices", "2", "--ep", "2", "-o", tmp_path / "plan.yaml"]
    args += {"experts": ["--expert-load", trace], "policy": ["--expert-load", trace, "--expert-policy", "best"],
             "window": ["--expert-load", trace, "--expert-load-window", "5:50"],
             "no-trace": ["--expert-policy", "greedy"]}[case]
    code, err = run(monkeypatch, capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "plan.yaml").exists()
