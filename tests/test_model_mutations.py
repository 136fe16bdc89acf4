"""Model-file tampering (issue 34): a valid model file mutated in one place is either refused with one line, or it is
read as written.

Each example edits one key of a shipped model file — a moeplan YAML (tiny-pangu, Llama 3 70B) or a Hugging Face
``config.json`` (DeepSeek-V3, Qwen3-30B-A3B, gpt-oss-120b): a new value (near the old one, of another type, null, a
container), the key deleted, renamed (a typo), written twice, or, in a config.json, a key of another family that
names the same quantity (``num_local_experts`` beside ``n_routed_experts``) added with another value. The file then
goes through :func:`moeplan.spec.read_model`, the reader of ``describe``, ``compile`` and ``explore``. Two outcomes
are allowed:

- refused by a SpecError whose message is one printable line (the CLI prints it and exits 2);
- accepted, and read as written. A model file says which model trains, so what the reader accepted must be what the
  file says: in a moeplan YAML every key is a spec field and holds the file's value (no key dropped, no value
  coerced: ``64.0`` or ``true`` for a size is no size); in a config.json every key moeplan reads holds the file's
  value, no two keys that name one quantity disagree (the reader would take one and drop the other), and every key it
  does not read and that changes a step is named in the warning line (:mod:`moeplan.hf_keys`); a key written twice
  is never accepted (the reader would keep the last).

Anything else fails: a traceback, a mutation accepted and read otherwise than written, or an example slower than
10 s (hypothesis's deadline).
"""
from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta
from importlib import resources
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from moeplan.errors import SpecError
from moeplan.hf_keys import NO_EFFECT, is_off
from moeplan.spec import HF_ALIASES, HFConfig, ModelFile, ModelSpec, read_model

MUTATIONS = settings(max_examples=200, deadline=timedelta(seconds=10), database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
_MODELS = resources.files("moeplan.examples") / "models"
BASES = {name: (_MODELS / name).read_text() for name in ("tiny-pangu.yaml", "llama3-70b.yaml",
                                                           "deepseek-v3/config.json", "qwen3-30b-a3b/config.json")}
BASES["gpt-oss-120b/config.json"] = (Path(__file__).parent / "fixtures" / "hf" / "gpt-oss-120b" / "config.json"
                                     ).read_text()
KINDS = ("value", "delete", "rename", "duplicate", "alias")
OUTCOMES: Counter = Counter()


def _values(v) -> st.SearchStrategy:
    """Values for a key that holds ``v``: valid-looking neighbours and values of other types."""
    near = []
    if isinstance(v, bool):
        near = [not v, int(v), str(v).lower()]
    elif isinstance(v, int):
        near = [v + 1, v - 1, 2 * v, 0, -v, float(v), str(v), v + 0.5]
    elif isinstance(v, float):
        near = [v * 2, -v, 0.0, int(v), str(v)]
    elif isinstance(v, str):
        near = [v.upper(), v + "x", ""]
    return st.one_of(st.sampled_from(near or [0]), st.none(), st.booleans(), st.integers(-2, 2**40),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6),
                     st.lists(st.integers(0, 4), max_size=3), st.just({"value": v}))


@st.composite
def mutation(draw) -> tuple[str, str, dict, str]:
    """(base file name, kind, the mutated document, the file's text): one key of a shipped model file edited."""
    name = draw(st.sampled_from(sorted(BASES)), label="base")
    hf = name.endswith(".json")
    doc = json.loads(BASES[name]) if hf else yaml.safe_load(BASES[name])
    kind = draw(st.sampled_from(KINDS if hf else KINDS[:-1]), label="kind")
    key = draw(st.sampled_from(sorted(doc)), label="key")
    out = dict(doc)
    extra = None
    if kind == "value":
        out[key] = draw(_values(doc[key]), label="value")
    elif kind == "delete":
        del out[key]
    elif kind == "rename":
        new = draw(st.sampled_from([key + "s", key[:-1], key.upper(), key.replace("_", "-")]), label="typo")
        out = {new if k == key else k: v for k, v in doc.items()}
    elif kind == "duplicate":
        extra = (key, draw(_values(doc[key]), label="value"))
    else:  # alias: a key of another family for the same quantity, with a drawn value
        group = draw(st.sampled_from([g for g in HF_ALIASES]), label="group")
        extra_key = draw(st.sampled_from(group), label="alias")
        out[extra_key] = draw(st.integers(0, 300), label="value")
    if hf:
        text = json.dumps(out, indent=1)
        if extra:
            text = text[:text.rindex("}")] + f', {json.dumps(extra[0])}: {json.dumps(extra[1])}}}'
    else:
        text = yaml.safe_dump(out, sort_keys=False, allow_unicode=True)
        if extra:
            text += f"{extra[0]}: {json.dumps(extra[1])}\n"
    return name, kind, out, text


