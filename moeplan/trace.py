"""Trace the model into the IR (docs/architecture.md §3): one fx graph per layer kind on the meta device, one annotation per node.

For each layer kind present (embedding, dense, moe, mtp, mtp_head, head) one piece is built on meta in bf16
(activations 2 bytes), traced with a ``torch.fx.Tracer`` that keeps :data:`moeplan.models.TRACER_LEAVES` whole
(the data-dependent expert dispatch and grouped matmul, attention, RMSNorm, rotary, router), for batch 1 and
``seq_len`` tokens. Shapes come from
``torch.fx.passes.shape_prop.ShapeProp``; the same interpreter pass measures every compute node on meta, in
isolation, with fresh leaf tensors for its inputs (sharing their storage, so aliasing is visible):

- forward FLOPs: the node's forward under ``torch.utils.flop_counter.FlopCounterMode``;
- backward FLOPs, split: ``torch.autograd.grad`` of the node's outputs (gradient of ones) w.r.t. its floating-point
  tensor inputs only, under the flop counter, is the input-gradient part (dX, ``bwd_input_flops``); autograd computes
  only the edges the requested inputs need, so a linear's dX is one GEMM. The weight-gradient part (dW,
  ``bwd_weight_flops``) is the whole backward (w.r.t. inputs AND parameters) minus dX — not a separate grad w.r.t.
  the parameters alone, because inside a fused leaf (the SwiGLU experts) the gradients of intermediates
  (``d(silu·w3 x)``) are needed by both and belong to the dX pass, as in a zero-bubble B/W split;
- saved-for-backward: ``torch.autograd.graph.saved_tensors_hooks`` during the forward. Parameters are excluded; a
  saved tensor sharing storage with an input becomes ``saved_inputs`` (the producer node's name), the rest
  ``saved_bytes`` (each storage once);
- bytes read / written: the node's input and parameter bytes and its output bytes (0 for views);
- ``matmul_mnk``: the largest GEMM the flop counter saw in the forward (per expert for the grouped matmul).

RMSNorm is a custom autograd function that keeps the input and ``rstd`` only (as fused kernels do), so its saved
bytes are the kernel's, not the fp32 copies of the composite op.

Attention: on meta, ``scaled_dot_product_attention`` decomposes into two batched matmuls over the FULL score
matrix, so the counter reports non-causal FLOPs, and its backward exactly twice that (no recompute). Both are
halved for the causal mask (``causal=True``), matching Megatron-LM's count (docs/references.md §4.1). The math path would save
the ``s × s`` probabilities, which no production kernel keeps: the saved set of attention is measured on
:meth:`CoreAttention.fused_kernel` (memory-efficient attention: q, k, v, output, logsumexp) instead.

The routed experts run on meta with balanced routing (``T·top_k/E`` tokens per expert, one ``bmm``), so their
FLOPs are those of the expected load. Each annotation is in ``LayerGraph.ops`` (topological order) and on its
node as ``node.meta["moeplan"]``. Traces are cached per (spec, seq_len) with ``functools.lru_cache``; callers
must treat the returned graphs as read-only.
"""
from __future__ import annotations

import functools
import operator
import weakref
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Callable, ClassVar, Mapping, Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F
import torch.utils.flop_counter as flop_counter
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from moeplan.errors import SpecError
from moeplan.ir import LayerGraph, LayerKind, ModelGraph, OpAnnotation, OpKind, ShardHint
from moeplan.models import (TRACER_LEAVES, CoreAttention, GroupedExperts, RMSNorm, Router, Rotary, TokenPermute,
                            TokenUnpermute, build_layer, shared_sources)
from moeplan.spec import ModelSpec

