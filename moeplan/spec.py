"""Model specifications: one typed description of a decoder-only (MoE) language model.

A :class:`ModelSpec` is loaded from moeplan's own YAML, from a Hugging Face style ``config.json`` (the field names of
DeepSeek-V3, openPangu MoE, Pangu Pro MoE, Qwen3-MoE, Mixtral and Llama-style dense configs), or by registry name
(``examples/models/registry.yaml``). It also carries the default training shape (``seq_len``, ``global_batch`` in
sequences). Every rule is checked at load time — types strictly (a size is an int: not "64", 64.0 or true), numbers
finite, every size within a bound no real model comes near (docs/inputs.md) — and a violation raises
:class:`~moeplan.errors.SpecError` whose one-line message names the field, the value and the rule.
"""
from __future__ import annotations

import hashlib
import re
import reprlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moeplan.errors import SpecError, validation_message
from moeplan.files import read_json, read_yaml
from moeplan.flops import count_params
from moeplan.hf_keys import IgnoredKey, ignored_keys, ignored_line

# Bounds no real model comes near; docs/inputs.md gives the reason for each. Above them a model could not be
# trained on any cluster, and building it on the meta device (moeplan.trace) could overflow PyTorch's int64 sizes.
MAX_VOCAB = 2**24
"""Largest ``vocab_size``: 16,777,216 tokens (published vocabularies: 32K to 262K)."""
MAX_WIDTH = 2**20
"""Largest width of any layer (hidden, FFN, latent ranks, head dims): 1,048,576 elements (published: up to 73,728,
PaLM 540B's FFN)."""
MAX_HEADS = 2**16
"""Largest ``num_heads`` / ``num_kv_heads``: 65,536 (published: up to 128)."""
MAX_LAYERS = 2**12
"""Largest ``num_layers`` / ``num_mtp_layers``: 4,096 (published: up to 126, Llama 3.1 405B)."""
MAX_EXPERTS = 2**20
"""Largest expert count (routed, shared, groups, top_k): 1,048,576, the size of PEER's expert pool (arXiv
2407.04153); MoE models publish up to 384."""
MAX_TOKENS = 2**24
"""Largest ``seq_len`` (tokens) and ``global_batch`` (sequences): 16,777,216 each."""
MAX_PARAMS = 10**14
"""Largest parameter count of the whole model (MTP included): 100 trillion, about 60x Switch-C's 1.6 trillion (arXiv
2101.03961); at 16 bytes of model states each (bf16 weights and grads, fp32 master and Adam moments) that is 1.6 PB,
whose byte counts stay below 2^53, exact in the float64 arithmetic of the memory estimates."""
MAX_ACTIVATION = 2**56
"""Largest activation tensor of one sequence, elements: the trace builds every layer for one sequence on the meta
device, attention's ``num_heads × seq_len²`` score matrix included; a tensor's byte size must fit int64 (2^63), and
2^56 elements keep even an fp32 copy 32x below that."""


def _pos(limit: int):
    """A required count or width in ``1..limit``."""
    return Field(gt=0, le=limit)


def _nonneg(limit: int):
    """A count or width in ``0..limit``, 0 by default (0: absent)."""
    return Field(default=0, ge=0, le=limit)


