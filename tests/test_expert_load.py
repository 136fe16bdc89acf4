"""Expert-load traces (moeplan.expert_load): moeplan's format round trip, the readers of the public formats, one-line
refusals of bad traces, the balance metrics and the load prediction on hand-computed examples."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moeplan.errors import LoadError
from moeplan.expert_load import (LoadTrace, balancedness, check_against, cv, imbalance, moe_layers, predict,
                                 rank_tokens, read_trace, write_trace)
from moeplan.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
EXCERPT = ROOT / "tests" / "fixtures" / "load" / "deepseek-v3-bincounts-3layers.json"
FULL = ROOT / "benchmarks" / "data" / "deepseek-v3-bincounts.json"
TOKENS_PER_LAYER = 2_582_784  # 322,848 tokens × top-8, every layer of the DeepSeek-V3 counts


@pytest.fixture(scope="module")
def deepseek():
    return load_spec("deepseek-v3")


@pytest.fixture(scope="module")
def tiny():
    return load_spec("tiny-pangu")  # 4 decoder layers, layer 0 dense, MTP as layer 4; 8 experts


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _refusal(path: Path, **kw) -> str:
    with pytest.raises(LoadError) as e:
        read_trace(path, **kw)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"expert-load={str(path)!r}: ")
    return message


# ---- moeplan's format ----------------------------------------------------------------------------------------------
def test_moeplan_format_round_trips(tmp_path, tiny):
    counts = np.arange(2 * 3 * 8).reshape(2, 3, 8)
    trace = LoadTrace("tiny-pangu", 8, (1, 2, 3), (10, 11), counts, source="moeplan run plan.yaml", ep=2,
                      placement=((0, 1, 2, 3), (4, 5, 6, 7)))
    write_trace(trace, tmp_path / "t.json")
    back = read_trace(tmp_path / "t.json", spec=tiny)
    assert (back.model, back.num_experts, back.layers, back.steps, back.source, back.ep, back.placement) == \
        (trace.model, 8, (1, 2, 3), (10, 11), "moeplan run plan.yaml", 2, ((0, 1, 2, 3), (4, 5, 6, 7)))
    assert back.counts.dtype == np.int64 and (back.counts == counts).all()
    assert json.loads((tmp_path / "t.json").read_text())["format"] == "moeplan.expert-load/1"


def test_an_empty_moeplan_trace_round_trips(tmp_path):
    write_trace(LoadTrace("m", 4, (1,), (), np.zeros((0, 1, 4), np.int64)), tmp_path / "t.json")
    assert read_trace(tmp_path / "t.json").counts.shape == (0, 1, 4)


# ---- the public formats --------------------------------------------------------------------------------------------
def test_the_deepseek_bincounts_excerpt_maps_ordinals_onto_the_moe_layers(deepseek):
    trace = read_trace(EXCERPT, spec=deepseek)
    assert trace.layers == (3, 4, 5) and trace.steps == (0,) and trace.counts.shape == (1, 3, 256)
    assert trace.model == "deepseek-v3" and trace.notes == ()
    assert (trace.counts.sum(axis=2) == TOKENS_PER_LAYER).all()
    assert trace.counts[0, 0, :3].tolist() == [11137, 8095, 6887]  # the file's first values, 11137.0, ...
    plain = read_trace(EXCERPT)
    assert plain.layers == (0, 1, 2) and "ordinals" in plain.notes[0]
    assert read_trace(EXCERPT, first_moe_layer=3).layers == (3, 4, 5)


def test_the_shipped_deepseek_counts_cover_its_58_moe_decoder_layers(deepseek):
    trace = read_trace(FULL, spec=deepseek)
    assert trace.layers == tuple(range(3, 61)) == moe_layers(deepseek)[:-1]  # the MTP layer 61 is not measured
    assert (trace.counts.sum(axis=2) == TOKENS_PER_LAYER).all()
    assert (trace.counts[:, :3] == read_trace(EXCERPT, spec=deepseek).counts).all()


def test_bincounts_with_float_counts_as_the_original_file_stores_them(tmp_path, tiny):
    trace = read_trace(_write(tmp_path / "b.json", json.dumps({"1": [2.0] * 8, "0": [1.0] * 8})), spec=tiny)
    assert trace.layers == (1, 2) and trace.counts[0].tolist() == [[1] * 8, [2] * 8]


WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4], [20, 107, 104, 64, 19, 197, 187, 157]]  # EPLB README's, cut to 8


@pytest.mark.parametrize("kind", ["json list", "json weight", "npy", "npy float", "pt", "pt bf16"])
def test_eplb_weight_in_every_container(tmp_path, tiny, kind):
    path = tmp_path / "w"
    if kind == "json list":
        _write(path, json.dumps(WEIGHT))
    elif kind == "json weight":
        _write(path, json.dumps({"weight": WEIGHT}))
    elif kind.startswith("npy"):
        with open(path, "wb") as f:
            np.save(f, np.array(WEIGHT, dtype=np.float32 if "float" in kind else np.int64))
    else:
        torch.save(torch.tensor(WEIGHT, dtype=torch.bfloat16 if "bf16" in kind else torch.int64), path)
    trace = read_trace(path, spec=tiny)
    assert trace.layers == (1, 2) and trace.steps == (0,) and trace.counts[0].tolist() == WEIGHT
    assert read_trace(path, format="eplb").layers == (0, 1)


def _sglang_dump(path: Path, logical_count: torch.Tensor) -> Path:
    """What SGLang's stat-mode recorder saves (_StatAccumulator.dump)."""
    torch.save({"rank": 0, "logical_count": logical_count, "average_utilization_rate_over_window": None}, path)
    return path


