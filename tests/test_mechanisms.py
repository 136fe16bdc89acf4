"""Overlap mechanisms are descriptors in one registry (moeplan/mechanisms.py): a new one is a registration — where it
applies, whether moeplan's runtime runs it, which collectives it hides — and nothing else changes; an unknown name
is an error wherever a name is read, never treated as another mechanism."""
from __future__ import annotations

import sys

import pytest

from moeplan.cli import main
from moeplan.compile import compile_model
from moeplan.errors import PlanError
from moeplan.export import export_plan
from moeplan.ir import LayerKind
from moeplan.mechanisms import MECHANISMS, OverlapMechanism, mechanism, register
from moeplan.plan import load_plan, save_plan
from moeplan.runtime.launch import check_strategy
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.targets import load_target


def _tiny(overlap: frozenset[str]):
    return compile_model(spec=load_spec("tiny-pangu"), target=load_target("cpu"), num_devices=4, workers=1,
                         fixed=Fixed(global_batch=8, seq_len=64, pp=2, vpp=1, tp=1, ep=2, schedule="1f1b",
                                     overlap=overlap))


@pytest.fixture
def dispatch_beside():
    """A trivial mechanism registered for one test (and removed after it): it runs the EP dispatch and combine
    beside compute in every MoE layer, like ``shared-expert`` without needing shared experts to hide behind."""
    m = register(OverlapMechanism("test-dispatch", "the EP dispatch and combine beside compute (a test)",
                                  applies=lambda schedule, layout, spec, ep: ep, runtime=True,
                                  hides=("dispatch", "combine")))
    yield m
    del MECHANISMS[m.name]


def test_a_registered_mechanism_is_priced_planned_run_and_exported(dispatch_beside, tmp_path):
    off, on = _tiny(frozenset()), _tiny(frozenset({"test-dispatch"}))
    moe = on.result.ranked[0].state.sharding.layer_costs[LayerKind.MOE].program
    tagged = {s.name for s in moe.fwd + moe.bwd_input if s.async_by == "test-dispatch"}
    assert tagged and all(n.startswith(("dispatch", "combine")) for n in tagged)
    # the dispatch and combine stop holding the compute stream, so the step can only get shorter
    assert on.plan.prediction.step_time_s < off.plan.prediction.step_time_s
    assert on.plan.comm.overlap == ["test-dispatch"]
    path = tmp_path / "plan.yaml"
    save_plan(on.plan, path)
    assert load_plan(path).comm.overlap == ["test-dispatch"]  # the plan schema reads the registry
    check_strategy(on.plan)  # moeplan's runtime runs it (runtime=True)
    for fmt in ("megatron", "mindspeed-llm", "torchtitan"):
        assert any("test-dispatch" in n for n in export_plan(on.plan, fmt).notes), fmt


def test_the_runtime_refuses_a_mechanism_it_does_not_run(dispatch_beside):
    plan = _tiny(frozenset({"test-dispatch"})).plan
    MECHANISMS["test-dispatch"] = OverlapMechanism("test-dispatch", "", applies=lambda *a: True, runtime=False)
    with pytest.raises(PlanError, match=r"comm.overlap=\['test-dispatch'\]: the runtime does not run test-dispatch"):
        check_strategy(plan)


def test_an_unknown_mechanism_is_an_error_everywhere(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match=r"overlap mechanism 'bogus': unknown; the known ones are shared-expert, "
                                         r"fb, dp, pp"):
        mechanism("bogus")
    with pytest.raises(ValueError, match="already registered"):
        register(MECHANISMS["fb"])
    monkeypatch.setattr(sys, "argv", ["moeplan", "compile", "tiny-pangu", "--target", "cpu", "--devices", "4",
                                      "--overlap", "fb,bogus", "-o", str(tmp_path / "p.yaml")])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert "overlap='bogus': must be one of shared-expert, fb, dp, pp, none, all, auto" in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()
    path = tmp_path / "plan.yaml"
    save_plan(_tiny(frozenset({"pp"})).plan, path)
    path.write_text(path.read_text().replace("  overlap: [pp]\n", "  overlap: [bogus]\n", 1))
    with pytest.raises(PlanError, match=r"comm.overlap.0=.bogus.: overlap mechanism .bogus.: unknown"):
        load_plan(path)