class ModelSpec(BaseModel):
    """A decoder-only transformer with optional MLA attention, MoE layers, MoGE routing and MTP.

    Layer layout: ``num_layers`` decoder layers, the first ``num_dense_layers`` with a dense SwiGLU FFN of width
    ``dense_ffn_size``, the rest MoE; then ``num_mtp_layers`` multi-token-prediction modules (DeepSeek-V3 §2.2),
    each an MoE decoder layer plus its projection ``2h → h``. Sizes are counts of elements, not bytes.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """The model's name: the ``name`` in its YAML file if given, else its registry name or the file's stem (the
    folder of a ``config.json``)."""
    vocab_size: int = _pos(MAX_VOCAB)
    """Vocabulary size, tokens: rows of the embedding and of the output layer."""
    hidden_size: int = _pos(MAX_WIDTH)
    """Hidden size ``h``, elements per token of the residual stream."""
    num_layers: int = _pos(MAX_LAYERS)
    """Decoder layers, a count: the ``num_dense_layers`` dense ones first, then MoE; MTP modules not included."""
    num_dense_layers: int = _nonneg(MAX_LAYERS)
    """Leading decoder layers with a dense SwiGLU FFN instead of MoE, a count (HF ``first_k_dense_replace``)."""
    dense_ffn_size: int = _nonneg(MAX_WIDTH)
    """Intermediate width of the dense layers' SwiGLU FFN, elements; 0 without dense layers."""
    # attention
    attention: Literal["mla", "gqa"]
    """Attention kind: ``mla`` (multi-head latent attention, DeepSeek-V2/V3) or ``gqa`` (grouped-query; MHA when
    ``num_kv_heads == num_heads``)."""
    num_heads: int = _pos(MAX_HEADS)
    """Attention (query) heads per layer, a count."""
    num_kv_heads: int = _nonneg(MAX_HEADS)
    """Key/value heads per layer, a count; gqa only, 0 for mla."""
    head_dim: int = _nonneg(MAX_WIDTH)
    """Width of one query/key/value head, elements; gqa only."""
    q_lora_rank: int = _nonneg(MAX_WIDTH)
    """Width of MLA's compressed query latent, elements; mla only, 0 = no query compression."""
    kv_lora_rank: int = _nonneg(MAX_WIDTH)
    """Width of MLA's compressed key/value latent, elements; mla only."""
    qk_nope_head_dim: int = _nonneg(MAX_WIDTH)
    """Per-head query/key width without RoPE (MLA), elements."""
    qk_rope_head_dim: int = _nonneg(MAX_WIDTH)
    """Per-head query/key width that carries RoPE (MLA; the key part is shared by all heads), elements; even."""
    v_head_dim: int = _nonneg(MAX_WIDTH)
    """Per-head value width (MLA), elements."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """RoPE base frequency θ, dimensionless."""
    # experts
    num_experts: int = _nonneg(MAX_EXPERTS)
    """Routed experts per MoE layer, a count; 0 for a dense model."""
    top_k: int = _nonneg(MAX_EXPERTS)
    """Routed experts each token is sent to, a count."""
    moe_ffn_size: int = _nonneg(MAX_WIDTH)
    """Intermediate width of one routed expert's SwiGLU FFN, elements."""
    num_shared_experts: int = _nonneg(MAX_EXPERTS)
    """Shared experts per MoE layer (every token goes through them), a count."""
    shared_ffn_size: int = _nonneg(MAX_WIDTH)
    """Total intermediate width of all shared experts, merged into one SwiGLU, elements; 0 without them."""
    router: Literal["sigmoid", "softmax"] = "softmax"
    """The router's score function over the ``num_experts`` gate logits (computed in fp32)."""
    routing: Literal["topk", "group_limited", "moge"] = "topk"
    """Expert choice: ``topk`` (plain top-k), ``group_limited`` (DeepSeek-V3 node-limited: only the ``topk_groups``
    best groups) or ``moge`` (Pangu Pro MoE: top ``top_k / num_expert_groups`` in every group)."""
    num_expert_groups: int = Field(default=1, gt=0, le=MAX_EXPERTS)
    """Groups the routed experts are split into, a count; used by ``group_limited`` and ``moge`` routing."""
    topk_groups: int = Field(default=1, gt=0, le=MAX_EXPERTS)
    """Groups a token may pick its experts from, a count; ``group_limited`` routing only."""
    router_scale: float = Field(default=1.0, gt=0)
    """Factor the gates are multiplied by after the top-k choice (HF ``routed_scaling_factor``), dimensionless."""
    norm_topk_prob: bool = True
    """Whether the chosen experts' gates are renormalised to sum to 1 (before ``router_scale``)."""
    capacity_factor: float | None = Field(default=None, gt=0)
    """Drop-and-pad expert capacity factor: each expert keeps ``ceil(capacity_factor · tokens · top_k /
    num_experts)`` rows of a micro-batch, dimensionless; None = dropless."""
    # the rest
    num_mtp_layers: int = _nonneg(MAX_LAYERS)
    """Multi-token-prediction modules after the decoder layers (DeepSeek-V3 §2.2), a count."""
    sandwich_norm: bool = False
    """Whether every decoder layer also normalises the attention and MLP outputs (two more RMSNorms; Pangu Ultra MoE
    "Depth-Scaled Sandwich-Norm", arXiv 2505.04519)."""
    norm_eps: float = Field(default=1e-5, gt=0)
    """The RMSNorms' ε, added to the mean square, dimensionless."""
    tie_embeddings: bool = False
    """Whether the output layer shares the embedding's weight."""
    # default training shape
    seq_len: int = _pos(MAX_TOKENS)
    """Training sequence length, tokens per sequence: the default shape, which ``compile --seq-len`` overrides (a
    plan's spec holds the shape it was compiled for)."""
    global_batch: int = _pos(MAX_TOKENS)
    """Global batch of one training step, sequences: the default shape, which ``compile --global-batch``
    overrides."""

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        _require(self.num_dense_layers <= self.num_layers, "num_dense_layers", self.num_dense_layers,
                 "must be <= num_layers", f" ({self.num_layers})")
        if self.num_dense_layers:
            _require(self.dense_ffn_size > 0, "dense_ffn_size", self.dense_ffn_size, "must be > 0 with dense layers")
        if self.attention == "gqa":
            _require(self.num_kv_heads > 0 and self.head_dim > 0, "num_kv_heads", self.num_kv_heads,
                     "gqa needs num_kv_heads > 0 and head_dim > 0")
            _require(self.num_heads % self.num_kv_heads == 0, "num_heads", self.num_heads,
                     "must be divisible by num_kv_heads", f" ({self.num_kv_heads})")
        else:
            for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                _require(getattr(self, f) > 0, f, getattr(self, f), "must be > 0 for mla attention")
            _require(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", self.qk_rope_head_dim, "must be even (RoPE)")
        if self.num_moe_layers or self.num_mtp_layers:
            self._check_moe()
        self._check_size()
        return self

    def _check_moe(self) -> None:
        _require(self.num_experts > 0, "num_experts", self.num_experts, "must be > 0 with MoE or MTP layers")
        _require(0 < self.top_k <= self.num_experts, "top_k", self.top_k,
                 "must be in 1..num_experts", f" ({self.num_experts})")
        _require(self.moe_ffn_size > 0, "moe_ffn_size", self.moe_ffn_size, "must be > 0 with MoE layers")
        _require((self.num_shared_experts > 0) == (self.shared_ffn_size > 0), "shared_ffn_size", self.shared_ffn_size,
                 "must be > 0 exactly when num_shared_experts > 0")
        if self.routing != "topk":
            g = self.num_expert_groups
            _require(self.num_experts % g == 0, "num_expert_groups", g,
                     "must divide num_experts", f" ({self.num_experts})")
        if self.routing == "moge":
            _require(self.top_k % self.num_expert_groups == 0, "top_k", self.top_k,
                     "MoGE needs top_k divisible by num_expert_groups", f" ({self.num_expert_groups})")
        if self.routing == "group_limited":
            _require(self.topk_groups <= self.num_expert_groups, "topk_groups", self.topk_groups,
                     "must be <= num_expert_groups", f" ({self.num_expert_groups})")
        if self.capacity_factor is not None:
            _require(self.capacity_factor <= self.num_experts, "capacity_factor", self.capacity_factor,
                     "must be <= num_experts", f" ({self.num_experts}): from num_experts / top_k on, every expert "
                     f"keeps every token routed to it")

    def _check_size(self) -> None:
        """The bounds on the whole model (docs/inputs.md): its parameters (MTP included) and the largest activation
        tensor of one sequence as the trace builds it."""
        pc = count_params(self)
        params = pc.total + pc.mtp + pc.mtp_copies
        if params > MAX_PARAMS:
            raise SpecError(f"parameters={params:.3g}: a model may have at most 1e+14 (100 trillion); reduce "
                            f"num_experts, moe_ffn_size, hidden_size, num_layers or vocab_size (docs/inputs.md)",
                            reason="parameters above 1e+14")
        s = self.seq_len
        sizes = [(self.num_heads * s * s, "num_heads·seq_len² (attention scores)"),
                 (s * self.vocab_size, "seq_len·vocab_size (logits)"),
                 (s * self.num_heads * max(self.qk_head_dim, self.v_head_dim),
                  "seq_len·num_heads·head width (queries, keys, values)")]
        if self.num_moe_layers or self.num_mtp_layers:
            sizes.append((s * self.top_k * max(1.0, self.capacity_factor or 1.0) * max(self.hidden_size,
                                                                                     self.moe_ffn_size),
                          "seq_len·top_k·max(hidden_size, moe_ffn_size) (routed tokens)"))
        n, what = max(sizes)
        if n > MAX_ACTIVATION:
            raise SpecError(f"seq_len={s}: the largest activation of one sequence, {what}, would hold {n:.3g} "
                            f"elements; at most 2^56 = {MAX_ACTIVATION:.3g} (docs/inputs.md)",
                            reason=f"{what} above 2^56 elements")

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def is_moe(self) -> bool:
        return self.num_moe_layers > 0

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: nope + rope for MLA, ``head_dim`` for GQA."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of the spec (first 16 hex digits); identifies the model in a plan."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]

    def with_shape(self, *, seq_len: int | None = None, global_batch: int | None = None) -> "ModelSpec":
        """Return a copy with another training shape; ``None`` keeps the default. Raises SpecError on bad values."""
        upd = self.model_dump()
        if seq_len is not None:
            upd["seq_len"] = seq_len
        if global_batch is not None:
            upd["global_batch"] = global_batch
        return _build(upd, source="command line")


