"""``moeplan timeline``: the trace is valid Trace Event Format with one process per PP rank and one track per stream,
every computing action appears once, the step ends where the plan says, the memory curve peaks at the plan's
figure, the PNG is drawn, and bad plan files exit 2 with one line."""
import json
from collections import Counter, defaultdict

import pytest
from inprocess import run_moeplan
from matplotlib.image import imread
from typer.testing import CliRunner

from moeplan.actions import compute_parts
from moeplan.cli import app
from moeplan.compile import compile_model
from moeplan.gantt import DPI, FIGSIZE_IN, step_timeline, trace_document, write_timeline
from moeplan.plan import SCHEMA_VERSION, save_plan
from moeplan.replay import plan_timeline
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.targets import load_target

# Trace Event Format (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU): the phases
# it defines, and the metadata event names with the one argument each carries
PHASES = set("BEXiICbneSTpFstfPONDMVvRc()")
METADATA_ARGS = {"process_name": ("name", str), "process_labels": ("labels", str), "process_sort_index":
                 ("sort_index", int), "thread_name": ("name", str), "thread_sort_index": ("sort_index", int)}
TOL_US = 1e-6


def check_trace(doc: dict) -> None:
    """Assert ``doc`` is a Trace Event Format document in the JSON Object Format, as the format document defines
    it: ``traceEvents`` a list of events; each event has a one-character ``ph`` among the defined phases, a string
    ``name``, integer ``pid`` / ``tid``, an object ``args`` and a string ``cat`` when present; a complete event
    (``X``) a number ``ts`` and ``dur``, both >= 0; a metadata event (``M``) one of the defined names with its
    argument of the right type; ``displayTimeUnit`` "ms" or "ns". And what a viewer needs to draw it: complete
    events on one thread nest (the duration events' rule), every thread and process that holds events is named."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    named_threads, named_procs, spans = set(), set(), defaultdict(list)
    for e in doc["traceEvents"]:
        assert isinstance(e, dict) and isinstance(e.get("ph"), str) and len(e["ph"]) == 1 and e["ph"] in PHASES, e
        assert isinstance(e.get("name"), str) and e["name"], e
        assert type(e.get("pid")) is int and type(e.get("tid")) is int, e
        assert isinstance(e.get("args", {}), dict) and isinstance(e.get("cat", ""), str), e
        if e["ph"] == "X":
            for k in ("ts", "dur"):
                assert type(e.get(k)) in (int, float) and e[k] >= 0, e
            spans[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
        elif e["ph"] == "M":
            assert e["name"] in METADATA_ARGS, e
            key, typ = METADATA_ARGS[e["name"]]
            assert type(e["args"].get(key)) is typ, e
            if e["name"] == "thread_name":
                named_threads.add((e["pid"], e["tid"]))
            elif e["name"] == "process_name":
                named_procs.add(e["pid"])
        else:
            pytest.fail(f"moeplan writes only complete and metadata events, not {e}")
    assert set(spans) <= named_threads and {p for p, _ in spans} <= named_procs
    for key, intervals in spans.items():
        stack: list[float] = []
        for start, end in sorted(intervals, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1] <= start + TOL_US:
                stack.pop()
            assert not stack or end <= stack[-1] + TOL_US, f"track {key}: [{start}, {end}] crosses a slice"
            stack.append(end)


def tiny(target: str, **fixed):
    return compile_model(spec=load_spec("tiny-pangu"), target=load_target(target), num_devices=4,
                         fixed=Fixed(global_batch=8, seq_len=64, pp=2, vpp=2, **fixed), workers=1).plan


@pytest.fixture(scope="module")
def plans():
    """pp 2 vpp 2 interleaved on the cpu target without overlap pairs, without and with full recompute, and with
    ``fb`` on h100: that one has OVERLAP_F_B pairs, EP all-to-alls on the intra-node link and DP collectives hidden
    under compute."""
    plain = dict(schedule="interleaved", overlap=frozenset({"pp"}))
    return {"cpu": tiny("cpu", **plain), "full": tiny("cpu", recompute="full", **plain),
            "fb": tiny("h100", micro_batch=1, ep=2, overlap=frozenset({"fb", "shared-expert", "dp"}))}


@pytest.fixture(scope="module")
def written(plans, tmp_path_factory):
    out = {}
    for name, plan in plans.items():
        d = tmp_path_factory.mktemp(name)
        st = write_timeline(plan, str(d / "trace.json"), str(d / "gantt.png"))
        out[name] = (st, json.loads((d / "trace.json").read_text()), d / "gantt.png")
    return out


@pytest.mark.parametrize("name", ["cpu", "fb"])
def test_trace_is_valid_with_a_process_per_rank_and_a_track_per_stream(plans, written, name):
    plan, (_, doc, _) = plans[name], written[name]
    check_trace(doc)
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert procs == {r: f"pp rank {r}" for r in range(plan.layout.pp)}
    order = {e["pid"]: e["args"]["sort_index"] for e in meta if e["name"] == "process_sort_index"}
    assert order == {r: r for r in range(plan.layout.pp)}
    threads = [(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name"]
    assert len(threads) == len(set(threads))  # one track per (rank, stream)
    tl = plan_timeline(plan).timeline
    for r in range(plan.layout.pp):
        streams = {f"comm {s.stream}" for s in tl.segment_events if s.rank == r and s.stream != "compute"}
        sends = {"p2p send"} if any(e.rank == r and e.stream == "comm" for e in tl.events) else set()
        assert {t for p, t in threads if p == r} == {"compute", "dp + optimizer"} | streams | sends
    if name == "fb":
        assert any(t == "comm intra" for _, t in threads)


@pytest.mark.parametrize("name", ["cpu", "fb"])
def test_every_computing_action_appears_once_with_its_segments(plans, written, name):
    plan, (_, doc, _) = plans[name], written[name]
    tl = plan_timeline(plan).timeline
    for r, actions in enumerate(plan.schedule.actions):
        shown = Counter(e["name"] for e in doc["traceEvents"] if e.get("cat") == "action" and e["pid"] == r)
        assert shown == Counter(a for a in actions if compute_parts(a))
        segments = [e for e in doc["traceEvents"] if e.get("cat") == "segment" and e["pid"] == r]
        assert len(segments) == sum(1 for s in tl.segment_events if s.rank == r and s.stream == "compute")
        assert {e["args"]["kind"] for e in segments} <= {"F", "B", "I", "W"}
    kinds = {e["args"]["kind"] for e in doc["traceEvents"] if e.get("cat") == "action"}
    assert kinds == ({"F", "B", "OVERLAP_F_B"} if name == "fb" else {"F", "B"})
    if name == "fb":  # collectives carry their comm class and bytes
        coll = [e["args"] for e in doc["traceEvents"] if e.get("cat") == "collective"]
        assert coll and {"ep"} <= {a["comm_class"] for a in coll} and all(a["bytes"] > 0 for a in coll)


@pytest.mark.parametrize("name", ["cpu", "fb"])
def test_last_event_ends_at_the_predicted_step(plans, written, name):
    plan, (_, doc, _) = plans[name], written[name]
    ends = defaultdict(float)
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            ends[e["cat"] in ("dp", "optimizer")] = max(ends[e["cat"] in ("dp", "optimizer")], e["ts"] + e["dur"])
    assert ends[False] == pytest.approx(plan_timeline(plan).timeline.step_time_s * 1e6, abs=2e-3)  # the pipeline
    assert ends[True] == pytest.approx(plan.prediction.step_time_s * 1e6, abs=2e-3)  # + DP and the optimizer
    assert doc["otherData"]["predicted_step_s"] == plan.prediction.step_time_s


@pytest.mark.parametrize("name, mode", [("cpu", "none"), ("full", "full")])
def test_memory_curve_peaks_at_the_plans_activation_figure(plans, written, name, mode):
    plan, st = plans[name], written[name][0]
    for r, m in enumerate(st.memory):
        assert plan.memory.ranks[r].recompute == mode and (m.working_set_bytes > 0) == (mode == "full")
        pm = plan.memory.ranks[r]  # the cpu target's allocator takes no share: the plan's bytes as they are
        assert m.activation_peak_bytes == pytest.approx(pm.activation_bytes + pm.working_set_bytes, abs=1)
        assert max(m.bytes_at) == pytest.approx(pm.total_bytes, abs=2)
        assert m.bytes_at[-1] == pytest.approx(m.static_bytes + m.working_set_bytes)  # every micro-batch freed


def test_memory_curve_follows_the_simulated_order_under_fb(plans, written):
    """With fb pairs the simulator starts a pair's forward before the previous pair's backward ends, so the timed
    peak can exceed the action-order peak the memory plan walks; the curve is the simulator's."""
    plan, st = plans["fb"], written["fb"][0]
    tl = plan_timeline(plan).timeline
    for r, m in enumerate(st.memory):
        grow = 1 + plan.target.memory_overheads.allocator_fraction  # the allocator's share of transient bytes
        assert m.activation_peak_bytes == pytest.approx(grow * tl.peak_activation_bytes[r] + m.working_set_bytes)
        pm = plan.memory.ranks[r]
        assert m.activation_peak_bytes >= grow * (pm.activation_bytes + pm.working_set_bytes) - 1


