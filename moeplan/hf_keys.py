"""The keys of a Hugging Face ``config.json`` that moeplan does not read, and what leaving each out does to a
prediction.

:func:`moeplan.spec.from_hf_config` reads the keys of :class:`moeplan.spec.HFConfig`. Every other key is one of:

- **no effect**: metadata, inference-only settings and training-loss coefficients that change neither the FLOPs,
  the bytes moved nor the memory of a training step (``NO_EFFECT``); also a key whose value turns a feature off
  (``attention_bias: false``, ``sliding_window: null``);
- **not modelled** (``NOT_MODELLED``): a feature moeplan's model lacks; the entry says which way the prediction is
  off;
- **unknown**: not in either table; moeplan cannot say what it does.

:func:`ignored_keys` lists the last two kinds; ``describe``, ``compile`` and ``explore`` print them as one warning line
(docs/inputs.md, "Hugging Face configs").
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

NO_EFFECT = frozenset({
    # metadata and tokenizer ids
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "name_or_path", "bos_token_id", "eos_token_id", "pad_token_id", "tokenizer_class",
    # inference-only: KV cache, context length and its RoPE extension (the training shape is seq_len)
    "use_cache", "max_position_embeddings", "initial_context_length", "rope_scaling", "rope_parameters",
    "max_window_layers", "use_sliding_window", "output_router_logits",
    # initialisation and loss coefficients: the same step, other numbers in it
    "initializer_range", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "router_z_loss_coef", "z_loss_coef",
    "moe_router_dtype",
    # routing details that the group fields already fix (DeepSeek's `noaux_tc`: group-limited choice by n_group /
    # topk_group; an EP size the plan chooses itself)
    "topk_method", "ep_size",
    # Llama's emulation of its pretraining TP in inference (split matmuls, same FLOPs)
    "pretraining_tp",
    # gpt-oss writes the top-k twice; `num_experts_per_tok` is read
    "experts_per_token",
})
"""Keys that do not change a training step's FLOPs, bytes or memory."""

_WINDOW = ("every layer is priced as full causal attention over seq_len: attention time too high for the windowed "
           "layers when seq_len exceeds the window")
_NOISE = "not priced, an elementwise operation: no effect beyond noise"
NOT_MODELLED: dict[str, str] = {
    "attention_bias": "q/k/v biases are not counted: parameters and memory low by a few elements per layer, step "
                      "time unchanged",
    "mlp_bias": "FFN biases are not counted: parameters and memory low by a few elements per layer, step time "
                "unchanged",
    "sliding_window": _WINDOW,
    "layer_types": _WINDOW,
    "swiglu_limit": f"the clamp of the SwiGLU input is {_NOISE}",
    "use_qk_norm": "the per-head q/k RMSNorms are not priced: step time and activation memory slightly low",
    "partial_rotary_factor": f"RoPE over part of the head is priced as over all of it, {_NOISE}",
    "quantization_config": "weights are priced in the training dtype, not the checkpoint's quantized format",
    "attention_dropout": "dropout and its mask are not priced: step time and memory slightly low",
    "hidden_dropout": "dropout and its mask are not priced: step time and memory slightly low",
    "hidden_act": "every FFN is priced as SwiGLU, three matrices; another activation with three matrices costs "
                  "the same",
    "router_jitter_noise": f"the router's input jitter is {_NOISE}",
}
"""Keys of features moeplan does not model, each with what that does to the prediction."""

_OFF = {"attention_bias": (False,), "mlp_bias": (False,), "use_qk_norm": (False,), "partial_rotary_factor": (1, 1.0),
        "attention_dropout": (0, 0.0), "hidden_dropout": (0, 0.0), "hidden_act": ("silu", "swiglu"),
        "router_jitter_noise": (0, 0.0)}
"""Values that turn the feature of a NOT_MODELLED key off (besides ``null``, which turns off any): nothing is left
out."""

SINKS_MODEL_TYPES = frozenset({"gpt_oss"})
"""``model_type``s whose attention has learned sinks (one logit per head added to the softmax, gpt-oss) with no key
that says so."""


@dataclass(frozen=True)
class IgnoredKey:
    """A key of a config that moeplan read past: ``effect`` says what that does to the prediction (``None``: an
    unknown key, effect not known)."""
    key: str
    effect: str | None


def is_off(key: str, value: object, cfg: dict) -> bool:
    """``value`` of ``key`` turns the feature of a NOT_MODELLED key off (``null``, :data:`_OFF`, a window that the
    config does not use): moeplan leaves nothing out by ignoring it."""
    if value is None or any(value == v and type(value) is type(v) for v in _OFF.get(key, ())):
        return True
    if key == "sliding_window":  # Qwen2 writes a window it does not use
        return cfg.get("use_sliding_window") is False
    if key == "layer_types":  # all full attention: the model's own
        return isinstance(value, list) and all(t == "full_attention" for t in value)
    return False


def ignored_keys(cfg: dict, read: Collection[str]) -> tuple[IgnoredKey, ...]:
    """The keys of ``cfg`` (a parsed config.json) that change the training step and that moeplan did not read
    (``read``: the keys it did), in the file's order, then a note for a ``model_type`` with a feature no key names."""
    out = []
    for key, value in cfg.items():
        if key in read or key in NO_EFFECT:
            continue
        if key in NOT_MODELLED:
            if not is_off(key, value, cfg):
                out.append(IgnoredKey(key, NOT_MODELLED[key]))
        else:
            out.append(IgnoredKey(key, None))
    if cfg.get("model_type") in SINKS_MODEL_TYPES:
        out.append(IgnoredKey(f"model_type={cfg['model_type']}",
                              f"attention sinks, one learned logit per head, are {_NOISE}"))
    return tuple(out)


def ignored_line(source: str, keys: tuple[IgnoredKey, ...]) -> str:
    """One warning line naming every ignored key, keys of the same effect together, e.g. ``gpt-oss/config.json:
    moeplan does not model 4 keys: attention_bias (q/k/v biases ...); layer_types, sliding_window (every layer
    ...)``."""
    by_effect: dict[str | None, list[str]] = {}
    for k in keys:
        by_effect.setdefault(k.effect, []).append(k.key)
    parts = [f"{', '.join(names)} ({effect or 'unknown to moeplan: its effect is not known'})"
             for effect, names in by_effect.items()]
    return f"{source}: moeplan does not model {len(keys)} key{'s' * (len(keys) != 1)}: {'; '.join(parts)}"
