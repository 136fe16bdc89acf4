"""The model as named pieces, buildable one at a time (the pipeline runtime builds only its stages' pieces).

Piece names, in pipeline order (``StagePlan`` uses the same): ``embedding``; ``layers.{i}`` for i in
``0..num_layers-1`` (the first ``num_dense_layers`` dense, the rest MoE); per MTP module j: ``mtp.{j}`` (its norms,
``2h → h`` projection and MoE decoder layer) and ``mtp_head.{j}`` (its final norm, logits through the output-layer
weight, cross-entropy); ``head`` (final norm, output layer, cross-entropy); ``empty.{k}`` (identity, for pipeline
balance). Interfaces: ``embedding(tokens [b, s]) -> h [b, s, H]``; ``layers.i(h) -> h``;
``mtp.j(h_prev, tokens) -> h_j`` (h_prev: the main model's last hidden state for j = 0, else ``mtp.{j-1}``'s);
``mtp_head.j(h_j, labels) -> loss``; ``head(h, labels) -> loss``. ``labels[b, i]`` is the target of position i
(normally ``tokens[b, i+1]``); -100 is ignored.

MTP (DeepSeek-V3 §2.2): module j (depth k = j+1) embeds the tokens shifted left by k, ``proj([norm(h_prev);
norm(emb)])`` feeds one MoE decoder layer; its head predicts ``labels`` shifted left by k (the last k positions are
ignored). The MTP embedding and MTP-head output weight are copies of ``embedding.word.weight`` and
``head.output.weight`` (see :func:`tied_parameters`); :class:`MoEModel` ties them, a pipeline runtime must sum
their gradients across stages. Loss = main + ``mtp_weight`` · mean of the MTP losses (DeepSeek-V3 eq. 25, λ = 0.3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from moeplan.errors import SpecError
from moeplan.ir import LayerKind, ShardHint
from moeplan.models.init import init_weights_
from moeplan.models.attention import build_attention
from moeplan.models.layers import RMSNorm, SwiGLU
from moeplan.models.moe import MoE
from moeplan.spec import ModelSpec

IGNORE_INDEX = -100
DEFAULT_MTP_WEIGHT = 0.3


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32: ``logits [b, s, V]``, ``labels [b, s]`` (``IGNORE_INDEX`` skipped)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer: ``forward(hidden [b, s, h]) -> [b, s, h]``.

    ``x = x + post_attn_norm(attn(input_norm(x)))``; ``x = x + post_mlp_norm(mlp(pre_mlp_norm(x)))``. The ``post_*``
    norms exist only with ``spec.sandwich_norm`` (Pangu Ultra MoE, arXiv 2505.04519, "Depth-Scaled Sandwich-Norm";
    their depth-scaled initial gain is not modelled: every norm starts at 1). ``mlp`` is :class:`MoE` when ``moe``
    else a SwiGLU of width ``dense_ffn_size``. Norms and residual adds work on the whole hidden state (SP).
    """

    SHARD: ClassVar[Mapping[str, ShardHint]] = {"": ShardHint.SP}

    def __init__(self, spec: ModelSpec, *, moe: bool, aux_loss_coeff: float = 0.0) -> None:
        super().__init__()
        h, eps = spec.hidden_size, spec.norm_eps
        self.input_norm = RMSNorm(h, eps=eps)
        self.attn = build_attention(spec)
        self.post_attn_norm = RMSNorm(h, eps=eps) if spec.sandwich_norm else None
        self.pre_mlp_norm = RMSNorm(h, eps=eps)
        self.mlp = MoE(spec, aux_loss_coeff=aux_loss_coeff) if moe else SwiGLU(h, spec.dense_ffn_size)
        self.post_mlp_norm = RMSNorm(h, eps=eps) if spec.sandwich_norm else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        attn = self.attn(self.input_norm(hidden))
        if self.post_attn_norm is not None:
            attn = self.post_attn_norm(attn)
        hidden = hidden + attn
        mlp = self.mlp(self.pre_mlp_norm(hidden))
        if self.post_mlp_norm is not None:
            mlp = self.post_mlp_norm(mlp)
        return hidden + mlp


