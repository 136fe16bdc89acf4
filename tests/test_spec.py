import json

import pytest

from moeplan.errors import SpecError
from moeplan.spec import from_hf_config, load_spec, registry_names


def test_registry_loads_every_entry():
    assert {"pangu-ultra-moe-718b", "pangu-pro-moe-72b", "deepseek-v3", "llama3-70b", "tiny-pangu"} <= set(
        registry_names())
    for name in registry_names():
        assert load_spec(name).name == name


def test_deepseek_config_json_maps_fields():
    s = load_spec("deepseek-v3")
    assert (s.attention, s.hidden_size, s.num_layers, s.num_dense_layers) == ("mla", 7168, 61, 3)
    assert (s.num_experts, s.top_k, s.moe_ffn_size, s.shared_ffn_size) == (256, 8, 2048, 2048)
    assert (s.router, s.routing, s.num_expert_groups, s.topk_groups) == ("sigmoid", "group_limited", 8, 4)
    assert s.num_mtp_layers == 1 and s.router_scale == 2.5 and s.vocab_size == 129280


@pytest.mark.parametrize("cfg, expect", [
    ({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
      "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "mlp_only_layers": [],
      "decoder_sparse_step": 1, "norm_topk_prob": True}, ("gqa", 0, 128, 8, 0, "softmax")),
    ({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
      "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8,
      "num_experts_per_tok": 2}, ("gqa", 0, 8, 2, 0, "softmax")),
    ({"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
      "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336},
     ("gqa", 32, 0, 0, 0, "softmax")),
])
def test_hf_families(cfg, expect):
    s = from_hf_config(cfg, name="x", seq_len=4096, global_batch=256)
    assert (s.attention, s.num_dense_layers, s.num_experts, s.top_k, s.shared_ffn_size, s.router) == expect


def test_hidden_not_divisible_by_heads(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text("vocab_size: 256\nhidden_size: 65\nnum_layers: 2\nnum_dense_layers: 2\n"
                   "dense_ffn_size: 128\nattention: gqa\nnum_heads: 4\nnum_kv_heads: 2\nhead_dim: 16\n"
                   "seq_len: 64\nglobal_batch: 8\n")
    with pytest.raises(SpecError, match=r"hidden_size=65: must be divisible by num_heads \(4\)"):
        load_spec(str(bad))


@pytest.mark.parametrize("text, match", [
    ("vocab_size: [1, 2\n", "malformed YAML"),
    ("- a\n- b\n", "must hold a mapping"),
    ("vocab_size: -5\n", "vocab_size=-5"),
])
def test_bad_yaml(tmp_path, text, match):
    p = tmp_path / "m.yaml"
    p.write_text(text)
    with pytest.raises(SpecError, match=match):
        load_spec(str(p))


def test_bad_json_and_unknown(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(SpecError, match="malformed JSON"):
        load_spec(str(p))
    with pytest.raises(SpecError, match="not a registry name"):
        load_spec("no-such-model")


def test_with_shape_validates():
    s = load_spec("tiny-pangu")
    assert s.with_shape(seq_len=128).seq_len == 128
    with pytest.raises(SpecError, match="seq_len=0"):
        s.with_shape(seq_len=0)


def test_moge_needs_divisible_topk():
    with pytest.raises(SpecError, match=r"top_k=3: MoGE needs top_k divisible by num_expert_groups \(4\)"):
        from_hf_config({"model_type": "pangu_pro_moe", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
                        "num_experts_per_tok": 3, "moe_intermediate_size": 16, "num_expert_groups": 4},
                       name="x", seq_len=64, global_batch=8)
    assert json.loads(load_spec("tiny-pangu").model_dump_json())["name"] == "tiny-pangu"