@pytest.mark.parametrize("name", ["cpu", "fb"])
def test_png_is_drawn(written, name):
    path = written[name][2]
    assert path.stat().st_size > 30_000
    pixels = imread(path)
    assert pixels.shape[:2] == (round(FIGSIZE_IN[1] * DPI), round(FIGSIZE_IN[0] * DPI))
    assert pixels[..., :3].var() > 0.01  # not blank


def test_exposed_swap_gets_its_track(plans):
    """A per-tensor plan whose swap the host link does not hide: the copy out ends each forward, the prefetch
    starts each backward (B or I), with the plan's seconds."""
    plan = tiny("h100", micro_batch=1, recompute="ilp")
    ranks = [m.model_copy(update={"exposed_swap_s": [[1e-4, 2e-4]] * plan.layout.vpp}) for m in plan.memory.ranks]
    plan = plan.model_copy(update={"memory": plan.memory.model_copy(update={"ranks": ranks})})
    st = step_timeline(plan)
    check_trace(trace_document(st))
    for r, actions in enumerate(plan.schedule.actions):
        swaps = [s for s in st.slices if s.rank == r and s.cat == "swap"]
        parts = Counter(p.kind for a in actions for p in compute_parts(a))
        assert Counter(s.name.split()[1] for s in swaps) == {"swap": parts["F"], "prefetch": parts["B"] + parts["I"]}
        assert all(s.end_s - s.start_s == pytest.approx(1e-4 if "swap" in s.name else 2e-4) for s in swaps)
        assert "swap (exposed)" in st.tracks[r]


