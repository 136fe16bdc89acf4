"""``moeplan diff A B``: only the fields that differ, with the plans' own values; one-line errors on bad input."""
import json
import re

import pytest
from inprocess import run_moeplan

from moeplan.compile import compile_model
from moeplan.diff import GIB, diff_json, diff_plans
from moeplan.plan import PlanLayout, load_plan, save_plan
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.targets import load_target


def compile_tiny(spec=None, target=None, **fixed):
    return compile_model(spec=spec or load_spec("tiny-pangu"), target=target or load_target("cpu"), num_devices=4,
                         fixed=Fixed(global_batch=8, seq_len=64, **fixed), workers=1).plan


@pytest.fixture(scope="module")
def pp2():
    return compile_tiny(pp=2, vpp=2, micro_batch=2, schedule="interleaved")  # loop placement: chunk moves are predictable


@pytest.fixture(scope="module")
def pp1():
    return compile_tiny(pp=1, micro_batch=2)


@pytest.fixture(scope="module")
def files(pp2, pp1, tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    save_plan(pp2, folder / "a.yaml")
    save_plan(pp1, folder / "b.yaml")
    return folder


moeplan = run_moeplan


def section(d, name):
    return {r.field: r for s in d.sections if s.name == name for r in s.rows}


def test_plan_against_itself_is_equal(pp2, files):
    d = diff_plans(pp2, pp2)
    assert d.equal and d.sections == () and d.warnings == ()
    proc = moeplan("diff", str(files / "a.yaml"), str(files / "a.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert "plans are equal" in proc.stdout


@pytest.mark.parametrize("other", [dict(pp=1, micro_batch=2), dict(pp=2, vpp=2, micro_batch=1)])
def test_layout_rows_are_exactly_the_differing_fields(pp2, other):
    b = compile_tiny(**other)
    d = diff_plans(pp2, b)
    expected = {f for f in PlanLayout.model_fields if getattr(pp2.layout, f) != getattr(b.layout, f)}
    rows = section(d, "layout")
    assert expected and set(rows) == expected
    for f, row in rows.items():
        assert (row.a, row.b) == (getattr(pp2.layout, f), getattr(b.layout, f))
        assert row.delta == row.b - row.a
    pred = section(d, "prediction")
    step = pred["step time"]
    assert (step.a, step.b) == (pp2.prediction.step_time_s, b.prediction.step_time_s)
    assert step.better == ("B" if b.prediction.step_time_s < pp2.prediction.step_time_s else "A")
    assert step.rel == pytest.approx(b.prediction.step_time_s / pp2.prediction.step_time_s - 1)
    assert pred["MFU"].a == pytest.approx(100 * pp2.prediction.mfu)
    assert d.warnings == () and not section(d, "model and target")


def test_pp_change_moves_layers(pp2, pp1):
    d = diff_plans(pp2, pp1)
    stages = section(d, "stages")
    row = stages["pp 0 chunk 0 · layers"]
    assert row.a == pp2.stages.chunks[0][0] and "layers.2 (from pp 1 chunk 0)" in row.change
    assert stages["pp 1 chunk 0 · layers"].b is None and stages["pp 1 chunk 0 · layers"].change == "only in A"
    assert section(d, "memory per device")["pp 1 · total"].b is None
    first = section(d, "schedule")["pp 0 · first difference"]
    i = next(k for k, (x, y) in enumerate(zip(pp2.schedule.actions[0], pp1.schedule.actions[0])) if x != y)
    assert first.change.startswith(f"at action {i} ") and first.a[i - max(0, i - 2)] == pp2.schedule.actions[0][i]


def test_recompute_change_shows_memory(pp2):
    full = compile_tiny(pp=2, vpp=2, micro_batch=2, recompute="full", schedule="interleaved")
    d = diff_plans(pp2, full)
    mem = section(d, "memory per device")
    for r in range(2):
        x, y = pp2.memory.ranks[r], full.memory.ranks[r]
        assert (mem[f"pp {r} · recompute"].a, mem[f"pp {r} · recompute"].b) == ("none", "full")
        act = mem[f"pp {r} · activations"]
        assert (act.a, act.b, act.unit) == (x.activation_bytes / GIB, y.activation_bytes / GIB, "GiB")
        assert act.b < act.a
        assert f"pp {r} · params" not in mem  # full recompute keeps the weights as they are
    assert "layout" not in {s.name for s in d.sections}


def test_json_carries_the_same_rows(pp2, files):
    proc = moeplan("diff", str(files / "a.yaml"), str(files / "b.yaml"), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    expected = diff_json(diff_plans(load_plan(files / "a.yaml"), load_plan(files / "b.yaml"),
                                    label_a=str(files / "a.yaml"), label_b=str(files / "b.yaml")))
    assert data == json.loads(json.dumps(expected)) and not data["equal"]
    layout = next(s for s in data["sections"] if s["name"] == "layout")
    assert {r["field"] for r in layout["rows"]} >= {"pp", "dp"}
    table = moeplan("diff", str(files / "a.yaml"), str(files / "b.yaml"))
    assert table.returncode == 0 and "step time (s)" in table.stdout and "layout" in table.stdout
    # the prediction comes first, before the stage moves (hundreds of lines on the 718B); --summary stops there
    assert table.stdout.index("step time (s)") < table.stdout.index("pp 0 chunk 0")
    short = moeplan("diff", str(files / "a.yaml"), str(files / "b.yaml"), "--summary").stdout
    assert "step time (s)" in short and "pp 0 chunk 0" not in short
    counts = {s["name"]: len(s["rows"]) for s in data["sections"] if s["name"] != "prediction"}
    assert [line for line in short.splitlines() if line.endswith(" differ")] == [
        f"{name}: {n} row{'s' * (n != 1)} differ" for name, n in counts.items()]
    assert short.rstrip().endswith("(`moeplan diff` without --summary lists the rows)")


def test_different_models_are_diffed_with_a_warning(pp2, make_spec):
    wide = compile_tiny(spec=make_spec(name="tiny-pangu-wide", hidden_size=128), pp=2, vpp=2, micro_batch=2)
    d = diff_plans(pp2, wide)
    assert len(d.warnings) == 1 and "different models" in d.warnings[0]
    rows = section(d, "model and target")
    assert (rows["spec.hidden_size"].a, rows["spec.hidden_size"].b) == (64, 128)
    assert rows["model"].b == "tiny-pangu-wide" and "target fingerprint" not in rows
    assert section(d, "prediction")["step time"].b == wide.prediction.step_time_s


def test_floats_within_the_tolerance_are_equal(pp2):
    def with_step(factor):
        return pp2.model_copy(update={"prediction": pp2.prediction.model_copy(
            update={"step_time_s": pp2.prediction.step_time_s * factor})})

    assert diff_plans(pp2, with_step(1 + 1e-9)).equal
    row = section(diff_plans(pp2, with_step(1 + 1e-3)), "prediction")["step time"]
    assert row.rel == pytest.approx(1e-3) and row.better == "A"


def test_different_targets_are_diffed_with_a_warning(pp2):
    other = compile_tiny(target=load_target("cpu", devices_per_node=2), pp=2, vpp=2, micro_batch=2)
    d = diff_plans(pp2, other)
    assert len(d.warnings) == 1 and "different targets" in d.warnings[0]
    rows = section(d, "model and target")
    assert (rows["target.devices_per_node"].a, rows["target.devices_per_node"].b) == \
        (pp2.target.devices_per_node, 2) and "target fingerprint" in rows


@pytest.mark.parametrize("side", ["A", "B"])
def test_bad_input_exits_2_with_one_line(files, tmp_path, side):
    good = str(files / "a.yaml")
    text = (files / "a.yaml").read_text()
    (tmp_path / "v.yaml").write_text(re.sub(r"^schema_version: \d+", "schema_version: 7", text))
    (tmp_path / "t.yaml").write_text(text[: len(text) // 3])
    (tmp_path / "x.yaml").write_bytes(bytes(range(256)) * 8)
    for name, needle in (("v.yaml", "schema_version=7"), ("t.yaml", "t.yaml"), ("x.yaml", "not a text file")):
        bad = str(tmp_path / name)
        proc = moeplan("diff", *((bad, good) if side == "A" else (good, bad)))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert lines[0].startswith(f"error: plan {side}: ") and needle in lines[0], lines[0]
        assert proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.yaml", "v.yaml", "x.yaml"]
