"""``moeplan describe``'s data: parameter counts, FLOPs per token (closed form and traced) and a row per layer kind.

The CLI renders a :class:`ModelDescription` and emits its JSON keys ``params_total``, ``params_activated``,
``params_mtp`` and ``flops_per_token``. Conventions (stated so the figures are not misread): ``params_total`` and
``params_activated`` exclude MTP; ``params_activated`` counts the embedding AND the output matrix (docs/references.md §1.1 quotes
Pangu Ultra MoE's 39.2B "counting one vocab matrix"; ``params_activated_one_vocab`` gives that figure);
``params_mtp`` is the MTP modules' own parameters without their embedding / output-layer copies;
``flops_per_token`` is Megatron-LM's model-FLOPs count (docs/references.md §4.1: forward + backward, causal, no MTP) and
``traced_flops_per_token`` the same quantity summed from the traced graph (it also counts the router GEMM).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from moeplan.flops import count_params, flops_per_token, flops_per_token_with_mtp
from moeplan.ir import LayerKind, ModelGraph
from moeplan.spec import ModelSpec
from moeplan.trace import trace_model

GIGA = 1e9
MTP_KINDS = (LayerKind.MTP, LayerKind.MTP_HEAD)


@dataclass(frozen=True)
class LayerKindRow:
    """One layer kind: how many, parameters per layer, work and saved activations per token of one layer."""

    kind: LayerKind
    count: int
    params: int  # owned by one layer (routed experts included, copies of other layers' weights excluded)
    activated_params: int
    fwd_gflop_per_token: float
    fwd_bwd_gflop_per_token: float
    saved_bytes_per_token: float  # saved for backward with no recompute, bf16 activations


@dataclass(frozen=True)
class ModelDescription:
    """What ``moeplan describe`` shows. Parameter counts are elements; FLOPs are per token, forward + backward."""

    name: str
    seq_len: int
    params_total: int
    params_activated: int
    params_activated_one_vocab: int
    params_mtp: int
    flops_per_token: float
    flops_per_token_with_mtp: float
    traced_flops_per_token: float
    rows: tuple[LayerKindRow, ...]


def traced_flops_per_token(graph: ModelGraph, *, include_mtp: bool = False) -> float:
    """Forward + backward FLOPs per token summed over ``graph.layer_sequence`` (MTP pieces only if asked)."""
    total = sum(graph.layer(k).fwd_flops + graph.layer(k).bwd_flops for k in graph.layer_sequence
                if include_mtp or k not in MTP_KINDS)
    return total / graph.seq_len


def _rows(graph: ModelGraph) -> tuple[LayerKindRow, ...]:
    counts = Counter(graph.layer_sequence)
    rows = []
    for kind, count in counts.items():
        layer, s = graph.layer(kind), graph.seq_len
        rows.append(LayerKindRow(
            kind=kind, count=count, params=layer.param_count, activated_params=layer.activated_param_count,
            fwd_gflop_per_token=layer.fwd_flops / s / GIGA,
            fwd_bwd_gflop_per_token=(layer.fwd_flops + layer.bwd_flops) / s / GIGA,
            saved_bytes_per_token=layer.saved_bytes() / s))
    return tuple(rows)


def describe_model(spec: ModelSpec, *, seq_len: int) -> ModelDescription:
    """Describe ``spec`` for sequences of ``seq_len`` tokens (traces the model on meta; cached)."""
    params = count_params(spec)
    graph = trace_model(spec, seq_len=seq_len)
    return ModelDescription(
        name=spec.name, seq_len=seq_len, params_total=params.total, params_activated=params.activated,
        params_activated_one_vocab=params.activated - params.output, params_mtp=params.mtp,
        flops_per_token=flops_per_token(spec, seq_len=seq_len),
        flops_per_token_with_mtp=flops_per_token_with_mtp(spec, seq_len=seq_len),
        traced_flops_per_token=traced_flops_per_token(graph), rows=_rows(graph))