def _require(ok: bool, field: str, value: object, rule: str, figures: str = "") -> None:
    """Raise SpecError ``{field}={value}: {rule}{figures}`` unless ``ok``; its ``reason`` is ``{field} {rule}``
    (``figures``: this spec's numbers the rule compares against)."""
    if not ok:
        raise SpecError(f"{field}={value!r}: {rule}{figures}", reason=f"{field} {rule}")


def _build(data: dict, *, source: str) -> ModelSpec:
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "value_error" and isinstance(err.get("ctx", {}).get("error"), SpecError):
            raise err["ctx"]["error"] from None
        raise SpecError(validation_message(err, where=f"in {source}")) from None


# ---- HF config.json ---------------------------------------------------------------------------------------------
def _opt(limit: int, low: int = 0):
    return Field(default=None, ge=low, le=limit)


class HFConfig(BaseModel):
    """The keys of a Hugging Face ``config.json`` that :func:`from_hf_config` reads, typed and bounded as the
    ModelSpec fields they become (transformers' ``PretrainedConfig`` names of each family:
    https://huggingface.co/docs/transformers/main_classes/configuration); other keys are ignored. A key that is
    absent or ``null`` takes the default of :func:`from_hf_config`."""

    model_config = ConfigDict(frozen=True, extra="allow", strict=True, allow_inf_nan=False, protected_namespaces=())

    model_type: str = ""
    vocab_size: int = _pos(MAX_VOCAB)
    hidden_size: int = _pos(MAX_WIDTH)
    num_hidden_layers: int = _pos(MAX_LAYERS)
    num_attention_heads: int = _pos(MAX_HEADS)
    num_key_value_heads: int | None = _opt(MAX_HEADS, 1)
    head_dim: int | None = _opt(MAX_WIDTH, 1)
    rope_theta: float | None = Field(default=None, gt=0)
    rms_norm_eps: float | None = Field(default=None, gt=0)
    tie_word_embeddings: bool | None = None
    sandwich_norm: bool | None = None
    num_nextn_predict_layers: int | None = _opt(MAX_LAYERS)
    num_mtp_layers: int | None = _opt(MAX_LAYERS)
    q_lora_rank: int | None = _opt(MAX_WIDTH)
    kv_lora_rank: int | None = _opt(MAX_WIDTH)
    qk_nope_head_dim: int | None = _opt(MAX_WIDTH)
    qk_rope_head_dim: int | None = _opt(MAX_WIDTH)
    v_head_dim: int | None = _opt(MAX_WIDTH)
    intermediate_size: int | None = _opt(MAX_WIDTH)
    moe_intermediate_size: int | None = _opt(MAX_WIDTH)
    shared_expert_intermediate_size: int | None = _opt(MAX_WIDTH)
    n_routed_experts: int | None = _opt(MAX_EXPERTS)
    num_local_experts: int | None = _opt(MAX_EXPERTS)
    num_experts: int | None = _opt(MAX_EXPERTS)
    n_shared_experts: int | None = _opt(MAX_EXPERTS)
    num_shared_experts: int | None = _opt(MAX_EXPERTS)
    num_experts_per_tok: int | None = _opt(MAX_EXPERTS)
    moe_topk: int | None = _opt(MAX_EXPERTS)
    first_k_dense_replace: int | None = _opt(MAX_LAYERS)
    mlp_only_layers: list[int] | None = Field(default=None, max_length=MAX_LAYERS)
    decoder_sparse_step: int | None = _opt(MAX_LAYERS)
    moe_layer_freq: int | None = _opt(MAX_LAYERS)
    scoring_func: str | None = None
    routing: str | None = None
    n_group: int | None = _opt(MAX_EXPERTS, 1)
    num_expert_groups: int | None = _opt(MAX_EXPERTS, 1)
    topk_group: int | None = _opt(MAX_EXPERTS, 1)
    routed_scaling_factor: float | None = Field(default=None, gt=0)
    norm_topk_prob: bool | None = None


