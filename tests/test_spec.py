import json
import sys
from pathlib import Path

import pytest

from moeplan.errors import SpecError
from moeplan.hf_keys import IgnoredKey, ignored_keys, ignored_line
from moeplan.plan import load_plan
from moeplan.spec import HFConfig, from_hf_config, load_spec, read_model, registry_names

sys.path.insert(0, str(Path(__file__).parent))
from inprocess import run_moeplan  # noqa: E402


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


def test_hidden_need_not_divide_by_heads_when_head_dim_is_given(tmp_path):
    yaml_file = tmp_path / "m.yaml"
    yaml_file.write_text("vocab_size: 256\nhidden_size: 65\nnum_layers: 2\nnum_dense_layers: 2\n"
                         "dense_ffn_size: 128\nattention: gqa\nnum_heads: 4\nnum_kv_heads: 2\nhead_dim: 16\n"
                         "seq_len: 64\nglobal_batch: 8\n")
    assert load_spec(str(yaml_file)).head_dim == 16
    cfg = {"vocab_size": 256, "hidden_size": 65, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128}
    assert from_hf_config({**cfg, "head_dim": 16}, name="x", seq_len=64, global_batch=8).head_dim == 16
    with pytest.raises(SpecError, match=r"^hidden_size=65: must be divisible by num_attention_heads \(4\) when "
                                        r"head_dim is not given \(in m/config.json\)$"):
        from_hf_config(cfg, name="x", seq_len=64, global_batch=8, source="m/config.json")


FIXTURES = Path(__file__).parent / "fixtures" / "hf"


@pytest.mark.parametrize("name, total_b, activated_b, head_dim, layers, dense, experts", [
    ("glm-4.5-air", 106.85, 12.80, 128, 46, 1, 128),  # published: 106B total, 12B activated
    ("glm-4.5", 352.80, 32.85, 128, 92, 3, 160),  # published: 355B total, 32B activated
    ("gpt-oss-120b", 116.79, 5.13, 64, 36, 0, 128),  # published: 116.8B total, 5.1B activated
])
def test_configs_that_state_head_dim_load(name, total_b, activated_b, head_dim, layers, dense, experts):
    from moeplan.flops import count_params

    s = load_spec(str(FIXTURES / name / "config.json"))
    assert (s.head_dim, s.num_layers, s.num_dense_layers, s.num_experts) == (head_dim, layers, dense, experts)
    assert s.num_heads * s.head_dim != s.hidden_size  # the rule that refused them does not apply
    pc = count_params(s)
    assert round(pc.total / 1e9, 2) == total_b and round((pc.activated - pc.output) / 1e9, 2) == activated_b
    assert s.router == ("sigmoid" if name.startswith("glm") else "softmax")  # Glm4MoeTopkRouter: sigmoid, no key


def test_ignored_keys_are_named_with_their_effect():
    gpt = read_model(str(FIXTURES / "gpt-oss-120b" / "config.json"))
    assert [k.key for k in gpt.ignored] == ["attention_bias", "layer_types", "quantization_config", "sliding_window",
                                           "swiglu_limit", "model_type=gpt_oss"]
    assert all(k.effect for k in gpt.ignored)
    line = gpt.warning()
    assert "\n" not in line and line.startswith(f"{FIXTURES / 'gpt-oss-120b' / 'config.json'}: moeplan does not "
                                               f"model 6 keys: attention_bias (q/k/v biases are not counted")
    assert "layer_types, sliding_window (every layer is priced as full causal attention" in line
    glm = read_model(str(FIXTURES / "glm-4.5-air" / "config.json"))  # use_qk_norm: false leaves nothing out
    assert [k.key for k in glm.ignored] == ["attention_bias", "partial_rotary_factor"]
    cfg = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "sliding_window": 4096, "use_sliding_window": False, "attention_bias": False,
           "hidden_act": "silu", "torch_dtype": "bfloat16", "frobnicate": 3}
    assert ignored_keys(cfg, HFConfig.model_fields.keys()) == (IgnoredKey("frobnicate", None),)
    assert "frobnicate (unknown to moeplan: its effect is not known)" in ignored_line("c.json", (IgnoredKey(
        "frobnicate", None),))
    for name in registry_names():  # the shipped configs: every key is read or has no effect
        assert read_model(name).warning() is None, name