ACT_DTYPE = torch.bfloat16
TOKEN_DTYPE = torch.int64
_COMPUTE_OPS = ("call_module", "call_function", "call_method")
_MODULE_KINDS: Mapping[type, OpKind] = MappingProxyType({
    nn.Linear: OpKind.MATMUL, nn.Embedding: OpKind.EMBEDDING, RMSNorm: OpKind.NORM,
    CoreAttention: OpKind.ATTENTION, Router: OpKind.ROUTER, TokenPermute: OpKind.DISPATCH,
    GroupedExperts: OpKind.GROUPED_MATMUL, TokenUnpermute: OpKind.COMBINE, Rotary: OpKind.ELEMENTWISE})
_FUNCTION_KINDS: Mapping[object, OpKind] = MappingProxyType({
    F.cross_entropy: OpKind.LOSS, torch.matmul: OpKind.MATMUL, torch.bmm: OpKind.MATMUL,
    operator.matmul: OpKind.MATMUL})


@runtime_checkable
class _Sharded(Protocol):
    """A model-family module that declares how its children's work divides (``""``: its own ops)."""

    SHARD: ClassVar[Mapping[str, ShardHint]]


class LeafTracer(torch.fx.Tracer):
    """fx tracer that keeps the model family's data-dependent and fused modules as single nodes."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, TRACER_LEAVES) or super().is_leaf_module(m, module_qualified_name)


# ---- one node ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Measured:
    fwd_flops: float
    bwd_input_flops: float
    bwd_weight_flops: float
    fwd_kernels: int
    bwd_input_kernels: int
    bwd_weight_kernels: int
    saved_bytes: int
    saved_fixed_bytes: int
    saved_inputs: tuple[str, ...]
    gemm: tuple[int, int, int] | None


def storage_id(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (views share it; valid on meta too), while the storage lives."""
    return t.untyped_storage()._cdata


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def tensors_of(tree: object) -> list[torch.Tensor]:
    """The tensors in a pytree (an op's outputs or arguments), in order."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _gemm_mapping(gemms: list[tuple[int, int, int, int]]) -> dict:
    """FlopCounterMode formulas for mm/addmm/bmm/baddbmm that also record (M, N, K, batch) of each GEMM."""
    aten = torch.ops.aten

    def mm(a, b, *args, out_shape=None, **kwargs):
        gemms.append((a[0], b[1], a[1], 1))
        return flop_counter.mm_flop(a, b)

    def addmm(c, a, b, *args, out_shape=None, **kwargs):
        return mm(a, b)

    def bmm(a, b, *args, out_shape=None, **kwargs):
        gemms.append((a[1], b[2], a[2], a[0]))
        return flop_counter.bmm_flop(a, b)

    def baddbmm(c, a, b, *args, out_shape=None, **kwargs):
        return bmm(a, b)

    return {aten.mm: mm, aten.addmm: addmm, aten.bmm: bmm, aten.baddbmm: baddbmm}


class _KernelCount(TorchDispatchMode):
    """Counts the aten ops dispatched below autograd: what eager PyTorch launches, one kernel each (views included:
    each is a dispatch on the eager path, though it moves no data)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (the dispatch protocol)
        self.count += 1
        return func(*args, **(kwargs or {}))


def _counted(fn: Callable[[], object], mapping: dict | None = None) -> tuple[object, int, int]:
    """(result, FLOPs, aten kernels) of ``fn``."""
    with flop_counter.FlopCounterMode(display=False, custom_mapping=mapping) as counter, _KernelCount() as kernels:
        out = fn()
    return out, counter.get_total_flops(), kernels.count


