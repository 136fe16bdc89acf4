"""Lower bounds (moeplan/bounds.py) and the search that prunes with them: on many small random models and device
counts, every bound is at most the simulated step, and the exact search finds the optimum of an exhaustive one."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moeplan.search_eval as search_eval
from moeplan.actions import placement_of
from moeplan.bounds import chain_s, dp_floor_s, floors, layout_bound, piece_sums, plan_bound, water_level
from moeplan.compiler import Pipeline
from moeplan.cost_models.step import norm_s
from moeplan.ir import named_layers
from moeplan.search import Fixed, search
from moeplan.spec import ModelSpec, load_spec
from moeplan.state import Segment, Strategy
from moeplan.targets import load_target
from moeplan.trace import trace_model

PIPELINE = Pipeline.parse("shard,partition-stages,place-experts,schedule,plan-memory,simulate")
TINY = load_spec("tiny-pangu")


@st.composite
def cases(draw: st.DrawFn) -> tuple[ModelSpec, str, int]:
    moe = draw(st.booleans())
    layers = draw(st.integers(2, 4))
    changes: dict = {"num_layers": layers, "hidden_size": draw(st.sampled_from([64, 128])),
                     "num_mtp_layers": draw(st.integers(0, 1)), "global_batch": draw(st.sampled_from([8, 16])),
                     "seq_len": draw(st.sampled_from([64, 256]))}
    if moe:
        experts = draw(st.sampled_from([4, 8, 16]))
        changes |= {"num_experts": experts, "top_k": draw(st.integers(1, min(4, experts))),
                    "num_dense_layers": draw(st.integers(0, 1)),
                    "num_shared_experts": (shared := draw(st.integers(0, 1))), "shared_ffn_size": 32 * shared}
    else:
        changes |= {"num_experts": 0, "top_k": 0, "num_dense_layers": layers, "num_shared_experts": 0,
                    "moe_ffn_size": 0, "shared_ffn_size": 0, "num_mtp_layers": 0}
    spec = ModelSpec.model_validate({**TINY.model_dump(), **changes})
    return spec, draw(st.sampled_from(["h100", "ascend-910b", "cpu"])), draw(st.sampled_from([2, 4, 8]))


def _run(spec: ModelSpec, target: str, devices: int, *, candidates: int | None, keep: int):
    graph = trace_model(spec, seq_len=spec.seq_len)
    return search(graph=graph, target=load_target(target), num_devices=devices,
                  fixed=Fixed(global_batch=spec.global_batch, seq_len=spec.seq_len), pipeline=PIPELINE,
                  candidates=candidates, workers=1, keep=keep)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_bounds_hold_and_pruning_keeps_the_optimum(case):
    spec, target, devices = case
    with pytest.MonkeyPatch.context() as m:  # nothing pruned: every option simulated, every result kept
        m.setattr(search_eval, "layout_bound", lambda *a, **k: 0.0)
        m.setattr(search_eval, "plan_bound", lambda state: 0.0)
        every = _run(spec, target, devices, candidates=None, keep=10**6)
    assert every.num_pruned == 0 and every.num_evaluated == every.num_options
    tgt = load_target(target)
    slots = [k for _, k in named_layers(spec)]
    for ev in every.ranked:
        state = ev.state
        bound = plan_bound(state)
        assert bound <= state.prediction.step_time_s * (1 + 1e-9), (state.layout.short(), state.strategy.short())
        per_kind = {k: floors(c, state.strategy) for k, c in state.sharding.layer_costs.items()}
        lay = state.layout
        dp_floor = dp_floor_s([state.sharding.layer_costs[k] for k in set(slots)], lay, tgt, state.strategy)
        assert layout_bound(piece_sums([per_kind[k] for k in slots], state.strategy), pp=lay.pp, vpp=lay.vpp,
                            v_shape=placement_of(state.strategy.schedule) == "v", num_microbatches=lay.num_microbatches,
                            opt_floor_s=norm_s(lay.world_size, tgt), dp_floor_s=dp_floor,
                            overlap_dp="dp" in state.strategy.overlap) <= bound * (1 + 1e-9)
    exact = _run(spec, target, devices, candidates=None, keep=1)
    best = exact.ranked[0].state
    assert best.prediction.step_time_s == pytest.approx(every.ranked[0].state.prediction.step_time_s, rel=1e-12)
    assert exact.bound_s == float("inf") and exact.gap < 0
    assert exact.num_evaluated + exact.num_pruned == exact.num_options


def test_compile_reports_the_bound_and_exact_proves_the_optimum(tmp_path):
    # the default search says how far from the optimum its plan can be; --exact finds the same or better and
    # proves it, pruning part of the space
    import json

    from typer.testing import CliRunner

    from moeplan.cli import app

    args = ["compile", "tiny-pangu", "--target", "cpu", "--devices", "4", "--global-batch", "16", "--json"]
    runner = CliRunner()
    default, exact = (json.loads(runner.invoke(app, args + extra).stdout) for extra in ([], ["--exact"]))
    d, e = default["search"], exact["search"]
    assert e["bound_s"] is None and e["gap"] == 0 and e["pruned"] > 0 and e["evaluated"] < e["options"]
    assert exact["predicted"]["step_time_s"] <= default["predicted"]["step_time_s"]
    # the default search simulates its 4 best estimates and at most 4 follow-ups (moeplan/search.py); --exact
    # simulates at least as many (as many when its bound rules out every other option)
    assert d["evaluated"] <= 8 and d["evaluated"] <= e["evaluated"] and d["options"] == e["options"]
    if d["bound_s"] is not None:  # some option is left that the bound cannot rule out
        assert d["bound_s"] <= exact["predicted"]["step_time_s"]
        assert d["gap"] == pytest.approx(default["predicted"]["step_time_s"] / d["bound_s"] - 1)
    # every option is simulated (or refused), pruned, or left open; the exact search leaves none open
    for x in (d, e):
        assert x["evaluated"] + x["pruned"] + x["open"] == x["options"] and x["simulation_s"] > 0
    assert e["open"] == 0 and (d["open"] > 0) == (d["bound_s"] is not None)


def test_the_closing_line_says_what_is_left_and_what_exact_would_cost():
    from collections import Counter

    from moeplan.render import duration_text, search_summary
    from moeplan.search import SearchResult

    class Best:  # the one figure the line reads of the best plan
        class state:
            class prediction:
                step_time_s = 8.0

    left = SearchResult(ranked=(Best,), rejected=Counter(), num_enumerated=9, num_evaluated=5, num_options=100,
                        num_pruned=60, bound_s=5.0, num_open=35, simulation_s=4.0, workers=2)
    assert search_summary(left).endswith(  # type: ignore[arg-type]
        "35 options left unsimulated have a lower bound below this plan's step (the least 5.000 s), so one of them "
        "could be up to 60.0% faster; --exact settles it by simulating at most those, about 70 s at 4 s each on 2 "
        "workers")
    done = SearchResult(ranked=(Best,), rejected=Counter(), num_enumerated=9, num_evaluated=5, num_options=100,
                        num_pruned=95)  # type: ignore[arg-type]
    assert search_summary(done).endswith("the plan is the optimum under the cost model (no option left can beat it)")
    assert [duration_text(x) for x in (0.2, 70, 700, 30000)] == ["1 s", "70 s", "12 min", "8.3 h"]


def test_water_level():
    assert water_level([0.0, 0.0], 4.0) == 2.0
    assert water_level([0.0, 10.0], 4.0) == 4.0  # all the work on the rank with nothing else to do
    assert water_level([1.0, 2.0, 3.0], 3.0) == 3.0


def test_chain_counts_the_wait_for_an_asynchronous_collective():
    """A forward: attention (1 s), the EP dispatch (3 s, asynchronous under shared-expert) beside the shared expert
    (0.5 s), then the experts (1 s), which read the dispatched tokens. Alone, the part cannot take less than
    attention → dispatch → experts: 5 s, where the stream floor counts 2.5 s. With the dispatch blocking, every
    segment queues on the stream: 5.5 s either way."""
    segs = (Segment("attention", "compute", 1.0),
            Segment("dispatch", "comm", 3.0, after=(0,), async_by="shared-expert"),
            Segment("shared_expert", "compute", 0.5, after=(0,)), Segment("experts", "compute", 1.0, after=(1,)))
    hidden = Strategy(schedule="zero-bubble", overlap=frozenset({"shared-expert"}))
    blocking = Strategy(schedule="zero-bubble", overlap=frozenset())
    assert chain_s(segs, hidden) == 5.0
    assert chain_s(segs, blocking) == 5.5
    # a chain starts and ends on the stream: a collective nothing on the stream reads after it is not counted
    assert chain_s(segs[:2], hidden) == 1.0