def test_sglang_stat_dump_keeps_the_moe_layers_and_the_filled_slots(tmp_path, tiny):
    lc = torch.zeros((5, 4, 8), dtype=torch.int32)  # 5 buffer slots, tiny-pangu's 4 decoder layers, 8 experts
    lc[0, 1:] = 1
    lc[1, 1:, 0] = 7
    lc[3, 1:, 2] = 2
    path = _sglang_dump(tmp_path / "expert_distribution_recorder_1.pt", lc)
    trace = read_trace(path, spec=tiny)
    assert trace.layers == (1, 2, 3) and trace.steps == (0, 1, 3) and trace.model == "tiny-pangu"
    assert (trace.counts == lc.numpy()[[0, 1, 3]][:, 1:]).all()
    assert read_trace(path).layers == (1, 2, 3)  # without a spec: the rows with tokens


def test_sglang_refusals(tmp_path, tiny, deepseek):
    lc = torch.ones((2, 4, 8), dtype=torch.int32)
    assert "dense layer 0 of tiny-pangu" in _refusal(_sglang_dump(tmp_path / "d.pt", lc), spec=tiny)
    assert "4 layers, deepseek-v3 has 61" in _refusal(tmp_path / "d.pt", spec=deepseek)
    assert "every slot is zero" in _refusal(_sglang_dump(tmp_path / "z.pt", torch.zeros((3, 4, 8))))
    torch.save({"records": [{"forward_pass_id": 0, "rank": 0, "global_physical_count": lc[0]}],
                "last_physical_to_logical_map": torch.arange(8)}, tmp_path / "p.pt")
    assert _refusal(tmp_path / "p.pt").split(": ", 1)[1].startswith("records: ")


class _Arbitrary:
    pass


def test_pickled_objects_are_never_loaded(tmp_path):
    torch.save({"weight": _Arbitrary()}, tmp_path / "x.pt")
    assert "weights_only=True" in _refusal(tmp_path / "x.pt")
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object))
    assert "allow_pickle=False" in _refusal(tmp_path / "o.npy")