class _SavedLog:
    """Pack hook that sorts saved tensors into parameters (ignored), inputs (by producer; an input without a
    producer name counts as internal) and internal storage (each storage once, at its full size).

    Only what is still held when the forward returns counts: a tensor saved by a branch that no output depends on
    (the group scores behind a top-k index, say) is freed with that branch, as it is in training. Storages are told
    apart by address, which a freed storage hands on, so the log keeps weak references and counts the live ones at
    the end (:meth:`internal`)."""

    def __init__(self, inputs: list[tuple[torch.Tensor, str | None]], params: list[torch.Tensor]) -> None:
        self.param_ids = {storage_id(p) for p in params}
        self.input_ids = {storage_id(t): name for t, name in inputs if name is not None}
        self.saved: list[tuple[weakref.ref, int, bool]] = []  # (tensor, storage bytes, not in ACT_DTYPE)
        self.producers: dict[str, None] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        sid = storage_id(t)
        if sid in self.input_ids:
            self.producers[self.input_ids[sid]] = None
        elif sid not in self.param_ids:
            self.saved.append((weakref.ref(t), t.untyped_storage().nbytes(), t.dtype != ACT_DTYPE))
        return t

    def internal(self) -> tuple[int, int]:
        """(bytes, the part not in ACT_DTYPE: indices, fp32 upcasts) of the live saved storages, each once."""
        live: dict[int, tuple[int, bool]] = {}
        for ref, nbytes, fixed in self.saved:
            t = ref()
            if t is not None:
                sid = storage_id(t)
                live[sid] = (max(nbytes, live.get(sid, (0, False))[0]), fixed or live.get(sid, (0, False))[1])
        return sum(b for b, _ in live.values()), sum(b for b, f in live.values() if f)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _grad_flops(outputs: list[torch.Tensor], wrt: list[torch.Tensor], retain: bool) -> tuple[int, int]:
    """(FLOPs, aten kernels) of ``autograd.grad(outputs, wrt)`` with gradients of ones; 0 when nothing connects
    them."""
    outs = [o for o in outputs if o.requires_grad]
    wrt = [w for w in wrt if w.requires_grad]
    if not outs or not wrt:
        return 0, 0
    grads = [torch.ones_like(o) for o in outs]
    _, flops, kernels = _counted(lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=retain,
                                                             allow_unused=True))
    return flops, kernels


def measure_node(run: Callable[[], object], inputs: list[tuple[torch.Tensor, str | None]],
                 params: list[torch.Tensor]) -> tuple[object, _Measured]:
    """Run one node (``run`` closes over ``inputs``' tensors and ``params``) and measure it as the module doc says."""
    gemms: list[tuple[int, int, int, int]] = []
    log = _SavedLog(inputs, params)
    with torch.enable_grad(), log.hooks():
        out, fwd, fwd_k = _counted(run, _gemm_mapping(gemms))
    saved = log.internal()
    outs = [o for o in tensors_of(out) if o.is_floating_point()]
    with torch.enable_grad():
        dx, dx_k = _grad_flops(outs, [t for t, _ in inputs], retain=True)
        if any(p.requires_grad for p in params):
            full, full_k = _grad_flops(outs, [t for t, _ in inputs] + params, retain=False)
        else:  # nothing but the inputs to differentiate: the full backward is the input-gradient one
            full, full_k = dx, dx_k
    gemm = max(gemms, key=lambda g: g[0] * g[1] * g[2] * g[3])[:3] if gemms else None
    return out, _Measured(fwd, dx, full - dx, fwd_k, dx_k, max(0, full_k - dx_k), *saved, tuple(log.producers),
                          gemm)


def measure_saved(run: Callable[[], object], inputs: list[tuple[torch.Tensor, str | None]],
                  params: list[torch.Tensor] = ()) -> tuple[int, int, tuple[str, ...]]:  # type: ignore[assignment]
    """Saved-for-backward of ``run`` alone: (internal bytes, the part not in ACT_DTYPE, producers of saved
    inputs); ``params`` are not counted."""
    log = _SavedLog(inputs, list(params))
    with torch.enable_grad(), log.hooks():
        out = run()  # held while the log counts: what it holds is what backward would find
        saved = log.internal()
    del out
    return *saved, tuple(log.producers)