class Embedding(nn.Module):
    """``forward(tokens [b, s] int64) -> [b, s, h]``; parameter ``word.weight [V, h]`` (vocab-parallel under TP)."""

    SHARD: ClassVar[Mapping[str, ShardHint]] = {"": ShardHint.TP, "word": ShardHint.TP}

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.word = nn.Embedding(spec.vocab_size, spec.hidden_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.word(tokens)


class Head(nn.Module):
    """Final norm, output layer and loss: ``forward(hidden [b, s, h], labels [b, s]) -> scalar``.

    ``depth`` shifts the labels left (an MTP head of depth k predicts ``labels[:, i+k]`` at position i).
    """

    SHARD: ClassVar[Mapping[str, ShardHint]] = {"": ShardHint.TP, "norm": ShardHint.SP, "output": ShardHint.TP}

    def __init__(self, spec: ModelSpec, *, depth: int = 0) -> None:
        super().__init__()
        self.depth = depth
        self.norm = RMSNorm(spec.hidden_size, eps=spec.norm_eps)
        self.output = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.depth:
            pad = torch.full_like(labels[:, :self.depth], IGNORE_INDEX)
            labels = torch.cat((labels[:, self.depth:], pad), dim=1)
        return lm_loss(self.output(self.norm(hidden)), labels)


class MTPBlock(nn.Module):
    """One MTP module's trunk (DeepSeek-V3 §2.2, eq. 21–22).

    ``forward(h_prev [b, s, h], tokens [b, s]) -> [b, s, h]`` =
    ``layer(proj(cat(hidden_norm(h_prev), embed_norm(embedding(tokens shifted left by depth)))))``; the shifted-in
    tail wraps around and only feeds positions whose labels the head ignores.
    """

    SHARD: ClassVar[Mapping[str, ShardHint]] = {"": ShardHint.SP, "hidden_norm": ShardHint.SP,
                                                "embed_norm": ShardHint.SP, "proj": ShardHint.TP}

    def __init__(self, spec: ModelSpec, *, depth: int, aux_loss_coeff: float = 0.0) -> None:
        super().__init__()
        h = spec.hidden_size
        self.depth = depth
        self.embedding = Embedding(spec)
        self.hidden_norm = RMSNorm(h, eps=spec.norm_eps)
        self.embed_norm = RMSNorm(h, eps=spec.norm_eps)
        self.proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(spec, moe=True, aux_loss_coeff=aux_loss_coeff)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        emb = self.embed_norm(self.embedding(tokens.roll(-self.depth, dims=1)))
        return self.layer(self.proj(torch.cat((self.hidden_norm(hidden), emb), dim=-1)))


class EmptyLayer(nn.Module):
    """A no-op layer for pipeline balance (MindSpeed ``--noop-layers``): ``forward(h) -> h``."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


# ---- names ---------------------------------------------------------------------------------------------------------
def layer_names(spec: ModelSpec, *, num_empty: int = 0) -> tuple[str, ...]:
    """All piece names in pipeline order: embedding, layers, (mtp, mtp_head) per MTP module, head, empty layers."""
    mtp = [n for j in range(spec.num_mtp_layers) for n in (f"mtp.{j}", f"mtp_head.{j}")]
    return ("embedding", *(f"layers.{i}" for i in range(spec.num_layers)), *mtp, "head",
            *(f"empty.{k}" for k in range(num_empty)))


def parse_layer_name(spec: ModelSpec, name: str) -> tuple[LayerKind, int]:
    """``name -> (kind, index)``. Raises SpecError for an unknown name or an index out of range."""
    if name in ("embedding", "head"):
        return (LayerKind.EMBEDDING if name == "embedding" else LayerKind.HEAD), 0
    stem, _, num = name.rpartition(".")
    limits = {"layers": spec.num_layers, "mtp": spec.num_mtp_layers, "mtp_head": spec.num_mtp_layers,
              "empty": 1 << 30}
    if stem not in limits or not num.isdigit() or int(num) >= limits[stem]:
        raise SpecError(f"layer={name!r}: must be embedding, head, layers.0..{spec.num_layers - 1}, "
                        f"mtp.j / mtp_head.j with j < num_mtp_layers ({spec.num_mtp_layers}) or empty.k")
    index = int(num)
    if stem == "layers":
        return (LayerKind.DENSE if index < spec.num_dense_layers else LayerKind.MOE), index
    return {"mtp": LayerKind.MTP, "mtp_head": LayerKind.MTP_HEAD, "empty": LayerKind.EMPTY}[stem], index


def shared_sources(spec: ModelSpec, name: str) -> Mapping[str, str]:
    """Parameters of piece ``name`` that copy another piece's: ``{local name: owner's full name}``."""
    kind, _ = parse_layer_name(spec, name)
    output_owner = "embedding.word.weight" if spec.tie_embeddings else "head.output.weight"
    if kind == LayerKind.MTP:
        return {"embedding.word.weight": "embedding.word.weight"}
    if kind == LayerKind.MTP_HEAD or (kind == LayerKind.HEAD and spec.tie_embeddings):
        return {"output.weight": output_owner}
    return {}


def tied_parameters(spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    """``(copy's full name, owner's full name)`` for every parameter copy; their gradients must be summed."""
    return tuple((f"{name}.{local}", owner) for name in layer_names(spec)
                 for local, owner in shared_sources(spec, name).items())


# ---- building ------------------------------------------------------------------------------------------------------
def _construct(spec: ModelSpec, kind: LayerKind, index: int, aux_loss_coeff: float) -> nn.Module:
    if kind == LayerKind.EMBEDDING:
        return Embedding(spec)
    if kind in (LayerKind.DENSE, LayerKind.MOE):
        return DecoderLayer(spec, moe=kind == LayerKind.MOE, aux_loss_coeff=aux_loss_coeff)
    if kind == LayerKind.MTP:
        return MTPBlock(spec, depth=index + 1, aux_loss_coeff=aux_loss_coeff)
    if kind == LayerKind.MTP_HEAD:
        return Head(spec, depth=index + 1)
    return Head(spec) if kind == LayerKind.HEAD else EmptyLayer()


def build_layer(spec: ModelSpec, name: str, *, device: str | torch.device = "cpu", seed: int = 0,
                dtype: torch.dtype = torch.float32, aux_loss_coeff: float = 0.0) -> nn.Module:
    """Build piece ``name`` (see the module docstring) on ``device``, weights from :func:`init_weights_`.

    The module is constructed on meta (fast at any size); on another device its storage is allocated and every
    parameter initialised from ``(seed, full name)``; on meta init is skipped. Raises SpecError for a bad name.
    """
    kind, index = parse_layer_name(spec, name)
    with torch.device("meta"):
        module = _construct(spec, kind, index, aux_loss_coeff).to(dtype)
    if torch.device(device).type == "meta":
        return module
    module = module.to_empty(device=device)
    init_weights_(module, prefix=name, seed=seed, sources=shared_sources(spec, name))
    return module


@dataclass(frozen=True)
class ModelLosses:
    """The main next-token loss and one loss per MTP module (scalars)."""

    main: torch.Tensor
    mtp: tuple[torch.Tensor, ...]

    def total(self, mtp_weight: float = DEFAULT_MTP_WEIGHT) -> torch.Tensor:
        """``main + mtp_weight · mean(mtp)`` (DeepSeek-V3 eq. 25); ``main`` alone without MTP."""
        if not self.mtp:
            return self.main
        return self.main + mtp_weight * torch.stack(self.mtp).mean()


class MoEModel(nn.Module):
    """The whole model composed from its pieces: ``forward(tokens [b, s], labels [b, s]) -> scalar loss``.

    Parameter names equal the pieces' full names; MTP copies are tied to their owners (and ``head.output.weight``
    to ``embedding.word.weight`` with ``tie_embeddings``).
    """

    def __init__(self, spec: ModelSpec, seed: int = 0, *, mtp_weight: float = DEFAULT_MTP_WEIGHT,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 aux_loss_coeff: float = 0.0) -> None:
        super().__init__()
        self.mtp_weight = mtp_weight

        def build(name: str) -> nn.Module:
            return build_layer(spec, name, device=device, seed=seed, dtype=dtype, aux_loss_coeff=aux_loss_coeff)

        self.embedding = build("embedding")
        self.layers = nn.ModuleList(build(f"layers.{i}") for i in range(spec.num_layers))
        self.head = build("head")  # registered before the MTP copies so parameter names are the owners'
        self.mtp = nn.ModuleList(build(f"mtp.{j}") for j in range(spec.num_mtp_layers))
        self.mtp_head = nn.ModuleList(build(f"mtp_head.{j}") for j in range(spec.num_mtp_layers))
        for copy, owner in tied_parameters(spec):
            parent, _, attr = copy.rpartition(".")
            setattr(self.get_submodule(parent), attr, self.get_parameter(owner))

    def losses(self, tokens: torch.Tensor, labels: torch.Tensor) -> ModelLosses:
        """Main and per-MTP-module losses for ``tokens, labels [b, s]``."""
        hidden = self.embedding(tokens)
        for layer in self.layers:
            hidden = layer(hidden)
        mtp_losses, mtp_hidden = [], hidden
        for block, head in zip(self.mtp, self.mtp_head):
            mtp_hidden = block(mtp_hidden, tokens)
            mtp_losses.append(head(mtp_hidden, labels))
        return ModelLosses(main=self.head(hidden, labels), mtp=tuple(mtp_losses))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.losses(tokens, labels).total(self.mtp_weight)
