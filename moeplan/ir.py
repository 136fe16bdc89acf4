"""The IR: a traced model as one fx graph per layer kind, with a typed annotation per compute node (docs/architecture.md §3).

Layers of one kind are identical, so only one layer per kind is traced and annotated; the model is the sequence
``ModelGraph.layer_sequence`` of kinds. All costs are for ONE sequence (batch 1) of ``ModelGraph.seq_len`` tokens,
unsharded; the ``shard`` pass scales them to a layout's micro-batch and degrees. FLOPs are floating-point
operations (a multiply-add is 2); bytes are bytes in the training dtype (bf16 activations, 2 bytes per element).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping

import torch.fx

from moeplan.spec import ModelSpec


class LayerKind(str, Enum):
    EMBEDDING = "embedding"
    DENSE = "dense"
    MOE = "moe"
    MTP = "mtp"  # one MTP module's block: its norms, 2h→h projection and an MoE decoder layer (DeepSeek-V3 §2.2)
    MTP_HEAD = "mtp_head"  # one MTP module's logits and loss through the shared output layer
    HEAD = "head"  # final norm, output layer (logits) and cross-entropy loss
    EMPTY = "empty"  # a no-op layer added for pipeline balance (MindSpeed ``--noop-layers``)


class OpKind(str, Enum):
    MATMUL = "matmul"
    GROUPED_MATMUL = "grouped_matmul"
    ATTENTION = "attention"
    ELEMENTWISE = "elementwise"
    NORM = "norm"
    ROUTER = "router"
    DISPATCH = "dispatch"
    COMBINE = "combine"
    COLLECTIVE = "collective"
    EMBEDDING = "embedding"
    LOSS = "loss"


class ShardHint(str, Enum):
    """How the work of an op divides over a layout (applied by the ``shard`` pass).

    TP: split over tp (column/row-parallel linear, attention heads). SP: split over tp only with sequence
    parallelism, otherwise replicated over tp. EXPERT: routed-expert work, split evenly over the tp·cp·dp ranks of a
    stage under balanced routing. REPLICATED: every TP rank does it in full. All hints also split over cp (tokens).
    """

    TP = "tp"
    SP = "sp"
    EXPERT = "expert"
    REPLICATED = "replicated"


@dataclass(frozen=True)
class OpAnnotation:
    """Costs of one fx node for one sequence of ``seq_len`` tokens, unsharded.

    ``fwd_flops`` forward; ``bwd_input_flops`` the input-gradient (dX, "I") part and ``bwd_weight_flops`` the
    weight-gradient (dW, "W") part of backward. ``saved_bytes`` counts tensors autograd keeps for backward that this
    node creates internally; ``saved_inputs`` names the producer nodes whose outputs it keeps (count those once per
    layer: two consumers of one tensor save it once). ``matmul_mnk`` is (M, N, K) of the dominant GEMM for alignment
    efficiency, or None. ``causal`` marks attention whose FLOPs were halved for the causal mask (docs/references.md §4.1).
    ``fwd_kernels`` / ``bwd_input_kernels`` / ``bwd_weight_kernels``: aten ops eager PyTorch dispatches for the
    node's forward, its dX and its dW (counted at trace time below autograd, moeplan/trace.py); a target whose
    ``launch.granularity`` is ``"kernel"`` (an eager runtime) pays its launch cost per kernel, one independent of the
    token count. ``saved_fixed_bytes`` / ``output_fixed_bytes``: the parts of ``saved_bytes`` /
    ``output_bytes`` not in the bf16 activation dtype (integer indices, fp32 upcasts such as the loss's
    log-probabilities and a norm's rstd), which keep their size in any training dtype. ``eager_saved_bytes``: the internal saved bytes of
    the node's eager code when they differ from the production kernel's (attention: the math path keeps the
    probabilities, upcast to fp32 — ``eager_saved_fixed_bytes`` is that set's part outside bf16; None: same as
    ``saved_bytes``); an eager runtime keeps these, and the outputs of ``eager_saved_inputs`` (None: same as
    ``saved_inputs``). ``view_of``: for a view (an output sharing an input's storage: split, getitem, transpose,
    reshape), the producer of that input; a saved view keeps its base's whole storage alive. ``inputs``: the nodes
    whose outputs it reads (producers and placeholders, in argument order): what re-running it needs.
    ``saved_act_input_bytes`` / ``saved_gemm_input_bytes``: the parts of ``saved_bytes`` that an activation
    function keeps as its input (the gate/up output) and that a GEMM keeps as its input (the activation output),
    for a node that runs several of them (the routed experts): FP8 storage and ``moe_act`` recompute act on them.
    """

    name: str
    op_kind: OpKind
    module_path: str
    layer_kind: LayerKind
    fwd_flops: float
    bwd_input_flops: float
    bwd_weight_flops: float
    bytes_read: int
    bytes_written: int
    output_bytes: int
    saved_bytes: int
    saved_inputs: tuple[str, ...]
    param_count: int
    shard: ShardHint
    matmul_mnk: tuple[int, int, int] | None = None
    causal: bool = False
    fwd_kernels: int = 1
    bwd_input_kernels: int = 1
    bwd_weight_kernels: int = 1
    saved_fixed_bytes: int = 0
    eager_saved_bytes: int | None = None
    eager_saved_fixed_bytes: int = 0
    output_fixed_bytes: int = 0
    eager_saved_inputs: tuple[str, ...] | None = None
    view_of: str | None = None
    inputs: tuple[str, ...] = ()
    saved_act_input_bytes: int = 0
    saved_gemm_input_bytes: int = 0

    @property
    def unit(self) -> str:
        """``cube`` (matrix unit: tensor cores / Ascend cube) or ``vector``."""
        return "cube" if self.op_kind in (OpKind.MATMUL, OpKind.GROUPED_MATMUL, OpKind.ATTENTION) else "vector"


@dataclass(frozen=True)
class LayerGraph:
    """One traced layer of a kind: its fx graph on meta and its op annotations in topological order.

    ``input_bytes``: bytes of the hidden-state input that crosses a pipeline boundary (``seq_len · hidden · 2``).
    ``param_count``: parameters owned by this layer (routed experts included); ``expert_param_count``: the routed
    experts' share; ``activated_param_count``: parameters one token touches (top-k of the routed experts);
    ``shared_param_count``: copies of parameters owned elsewhere (the MTP's embedding, the MTP head's output
    layer) that still occupy memory on the stage holding this layer. ``param_tensor_count``: parameter tensors
    owned by this layer (an eager optimizer pays per-tensor work: flattening, copying back).
    ``grad_fanout_adds``: gradient additions autograd runs in backward where one floating-point tensor feeds several
    ops (a tensor with ``u`` consumers gets ``u - 1`` adds; eager backward runs each as one kernel).
    """

    kind: LayerKind
    gm: torch.fx.GraphModule | None
    ops: tuple[OpAnnotation, ...]
    input_bytes: int
    param_count: int
    expert_param_count: int
    activated_param_count: int
    shared_param_count: int = 0
    param_tensor_count: int = 0
    grad_fanout_adds: int = 0

    @property
    def fwd_flops(self) -> float:
        return sum(o.fwd_flops for o in self.ops)

    @property
    def bwd_flops(self) -> float:
        return sum(o.bwd_input_flops + o.bwd_weight_flops for o in self.ops)

    def saved_bytes(self) -> int:
        """Bytes saved for backward by the whole layer with no recompute, each producer's output counted once."""
        out = {o.name: o.output_bytes for o in self.ops}
        kept = {n for o in self.ops for n in o.saved_inputs}
        return sum(o.saved_bytes for o in self.ops) + sum(out.get(n, self.input_bytes) for n in kept)


@dataclass(frozen=True)
class ModelGraph:
    """The traced model: one :class:`LayerGraph` per kind and the order of kinds from input to loss."""

    spec: ModelSpec
    seq_len: int
    layers: Mapping[LayerKind, LayerGraph]
    layer_sequence: tuple[LayerKind, ...]

    def layer(self, kind: LayerKind) -> LayerGraph:
        return self.layers[kind]


def layer_kind_of(name: str) -> LayerKind:
    """Layer kind of a layer name (``embedding``, ``layers.{i}`` needs the spec: use ModelGraph.kind_of)."""
    head = name.split(".", 1)[0]
    return {"embedding": LayerKind.EMBEDDING, "mtp": LayerKind.MTP, "mtp_head": LayerKind.MTP_HEAD,
            "head": LayerKind.HEAD, "empty": LayerKind.EMPTY}[head]


def named_layers(spec: ModelSpec) -> tuple[tuple[str, LayerKind], ...]:
    """The model's layers in pipeline order as (name, kind): ``embedding``, ``layers.{i}`` (dense first, then MoE),
    ``mtp.{j}`` and ``mtp_head.{j}`` per MTP module, ``head``. These names are shared by the plan, the runtime
    (``moeplan.models.build_layer``) and the exporters."""
    out = [("embedding", LayerKind.EMBEDDING)]
    out += [(f"layers.{i}", LayerKind.DENSE if i < spec.num_dense_layers else LayerKind.MOE)
            for i in range(spec.num_layers)]
    for j in range(spec.num_mtp_layers):
        out += [(f"mtp.{j}", LayerKind.MTP), (f"mtp_head.{j}", LayerKind.MTP_HEAD)]
    out.append(("head", LayerKind.HEAD))
    return tuple(out)


def kind_of(spec: ModelSpec, name: str) -> LayerKind:
    """Layer kind of any layer name of ``spec``; raises KeyError for a name the model does not have."""
    if name.startswith("layers."):
        i = int(name.split(".")[1])
        if not 0 <= i < spec.num_layers:
            raise KeyError(name)
        return LayerKind.DENSE if i < spec.num_dense_layers else LayerKind.MOE
    return layer_kind_of(name)