# ---- one layer -----------------------------------------------------------------------------------------------------
def module_path(n: torch.fx.Node) -> str:
    """The module an fx node runs in: a module call's own path, else the innermost module on its stack."""
    if n.op == "call_module":
        return str(n.target)
    stack = n.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _shard_hint(root: nn.Module, path: str, is_module_call: bool) -> ShardHint:
    """The hint of the innermost declaring module: a call of child ``c`` of module M takes ``M.SHARD[c]``, other
    ops inside M take ``M.SHARD[""]``; a module that does not name the child gives its own ``""`` hint; no
    declaration at all means SP (work on the whole hidden state, split only under sequence parallelism)."""
    parts = (path.split(".") if path else []) + ([] if is_module_call else [""])
    for i in range(len(parts), 0, -1):
        parent = root.get_submodule(".".join(parts[:i - 1]))
        if isinstance(parent, _Sharded):
            table = parent.SHARD
            if parts[i - 1] in table:
                return table[parts[i - 1]]
            if "" in table:
                return table[""]
    return ShardHint.SP


def _op_kind(root: nn.Module, n: torch.fx.Node) -> OpKind:
    if n.op == "call_module":
        return _MODULE_KINDS.get(type(root.get_submodule(str(n.target))), OpKind.ELEMENTWISE)
    if n.op == "call_function":
        return _FUNCTION_KINDS.get(n.target, OpKind.ELEMENTWISE)
    return OpKind.ELEMENTWISE


_NOT_RUN = object()