def _first(*values, default=None):
    """The first value that is not None (HF families name one field differently), else ``default``."""
    return next((v for v in values if v is not None), default)


def from_hf_config(cfg: object, *, name: str, seq_len: int, global_batch: int, source: str = "config.json"
                   ) -> ModelSpec:
    """Map a Hugging Face style config dict to a ModelSpec.

    Understood: DeepSeek-V3/V2 and openPangu MoE (MLA, ``n_routed_experts``, ``first_k_dense_replace``), Pangu Pro
    MoE (``num_experts``, ``num_experts_per_tok``, ``shared_expert_intermediate_size``, grouped routing), Qwen3-MoE
    (``num_experts``, ``mlp_only_layers``), Mixtral (``num_local_experts``) and Llama-style dense configs. The keys
    read are validated first (:class:`HFConfig`). Raises SpecError for a document that is not a JSON object, a key
    that is missing, of the wrong type or out of bounds, or a layout it cannot express.
    """
    if not isinstance(cfg, dict):
        raise SpecError(f"config={type(cfg).__name__}: a config.json must hold a JSON object (in {source})")
    nested = sorted(k for k, v in cfg.items() if k.endswith("_config") and isinstance(v, dict))
    if nested and not {"hidden_size", "num_hidden_layers"} <= cfg.keys():  # DBRX, or a text_config wrapper
        raise SpecError(f"{', '.join(nested)}: nested config layout (model_type {cfg.get('model_type')!r}) is not "
                        f"supported; moeplan reads flat configs with hidden_size, num_hidden_layers, ... at the top "
                        f"level; write a moeplan YAML (examples/models/) instead (in {source})")
    try:
        c = HFConfig.model_validate(cfg)
    except ValidationError as e:
        raise SpecError(validation_message(e.errors()[0], where=f"in {source}")) from None
    _check_aliases(cfg, source)
    if c.model_type.lower() in SIGMOID_ROUTER_TYPES and c.scoring_func is None:
        c = c.model_copy(update={"scoring_func": "sigmoid"})
    d: dict = dict(name=name, vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                   num_heads=c.num_attention_heads, rope_theta=_first(c.rope_theta, default=10000.0),
                   norm_eps=_first(c.rms_norm_eps, default=1e-5), tie_embeddings=bool(c.tie_word_embeddings),
                   num_mtp_layers=_first(c.num_nextn_predict_layers, c.num_mtp_layers, default=0),
                   sandwich_norm=bool(c.sandwich_norm), seq_len=seq_len, global_batch=global_batch)
    if c.kv_lora_rank:
        d.update(attention="mla", q_lora_rank=c.q_lora_rank or 0, kv_lora_rank=c.kv_lora_rank,
                 qk_nope_head_dim=c.qk_nope_head_dim or 0, qk_rope_head_dim=c.qk_rope_head_dim or 0,
                 v_head_dim=c.v_head_dim or 0)
    else:
        if c.head_dim is None and c.hidden_size % c.num_attention_heads:
            raise SpecError(f"hidden_size={c.hidden_size}: must be divisible by num_attention_heads "
                            f"({c.num_attention_heads}) when head_dim is not given (in {source})",
                            reason="hidden_size must be divisible by num_attention_heads")
        d.update(attention="gqa", num_kv_heads=_first(c.num_key_value_heads, default=c.num_attention_heads),
                 head_dim=_first(c.head_dim, default=c.hidden_size // c.num_attention_heads))
    d.update(_hf_moe(c, source))
    try:
        return _build(d, source=source)
    except SpecError as e:  # a rule of ModelSpec: say it in the config's own keys
        msg = _hf_names(str(e), cfg)
        raise SpecError(msg if f"in {source}" in msg else f"{msg} (in {source})", reason=e.reason) from None


SIGMOID_ROUTER_TYPES = frozenset({"glm4_moe"})
"""``model_type``s whose router scores with a sigmoid without a ``scoring_func`` key (transformers'
``Glm4MoeTopkRouter``)."""

HF_KEYS: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers",), "num_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads",), "num_dense_layers": ("first_k_dense_replace", "mlp_only_layers"),
    "dense_ffn_size": ("intermediate_size",), "num_experts": ("n_routed_experts", "num_local_experts", "num_experts"),
    "top_k": ("num_experts_per_tok", "moe_topk"), "moe_ffn_size": ("moe_intermediate_size", "intermediate_size"),
    "num_shared_experts": ("n_shared_experts", "num_shared_experts"),
    "shared_ffn_size": ("shared_expert_intermediate_size", "n_shared_experts"),
    "num_expert_groups": ("n_group", "num_expert_groups"), "topk_groups": ("topk_group",),
    "num_mtp_layers": ("num_nextn_predict_layers", "num_mtp_layers"), "norm_eps": ("rms_norm_eps",),
    "router_scale": ("routed_scaling_factor",), "tie_embeddings": ("tie_word_embeddings",),
}
"""ModelSpec field -> the config.json keys it is read from, in the order :func:`from_hf_config` prefers them."""


HF_ALIASES: tuple[tuple[str, ...], ...] = (
    ("n_routed_experts", "num_local_experts", "num_experts"), ("n_shared_experts", "num_shared_experts"),
    ("num_experts_per_tok", "moe_topk", "experts_per_token"), ("n_group", "num_expert_groups"),
    ("num_nextn_predict_layers", "num_mtp_layers"), ("decoder_sparse_step", "moe_layer_freq"))
"""config.json keys that name one quantity in different families (gpt-oss writes its top-k twice): the reader
takes the first that is set (:data:`HF_KEYS`), so two that disagree are refused rather than one of them dropped."""


def _check_aliases(cfg: dict, source: str) -> None:
    """Refuse two keys of one :data:`HF_ALIASES` group with different values, and ``first_k_dense_replace`` beside
    an ``mlp_only_layers`` of another length (both give the dense prefix). Raises SpecError."""
    for group in HF_ALIASES:
        (key, value), *others = [(k, cfg[k]) for k in group if cfg.get(k) is not None] or [(None, None)]
        for other, v in others:
            if v != value:  # reprlib: a value that only one key types (experts_per_token) may be any size
                raise SpecError(f"{other}={reprlib.repr(v)}: names the same quantity as {key}={reprlib.repr(value)} "
                                f"with another value; keep one of them (in {source})", reason="config keys disagree")
    first, dense = cfg.get("first_k_dense_replace"), cfg.get("mlp_only_layers")
    if first is not None and isinstance(dense, list) and len(dense) != first:
        raise SpecError(f"mlp_only_layers={reprlib.repr(dense)}: {len(dense)} dense layers where "
                        f"first_k_dense_replace={first!r}; keep one of them (in {source})",
                        reason="config keys disagree")


def _hf_names(message: str, cfg: dict) -> str:
    """``message`` of a ModelSpec rule with each field renamed to the config.json key it came from (the first of
    :data:`HF_KEYS` the config has), all at once: ``top_k=9: must be in 1..num_experts (8)`` becomes
    ``num_experts_per_tok=9: must be in 1..n_routed_experts (8)``."""
    names = {f: next((k for k in keys if k in cfg), keys[0]) for f, keys in HF_KEYS.items()}
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: names[m.group(1)], message)


