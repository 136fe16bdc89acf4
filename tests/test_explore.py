"""``moeplan explore``: the SPACE file is validated like every input, the screen's branch and bound keeps the best
shortlist option, the figures it reports are the ones the code computes, and the outputs (CSV, PNG) are written."""
from __future__ import annotations

import csv
import functools
import io
from collections import Counter
from pathlib import Path

import pytest
from inprocess import run_moeplan
import yaml
from hypothesis import given, settings, strategies as hs

from moeplan.explore import Screened, _graph, _screen_group, architectures, explore, load_space, pareto, shortlist
from moeplan.render_explore import pareto_png, to_csv
from moeplan.errors import SpecError
from moeplan.flops import count_params
from moeplan.ir import named_layers
from moeplan.passes.partition_stages import SLOT_KINDS
from moeplan.estimate import estimate_memory, estimate_step, model_cost, slot_weights, stage_params
from moeplan.search import check
from moeplan.spec import load_spec
from moeplan.targets import load_target

TINY = {"name": "tiny", "base": "tiny-pangu",
        "choices": {"num_layers": {"min": 2, "max": 5}, "hidden_size": [64, 96, 128], "num_experts": [4, 8],
                    "top_k": [1, 2]},
        "constraints": {"multiple_of": {"hidden_size": 64}}}


def write(tmp_path: Path, data: object, name: str = "space.yaml") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def edited(**changes: object) -> dict:
    data = yaml.safe_load(yaml.safe_dump(TINY))
    for path, value in changes.items():
        *head, last = path.split("__")
        node = data
        for k in head:
            node = node[k]
        node[last] = value
    return data


@pytest.mark.parametrize("data, needle", [
    (edited(choices__num_layerz=[2]), "space.choices.num_layerz"),
    (edited(choices__hidden_size=[]), "hidden_size: give at least one value"),
    (edited(choices__top_k=[1, 1]), "top_k: values must not repeat"),
    (edited(choices__num_experts=[0, 4]), "num_experts: 0 must be > 0"),
    (edited(choices__num_layers={"min": 5, "max": 2}), "a range needs min <= max"),
    (edited(constraints__multiple_of={"attention": 2}), "'attention' is not an integer model field"),
    (edited(constraints__total_params_b=[5, 1]), "must be [min, max]"),
    (edited(base="no-such-model"), "no-such-model"),
    (edited(choices__num_kv_heads=[2]), "mla attention"),
    ("name: [unclosed", "malformed YAML"),
    ("- a list", "must be a mapping"),
])
def test_bad_space_is_one_line_exit_2_and_nothing_written(tmp_path, data, needle):
    space = write(tmp_path, data)
    proc = run_moeplan("explore", space, "--target", "h100", "--devices", "8", "--out", tmp_path / "out")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert needle in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
    with pytest.raises(SpecError):
        load_space(space)


def test_rejected_combinations_are_counted_by_the_rule_not_its_figures(tmp_path):
    """top_k 8 breaks "top_k must be in 1..num_experts" for 4 and for 6 experts: one reason, both counted, no
    figures in it (SpecError.reason, not a pattern over the message)."""
    space = load_space(write(tmp_path, edited(choices__num_experts=[4, 6, 8], choices__top_k=[2, 8],
                                              choices__hidden_size=[64], constraints__multiple_of={})))
    archs = architectures(space)
    assert archs.rejected == {"top_k must be in 1..num_experts": 4 * 2}


def test_architectures_build_count_and_filter(tmp_path):
    space = load_space(write(tmp_path, edited(constraints__activated_params_b=[0.0001, 1.0])))
    archs = architectures(space)
    assert archs.combinations == 4 * 3 * 2 * 2
    # hidden 96 is not a multiple of 64; the activated floor drops the smallest of the rest
    assert archs.rejected["hidden_size not a multiple of 64"] == 4 * 2 * 2
    assert len(archs.kept) + sum(archs.rejected.values()) == archs.combinations
    for a in archs.kept:
        pc = count_params(a.spec)
        assert (a.total_params, a.activated_params) == (pc.total, pc.activated)
        assert 0.0001 <= a.activated_params / 1e9 <= 1.0
        values = dict(a.values)
        assert a.spec.num_layers == values["num_layers"] and a.spec.top_k == values["top_k"]
    base = load_spec("tiny-pangu")
    shared = load_space(write(tmp_path, edited(choices={"moe_ffn_size": [16, 48]}), "s.yaml"))
    assert [a.spec.shared_ffn_size for a in architectures(shared).kept] == [base.num_shared_experts * 16,
                                                                            base.num_shared_experts * 48]


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    space = load_space(write(tmp_path_factory.mktemp("explore"), TINY))
    return explore(space, target=load_target("h100"), num_devices=8, verify=3, workers=1)


