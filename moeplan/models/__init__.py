"""The PyTorch model family: MLA/GQA attention, SwiGLU and MoE FFNs (top-k, group-limited, MoGE routing), MTP.

Build a piece by name with :func:`build_layer` (the pipeline runtime builds only its own pieces) or the whole model
with :class:`MoEModel`; weights depend only on ``(seed, full parameter name)``. :data:`TRACER_LEAVES` are the
modules the fx tracer keeps whole (data-dependent dispatch, fused attention and norm, rotary, router).
"""
from moeplan.models.attention import CoreAttention, GQAttention, MLAttention, build_attention
from moeplan.models.init import init_weights_, param_seed
from moeplan.models.layers import RMSNorm, Rotary, SwiGLU
from moeplan.models.model import (DEFAULT_MTP_WEIGHT, IGNORE_INDEX, DecoderLayer, Embedding, EmptyLayer, Head,
                                  ModelLosses, MoEModel, MTPBlock, build_layer, layer_names, lm_loss, parse_layer_name,
                                  shared_sources, tied_parameters)
from moeplan.models.moe import (GroupedExperts, MoE, Router, TokenPermute, TokenUnpermute,
                                expert_capacity, group_limited_experts, load_balance_loss, moge_experts)

TRACER_LEAVES: tuple[type, ...] = (RMSNorm, Rotary, CoreAttention, Router, TokenPermute, GroupedExperts, TokenUnpermute)

__all__ = [
    "CoreAttention", "DEFAULT_MTP_WEIGHT", "DecoderLayer", "Embedding", "EmptyLayer", "GQAttention", "GroupedExperts",
    "Head", "IGNORE_INDEX", "MLAttention", "RMSNorm", "MTPBlock", "ModelLosses", "MoE", "MoEModel", "Rotary", "Router",
    "SwiGLU", "TRACER_LEAVES", "TokenPermute", "TokenUnpermute", "build_attention", "build_layer",
    "expert_capacity", "group_limited_experts", "init_weights_", "layer_names", "lm_loss", "load_balance_loss",
    "moge_experts", "param_seed", "parse_layer_name", "shared_sources", "tied_parameters",
]