def test_hf_rule_errors_name_the_configs_keys_and_file():
    cfg = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 3, "intermediate_size": 128, "n_routed_experts": 8, "num_experts_per_tok": 9,
           "moe_intermediate_size": 32}
    with pytest.raises(SpecError, match=r"^num_experts_per_tok=9: must be in 1..n_routed_experts \(8\) \(in c.json\)$"):
        from_hf_config({**cfg, "num_key_value_heads": 2}, name="x", seq_len=64, global_batch=8, source="c.json")
    with pytest.raises(SpecError, match=r"^num_attention_heads=4: must be divisible by num_key_value_heads \(3\) "
                                        r"\(in c.json\)$"):
        from_hf_config({**cfg, "num_experts_per_tok": 2}, name="x", seq_len=64, global_batch=8, source="c.json")


def test_an_mla_config_need_not_divide_hidden_by_heads(tmp_path):
    """MLA sizes its heads by qk_nope_head_dim + qk_rope_head_dim and v_head_dim, not hidden_size / heads: the
    divisibility rule was applied to MLA configs too (issue 34). DeepSeek-V3 at hidden 7000 (7000 / 128 is not
    whole) loads with its MLA heads."""
    cfg = json.loads((Path(__file__).parents[1] / "examples" / "models" / "deepseek-v3" / "config.json").read_text())
    path = tmp_path / "odd" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**cfg, "hidden_size": 7000}))
    spec = load_spec(str(path))
    assert (spec.attention, spec.hidden_size, spec.num_heads, spec.qk_nope_head_dim) == ("mla", 7000, 128, 128)


def test_a_huge_integer_in_a_config_is_refused_in_one_line(tmp_path):
    """A 5001-digit vocab_size: the JSON reader raised Python's int-conversion ValueError, exit 1 (issue 34)."""
    path = tmp_path / "big" / "config.json"
    path.parent.mkdir()
    text = (Path(__file__).parents[1] / "examples" / "models" / "deepseek-v3" / "config.json").read_text()
    path.write_text(text.replace('"vocab_size": 129280', '"vocab_size": ' + "9" * 5001))
    with pytest.raises(SpecError) as e:
        load_spec(str(path))
    msg = str(e.value)
    assert msg.startswith(f"model={str(path)!r}: malformed JSON") and msg.isprintable() and len(msg) < 400, msg


def test_config_keys_that_name_one_quantity_must_agree():
    """DeepSeek's n_routed_experts beside Mixtral's num_local_experts: the reader took the first and dropped the
    other without a word (found by tests/test_model_mutations.py). Equal values, as gpt-oss writes its top-k twice,
    load."""
    cfg = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
           "intermediate_size": 128, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    read = dict(name="x", seq_len=64, global_batch=8, source="c.json")
    with pytest.raises(SpecError, match=r"^num_local_experts=16: names the same quantity as n_routed_experts=8 with "
                                        r"another value; keep one of them \(in c.json\)$"):
        from_hf_config({**cfg, "num_local_experts": 16}, **read)
    with pytest.raises(SpecError, match=r"^mlp_only_layers=\[0, 1\]: 2 dense layers where first_k_dense_replace=1"):
        from_hf_config({**cfg, "first_k_dense_replace": 1, "mlp_only_layers": [0, 1]}, **read)
    assert from_hf_config({**cfg, "experts_per_token": 2, "num_local_experts": 8}, **read).top_k == 2


def test_the_cli_prints_the_ignored_keys_once_and_glm_air_compiles(tmp_path):
    gpt = FIXTURES / "gpt-oss-120b" / "config.json"
    proc = run_moeplan("describe", gpt)
    assert proc.returncode == 0 and proc.stderr.splitlines() == [f"warning: {read_model(str(gpt)).warning()}"]
    air = FIXTURES / "glm-4.5-air" / "config.json"
    # the layout the default search picks for 128 H100 (it searches 5061 layouts in about 9 s); fixed here
    proc = run_moeplan("compile", air, "--target", "h100", "--devices", "128", "--tp", "2", "--pp", "2", "--vpp",
                       "2", "--ep", "8", "-o", tmp_path / "air.yaml")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0].startswith(f"warning: {air}: moeplan does not model 2 keys: attention_bias")
    assert load_plan(tmp_path / "air.yaml").model.spec.head_dim == 128


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
    with pytest.raises(SpecError, match=r"^num_experts_per_tok=3: MoGE needs num_experts_per_tok divisible by "
                                            r"num_expert_groups \(4\) \(in config.json\)$"):
        from_hf_config({"model_type": "pangu_pro_moe", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
                        "num_experts_per_tok": 3, "moe_intermediate_size": 16, "num_expert_groups": 4},
                       name="x", seq_len=64, global_batch=8)
    assert json.loads(load_spec("tiny-pangu").model_dump_json())["name"] == "tiny-pangu"