def test_cli_writes_the_trace_and_the_png(plans, tmp_path):
    save_plan(plans["cpu"], tmp_path / "plan.yaml")
    res = CliRunner().invoke(app, ["timeline", str(tmp_path / "plan.yaml"), "-o", str(tmp_path / "t.json"),
                                   "--png", str(tmp_path / "t.png")])
    assert res.exit_code == 0, res.output
    check_trace(json.loads((tmp_path / "t.json").read_text()))
    assert (tmp_path / "t.png").stat().st_size > 30_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.yaml", "t.json", "t.png"]  # no temp file left


@pytest.mark.parametrize("case, needle", [("version", "schema_version=7"), ("truncated", "plan"),
                                          ("binary", "plan")])
def test_bad_plan_files_exit_2_with_one_line(plans, tmp_path, case, needle):
    save_plan(plans["cpu"], tmp_path / "plan.yaml")
    text = (tmp_path / "plan.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    if case == "version":
        bad.write_text(text.replace(f"schema_version: {SCHEMA_VERSION}", "schema_version: 7"))
    elif case == "truncated":
        bad.write_text(text[: len(text) // 2])
    else:
        bad.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\x80")
    proc = run_moeplan("timeline", bad, "-o", tmp_path / "t.json", "--png", tmp_path / "t.png")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr and needle in lines[0], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "plan.yaml"]
