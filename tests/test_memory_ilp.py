"""Per-tensor keep / recompute / swap: the saved-tensor model, the ILP against brute force, and the pass."""
from __future__ import annotations

import itertools
import random

import pytest

from moeplan.compile import compile_model
from moeplan.compiler import Pipeline, with_option
from moeplan.cost_models.memory import in_flight_vectors
from moeplan.cost_models.saved_tensors import LayerTensors, RedoOp, SavedTensor, layer_tensors
from moeplan.cost_models.sharding import layer_cost, op_times_s
from moeplan.errors import PlanError
from moeplan.ir import LayerKind
from moeplan.layout import Layout
from moeplan.memory_ilp import Group, RankProblem, choice_of, evaluate, heuristic, solve
from moeplan.plan import load_plan, save_plan
from moeplan.replay import resimulate
from moeplan.runtime.launch import check_strategy
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.targets import load_target
from moeplan.trace import trace_model


@pytest.mark.parametrize("model,target", [("pangu-ultra-moe-718b", "ascend-910b"), ("tiny-pangu", "cpu")])
def test_kept_tensors_sum_to_the_layer_saved_bytes(model: str, target: str) -> None:
    spec, tgt = load_spec(model), load_target(target)
    graph = trace_model(spec, seq_len=spec.seq_len)
    lay = Layout(tp=2, pp=2, vpp=1, ep=2, etp=1, cp=1, dp=2, micro_batch=2, global_batch=8, seq_len=spec.seq_len)
    for kind, lg in graph.layers.items():
        lt = layer_tensors(lg, spec=spec, layout=lay, target=tgt, dispatcher="flat",
                           times=op_times_s(lg, layout=lay, target=tgt))
        assert lt.kept_bytes({}) == layer_cost(lg, spec=spec, layout=lay, target=tgt).saved_bytes, kind


def _random_layer(rng: random.Random, n_ops: int, kind: LayerKind = LayerKind.MOE) -> LayerTensors:
    tensors = [SavedTensor("x", "", rng.randint(1, 9) * 2**24, True)]
    ops = []
    outputs = ["x"]
    for i in range(n_ops):
        name = f"o{i}"
        reads = tuple(sorted(set(rng.sample(outputs, rng.randint(1, min(2, len(outputs)))))))
        makes = [name]
        tensors.append(SavedTensor(name, name, rng.randint(1, 9) * 2**24, rng.random() < 0.6))
        if rng.random() < 0.3:
            tensors.append(SavedTensor(f"{name}.internal", name, rng.randint(1, 9) * 2**24, True))
            makes.append(f"{name}.internal")
        ops.append(RedoOp(name, "op", rng.uniform(0.1, 2.0), reads, tuple(makes)))
        outputs.append(name)
    return LayerTensors(kind, tuple(tensors), tuple(ops), rng.uniform(0.5, 3.0), rng.uniform(1.0, 5.0))