# ---- bad traces: one line naming the field, the value and the rule --------------------------------------------------
BAD = [
    ("empty", "", "is empty"),
    ("non-integer", '{"0": [1, 2.5]}', '["0"][1]=2.5: counts must be whole numbers'),
    ("negative", '{"0": [1, -2]}', '["0"][1]=-2: counts must be ≥ 0'),
    ("ragged layers", '{"0": [1, 2], "1": [3]}', '["1"]: length 1, ["0"] has length 2'),
    ("ragged weight", "[[1, 2], [3]]", "weight[1]: length 1, weight[0] has length 2"),
    ("row not a list", "[[1, 2], 3]", "weight[1]=3: must be a list"),
    ("boolean", "[[1, true]]", "weight[0][1]=True: must be a number"),
    ("string", '[[1, "2"]]', "weight[0][1]='2': must be a number"),
    ("not finite", "[[1, NaN]]", "weight[0][1]=nan: counts must be finite"),
    ("no layers", "[]", "weight: must be [layers, experts]"),
    ("no experts", "[[], []]", "weight: shape [2, 0] [layers, experts] is empty"),
    ("bad key", '{"0": [1], "x": [2]}', 'not an expert-load trace'),
    ("ordinal twice", '{"0": [1], "00": [2]}', '["0"]: MoE-layer ordinal 0 given twice'),
    ("other format", '{"format": "other/1"}', "format='other/1': moeplan reads moeplan.expert-load/1"),
    ("moeplan negative", '{"format": "moeplan.expert-load/1", "num_experts": 2, "layers": [1], "steps": [0], '
                         '"counts": [[[1, -1]]]}', "counts[0][0][1]=-1: counts must be ≥ 0"),
    ("moeplan shape", '{"format": "moeplan.expert-load/1", "num_experts": 3, "layers": [1], "steps": [0], '
                      '"counts": [[[1, 1]]]}', "counts: shape [1, 1, 2] must be"),
    ("moeplan placement", '{"format": "moeplan.expert-load/1", "num_experts": 2, "layers": [1], "steps": [0], '
                          '"placement": [[0, 5]], "counts": [[[1, 1]]]}', "placement=[[0, 5]]: a list per rank"),
]