def test_screen_reports_the_best_shortlist_estimate(tiny_result):
    """The branch and bound (estimate floors, then full estimates in floor order) returns what pricing every
    shortlist option in full returns."""
    res = tiny_result
    target = res.target
    options = res.shortlist
    assert options[:res.space.screen_layouts] == tuple(
        shortlist([load_spec("tiny-pangu")], target=target, num_devices=8, keep=res.space.screen_layouts))
    for s in res.screened[::5]:
        spec = res.archs.kept[s.index].spec
        graph = _graph(spec)
        slots = [k for _, k in named_layers(spec)]
        counts = Counter(slots)
        best = None
        for lay, st in options:
            try:
                check(lay, graph=graph, num_devices=8, devices_per_node=target.devices_per_node, num_slots=len(slots))
            except ValueError:
                continue
            cost = model_cost(graph, lay, target, st.dispatcher, st.overlap, counts, {})
            memory = estimate_memory(lay, st, cost, kinds=tuple(slots), target=target, budget=target.memory_bytes,
                                     hidden_size=spec.hidden_size)
            est = estimate_step(lay, st, cost, weights=slot_weights(graph, slots),
                                slots=tuple(int(k in SLOT_KINDS) for k in slots),
                                params=stage_params(lay, graph, counts), target=target, memory=memory)
            if best is None or (not est.fits, est.step_s) < best:
                best = (not est.fits, est.step_s)
        assert s.status == "ok" and (not s.fits, s.step_s) == pytest.approx(best, rel=1e-12)
        assert s.tokens_per_s == pytest.approx(spec.global_batch * spec.seq_len / s.step_s)


def test_verified_are_the_best_screened_compiled_in_full(tiny_result):
    res = tiny_result
    assert len(res.screened) == len(res.archs.kept) and all(s.status == "ok" for s in res.screened)
    best = res.ranked()[:3]
    assert [v.index for v in res.verified] == [s.index for s in best]
    for v in res.verified:
        assert v.status == "ok" and v.step_s > 0 and v.tokens_per_s == pytest.approx(
            res.archs.kept[v.index].spec.global_batch * res.archs.kept[v.index].spec.seq_len / v.step_s)


def test_outputs(tiny_result):
    res = tiny_result
    rows = list(csv.DictReader(io.StringIO(to_csv(res))))
    assert len(rows) == len(res.archs.kept)
    assert [r["name"] for r in rows[:3]] == [res.archs.kept[s.index].spec.name for s in res.ranked()[:3]]
    assert sum(1 for r in rows if r["full_step_s"]) == 3
    for r in rows:
        assert float(r["screen_tokens_per_s"]) > 0 and r["num_layers"] and r["layout"].startswith("tp")
    assert pareto_png(res)[:8] == b"\x89PNG\r\n\x1a\n"
    front = pareto(res)
    ok = [s for s in res.screened if s.status == "ok" and s.fits]
    act = {s.index: res.archs.kept[s.index].activated_params for s in ok}
    for f in front:  # nothing has both more activated parameters and more tokens/s
        assert not any(act[s.index] > act[f.index] and s.tokens_per_s > f.tokens_per_s for s in ok)
    assert [act[f.index] for f in front] == sorted(act[f.index] for f in front)


def test_explore_cli_writes_csv_and_png(tmp_path):
    space = write(tmp_path, edited(choices__num_layers=[2, 3], choices__hidden_size=[64]))
    proc = run_moeplan("explore", space, "--target", "h100", "--devices", "8", "--verify", "1", "--workers", "1",
                       "--out", tmp_path / "out", "--json")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert len((tmp_path / "out" / "results.csv").read_text().splitlines()) == 1 + 2 * 2 * 2
    assert '"verified": 1' in proc.stdout


