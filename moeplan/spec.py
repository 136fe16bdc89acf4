"""Model specifications: one typed description of a decoder-only (MoE) language model.

A :class:`ModelSpec` is loaded from moeplan's own YAML, from a Hugging Face style ``config.json`` (the field names of
DeepSeek-V3, openPangu MoE, Pangu Pro MoE, Qwen3-MoE, Mixtral and Llama-style dense configs), or by registry name
(``examples/models/registry.yaml``). It also carries the default training shape (``seq_len``, ``global_batch`` in
sequences). Every rule is checked at load time and a violation raises :class:`~moeplan.errors.SpecError` whose
one-line message names the field, the value and the rule.
"""
from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moeplan.errors import SpecError

Pos = Field(gt=0)
def NonNeg():
    return Field(default=0, ge=0)


class ModelSpec(BaseModel):
    """A decoder-only transformer with optional MLA attention, MoE layers, MoGE routing and MTP.

    Layer layout: ``num_layers`` decoder layers, the first ``num_dense_layers`` with a dense SwiGLU FFN of width
    ``dense_ffn_size``, the rest MoE; then ``num_mtp_layers`` multi-token-prediction modules (DeepSeek-V3 §2.2),
    each an MoE decoder layer plus its projection ``2h → h``. Sizes are counts of elements, not bytes.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """The model's name: the ``name`` in its YAML file if given, else its registry name or the file's stem (the
    folder of a ``config.json``)."""
    vocab_size: int = Pos
    """Vocabulary size, tokens: rows of the embedding and of the output layer."""
    hidden_size: int = Pos
    """Hidden size ``h``, elements per token of the residual stream."""
    num_layers: int = Pos
    """Decoder layers, a count: the ``num_dense_layers`` dense ones first, then MoE; MTP modules not included."""
    num_dense_layers: int = NonNeg()
    """Leading decoder layers with a dense SwiGLU FFN instead of MoE, a count (HF ``first_k_dense_replace``)."""
    dense_ffn_size: int = NonNeg()
    """Intermediate width of the dense layers' SwiGLU FFN, elements; 0 without dense layers."""
    # attention
    attention: Literal["mla", "gqa"]
    """Attention kind: ``mla`` (multi-head latent attention, DeepSeek-V2/V3) or ``gqa`` (grouped-query; MHA when
    ``num_kv_heads == num_heads``)."""
    num_heads: int = Pos
    """Attention (query) heads per layer, a count."""
    num_kv_heads: int = NonNeg()
    """Key/value heads per layer, a count; gqa only, 0 for mla."""
    head_dim: int = NonNeg()
    """Width of one query/key/value head, elements; gqa only."""
    q_lora_rank: int = NonNeg()
    """Width of MLA's compressed query latent, elements; mla only, 0 = no query compression."""
    kv_lora_rank: int = NonNeg()
    """Width of MLA's compressed key/value latent, elements; mla only."""
    qk_nope_head_dim: int = NonNeg()
    """Per-head query/key width without RoPE (MLA), elements."""
    qk_rope_head_dim: int = NonNeg()
    """Per-head query/key width that carries RoPE (MLA; the key part is shared by all heads), elements; even."""
    v_head_dim: int = NonNeg()
    """Per-head value width (MLA), elements."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """RoPE base frequency θ, dimensionless."""
    # experts
    num_experts: int = NonNeg()
    """Routed experts per MoE layer, a count; 0 for a dense model."""
    top_k: int = NonNeg()
    """Routed experts each token is sent to, a count."""
    moe_ffn_size: int = NonNeg()
    """Intermediate width of one routed expert's SwiGLU FFN, elements."""
    num_shared_experts: int = NonNeg()
    """Shared experts per MoE layer (every token goes through them), a count."""
    shared_ffn_size: int = NonNeg()
    """Total intermediate width of all shared experts, merged into one SwiGLU, elements; 0 without them."""
    router: Literal["sigmoid", "softmax"] = "softmax"
    """The router's score function over the ``num_experts`` gate logits (computed in fp32)."""
    routing: Literal["topk", "group_limited", "moge"] = "topk"
    """Expert choice: ``topk`` (plain top-k), ``group_limited`` (DeepSeek-V3 node-limited: only the ``topk_groups``
    best groups) or ``moge`` (Pangu Pro MoE: top ``top_k / num_expert_groups`` in every group)."""
    num_expert_groups: int = Field(default=1, gt=0)
    """Groups the routed experts are split into, a count; used by ``group_limited`` and ``moge`` routing."""
    topk_groups: int = Field(default=1, gt=0)
    """Groups a token may pick its experts from, a count; ``group_limited`` routing only."""
    router_scale: float = Field(default=1.0, gt=0)
    """Factor the gates are multiplied by after the top-k choice (HF ``routed_scaling_factor``), dimensionless."""
    norm_topk_prob: bool = True
    """Whether the chosen experts' gates are renormalised to sum to 1 (before ``router_scale``)."""
    capacity_factor: float | None = Field(default=None, gt=0)
    """Drop-and-pad expert capacity factor: each expert keeps ``ceil(capacity_factor · tokens · top_k /
    num_experts)`` rows of a micro-batch, dimensionless; None = dropless."""
    # the rest
    num_mtp_layers: int = NonNeg()
    """Multi-token-prediction modules after the decoder layers (DeepSeek-V3 §2.2), a count."""
    sandwich_norm: bool = False
    """Whether every decoder layer also normalises the attention and MLP outputs (two more RMSNorms; Pangu Ultra MoE
    "Depth-Scaled Sandwich-Norm", arXiv 2505.04519)."""
    norm_eps: float = Field(default=1e-5, gt=0)
    """The RMSNorms' ε, added to the mean square, dimensionless."""
    tie_embeddings: bool = False
    """Whether the output layer shares the embedding's weight."""
    # default training shape
    seq_len: int = Pos
    """Training sequence length, tokens per sequence: the default shape, which ``compile --seq-len`` overrides (a
    plan's spec holds the shape it was compiled for)."""
    global_batch: int = Pos
    """Global batch of one training step, sequences: the default shape, which ``compile --global-batch``
    overrides."""

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        _require(self.num_dense_layers <= self.num_layers, "num_dense_layers", self.num_dense_layers,
                 f"must be <= num_layers ({self.num_layers})")
        _require(self.hidden_size % self.num_heads == 0, "hidden_size", self.hidden_size,
                 f"must be divisible by num_heads ({self.num_heads})")
        if self.num_dense_layers:
            _require(self.dense_ffn_size > 0, "dense_ffn_size", self.dense_ffn_size, "must be > 0 with dense layers")
        if self.attention == "gqa":
            _require(self.num_kv_heads > 0 and self.head_dim > 0, "num_kv_heads", self.num_kv_heads,
                     "gqa needs num_kv_heads > 0 and head_dim > 0")
            _require(self.num_heads % self.num_kv_heads == 0, "num_heads", self.num_heads,
                     f"must be divisible by num_kv_heads ({self.num_kv_heads})")
        else:
            for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                _require(getattr(self, f) > 0, f, getattr(self, f), "must be > 0 for mla attention")
            _require(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", self.qk_rope_head_dim, "must be even (RoPE)")
        if self.num_moe_layers or self.num_mtp_layers:
            self._check_moe()
        return self

    def _check_moe(self) -> None:
        _require(self.num_experts > 0, "num_experts", self.num_experts, "must be > 0 with MoE or MTP layers")
        _require(0 < self.top_k <= self.num_experts, "top_k", self.top_k,
                 f"must be in 1..num_experts ({self.num_experts})")
        _require(self.moe_ffn_size > 0, "moe_ffn_size", self.moe_ffn_size, "must be > 0 with MoE layers")
        _require((self.num_shared_experts > 0) == (self.shared_ffn_size > 0), "shared_ffn_size", self.shared_ffn_size,
                 "must be > 0 exactly when num_shared_experts > 0")
        if self.routing != "topk":
            g = self.num_expert_groups
            _require(self.num_experts % g == 0, "num_expert_groups", g,
                     f"must divide num_experts ({self.num_experts})")
        if self.routing == "moge":
            _require(self.top_k % self.num_expert_groups == 0, "top_k", self.top_k,
                     f"MoGE needs top_k divisible by num_expert_groups ({self.num_expert_groups})")
        if self.routing == "group_limited":
            _require(self.topk_groups <= self.num_expert_groups, "topk_groups", self.topk_groups,
                     f"must be <= num_expert_groups ({self.num_expert_groups})")

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


def _require(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise SpecError(f"{field}={value!r}: {rule}")


def _build(data: dict, *, source: str) -> ModelSpec:
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "value_error" and isinstance(err.get("ctx", {}).get("error"), SpecError):
            raise err["ctx"]["error"] from None
        field = ".".join(str(p) for p in err["loc"]) or "spec"
        if err["type"] == "missing":
            raise SpecError(f"{field}=None: required (in {source})") from None
        raise SpecError(f"{field}={err.get('input')!r}: {err['msg']} (in {source})") from None


# ---- HF config.json ---------------------------------------------------------------------------------------------
def _hf_get(cfg: dict, *keys: str, default=None):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def from_hf_config(cfg: dict, *, name: str, seq_len: int, global_batch: int, source: str = "config.json") -> ModelSpec:
    """Map a Hugging Face style config dict to a ModelSpec.

    Understood: DeepSeek-V3/V2 and openPangu MoE (MLA, ``n_routed_experts``, ``first_k_dense_replace``), Pangu Pro
    MoE (``num_experts``, ``num_experts_per_tok``, ``shared_expert_intermediate_size``, grouped routing), Qwen3-MoE
    (``num_experts``, ``mlp_only_layers``), Mixtral (``num_local_experts``) and Llama-style dense configs.
    Raises SpecError for a field that is missing or a layout it cannot express.
    """
    if not isinstance(cfg, dict):
        raise SpecError(f"config={type(cfg).__name__}: a config.json must hold a JSON object (in {source})")
    model_type = str(cfg.get("model_type", "")).lower()
    num_layers = _hf_get(cfg, "num_hidden_layers")
    hidden = _hf_get(cfg, "hidden_size")
    for f, v in (("num_hidden_layers", num_layers), ("hidden_size", hidden), ("vocab_size", cfg.get("vocab_size")),
                 ("num_attention_heads", cfg.get("num_attention_heads"))):
        if v is None:
            raise SpecError(f"{f}=None: required in an HF config (in {source})")
    d: dict = dict(name=name, vocab_size=cfg["vocab_size"], hidden_size=hidden, num_layers=num_layers,
                   num_heads=cfg["num_attention_heads"], rope_theta=_hf_get(cfg, "rope_theta", default=10000.0),
                   norm_eps=_hf_get(cfg, "rms_norm_eps", default=1e-5),
                   tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   num_mtp_layers=_hf_get(cfg, "num_nextn_predict_layers", "num_mtp_layers", default=0),
                   sandwich_norm=bool(cfg.get("sandwich_norm", False)), seq_len=seq_len, global_batch=global_batch)
    if cfg.get("kv_lora_rank"):
        d.update(attention="mla", q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=cfg["kv_lora_rank"],
                 qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                 v_head_dim=cfg["v_head_dim"])
    else:
        d.update(attention="gqa", num_kv_heads=_hf_get(cfg, "num_key_value_heads", default=cfg["num_attention_heads"]),
                 head_dim=_hf_get(cfg, "head_dim", default=hidden // cfg["num_attention_heads"]))
    d.update(_hf_moe(cfg, model_type, num_layers, source))
    return _build(d, source=source)


def _hf_moe(cfg: dict, model_type: str, num_layers: int, source: str) -> dict:
    ffn = _hf_get(cfg, "intermediate_size", default=0)
    num_experts = _hf_get(cfg, "n_routed_experts", "num_local_experts", "num_experts", default=0)
    if not num_experts:
        return dict(num_dense_layers=num_layers, dense_ffn_size=ffn)
    moe_ffn = _hf_get(cfg, "moe_intermediate_size", default=ffn)
    n_shared = _hf_get(cfg, "n_shared_experts", "num_shared_experts", default=0)
    shared_ffn = _hf_get(cfg, "shared_expert_intermediate_size", default=n_shared * moe_ffn)
    if shared_ffn and not n_shared:
        n_shared = max(1, shared_ffn // moe_ffn)
    first_dense = _hf_get(cfg, "first_k_dense_replace", default=0)
    mlp_only = list(cfg.get("mlp_only_layers") or [])
    if mlp_only:
        if mlp_only != list(range(len(mlp_only))):
            raise SpecError(f"mlp_only_layers={mlp_only!r}: only a prefix of dense layers is supported (in {source})")
        first_dense = len(mlp_only)
    if _hf_get(cfg, "decoder_sparse_step", "moe_layer_freq", default=1) != 1:
        raise SpecError(f"decoder_sparse_step={cfg.get('decoder_sparse_step', cfg.get('moe_layer_freq'))!r}: "
                        f"only every layer after the dense prefix being MoE is supported (in {source})")
    scoring = str(_hf_get(cfg, "scoring_func", default="softmax"))
    n_group = _hf_get(cfg, "n_group", "num_expert_groups", default=1)
    topk_group = _hf_get(cfg, "topk_group", default=n_group)
    if "pangu_pro" in model_type or "moge" in model_type or cfg.get("routing") == "moge":
        routing = "moge"
    elif n_group > 1 and topk_group < n_group:
        routing = "group_limited"
    else:
        routing = "topk"
    return dict(num_dense_layers=first_dense, dense_ffn_size=ffn if first_dense else 0, num_experts=num_experts,
                top_k=_hf_get(cfg, "num_experts_per_tok", "moe_topk", default=1), moe_ffn_size=moe_ffn,
                num_shared_experts=n_shared, shared_ffn_size=shared_ffn,
                router="sigmoid" if scoring == "sigmoid" else "softmax", routing=routing,
                num_expert_groups=n_group, topk_groups=topk_group if routing == "group_limited" else 1,
                router_scale=float(_hf_get(cfg, "routed_scaling_factor", default=1.0)),
                norm_topk_prob=bool(_hf_get(cfg, "norm_topk_prob", default=True)))


# ---- files and the registry --------------------------------------------------------------------------------------
def _read_structured(path: Path) -> object:
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"model={str(path)!r}: cannot read the file ({e.strerror})") from None
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        kind = "JSON" if path.suffix == ".json" else "YAML"
        line = str(e).splitlines()[0]
        raise SpecError(f"model={str(path)!r}: malformed {kind} ({line})") from None


def _registry() -> dict[str, dict]:
    root = resources.files("moeplan.examples") / "models"
    return yaml.safe_load((root / "registry.yaml").read_text())


def registry_names() -> list[str]:
    """Names the registry knows, sorted."""
    return sorted(_registry())


def load_spec(ref: str) -> ModelSpec:
    """Load a ModelSpec from a registry name, a moeplan YAML file or an HF ``config.json``.

    Raises SpecError: unknown name, unreadable or malformed file, or a spec that breaks a rule.
    """
    reg = _registry()
    if ref in reg:
        entry = reg[ref]
        root = resources.files("moeplan.examples") / "models"
        with resources.as_file(root / entry["file"]) as p:
            return _load_file(Path(p), name=ref, seq_len=entry.get("seq_len"), global_batch=entry.get("global_batch"))
    path = Path(ref)
    if path.suffix in (".yaml", ".yml", ".json") and path.exists():
        return _load_file(path, name=path.stem if path.name != "config.json" else path.parent.name)
    raise SpecError(f"model={ref!r}: not a registry name ({', '.join(sorted(reg))}) nor an existing "
                    f".yaml/.json file")


def _load_file(path: Path, *, name: str, seq_len: int | None = None, global_batch: int | None = None) -> ModelSpec:
    data = _read_structured(path)
    if path.suffix == ".json":
        return from_hf_config(data, name=name, seq_len=seq_len or 4096, global_batch=global_batch or 1024,
                              source=str(path))
    if not isinstance(data, dict):
        raise SpecError(f"model={str(path)!r}: a model YAML must hold a mapping, got {type(data).__name__}")
    data = {"name": name, **data}
    return _build(data, source=str(path))