class _CostProp(ShapeProp):
    """``ShapeProp`` that also measures every compute node on meta (see the module docstring).

    ``hidden_input``: the placeholder whose saved tensors are charged as ``saved_inputs`` (the layer's
    ``input_bytes``); saved tensors of other placeholders (token ids, labels) count as the node's own bytes.
    """

    def __init__(self, gm: torch.fx.GraphModule, *, root: nn.Module, kind: LayerKind, hidden_input: str) -> None:
        super().__init__(gm)
        self.root, self.kind, self.hidden_input = root, kind, hidden_input
        self.ops: list[OpAnnotation] = []
        self._ran: object = _NOT_RUN  # the measured run's output of the node being propagated

    def run_node(self, n: torch.fx.Node) -> object:
        if n.op in _COMPUTE_OPS:
            annotation, out = self._annotate(n)
            n.meta["moeplan"] = annotation  # docs/architecture.md §3: the typed annotation also rides on the node
            self.ops.append(annotation)
            self._ran = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
        try:
            with torch.no_grad():
                return super().run_node(n)  # shapes and metadata; the op itself ran once, measured
        finally:
            self._ran = _NOT_RUN

    def call_module(self, target, args, kwargs):  # noqa: ANN001, ANN201 (torch.fx.Interpreter's signature)
        return super().call_module(target, args, kwargs) if self._ran is _NOT_RUN else self._ran

    def call_function(self, target, args, kwargs):  # noqa: ANN001, ANN201
        return super().call_function(target, args, kwargs) if self._ran is _NOT_RUN else self._ran

    def call_method(self, target, args, kwargs):  # noqa: ANN001, ANN201
        return super().call_method(target, args, kwargs) if self._ran is _NOT_RUN else self._ran

    def _materialize(self, n: torch.fx.Node) -> tuple[tuple, dict, list[tuple[torch.Tensor, str | None]],
                                                       list[torch.Tensor]]:
        """Fresh leaf tensors (same storage) for the node's inputs, with their producers, and its parameters."""
        inputs: list[tuple[torch.Tensor, str | None]] = []
        params: list[torch.Tensor] = []

        def leaf(node: torch.fx.Node) -> object:
            value = self.env[node]
            if node.op == "get_attr":
                params.extend(t for t in tensors_of(value) if isinstance(t, nn.Parameter))
                return value
            producer = None if node.op == "placeholder" and node.name != self.hidden_input else node.name

            def fresh(t: object) -> object:
                if not isinstance(t, torch.Tensor):
                    return t
                c = t.detach().requires_grad_(t.is_floating_point())
                inputs.append((c, producer))
                return c
            return tree_map(fresh, value)

        args = torch.fx.node.map_arg(n.args, leaf)
        kwargs = torch.fx.node.map_arg(n.kwargs, leaf)
        if n.op == "call_module":
            params.extend(self.module.get_submodule(str(n.target)).parameters())
        return args, kwargs, inputs, params

    def _annotate(self, n: torch.fx.Node) -> tuple[OpAnnotation, object]:
        args, kwargs, inputs, params = self._materialize(n)
        kind = _op_kind(self.module, n)
        out, m = measure_node(lambda: getattr(self, n.op)(n.target, args, kwargs), inputs, params)
        saved_bytes, saved_fixed, saved_inputs, causal = m.saved_bytes, m.saved_fixed_bytes, m.saved_inputs, False
        eager_inputs, act_in, gemm_in = None, 0, 0
        outs, in_tensors = tensors_of(out), [t for t, _ in inputs]
        if kind == OpKind.ATTENTION:  # saved set of the fused kernel; FLOPs halved for the causal mask
            core = self.module.get_submodule(str(n.target))
            saved_bytes, saved_fixed, saved_inputs = measure_saved(lambda: core.fused_kernel(*args), inputs)
            causal, eager_inputs = core.causal, m.saved_inputs
        elif kind == OpKind.GROUPED_MATMUL:  # the routed experts with a fused SwiGLU (models/moe.py)
            experts = self.module.get_submodule(str(n.target))
            saved_bytes, saved_fixed, saved_inputs = measure_saved(lambda: experts.fused_kernel(*args), inputs,
                                                                   params)
            _, hidden, ffn = experts.w1.shape
            gemm_in = _nbytes(outs) * ffn // hidden  # the activation output, which the down GEMM keeps
            act_in = 2 * gemm_in  # the gate/up output, which the SwiGLU keeps
        elif kind == OpKind.COMBINE:  # probabilities applied inside the activation (Megatron-LM core_v0.12.1+):
            saved_bytes, saved_fixed = 0, 0  # the combine keeps its index maps, not the expert outputs
        scale = 0.5 if causal else 1.0
        out_ids = {storage_id(o) for o in outs}
        is_view = bool(outs) and out_ids <= {storage_id(t) for t in in_tensors}
        view_of = next((name for t, name in inputs if storage_id(t) in out_ids), None) if is_view else None
        path = module_path(n)
        return (OpAnnotation(
            name=n.name, op_kind=kind, module_path=path, layer_kind=self.kind, fwd_flops=m.fwd_flops * scale,
            bwd_input_flops=m.bwd_input_flops * scale, bwd_weight_flops=m.bwd_weight_flops,
            bytes_read=0 if is_view else _nbytes(in_tensors) + _nbytes(params),
            bytes_written=0 if is_view else _nbytes(outs), output_bytes=_nbytes(outs), saved_bytes=saved_bytes,
            saved_inputs=saved_inputs, param_count=sum(p.numel() for p in params),
            shard=_shard_hint(self.root, path, n.op == "call_module"), matmul_mnk=m.gemm, causal=causal,
            fwd_kernels=m.fwd_kernels, bwd_input_kernels=m.bwd_input_kernels, bwd_weight_kernels=m.bwd_weight_kernels,
            saved_fixed_bytes=saved_fixed, eager_saved_bytes=m.saved_bytes, eager_saved_fixed_bytes=m.saved_fixed_bytes,
            output_fixed_bytes=_nbytes([o for o in outs if o.dtype != ACT_DTYPE]), eager_saved_inputs=eager_inputs,
            view_of=view_of, inputs=tuple(a.name for a in n.all_input_nodes), saved_act_input_bytes=act_in,
            saved_gemm_input_bytes=gemm_in), out)


def representative_layer(spec: ModelSpec, kind: LayerKind) -> str:
    """The piece name traced for ``kind`` (all pieces of a kind are identical)."""
    names = {LayerKind.EMBEDDING: "embedding", LayerKind.DENSE: "layers.0",
             LayerKind.MOE: f"layers.{spec.num_dense_layers}", LayerKind.MTP: "mtp.0",
             LayerKind.MTP_HEAD: "mtp_head.0", LayerKind.HEAD: "head", LayerKind.EMPTY: "empty.0"}
    return names[kind]


