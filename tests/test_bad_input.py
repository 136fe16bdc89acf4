"""Bad input never gets a traceback (docs/inputs.md).

Property-based: malformed model YAML, HF config.json, target YAML and plan YAML (wrong types, a float where a size
is expected, missing and extra keys, huge and negative numbers, NaN and infinity, non-UTF-8 bytes, wrong top-level
types) are each refused by their loader with our ValueError subclass and a one-line message naming the field (300
inputs per loader), and through the CLI with exit 2, one line on stderr and no file written (a sample). Then the
two tracebacks seen with valid input, the last-resort guard, and the layout messages.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import sys
import time
from importlib import resources
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplan.cli import main
from moeplan.errors import LayoutError, MoeplanError, OutputError, PlanError, SpecError, TargetError
from moeplan.files import write_atomic
from moeplan.layout import REASONS, Rejection, check_fixed_degrees
from moeplan.plan import Plan, load_plan
from moeplan.spec import HFConfig, ModelSpec, load_spec
from moeplan.targets import Efficiency, LaunchCost, Link, Target, load_target

PER_LOADER = settings(max_examples=300, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
CLI_SAMPLE = settings(max_examples=12, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

_MODELS = resources.files("moeplan.examples") / "models"
_TARGETS = resources.files("moeplan.targets")


def _yaml(name):
    return yaml.safe_load((_MODELS / name).read_text()) if name.endswith(".yaml") else json.loads(
        (_MODELS / name).read_text())


OURS = [_yaml("tiny-pangu.yaml"), _yaml("llama3-70b.yaml")]
HF = [_yaml("deepseek-v3/config.json"), _yaml("qwen3-30b-a3b/config.json")]
TARGETS = [yaml.safe_load((_TARGETS / f"{n}.yaml").read_text()) for n in ("h100", "cpu")]  # no variants


@functools.cache
def _plan_doc() -> dict:
    from moeplan.compile import compile_model
    from moeplan.search import Fixed

    plan = compile_model(spec=load_spec("tiny-pangu"), target=load_target("cpu"), num_devices=4,
                         fixed=Fixed(global_batch=8, seq_len=64, pp=2, vpp=2), workers=1).plan
    return plan.model_dump(mode="json")


def _int_fields(model) -> set[str]:
    return {n for n, f in model.model_fields.items() if f.annotation in (int, int | None)}


# ---- malformed documents ----------------------------------------------------------------------------------------
def _leaves(doc, path=()):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _leaves(v, (*path, i))
    else:
        yield path, doc


def _replace(doc, path, value):
    if not path:
        return value
    out = dict(doc) if isinstance(doc, dict) else list(doc)
    out[path[0]] = _replace(doc[path[0]], path[1:], value)
    return out


def _delete(doc, path):
    out = dict(doc)
    if len(path) == 1:
        del out[path[0]]
    else:
        out[path[0]] = _delete(doc[path[0]], path[1:])
    return out


# lists non-empty: a field that names a set by a string may take the empty set as a list (runtime.overlap: "all",
# or [] for a runtime that overlaps nothing)
_CONTAINERS = st.one_of(st.lists(st.integers(), min_size=1, max_size=3),
                        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_NUMBER = (int, float)


def _is_number(v) -> bool:
    return isinstance(v, _NUMBER) and not isinstance(v, bool)


def _wrong_type(v, *, lax: bool):
    """Values of another type than ``v``'s; ``lax`` (the plan, validated without strict mode): containers only,
    since a lax int field takes "12"."""
    if lax:  # a non-empty list of strings: no scalar, mapping or curve of points takes it
        return _CONTAINERS if v is not None else st.lists(st.text(max_size=3), min_size=1, max_size=2)
    if isinstance(v, bool):
        return st.one_of(st.text(max_size=8), st.integers(), st.floats(), _CONTAINERS)
    if _is_number(v):
        return st.one_of(st.text(max_size=8), st.booleans(), _CONTAINERS)
    if isinstance(v, str):
        return st.one_of(st.integers(), st.floats(), st.booleans(), _CONTAINERS)
    return st.one_of(st.text(max_size=8), _CONTAINERS)


_BAD_UTF8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80abc", b"\xf8\x88\x80\x80\x80"])
_TOP_LEVEL = st.one_of(st.lists(st.integers(), max_size=3), st.text(max_size=10), st.integers(), st.floats(),
                       st.none(), st.booleans())
_KEY = st.text(min_size=1, max_size=12)


def draw_malformed(data, doc, *, kinds, ints=(), huge_floats=False, required=(), known=(), extra_in=((),),
                   leaf_ok=lambda path: True, lax=False):
    """(document or raw bytes, kind, the name the error must carry or None): ``doc`` broken in one way of
    ``kinds``. ``ints``: the int-typed leaf names; ``required``: key paths whose removal is an error; ``known``:
    names an extra key must not take; ``extra_in``: the mappings an extra key may go into; ``leaf_ok``: the leaves
    a value may be changed at; ``huge_floats``: every float field has an upper bound."""
    kind = data.draw(st.sampled_from(kinds), label="kind")
    leaves = [(p, v) for p, v in _leaves(doc) if p and leaf_ok(p)]
    numbers = [(p, v) for p, v in leaves if _is_number(v)]
    if kind == "non_utf8":
        return ("utf8", data.draw(_BAD_UTF8), data.draw(st.floats(0, 1))), kind, None
    if kind == "top_level":
        return data.draw(_TOP_LEVEL, label="document"), kind, None
    if kind == "missing":
        path = data.draw(st.sampled_from(required), label="missing")
        return _delete(doc, path), kind, str(path[-1])
    if kind == "extra":
        where = data.draw(st.sampled_from(extra_in), label="in")
        key = data.draw(_KEY.filter(lambda k: k not in known), label="key")
        inner = _replace(doc, where, {**_at(doc, where), key: data.draw(st.integers() | st.text(max_size=5))})
        return inner, kind, key if key.isprintable() else None
    if kind == "wrong_type":
        path, v = data.draw(st.sampled_from(leaves), label="leaf")
        return _replace(doc, path, data.draw(_wrong_type(v, lax=lax), label="value")), kind, _name(path)
    candidates = {"float_for_int": [(p, v) for p, v in numbers if p[-1] in ints],
                  "huge": [(p, v) for p, v in numbers if p[-1] in ints or huge_floats],
                  "negative": numbers, "nan_inf": numbers}[kind]
    path, _ = data.draw(st.sampled_from(candidates), label="leaf")
    value = data.draw({"float_for_int": st.floats(allow_nan=False, allow_infinity=False),
                       "huge": st.integers(2**64, 10**40) | (st.floats(1e19, 1e300) if huge_floats else st.nothing()),
                       "negative": st.integers(max_value=-1) | st.floats(-1e300, -1e-9),
                       "nan_inf": st.sampled_from([math.nan, math.inf, -math.inf])}[kind], label="value")
    return _replace(doc, path, value), kind, _name(path)


def _at(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def _name(path) -> str:
    return next(str(p) for p in reversed(path) if isinstance(p, str))


def write(tmp: Path, name: str, doc, *, as_json: bool = False) -> Path:
    """Write ``doc`` (or, for ``("utf8", bad bytes, where)``, a valid-looking document with bad bytes inside)."""
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(doc, tuple) and doc[:1] == ("utf8",):
        text = (json.dumps(HF[0]) if as_json else yaml.safe_dump(OURS[0])).encode()
        at = int(doc[2] * len(text))
        path.write_bytes(text[:at] + doc[1] + text[at:])
    else:
        path.write_text(json.dumps(doc) if as_json else yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    return path


def assert_refused(load, path: Path, error: type[MoeplanError], name: str | None) -> str:
    with pytest.raises(error) as exc:
        load(path)
    msg = str(exc.value)
    assert isinstance(exc.value, ValueError) and msg and msg.isprintable() and len(msg) < 400, msg
    if name is not None:
        assert name in msg, msg
    return msg


ALL_KINDS = ("wrong_type", "float_for_int", "missing", "extra", "huge", "negative", "nan_inf", "non_utf8",
             "top_level")
OURS_REQUIRED = [(n,) for n, f in ModelSpec.model_fields.items() if f.is_required() and n != "name"]
HF_REQUIRED = [(n,) for n, f in HFConfig.model_fields.items() if f.is_required()]
TARGET_REQUIRED = ([(n,) for n, f in Target.model_fields.items() if f.is_required()]
                   + [("intra_node", "latency_s"), ("inter_node", "bandwidth_bytes_per_s")])
TARGET_KNOWN = {"variants", "default_variant"}.union(*(m.model_fields for m in (Target, Link, Efficiency, LaunchCost)))


# ---- the loaders: 300 malformed inputs each --------------------------------------------------------------------
@PER_LOADER
@given(data=st.data())
def test_model_yaml_refused(tmp_path, data):
    doc = data.draw(st.sampled_from(OURS), label="base")
    bad, kind, name = draw_malformed(data, doc, kinds=ALL_KINDS, ints=_int_fields(ModelSpec),
                                     required=OURS_REQUIRED, known=set(ModelSpec.model_fields))
    assert_refused(load_spec, write(tmp_path, "m.yaml", bad), SpecError, name)


@PER_LOADER
@given(data=st.data())
def test_hf_config_refused(tmp_path, data):
    doc = data.draw(st.sampled_from(HF), label="base")
    known = set(HFConfig.model_fields)
    kinds = tuple(k for k in ALL_KINDS if k != "extra")  # an HF config may hold any other key: it is ignored
    bad, kind, name = draw_malformed(data, doc, kinds=kinds, ints=_int_fields(HFConfig), required=HF_REQUIRED,
                                     leaf_ok=lambda p: p[0] in known)
    assert_refused(load_spec, write(tmp_path, "m/config.json", bad, as_json=True), SpecError, name)


@PER_LOADER
@given(data=st.data())
def test_target_yaml_refused(tmp_path, data):
    doc = data.draw(st.sampled_from(TARGETS), label="base")
    bad, kind, name = draw_malformed(data, doc, kinds=ALL_KINDS, ints={"devices_per_node", "matmul_alignment"},
                                     huge_floats=True, required=TARGET_REQUIRED, known=TARGET_KNOWN,
                                     extra_in=[(), ("intra_node",), ("efficiency",), ("launch",)])
    assert_refused(lambda p: load_target(str(p)), write(tmp_path, "t.yaml", bad), TargetError, name)


_PLAN_LAYOUT_INTS = {"tp", "pp", "cp", "dp", "num_devices"}


@PER_LOADER
@given(data=st.data())
def test_plan_yaml_refused(tmp_path, data):
    doc = _plan_doc()
    kind = data.draw(st.sampled_from(ALL_KINDS), label="family")
    # what a plan field's schema refuses for certain: any container for a scalar; NaN and infinity anywhere;
    # negative and huge degrees of the layout (>= 1, and tp·cp·dp·pp = num_devices); the spec's own bounds
    spec_ints = _int_fields(ModelSpec)
    if kind in ("huge", "float_for_int", "negative"):
        layout = kind != "float_for_int"  # the layout is validated lax: 2.0 is a valid tp
        ok = (lambda p: layout and p[:1] == ("layout",) and p[-1] in _PLAN_LAYOUT_INTS or p[:2] == ("model", "spec"))
        bad, kind, name = draw_malformed(data, doc, kinds=(kind,), ints=spec_ints | _PLAN_LAYOUT_INTS, leaf_ok=ok)
    else:
        bad, kind, name = draw_malformed(
            data, doc, kinds=(kind,), lax=True, known=set(Plan.model_fields),
            required=[(n,) for n, f in Plan.model_fields.items() if f.is_required()] + [("layout", "tp")])
        name = None if kind == "wrong_type" else name  # a container at schema_version is refused by its check
    assert_refused(load_plan, write(tmp_path, "p.yaml", bad), PlanError, name)


def test_yaml_that_would_crash_the_reader(tmp_path):
    """Deep nesting (libyaml's C composer would overflow its stack), an alias inside its own anchor, a billion
    laughs, a date that cannot be: one line each."""
    laughs = "a: &a [1,1,1,1,1,1,1,1,1,1]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(9))
    for text, needle in (("[" * 60_000, "nested too deeply"), ("- " * 60_000 + "x", "nested too deeply"),
                         ("a: &a [*a]\n", "contains itself"), (laughs, "expanding"),
                         ("vocab_size: 2024-13-45\n", "month must be in 1..12")):
        (tmp_path / "m.yaml").write_text(text)
        assert needle in assert_refused(load_spec, tmp_path / "m.yaml", SpecError, "malformed YAML")


def test_a_long_comment_is_read_by_libyaml(tmp_path, monkeypatch):
    """A 20 MB comment line sent the file to PyYAML's pure-Python loader (49-77 s): the depth bound counted the
    longest line. It counts a line's indentation and indicators now; the deep cases above still fall back."""
    from moeplan import files

    monkeypatch.setattr(files, "_PURE_LOADER", None)  # yaml.load(Loader=None) fails: the fallback would be seen
    model = tmp_path / "m.yaml"
    model.write_text((_MODELS / "tiny-pangu.yaml").read_text() + "# " + "x" * 20_000_000 + "\n")
    assert load_spec(str(model)).num_layers == load_spec("tiny-pangu").num_layers
    assert files._depth_bound("- " * 60_000 + "x") > files.MAX_DEPTH  # "- - - x" still nests per indicator


def test_a_run_count_is_bounded_before_it_is_expanded(tmp_path):
    """``0F0*2000000000`` in a schedule line is refused from its count, before a single action is expanded: a line
    holds at most 9 actions per chunk and micro-batch of the plan's layout (moeplan/plan_schedule.py)."""
    doc = _plan_doc()
    limit = 9 * doc["layout"]["vpp"] * doc["layout"]["num_microbatches"]
    doc = {**doc, "schedule": {**doc["schedule"], "ranks": ["0F0*2000000000", *doc["schedule"]["ranks"][1:]]}}
    t0 = time.perf_counter()
    msg = assert_refused(load_plan, write(tmp_path, "p.yaml", doc), PlanError, "schedule.ranks[0]")
    assert time.perf_counter() - t0 < 5 and f"more than {limit} actions" in msg, msg
    # a layout too large to trust still bounds the line (64 chunks and 4096 micro-batches)
    doc["layout"] = {**doc["layout"], "num_microbatches": 10**12}
    assert f"more than {9 * 64 * 4096} actions" in assert_refused(load_plan, write(tmp_path, "q.yaml", doc),
                                                                   PlanError, "schedule.ranks[0]")


def _swap_layers(doc: dict) -> None:
    """Swap the first two layers of the first chunk that holds two."""
    names = next(c for rank in doc["stages"]["chunks"] for c in rank if len(c) >= 2)
    names[0], names[1] = names[1], names[0]


def _head_first(doc: dict) -> None:
    """Move ``head`` to the front of its chunk."""
    chunk = next(c for rank in doc["stages"]["chunks"] for c in rank if "head" in c)
    chunk.remove("head")
    chunk.insert(0, "head")


def _newline_in_empty_layer(doc: dict) -> None:
    """Rename the first empty layer to a name with a line break, where it is listed and where it sits."""
    old = doc["stages"]["empty_layers"][0]
    new = old + "\ntouch pwned"
    doc["stages"]["empty_layers"][0] = new
    for rank in doc["stages"]["chunks"]:
        for chunk in rank:
            chunk[:] = [new if n == old else n for n in chunk]


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d["layout"].update(global_batch=2 * d["layout"]["global_batch"]),
     "layout.global_batch=16: must equal dp·micro_batch·num_microbatches = 2·4·1 = 8 sequences"),
    (lambda d: d["layout"].update(seq_len=128), "layout.seq_len=128: must equal the model's seq_len (64)"),
    (_swap_layers, "along the stages; each stage holds a contiguous run of the model's layers"),
    (lambda d: d["prediction"].update(step_time_s=-d["prediction"]["step_time_s"]), "prediction.step_time_s="),
    (lambda d: d["prediction"].update(mfu=-0.1), "prediction.mfu=-0.1"),
    (lambda d: d["prediction"]["exposed_comm_s"].update(ep=-1.0), "prediction.exposed_comm_s.ep=-1.0"),
    (_head_first, "comes after 'head' along the stages"),
    (_newline_in_empty_layer, "a plan's text is one line of printable characters"),
    (lambda d: d["target"].update(memory_bytes=1), "target.memory_bytes=1: below the plan's memory budget"),
], ids=["global_batch", "seq_len", "layer_order", "negative_step", "negative_mfu", "negative_exposed", "head_first",
        "newline_in_empty_layer", "memory_bytes_1"])