@pytest.mark.parametrize("content, expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_trace_is_refused_in_one_line_naming_the_field(tmp_path, content, expected):
    assert expected in _refusal(_write(tmp_path / "t.json", content))


def test_a_trace_that_does_not_fit_the_model_is_refused(tmp_path, deepseek, tiny):
    ok = _write(tmp_path / "ok.json", json.dumps({"0": [1] * 256, "1": [2] * 256}))
    assert "num_experts=256: tiny-pangu has 8 routed experts per MoE layer" in _refusal(ok, spec=tiny)
    many = _write(tmp_path / "many.json", json.dumps({str(i): [1] * 8 for i in range(5)}))
    assert "ordinal 4 but tiny-pangu has 4 MoE layers (MoE layers 1–3, MTP 4)" in _refusal(many, spec=tiny)
    with pytest.raises(LoadError, match="^first_moe_layer=3: give spec or first_moe_layer, not both"):
        read_trace(ok, spec=deepseek, first_moe_layer=3)  # the call's arguments: no file named
    with pytest.raises(LoadError, match="^format='csv': one of moeplan, bincounts, eplb, sglang$"):
        read_trace(ok, format="csv")
    assert "document: a layer -> counts JSON object" in _refusal(_write(tmp_path / "l.json", "[[1]]"),
                                                               format="bincounts")
    with pytest.raises(LoadError, match=r"^layers=\[0, 3\]: layer 0 is not an MoE layer of deepseek-v3 "
                                        r"\(MoE layers 3–60, MTP 61\)$"):
        check_against(LoadTrace("m", 256, (0, 3), (0,), np.ones((1, 2, 256), np.int64)), deepseek)
    with pytest.raises(LoadError, match="^model='llama2-7b': has no MoE layers"):
        check_against(LoadTrace("m", 8, (1,), (0,), np.ones((1, 1, 8), np.int64)), load_spec("llama2-7b"))
    check_against(LoadTrace("m", 8, (4,), (0,), np.ones((1, 1, 8), np.int64)), tiny)  # the MTP layer is MoE


# ---- metrics -------------------------------------------------------------------------------------------------------
def test_rank_tokens_sums_each_ranks_experts_and_splits_replicas_evenly():
    counts = np.array([[10, 20, 30, 40], [1, 2, 3, 4]])
    assert rank_tokens(counts, [(0, 1), (2, 3)]).tolist() == [[30, 70], [3, 7]]
    # expert 3 (40 tokens) on ranks 0 and 1: 20 each
    assert rank_tokens(counts[:1], [(0, 3), (1, 3), (2,)]).tolist() == [[30, 40, 30]]
    # a placement per layer, and leading step dimensions
    per_layer = [[(0, 1), (2, 3)], [(0, 3), (1, 2)]]
    assert rank_tokens(np.stack([counts, 2 * counts]), per_layer).tolist() == [[[30, 70], [5, 5]],
                                                                              [[60, 140], [10, 10]]]
    with pytest.raises(LoadError, match="^shards: expert 3 is held by no rank"):
        rank_tokens(counts, [(0, 1), (2,)])
    with pytest.raises(LoadError, match=r"^shards\[1\]: expert 7 must be an integer in 0..3"):
        rank_tokens(counts, [(0, 1), (2, 3, 7)])
    with pytest.raises(LoadError, match="^shards: 1 layers of shards, counts have 2 layers"):
        rank_tokens(counts, [[(0, 1), (2, 3)]])


def test_balance_metrics_on_a_hand_example():
    tokens = np.array([[30.0, 40.0, 30.0], [50, 50, 50], [0, 0, 0]])
    assert imbalance(tokens) == pytest.approx([40 / (100 / 3) - 1, 0, 0])  # 0.2
    assert balancedness(tokens) == pytest.approx([(100 / 3) / 40, 1, 1])  # 1 / 1.2
    assert cv(tokens) == pytest.approx([np.sqrt(2) / 10, 0, 0])  # population std 10·√2/3 over mean 100/3
    with pytest.raises(LoadError, match="^tokens_per_rank: must be finite and ≥ 0"):
        imbalance([1.0, -1.0])


# ---- prediction ----------------------------------------------------------------------------------------------------
def _steps() -> LoadTrace:
    x = np.array([[[0, 4]], [[2, 8]], [[4, 0]], [[9, 9]]])  # 4 steps, 1 layer, 2 experts
    return LoadTrace("m", 2, (1,), (10, 11, 12, 13), x)


def test_predict_mean_and_ema_over_the_window_before_the_step():
    trace = _steps()
    assert predict(trace, at=3, window=3).tolist() == [[2, 4]]
    # α = 2 / (3 + 1) = 0.5: p = [0, 4] → [1, 6] → [2.5, 3]
    assert predict(trace, at=3, window=3, method="ema").tolist() == [[2.5, 3]]
    assert predict(trace, at=3, window=3, method="ema", alpha=1.0).tolist() == [[4, 0]]
    assert predict(trace, at=4, window=1).tolist() == [[9, 9]]  # the step after the trace


@pytest.mark.parametrize("kw, message", [
    ({"at": 2, "window": 3}, r"^at=2: the window \[at − 3, at\) must lie in the trace's 4 steps"),
    ({"at": 5, "window": 1}, "^at=5: "),
    ({"at": 1, "window": 0}, "^window=0: must be an integer ≥ 1"),
    ({"at": 2, "window": 1, "method": "median"}, "^method='median': 'mean' or 'ema'"),
    ({"at": 2, "window": 1, "method": "ema", "alpha": 0.0}, r"^alpha=0.0: must be in \(0, 1\]"),
    ({"at": 2, "window": 1, "alpha": 0.5}, "^alpha=0.5: only for method='ema'"),
])
def test_predict_refuses_an_empty_or_out_of_range_window(kw, message):
    with pytest.raises(LoadError, match=message):
        predict(_steps(), **kw)