def _same(got, want) -> bool:
    """``got`` is ``want`` as read: equal and of the same kind (an int may be read into a float field)."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, (int, float)) and isinstance(got, float):
        return got == want
    if isinstance(want, list) and isinstance(got, (list, tuple)):
        return len(got) == len(want) and all(map(_same, got, want))
    return type(got) is type(want) and got == want


def read_as_written(doc: dict, model: ModelFile, hf: bool) -> str | None:
    """Why the accepted ``doc`` was not read as written, or None."""
    if not hf:
        for k, v in doc.items():
            if k not in ModelSpec.model_fields or not _same(getattr(model.spec, k), v):
                return f"{k}={v!r} read as {getattr(model.spec, k, '(dropped)')!r}"
        return None
    read = HFConfig.model_validate(doc)
    for k in HFConfig.model_fields.keys() & doc.keys():
        if doc[k] is not None and not _same(getattr(read, k), doc[k]):
            return f"{k}={doc[k]!r} read as {getattr(read, k)!r}"
    for group in HF_ALIASES:
        values = {json.dumps(doc[k]) for k in group if doc.get(k) is not None}
        if len(values) > 1:
            return f"{', '.join(k for k in group if k in doc)} disagree, one was dropped"
    if isinstance(doc.get("mlp_only_layers"), list) and doc.get("first_k_dense_replace") not in (
            None, len(doc["mlp_only_layers"])):
        return "first_k_dense_replace and mlp_only_layers disagree"
    named = {i.key for i in model.ignored}
    silent = [k for k, v in doc.items() if k not in HFConfig.model_fields and k not in NO_EFFECT
              and not is_off(k, v, doc) and k not in named]
    return f"{silent} ignored without a word" if silent else None


def outcome(tmp_path: Path, name: str, kind: str, doc: dict, text: str) -> str:
    path = tmp_path / ("m/config.json" if name.endswith(".json") else "m.yaml")
    path.parent.mkdir(exist_ok=True)
    path.write_text(text, encoding="utf-8")
    try:
        model = read_model(str(path))
    except SpecError as e:
        msg = str(e)
        assert isinstance(e, ValueError) and msg and msg.isprintable() and len(msg) < 400, (kind, msg)
        return "refused"
    assert kind != "duplicate", f"{name}: a key written twice was accepted"
    why = read_as_written(doc, model, name.endswith(".json"))
    assert why is None, f"{name}, {kind}: accepted, but {why}"
    return "accepted"


@MUTATIONS
@given(data=st.data())
def test_a_mutated_model_file_is_refused_in_one_line_or_read_as_written(tmp_path, data):
    name, kind, doc, text = data.draw(mutation(), label="mutation")
    result = outcome(tmp_path, name, kind, doc, text)
    event(f"{kind}: {result}")
    OUTCOMES[kind, result] += 1


def test_the_model_mutations_reach_every_outcome():
    """Run after the property test in this file: every kind was drawn, and both outcomes happened (a reader that
    refused everything, or nothing, would pass the property alone)."""
    if sum(OUTCOMES.values()) < 200:
        pytest.skip("the property test did not run before this one")
    assert {k for k, _ in OUTCOMES} == set(KINDS) and {r for _, r in OUTCOMES} == {"refused", "accepted"}, OUTCOMES