def _hf_moe(c: HFConfig, source: str) -> dict:
    ffn = _first(c.intermediate_size, default=0)
    num_experts = _first(c.n_routed_experts, c.num_local_experts, c.num_experts, default=0)
    if not num_experts:
        return dict(num_dense_layers=c.num_hidden_layers, dense_ffn_size=ffn)
    moe_ffn = _first(c.moe_intermediate_size, default=ffn)
    n_shared = _first(c.n_shared_experts, c.num_shared_experts, default=0)
    shared_ffn = _first(c.shared_expert_intermediate_size, default=n_shared * moe_ffn)
    if shared_ffn and not n_shared:
        n_shared = max(1, shared_ffn // moe_ffn) if moe_ffn else 1
    first_dense = _first(c.first_k_dense_replace, default=0)
    if c.mlp_only_layers:
        if c.mlp_only_layers != list(range(len(c.mlp_only_layers))):
            raise SpecError(f"mlp_only_layers={c.mlp_only_layers!r}: only a prefix of dense layers is supported "
                            f"(in {source})")
        first_dense = len(c.mlp_only_layers)
    step = _first(c.decoder_sparse_step, c.moe_layer_freq, default=1)
    if step != 1:
        raise SpecError(f"decoder_sparse_step={step!r}: only every layer after the dense prefix being MoE is "
                        f"supported (in {source})")
    n_group = _first(c.n_group, c.num_expert_groups, default=1)
    topk_group = _first(c.topk_group, default=n_group)
    model_type = c.model_type.lower()
    if "pangu_pro" in model_type or "moge" in model_type or c.routing == "moge":
        routing = "moge"
    elif n_group > 1 and topk_group < n_group:
        routing = "group_limited"
    else:
        routing = "topk"
    return dict(num_dense_layers=first_dense, dense_ffn_size=ffn if first_dense else 0, num_experts=num_experts,
                top_k=_first(c.num_experts_per_tok, c.moe_topk, default=1), moe_ffn_size=moe_ffn,
                num_shared_experts=n_shared, shared_ffn_size=shared_ffn,
                router="sigmoid" if c.scoring_func == "sigmoid" else "softmax", routing=routing,
                num_expert_groups=n_group, topk_groups=topk_group if routing == "group_limited" else 1,
                router_scale=float(_first(c.routed_scaling_factor, default=1.0)),
                norm_topk_prob=_first(c.norm_topk_prob, default=True))


# ---- files and the registry --------------------------------------------------------------------------------------
def _registry() -> dict[str, dict]:
    root = resources.files("moeplan.examples") / "models"
    return yaml.safe_load((root / "registry.yaml").read_text())


def registry_names() -> list[str]:
    """Names the registry knows, sorted."""
    return sorted(_registry())


@dataclass(frozen=True)
class ModelFile:
    """A model as read: its spec, where it came from (a registry name or a path) and, for a config.json, the keys
    that change the training step but that moeplan did not read (:mod:`moeplan.hf_keys`)."""
    spec: ModelSpec
    source: str
    ignored: tuple[IgnoredKey, ...] = ()

    def warning(self) -> str | None:
        """One line naming every ignored key and what leaving it out does to the prediction; None when none."""
        return ignored_line(self.source, self.ignored) if self.ignored else None


def load_spec(ref: str) -> ModelSpec:
    """Load a ModelSpec from a registry name, a moeplan YAML file or an HF ``config.json`` (:func:`read_model`).

    Raises SpecError: unknown name, unreadable or malformed file, or a spec that breaks a rule.
    """
    return read_model(ref).spec


def read_model(ref: str) -> ModelFile:
    """Read a registry name, a moeplan YAML file or an HF ``config.json``: the spec and the config keys it left out.

    Raises SpecError: unknown name, unreadable or malformed file, or a spec that breaks a rule.
    """
    reg = _registry()
    if ref in reg:
        entry = reg[ref]
        root = resources.files("moeplan.examples") / "models"
        with resources.as_file(root / entry["file"]) as p:
            return _load_file(Path(p), name=ref, seq_len=entry.get("seq_len"), global_batch=entry.get("global_batch"),
                              source=ref)
    path = Path(ref)
    if path.suffix in (".yaml", ".yml", ".json") and path.exists():
        return _load_file(path, name=path.stem if path.name != "config.json" else path.parent.name, source=ref)
    raise SpecError(f"model={ref!r}: not a registry name ({', '.join(sorted(reg))}) nor an existing "
                    f".yaml/.json file")


def _load_file(path: Path, *, name: str, source: str, seq_len: int | None = None,
               global_batch: int | None = None) -> ModelFile:
    read = read_json if path.suffix == ".json" else read_yaml
    data = read(path, field="model", error=SpecError)
    if path.suffix == ".json":
        spec = from_hf_config(data, name=name, seq_len=seq_len or 4096, global_batch=global_batch or 1024,
                              source=str(path))
        return ModelFile(spec, source, ignored_keys(data, HFConfig.model_fields.keys()))
    if not isinstance(data, dict):
        raise SpecError(f"model={str(path)!r}: a model YAML must hold a mapping, got {type(data).__name__}")
    data = {"name": name, **data}
    return ModelFile(_build(data, source=str(path)), source)