def test_a_plan_is_checked_whole(tmp_path, edit, needle):
    """What the schema alone accepts but no compile makes: the batch arithmetic, the shape the spec was compiled
    for, the layers' order (``head`` first in its chunk), a line break in an empty layer's name, a device smaller
    than the plan's memory budget, negative predictions (each was simulated or run: issue 34)."""
    doc = copy.deepcopy(_plan_doc())
    edit(doc)
    assert needle in assert_refused(load_plan, write(tmp_path, "p.yaml", doc), PlanError, None)


def test_a_key_written_twice_in_a_plan_is_refused(tmp_path):
    """The last of two ``memory_bytes`` keys won in silence (issue 34): every reader refuses a duplicate key."""
    text = yaml.safe_dump(_plan_doc(), sort_keys=False)
    text = text.replace("  memory_bytes: ", "  memory_bytes: 1\n  memory_bytes: ", 1)
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert "duplicate key 'memory_bytes'" in assert_refused(load_plan, path, PlanError, None)


# ---- the CLI: exit 2, one line, nothing written ----------------------------------------------------------------
def run(monkeypatch, capsys, *args) -> tuple[int, str]:
    """``moeplan ARGS`` in this process: (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", ["moeplan", *map(str, args)])
    with pytest.raises(SystemExit) as exc:
        main()
    return exc.value.code, capsys.readouterr().err


def assert_one_line(code: int, stderr: str, expect: int, *needles: str) -> str:
    lines = stderr.strip().splitlines()
    assert code == expect and len(lines) == 1 and "Traceback" not in stderr, stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@CLI_SAMPLE
@given(data=st.data(), which=st.sampled_from(["model", "hf", "target", "plan"]))
def test_cli_refuses_malformed_files(tmp_path, monkeypatch, capsys, data, which):
    for old in tmp_path.rglob("*"):
        if old.is_file():
            old.unlink()
    out = tmp_path / "plan.yaml"
    if which == "model":
        bad, _, _ = draw_malformed(data, OURS[0], kinds=ALL_KINDS, ints=_int_fields(ModelSpec),
                                   required=OURS_REQUIRED, known=set(ModelSpec.model_fields))
        args = ["compile", write(tmp_path, "m.yaml", bad), "--target", "cpu", "--devices", 4, "-o", out]
    elif which == "hf":
        bad, _, _ = draw_malformed(data, HF[0], kinds=[k for k in ALL_KINDS if k != "extra"],
                                   ints=_int_fields(HFConfig), required=HF_REQUIRED,
                                   leaf_ok=lambda p: p[0] in HFConfig.model_fields)
        args = ["describe", write(tmp_path, "m/config.json", bad, as_json=True)]
    elif which == "target":
        bad, _, _ = draw_malformed(data, TARGETS[0], kinds=ALL_KINDS, ints={"devices_per_node"}, huge_floats=True,
                                   required=TARGET_REQUIRED, known=TARGET_KNOWN)
        args = ["compile", "tiny-pangu", "--target", write(tmp_path, "t.yaml", bad), "--devices", 4, "-o", out]
    else:
        bad, _, _ = draw_malformed(data, _plan_doc(), kinds=["wrong_type", "missing", "extra", "nan_inf",
                                                             "non_utf8", "top_level"], lax=True,
                                   known=set(Plan.model_fields), required=[("layout",), ("schedule",)])
        args = ["simulate", write(tmp_path, "p.yaml", bad)]
    before = sorted(tmp_path.rglob("*"))
    assert_one_line(*run(monkeypatch, capsys, *args), 2)
    assert sorted(tmp_path.rglob("*")) == before and not out.exists()


# ---- tracebacks seen with valid input ---------------------------------------------------------------------------
def test_output_folder_missing_or_a_folder(tmp_path, monkeypatch, capsys):
    for target, needle in ((tmp_path / "no" / "x.yaml", "does not exist"), (tmp_path, "is a folder")):
        code, stderr = run(monkeypatch, capsys, "compile", "tiny-pangu", "--target", "cpu", "--devices", 4, "-o",
                           target)
        assert_one_line(code, stderr, 2, f"output={str(target)!r}", needle)
    with pytest.raises(OutputError, match="cannot write"):
        write_atomic(tmp_path / "no" / "x.yaml", "text")
    assert list(tmp_path.iterdir()) == []


def test_pipeline_without_simulate(tmp_path, monkeypatch, capsys):
    pipeline = "shard,partition-stages,place-experts,schedule,plan-memory"
    code, stderr = run(monkeypatch, capsys, "compile", "tiny-pangu", "--target", "cpu", "--devices", 4,
                       "--pipeline", pipeline, "-o", tmp_path / "p.yaml")
    assert_one_line(code, stderr, 2, f"pipeline={pipeline!r}", "needs prediction")
    from moeplan.compile import compile_model
    from moeplan.search import Fixed

    with pytest.raises(PlanError, match="needs experts"):  # a pipeline that simulates but places no experts
        compile_model(spec=load_spec("tiny-pangu"), target=load_target("cpu"), num_devices=2, workers=1,
                      pipeline="shard,partition-stages,schedule,plan-memory,simulate",
                      fixed=Fixed(global_batch=8, seq_len=64, pp=2))
    assert list(tmp_path.iterdir()) == []


def test_internal_error_is_one_line_and_debug_shows_the_traceback(monkeypatch, capsys):
    import moeplan.describe

    def broken(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(moeplan.describe, "describe_model", broken)
    line = assert_one_line(*run(monkeypatch, capsys, "describe", "tiny-pangu"), 1, "internal error",
                           "`moeplan describe`", "RuntimeError: boom second line", "--debug")
    assert line.startswith("error: ")
    code, stderr = run(monkeypatch, capsys, "--debug", "describe", "tiny-pangu")
    assert code == 1 and "Traceback" in stderr and stderr.strip().splitlines()[-1] == line
    # --debug belongs to its invocation: the next one in this process prints the one line again
    assert assert_one_line(*run(monkeypatch, capsys, "describe", "tiny-pangu"), 1, "internal error") == line


# ---- layout messages that explain -------------------------------------------------------------------------------
def test_fixed_degrees_that_fit_no_layout():
    with pytest.raises(LayoutError, match=r"^devices=100: must be a multiple of tp·pp = 128 \(tp=8, pp=16\)$"):
        check_fixed_degrees(100, tp=8, pp=16)
    with pytest.raises(LayoutError, match=r"^ep=7: must divide dp·cp, .* the device count \(6144\), which 7 does "
                                          r"not divide$"):
        check_fixed_degrees(6144, ep=7)
    with pytest.raises(LayoutError, match=r"devices/tp = 6144/8 = 768, which 7"):
        check_fixed_degrees(6144, tp=8, ep=7)
    with pytest.raises(LayoutError, match=r"devices=2000000: must be <= 2\^20"):
        check_fixed_degrees(2_000_000)
    check_fixed_degrees(6144, tp=8, pp=16, ep=4)  # Pangu Ultra MoE's layout fits


def test_layout_messages_through_the_cli(monkeypatch, capsys):
    for args, needles in (
            (["--devices", 100, "--tp", 8, "--pp", 16], ["devices=100: must be a multiple of tp·pp = 128"]),
            (["--devices", 12, "--ep", 7], ["ep=7", "device count (12), which 7 does not divide"]),
            (["--devices", 3, "--tp", 3], ["tp=3: must divide the attention heads (4)", "every one of the"]),
            (["--devices", 16, "--pp", 16, "--tp", 1, "--cp", 1],
             ["pp=16: pp·vpp = 16 chunks exceed the", "layers"]),
            # issue 34: these blamed dp·cp, and "fits none of the 57 layouts"
            (["--devices", 16, "--ep", 16], ["ep=16: the routed experts (8) must be divisible by ep"]),
            (["--devices", 8, "--pp", 2, "--vpp", 3, "--schedule", "dualpipev"],
             ["schedule='dualpipev': dualpipev places two chunks per rank in a V (vpp=2); given vpp=3, pp=2"])):
        assert_one_line(*run(monkeypatch, capsys, "compile", "tiny-pangu", "--target", "cpu", *args), 2, *needles)
    assert_one_line(*run(monkeypatch, capsys, "compile", "tiny-pangu", "--target", "h100:foo", "--devices", 8), 2,
                    "variant='foo': target h100 has no variants")
    assert_one_line(*run(monkeypatch, capsys, "compile", "tiny-pangu", "--target", "ascend-910b:foo", "--devices",
                         8), 2, "variants 313t, 376t")


def test_rejections_are_typed():
    from moeplan.compile import compile_model
    from moeplan.search import Fixed, build_options
    from moeplan.trace import trace_model

    spec = load_spec("tiny-pangu")
    cpu = load_target("cpu")
    built = build_options(graph=trace_model(spec, seq_len=64), target=cpu, num_devices=16,
                          fixed=Fixed(global_batch=8, seq_len=64), budget=cpu.memory_bytes)
    assert built.options and set(built.rejected) <= set(REASONS) and set(built.examples) == set(built.rejected)
    heads = built.examples["tp-heads"]
    assert isinstance(heads, Rejection) and heads.figure == spec.num_heads and heads.message.startswith("tp=")
    with pytest.raises(LayoutError) as exc:
        compile_model(spec=spec, target=load_target("cpu"), num_devices=3, workers=1,
                      fixed=Fixed(global_batch=8, seq_len=64, tp=3))
    assert exc.value.rejection.reason == "tp-heads" and exc.value.rejection.figure == 4