def test_explore_verifies_in_parallel_and_says_each_as_it_finishes(tmp_path):
    """Two verification compiles at once (one per worker) write the results of one at a time, and each is said on
    stderr as it finishes."""
    space = write(tmp_path, edited(choices__num_layers=[2, 3], choices__hidden_size=[64]))
    runs = {}
    for workers in (1, 2):
        proc = run_moeplan("explore", space, "--target", "h100", "--devices", "8", "--verify", "2", "--workers",
                           workers, "--out", tmp_path / f"out{workers}")
        assert proc.returncode == 0, proc.stderr
        runs[workers] = proc
    said = [line for line in runs[2].stderr.splitlines() if line.startswith("verified ")]
    assert len(said) == 2 and all(" tokens/s, MFU " in line for line in said), runs[2].stderr
    assert (tmp_path / "out1" / "results.csv").read_text() == (tmp_path / "out2" / "results.csv").read_text()


@functools.cache
def _estimate_cases() -> list[tuple]:
    """(layout, strategy, cost, keyword arguments) of estimate_step for tiny-pangu's shortlist on 8 H100s: built
    once, as they do not depend on the load."""
    spec = load_spec("tiny-pangu")
    target = load_target("h100")
    graph = _graph(spec)
    slots = [k for _, k in named_layers(spec)]
    counts = Counter(slots)
    cases = []
    for lay, st in shortlist([spec], target=target, num_devices=8, keep=40):
        cost = model_cost(graph, lay, target, st.dispatcher, st.overlap, counts, {})
        kw = dict(weights=slot_weights(graph, slots), slots=tuple(int(k in SLOT_KINDS) for k in slots),
                  params=stage_params(lay, graph, counts), target=target,
                  memory=estimate_memory(lay, st, cost, kinds=tuple(slots), target=target,
                                         budget=target.memory_bytes, hidden_size=spec.hidden_size))
        cases.append((lay, st, cost, kw))
    return cases


@settings(max_examples=25, deadline=None)
@given(load=hs.floats(1.0, 3.0), more=hs.floats(0.0, 2.0))
def test_estimate_never_falls_as_the_busiest_rank_gets_more(load, more):
    """What the screen's bound relies on: estimate_step is non-decreasing in ``load``."""
    for lay, st, cost, kw in _estimate_cases():
        lo = estimate_step(lay, st, cost, load=load, **kw).step_s
        assert estimate_step(lay, st, cost, load=load + more, **kw).step_s >= lo - 1e-15


def test_screened_defaults():
    s = Screened(0, "no-layout", "why")
    assert s.tokens_per_s == 0.0 and s.layout is None
    assert _screen_group([[], [], load_target("h100"), 8]) == []


@pytest.mark.parametrize("choices, says", [
    ({"num_layers": ["64"]}, "space.choices.num_layers.0='64': Input should be a valid integer"),
    ({"num_layers": [True]}, "space.choices.num_layers.0=True: Input should be a valid integer"),
    ({"num_layers": {"min": 1, "max": 4096}, "hidden_size": {"min": 1, "max": 2**20},
      "num_experts": {"min": 1, "max": 2**20}}, "4,503,599,627,370,496 combinations of hidden_size, num_experts, "
                                                 "num_layers; a space may hold at most 100,000"),  # the file's order
    ({"num_layers": {"min": 1, "max": 2**40}}, "1,099,511,627,776 combinations of num_layers"),
    ({"num_layers": list(range(1, 400)), "hidden_size": list(range(64, 64 * 300, 64))}, "119,301 combinations"),
])
def test_a_space_is_strict_and_bounded(tmp_path, choices, says):
    """Issue 34: explore read "64" as 64 where model files are strict, and a 4096 x 2^20 x 2^20 space printed
    nothing for minutes; each is refused when the file is read, with one line (the 2^40 range before its list)."""
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": "tiny-pangu", "choices": choices}))
    with pytest.raises(SpecError) as e:
        load_space(path)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