def _brute_force(problem: RankProblem) -> float:
    """The least added seconds over every keep / swap / drop assignment of every tensor of every group."""
    per_group = []
    for g in problem.groups:
        options = []
        names = [t.name for t in g.layer.tensors]
        maker = {m: o.name for o in g.layer.ops for m in o.makes}
        choices = ("keep", "swap", "drop") if problem.host_bandwidth else ("keep", "drop")
        for assign in itertools.product(choices, repeat=len(names)):
            d = dict(zip(names, assign))
            if any(d[t.name] == "drop" and t.op == "" for t in g.layer.tensors):
                continue  # the layer input cannot be re-made
            rerun = {maker[t.name] for t in g.layer.tensors if d[t.name] == "drop" and t.needed}
            try:
                options.append(choice_of(g, rerun, {n for n, a in d.items() if a == "swap"}))
            except ValueError:
                continue
        per_group.append(options)
    best = float("inf")
    for combo in itertools.product(*per_group):
        added, peak, _ = evaluate(problem, combo)
        if peak <= problem.budget_bytes + 1e-9:
            best = min(best, added)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_ilp_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    two = seed % 3 == 0
    layers = [_random_layer(rng, 3 if two else rng.randint(4, 6)) for _ in range(2 if two else 1)]
    groups = tuple(Group(c, rng.randint(1, 3), lt) for c, lt in enumerate(layers))
    vectors = tuple(tuple(rng.randint(0, 4) for _ in groups) for _ in range(3))
    full = max(sum(n * g.count * g.layer.kept_bytes({}) for n, g in zip(v, groups)) for v in vectors)
    problem = RankProblem(groups, vectors, full * rng.uniform(0.2, 0.9), rng.randint(1, 8),
                          rng.choice([None, 4e9, 4e10]))
    expected = _brute_force(problem)
    sol = solve(problem, time_limit_s=10)
    if expected == float("inf"):
        assert sol.status == "infeasible" and "GiB" in sol.reason
        return
    assert sol.status == "optimal" and sol.peak_bytes <= problem.budget_bytes + 1e-6
    assert sol.added_s == pytest.approx(expected, rel=1e-6, abs=1e-6)
    greedy = heuristic(problem)
    assert greedy.status in ("heuristic", "infeasible") and greedy.added_s >= sol.added_s - 1e-9


def test_in_flight_vectors_follow_the_action_list() -> None:
    # a rank holding stages 0 and 2: (2, 0) and (1, 2) are incomparable peaks; the vectors they cover drop out
    actions = ("0F0", "0F1", "0B0", "2F0", "2F1", "2B0", "0B1", "2B1")
    assert in_flight_vectors(actions, [0, 2]) == ((1, 2), (2, 0))
    assert in_flight_vectors(("0F0", "2F0", "2B0", "0F1", "0B0", "0B1"), [0, 2]) == ((1, 1), (2, 0))


def test_with_option_sets_a_pass_option() -> None:
    head = "shard,partition-stages,place-experts,schedule,"
    text = with_option(head + "plan-memory{budget_fraction=0.9},simulate", "plan-memory", "budget_gib", 40.0)
    assert text == head + "plan-memory{budget_fraction=0.9,budget_gib=40.0},simulate"
    with pytest.raises(PlanError, match="has no plan-memory"):
        with_option("shard", "plan-memory", "budget_gib", 1)


def test_ilp_plan_records_decisions_round_trips_and_is_runnable(tmp_path) -> None:
    spec, tgt = load_spec("tiny-pangu"), load_target("cpu")
    fixed = Fixed(global_batch=spec.global_batch, seq_len=spec.seq_len, tp=1, pp=2, recompute="ilp")
    roomy = compile_model(spec=spec, target=tgt, num_devices=2, fixed=fixed, workers=1).plan
    need = max(r.total_bytes for r in roomy.memory.ranks)
    pipeline = with_option("shard,partition-stages,place-experts,schedule,plan-memory,simulate", "plan-memory",
                           "budget_gib", need * 0.9 / 2**30)
    Pipeline.parse(pipeline)
    plan = compile_model(spec=spec, target=tgt, num_devices=2, fixed=fixed, pipeline=pipeline, workers=1).plan
    ranks = plan.memory.ranks
    assert all(r.recompute == "ilp" and r.solve_status == "optimal" for r in ranks)
    assert max(r.total_bytes for r in ranks) <= need * 0.9
    assert any(op.saved_bytes > 0 for r in ranks for d in r.decisions for op in d.ops)
    assert plan.prediction.step_time_s >= roomy.prediction.step_time_s
    save_plan(plan, tmp_path / "p.yaml")
    again = load_plan(tmp_path / "p.yaml")
    assert again == plan
    assert resimulate(again).prediction.step_time_s == pytest.approx(plan.prediction.step_time_s)
    check_strategy(again)  # the runtime executes per-tensor plans (tests/runtime/test_per_tensor.py)