def _example_inputs(spec: ModelSpec, kind: LayerKind, seq_len: int) -> tuple[torch.Tensor, ...]:
    tokens = torch.zeros(1, seq_len, dtype=TOKEN_DTYPE, device="meta")
    hidden = torch.empty(1, seq_len, spec.hidden_size, dtype=ACT_DTYPE, device="meta")
    if kind == LayerKind.EMBEDDING:
        return (tokens,)
    return (hidden,) if kind in (LayerKind.DENSE, LayerKind.MOE) else (hidden, tokens)


def input_bytes(spec: ModelSpec, kind: LayerKind, *, seq_len: int) -> int:
    """Bytes of a layer's pipeline input for one sequence: hidden states ``s·h·2`` (bf16); token ids ``s·8`` for
    the embedding."""
    if kind == LayerKind.EMBEDDING:
        return seq_len * torch.iinfo(TOKEN_DTYPE).bits // 8
    return seq_len * spec.hidden_size * torch.finfo(ACT_DTYPE).bits // 8


def _param_stats(spec: ModelSpec, module: nn.Module, name: str) -> tuple[int, int, int, int, int]:
    """(owned params, routed-expert params, activated params, copies of other pieces' params, owned tensors)."""
    sources = shared_sources(spec, name)
    shared = sum(module.get_parameter(local).numel() for local in sources)
    owned = sum(p.numel() for p in module.parameters()) - shared
    expert = sum(p.numel() for m in module.modules() if isinstance(m, GroupedExperts) for p in m.parameters())
    activated = owned - expert + (expert // spec.num_experts * spec.top_k if expert else 0)
    return owned, expert, activated, shared, sum(1 for _ in module.parameters()) - len(sources)


def _fanout_adds(gm: torch.fx.GraphModule, hidden: str) -> int:
    """Σ (consumers − 1) over the floating-point tensors of the layer (its hidden input and node outputs): the
    gradient additions autograd runs where a tensor feeds several ops (see ``LayerGraph.grad_fanout_adds``)."""
    adds = 0
    for n in gm.graph.nodes:
        meta = n.meta.get("tensor_meta")
        floating = hasattr(meta, "dtype") and meta.dtype.is_floating_point
        if floating and (n.op in _COMPUTE_OPS or n.name == hidden):
            adds += max(0, sum(1 for u in n.users if u.op in _COMPUTE_OPS) - 1)
    return adds


def production_saves(ops: Sequence[OpAnnotation]) -> tuple[OpAnnotation, ...]:
    """``ops`` with the saved sets of production kernels where the traced eager ops keep more (the eager sets stay
    in ``eager_saved_inputs``, which moeplan's runtime keeps; cost_models/sharding.py picks by the target):

    - ``silu(gate) * up`` is one fused SwiGLU kernel that keeps its input (Megatron-LM ``bias_swiglu_impl``,
      megatron/core/fusions/fused_bias_swiglu.py): ``silu`` keeps nothing, the product keeps gate and up;
    - the attention output reaches the output projection without a copy (FlashAttention and Transformer Engine's
      fused attention write ``[s, b, heads · head_dim]``), and the attention kernel keeps that output anyway: the
      projection's saved copy of it is not kept.
    """
    by = {o.name: o for o in ops}

    def base(name: str) -> str:
        while name in by and by[name].view_of is not None:
            name = by[name].view_of  # type: ignore[assignment]
        return name

    def copy_of_attention(name: str) -> bool:
        o = by.get(name)
        return (o is not None and o.op_kind == OpKind.ELEMENTWISE and o.view_of is None and len(o.inputs) == 1
                and base(o.inputs[0]) in by and by[base(o.inputs[0])].op_kind == OpKind.ATTENTION)

    new: dict[str, OpAnnotation] = {}
    for o in ops:
        silu = next((by[i] for i in o.inputs if i in by and by[i].op_kind == OpKind.ELEMENTWISE
                     and by[i].name.startswith("silu") and len(by[i].inputs) == 1), None)
        if o.op_kind == OpKind.ELEMENTWISE and o.name.startswith("mul") and silu is not None and len(o.inputs) == 2:
            up = next(i for i in o.inputs if i != silu.name)
            new[silu.name] = replace(silu, saved_inputs=(), eager_saved_inputs=silu.saved_inputs)
            new[o.name] = replace(o, saved_inputs=(silu.inputs[0], up), eager_saved_inputs=o.saved_inputs)
        elif o.op_kind == OpKind.MATMUL and any(copy_of_attention(i) for i in o.saved_inputs):
            new[o.name] = replace(o, saved_inputs=tuple(i for i in o.saved_inputs if not copy_of_attention(i)),
                                  eager_saved_inputs=o.saved_inputs)
    return tuple(new.get(o.name, o) for o in ops)


def trace_layer(spec: ModelSpec, kind: LayerKind, *, seq_len: int) -> LayerGraph:
    """Build one piece of ``kind`` on meta, trace, shape-propagate and annotate it (batch 1, ``seq_len`` tokens)."""
    in_bytes = input_bytes(spec, kind, seq_len=seq_len)
    if kind == LayerKind.EMPTY:
        return LayerGraph(kind=kind, gm=None, ops=(), input_bytes=in_bytes, param_count=0, expert_param_count=0,
                          activated_param_count=0)
    name = representative_layer(spec, kind)
    module = build_layer(spec, name, device="meta", dtype=ACT_DTYPE)
    gm = torch.fx.GraphModule(module, LeafTracer().trace(module), class_name=type(module).__name__)
    hidden = next(n.name for n in gm.graph.nodes if n.op == "placeholder")
    prop = _CostProp(gm, root=module, kind=kind, hidden_input=hidden)
    prop.propagate(*_example_inputs(spec, kind, seq_len))
    owned, expert, activated, shared, tensors = _param_stats(spec, module, name)
    ops = production_saves(prop.ops)
    by_name = {o.name: o for o in ops}
    for n in gm.graph.nodes:
        if "moeplan" in n.meta:
            n.meta["moeplan"] = by_name[n.meta["moeplan"].name]
    return LayerGraph(kind=kind, gm=gm, ops=ops, input_bytes=in_bytes, param_count=owned,
                      expert_param_count=expert, activated_param_count=activated, shared_param_count=shared,
                      param_tensor_count=tensors, grad_fanout_adds=_fanout_adds(gm, hidden))


def layer_sequence(spec: ModelSpec) -> tuple[LayerKind, ...]:
    """Kinds from input to loss: embedding, dense layers, MoE layers, (mtp, mtp_head) per MTP module, head."""
    return (LayerKind.EMBEDDING, *([LayerKind.DENSE] * spec.num_dense_layers),
            *([LayerKind.MOE] * spec.num_moe_layers),
            *([LayerKind.MTP, LayerKind.MTP_HEAD] * spec.num_mtp_layers), LayerKind.HEAD)


def trace_model(spec: ModelSpec, *, seq_len: int) -> ModelGraph:
    """The :class:`ModelGraph` of ``spec`` for one sequence of ``seq_len`` tokens: every kind in
    :func:`layer_sequence` traced once, plus an untraced ``EMPTY`` layer. Cached per (spec, seq_len).
    Raises SpecError when ``seq_len`` is not a positive int."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise SpecError(f"seq_len={seq_len!r}: must be a positive integer")
    return _trace_cached(spec.model_dump_json(), seq_len)


@functools.lru_cache(maxsize=8)
def _trace_cached(spec_json: str, seq_len: int) -> ModelGraph:
    spec = ModelSpec.model_validate_json(spec_json)
    sequence = layer_sequence(spec)
    kinds = [*dict.fromkeys(sequence), LayerKind.EMPTY]
    layers = {kind: trace_layer(spec, kind, seq_len=seq_len) for kind in kinds}
    return ModelGraph(spec=spec, seq_len=seq_len, layers=MappingProxyType(layers), layer_sequence=sequence)
