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
    """``moeplan ARGS`` in this process: (exit code, stderr)."""
    code, _, err = run_out(monkeypatch, capsys, *args)
    return code, err


def run_out(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """``moeplan ARGS`` in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["moeplan", *map(str, args)])
    with pytest.raises(SystemExit) as exc:
        main()
    got = capsys.readouterr()
    return exc.value.code, got.out, got.err


@pytest.mark.parametrize("case, needle", [
    ("experts", "num_experts"),
    ("policy", "expert_policy"),
    ("window", "expert_load_window"),
    ("no-trace", "needs a load trace"),
    ("no-trace-rebalance", "needs a load trace"),
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
             "no-trace": ["--expert-policy", "greedy"], "no-trace-rebalance": ["--rebalance-every", "10"]}[case]
    code, err = run(monkeypatch, capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "plan.yaml").exists()


def replayed(trace: LoadTrace, every: int, threshold: float, n: int = 2):
    """By hand, as the runtime rebalances (moeplan.runtime.rebalance): contiguous at the start, after every
    ``every``-th step each layer re-placed from the counts of the steps since the last rebalance; each step's
    imbalance per layer under the placement in force, and the experts moved at each rebalance."""
    from moeplan.expert_load import imbalance, rank_tokens
    from moeplan.placement import contiguous, rebalance_layer

    place = [contiguous(trace.num_experts, n).shards for _ in trace.layers]
    per_step, moved = [], []
    for s in range(len(trace.steps)):
        per_step.append([float(imbalance(rank_tokens(trace.counts[s, i][None], p))[0]) for i, p in enumerate(place)])
        if (s + 1) % every == 0 and s + 1 < len(trace.steps):
            window = trace.counts[s + 1 - every:s + 1].sum(axis=0)
            decisions = [rebalance_layer(window[i], p, threshold) for i, p in enumerate(place)]
            place = [d.placement for d in decisions]
            moved.append(sum(len(d.moved) for d in decisions))
    return np.array(per_step), moved


def test_rebalancing_is_priced_as_the_runtime_would_rebalance_the_trace():
    t = skewed_trace(steps=12)  # even layers: one skew for all steps; odd layers: a new one every step
    model = LoadModel(t)
    static, rebalanced = model.at(2), model.at(2, rebalance_every=3, rebalance_threshold=0.05)
    per_step, moved = replayed(t, 3, 0.05)
    assert [x.imbalance for x in rebalanced.layers] == pytest.approx(per_step.mean(axis=0).tolist(), rel=1e-12)
    r = rebalanced.rebalancing
    assert r is not None and r.after == (3, 6, 9) and r.window_steps == 12 and r.moved_experts == tuple(moved)
    assert all((s.sum(axis=1) == v.sum(axis=1)).all() for s, v in zip(r.sent, r.received))  # one move, two ends
    assert static.rebalancing is None and rebalanced.layers[0].shards == static.layers[0].shards  # where it starts
    # the stationary layers gain, the others cannot (tomorrow's skew is not today's)
    assert rebalanced.layers[0].imbalance < 0.5 * static.layers[0].imbalance
    # a window from step 7: the rebalance after step 3 happened before it and is not priced; the placement it left is
    later = LoadModel(t, window=(6, 12)).at(2, rebalance_every=3)
    assert later.rebalancing.after == (6, 9) and later.rebalancing.window_steps == 6  # type: ignore[union-attr]
    assert [x.imbalance for x in later.layers] == pytest.approx(per_step[6:].mean(axis=0).tolist(), rel=1e-12)
    with pytest.raises(Exception, match="replicas"):
        model.at(2, "eplb", 1, rebalance_every=3)


def test_a_plan_that_rebalances_prices_the_migration_and_the_run_takes_it_from_the_plan(tmp_path, monkeypatch,
                                                                                      capsys):
    from moeplan.cost_models.comm import all_to_all_time_s, collective_time_s
    from moeplan.cost_models.rebalance import COUNT_BYTES

    trace, out = tmp_path / "load.json", tmp_path / "plan.yaml"
    write_trace(skewed_trace(), trace)
    args = ["compile", "tiny-pangu", "--target", "cpu", "--devices", "2", "--ep", "2", "--tp", "1", "--pp", "1",
            "--global-batch", "8", "--seq-len", "64", "--expert-load", trace, "-o", out]
    code, printed, _ = run_out(monkeypatch, capsys, *args, "--rebalance-every", "3")
    assert code == 0 and "rebalanced every 3 steps" in printed
    plan = load_plan(out)
    r, spec, cpu = plan.experts.load.rebalance, plan.model.spec, load_target("cpu")  # type: ignore[union-attr]
    assert r is not None and (r.every, r.threshold, r.rebalances) == (3, 0.05, 3)
    assert plan.layout.expert_load < LoadModel(skewed_trace()).at(2).expert_load  # the stationary layers gain
    # by hand: a moved expert is its w1, w3, w2 (3·h·f parameters), fp32, with an fp32 master and two fp32 moments
    per_expert = 3 * spec.hidden_size * spec.moe_ffn_size * 16
    moved = LoadModel(skewed_trace()).at(2, rebalance_every=3).rebalancing
    busiest = [max(s.sum(axis=0).max(), v.sum(axis=0).max()) * per_expert for s, v in zip(moved.sent, moved.received)]
    assert r.sent_bytes == pytest.approx(np.mean(busiest), rel=1e-12)
    count_s = collective_time_s(kind="all_reduce", bytes=len(TINY_MOE_LAYERS) * 8 * COUNT_BYTES, group_size=2,
                                tier="intra", target=cpu)
    migrate = [all_to_all_time_s(bytes=b * 2, group_size=2, stride=1, target=cpu) for b in busiest]
    assert r.migrate_s == pytest.approx(np.mean(migrate), rel=1e-12)
    assert r.seconds == pytest.approx(count_s + r.migrate_s, rel=1e-12)
    assert r.per_step_s == pytest.approx(3 * r.seconds / 12, rel=1e-12)
    for runtime in ("megatron", "mindspeed-llm", "torchtitan"):  # none of them moves experts while training
        assert any("experts.load.rebalance.every=3" in n for n in export_plan(plan, runtime).notes), runtime
    # moeplan run rebalances as the plan says, unless told otherwise (also on the ranks a printed command starts)
    for extra, says in (((), "--rebalance-every 3 --rebalance-threshold 0.05"), (("--rebalance-every", "0"),
                                                                               "--rebalance-every 0")):
        code, printed, _ = run_out(monkeypatch, capsys, "run", out, "--steps", "3", "--print-command", *extra)
        assert code == 0 and says in printed, printed


@pytest.mark.parametrize("extra, needle", [
    (("--rebalance-threshold", "0.1"), "rebalance_threshold=0.1"),
    (("--rebalance-every", "3", "--expert-policy", "eplb", "--expert-replicas", "1"), "replicas"),
    (("--rebalance-every", "-1"), "rebalance_every=-1"),
])
def test_bad_rebalancing_options_are_refused_in_one_line(tmp_path, monkeypatch, capsys, extra, needle):
    trace = tmp_path / "load.json"
    write_trace(skewed_trace(), trace)
    code, err = run(monkeypatch, capsys, "compile", "tiny-pangu", "--target", "cpu", "--devices", "2", "--ep", "2",
                    "--expert-load", trace, "-o", tmp_path / "plan.yaml", *extra)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "plan.yaml").exists()
