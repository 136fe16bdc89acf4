"""What one layer keeps for backward, tensor by tensor, and what dropping each costs (docs/memory.md §1).

The ``plan-memory`` pass decides, per saved tensor, **keep** (held on the device from the forward to the backward),
**recompute** (the op that makes it runs again in backward) or **swap** (copied to host after the forward, fetched
back before the backward). This module turns one traced layer (moeplan/ir.py) under a layout into that problem's
data, per micro-batch on one device:

- a :class:`SavedTensor` per storage the layer's backward may read: each op's output that a consumer saves (a saved
  view keeps its base's storage, as in cost_models/sharding.py), the tensors an op keeps internally (``<op>.internal``),
  and the layer's hidden input (kept or swapped, never recomputed: it is the recompute boundary, as in full
  recompute). Bytes are cost_models/sharding.py's: summed over the kept tensors they equal ``LayerCost.saved_bytes``.
- a :class:`RedoOp` per op that makes a storage: the forward seconds re-running it costs (cost_models/sharding.py's price
  of the op; for the MoE permute and unpermute also the EP dispatch or combine they wrap, as a blocking
  collective, which is what Megatron-LM's and MindSpeed's MoE recompute re-runs) and the storages it reads. The
  SP all-gathers are not charged: the backward re-gathers a sequence-parallel input for the weight gradient anyway
  (cost_models/layer_program.py), so a re-run column-parallel GEMM finds it.

A storage that no backward reads is not kept, but a re-run op may need it: then it must be kept, swapped or
re-run itself (:func:`closure`). Names in the field's terms (:func:`label`) and the Megatron-LM /
MindSpeed-LLM flags that express a decision (:func:`flag_of`) come with each op.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

from moeplan.cost_models.compute import runs_fp8
from moeplan.cost_models.layer_program import moe_comm
from moeplan.cost_models.sharding import dtype_scaled, eager, kept_scale, op_scale, saved_inputs, storage_bytes
from moeplan.ir import LayerGraph, LayerKind, OpAnnotation, OpKind
from moeplan.layout import Layout
from moeplan.spec import ModelSpec
from moeplan.state import Dispatcher
from moeplan.targets import Target

Decision = Literal["keep", "recompute", "swap"]


@dataclass(frozen=True)
class SavedTensor:
    """One storage one micro-batch of a layer may keep for backward on one device: ``bytes`` in the training
    dtype; ``needed``: the backward reads it (it is saved) whatever else is recomputed; ``op``: the op that makes
    it (``""`` for the layer input, which cannot be recomputed)."""

    name: str
    op: str
    bytes: int
    needed: bool


@dataclass(frozen=True)
class RedoOp:
    """One op that makes storages: ``seconds`` to run its forward again in backward (``flops`` of it), the
    storages it ``reads`` and those it ``makes`` (its output and what it keeps internally), and the module it runs
    in (``attn.core``, ``mlp.shared.w1``…)."""

    name: str
    label: str
    seconds: float
    reads: tuple[str, ...]
    makes: tuple[str, ...]
    flops: float = 0.0
    module: str = ""


@dataclass(frozen=True)
class LayerTensors:
    """A layer kind's saved-tensor problem under a layout (module docstring); ``fwd_s`` / ``bwd_s`` the layer's
    forward and backward compute seconds (what a swap can hide under); ``mla``: the attention is MLA (its flags
    differ)."""

    kind: LayerKind
    tensors: tuple[SavedTensor, ...]
    ops: tuple[RedoOp, ...]
    fwd_s: float
    bwd_s: float
    mla: bool = False

    def tensor(self, name: str) -> SavedTensor:
        return next(t for t in self.tensors if t.name == name)

    def kept_bytes(self, decisions: Mapping[str, Decision]) -> int:
        """Bytes kept on the device under ``decisions`` (tensor name -> decision; a needed tensor absent from it
        is kept, one that is not needed is not)."""
        return sum(t.bytes for t in self.tensors if decisions.get(t.name, "keep" if t.needed else "") == "keep")


def layer_tensors(lg: LayerGraph, *, spec: ModelSpec, layout: Layout, target: Target, dispatcher: Dispatcher,
                  times: Mapping[str, tuple[float, float, float]], fp8_act_input: bool = False) -> LayerTensors:
    """:class:`LayerTensors` of ``lg`` for one micro-batch on one device; ``times``: each op's (forward, dX, dW)
    seconds under the layout (cost_models/sharding.py ``op_times``). Bytes are cost_models/sharding.py's ``storage_bytes``. On a
    target with production kernels the routed experts' activation output (what their down GEMM keeps) is its own
    storage, ``<experts>.act``, made by its own op (the activation, ``moe_act``), so that it can be recomputed
    alone; moeplan's eager runtime runs the experts as one op."""
    by_name = {o.name: o for o in lg.ops}
    sb = storage_bytes(lg, layout, target, fp8_act_input)

    def base(name: str) -> str:
        while name in by_name and by_name[name].view_of is not None:
            name = by_name[name].view_of  # type: ignore[assignment]
        return name

    saved = {base(n) for o in lg.ops for n in saved_inputs(o, target)}
    hidden = {n for n in saved if n not in by_name}  # the layer input (placeholders other than it are token ids)
    comm = _moe_comm_s(lg, spec=spec, layout=layout, target=target, dispatcher=dispatcher)
    tensors = [SavedTensor(n, "", int(sb.outputs[n]), True) for n in sorted(hidden)]
    ops = []
    for o in lg.ops:
        internal = sb.internal[o.name]
        act = 0.0
        if o.saved_gemm_input_bytes and internal > 0 and not eager(target):  # the routed experts' activation
            act = min(internal, dtype_scaled(o.saved_gemm_input_bytes, 0, target) * op_scale(o, layout)  # output
                      * (0.5 if runs_fp8(o, target) else 1.0))
        makes = []
        if o.view_of is None:
            tensors.append(SavedTensor(o.name, o.name, int(sb.outputs.get(o.name, 0.0)) if o.name in saved else
                                       int(_output_bytes(o, layout, target)), o.name in saved))
            makes.append(o.name)
        if internal - act > 0:
            tensors.append(SavedTensor(f"{o.name}.internal", o.name, int(internal - act), True))
            makes.append(f"{o.name}.internal")
        if makes:
            reads = tuple(dict.fromkeys(base(n) for n in o.inputs if base(n) in by_name or base(n) in hidden))
            f = times[o.name][0]
            ops.append(RedoOp(o.name, label(o), f + comm.get(o.op_kind, 0.0), reads, tuple(makes),
                              o.fwd_flops * op_scale(o, layout), o.module_path))
        if act > 0:  # re-made from the gate/up output by the activation alone: elementwise, memory-bound
            tensors.append(SavedTensor(f"{o.name}.act", f"{o.name}.act", int(act), True))
            ops.append(RedoOp(f"{o.name}.act", "routed experts SwiGLU activation", act_s(act, target),
                              (f"{o.name}.internal",), (f"{o.name}.act",), 0.0, o.module_path))
    fwd = sum(t[0] for t in times.values())
    bwd = sum(t[1] + t[2] for t in times.values())
    return LayerTensors(lg.kind, tuple(tensors), tuple(ops), fwd, bwd, spec.attention == "mla")


def _output_bytes(o: OpAnnotation, layout: Layout, target: Target) -> float:
    """Bytes of ``o``'s output for one micro-batch on one device, as kept (cost_models/sharding.py)."""

    return dtype_scaled(o.output_bytes, o.output_fixed_bytes, target) * kept_scale(o, layout)


def act_s(nbytes: float, target: Target) -> float:
    """Seconds to re-make ``nbytes`` of SwiGLU output from its input: it reads twice its output and writes it once
    at the target's achievable HBM bandwidth (memory-bound elementwise)."""
    return 3 * nbytes / (target.hbm_bandwidth_bytes_per_s * target.efficiency.memory)


def _moe_comm_s(lg: LayerGraph, *, spec: ModelSpec, layout: Layout, target: Target,
                dispatcher: Dispatcher) -> dict[OpKind, float]:
    """Seconds of the EP collective a re-run permute (dispatch) or unpermute (combine) repeats."""
    if not any(o.op_kind == OpKind.DISPATCH for o in lg.ops):
        return {}
    c = moe_comm(spec, layout, target, dispatcher)
    return {OpKind.DISPATCH: sum(x.time_s for x in (c.counts, c.dispatch) if x is not None),
            OpKind.COMBINE: c.combine.time_s if c.combine is not None else 0.0}


def closure(lt: LayerTensors, rerun: set[str], keep_or_swap: set[str]) -> set[str]:
    """The ops that must run again in backward when ``rerun`` do and the storages in ``keep_or_swap`` are held
    (kept or swapped): a re-run op's inputs that are not held are made by re-running their op. Raises ValueError
    when a re-run op reads the layer input and the input is not held."""
    ops = {o.name: o for o in lt.ops}
    maker = {m: o.name for o in lt.ops for m in o.makes}
    todo, out = list(rerun), set()
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        for r in ops[name].reads:
            if r in keep_or_swap:
                continue
            if r not in maker:
                raise ValueError(f"recompute: {name} reads the layer input {r}, which is neither kept nor swapped")
            todo.append(maker[r])
    return out


# ---- Megatron-LM's recompute modules -------------------------------------------------------------------------------
RECOMPUTE_MODULES: dict[str, str] = {
    "core_attn": "core attention: its inputs q, k, v kept, everything inside it re-run",
    "layernorm": "the decoder layers' norms: their outputs re-made from their inputs",
    "mla_up_proj": "MLA's latent norms, q/kv up-projections and rotary: q, k, v re-made from the latents",
    "mlp": "a dense layer's MLP: its input kept, the whole MLP re-run",
    "moe": "an MoE layer's MoE block: its input kept, router, dispatch, experts, combine and shared experts re-run",
    "moe_act": "the routed experts' activation: its output (the down GEMM's input) re-made from the gate/up output",
    "shared_experts": "the shared experts: their input kept, the shared MLP re-run",
}
"""Megatron-LM ``--recompute-granularity selective --recompute-modules`` (megatron/core/transformer/
transformer_config.py @ core_v0.15.0: core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts;
transformer_layer.py, multi_latent_attention.py, moe/moe_layer.py, moe/experts.py): what each re-runs in backward.
``mlp`` applies to dense MLPs only, ``moe`` to MoE blocks."""
MODULE_ALIASES = {"norm": "layernorm", "activation_function": "moe_act", "mla-up-proj": "mla_up_proj",
                  "recompute-norm": "layernorm", "recompute-mla-up-proj": "mla_up_proj"}
"""MindSpeed-LLM's names for the same modules (``--recompute-norm``, ``--recompute-mla-up-proj``,
``--recompute-activation-function`` on the routed experts)."""

_MLA_UP = frozenset({"q latent norm", "kv latent norm", "q up-projection", "kv up-projection", "rotary (q)",
                     "rotary (k)"})


def module_ops(lt: LayerTensors, modules: frozenset[str] | set[str] | tuple[str, ...]) -> set[str]:
    """The ops of ``lt`` that Megatron-LM re-runs in backward when ``modules`` are recomputed
    (:data:`RECOMPUTE_MODULES`); the inputs they need stay kept (``choice_of`` in moeplan/memory_ilp.py)."""
    is_moe = any(o.label == "router and probabilities" for o in lt.ops)
    made_by = {m: o.name for o in lt.ops for m in o.makes}
    out: set[str] = set()
    for o in lt.ops:
        parts = o.module.split(".") if o.module else []
        in_mlp = "mlp" in parts
        if (("core_attn" in modules and o.label == "core attention")
                or ("layernorm" in modules and o.label == "norm")
                or ("mla_up_proj" in modules and lt.mla and o.label in _MLA_UP)
                or ("moe_act" in modules and o.label == "routed experts SwiGLU activation")
                or ("mlp" in modules and in_mlp and not is_moe)
                or ("moe" in modules and in_mlp and is_moe)
                or ("shared_experts" in modules and "shared" in parts)):
            out.add(o.name)
    if "mla_up_proj" in modules and lt.mla:  # the attention's elementwise ops between the up-projections and core
        grown = True  # attention (the concatenations of the rotary and non-rotary parts) are inside the checkpoint
        while grown:
            grown = False
            for o in lt.ops:
                if (o.name not in out and "attn" in o.module.split(".") and o.label != "core attention"
                        and "projection" not in o.label and any(made_by.get(r) in out for r in o.reads)
                        and o.label not in ("o-projection",)):
                    out.add(o.name)
                    grown = True
    return out


# ---- names in the field's terms, and the flags of Megatron-LM and MindSpeed-LLM ----------------------------------
_LABELS = {
    "q_a": "q down-projection", "kv_a": "kv down-projection", "q_b": "q up-projection",
    "kv_b": "kv up-projection", "q_a_norm": "q latent norm", "kv_norm": "kv latent norm",
    "rope_q": "rotary (q)", "rope_k": "rotary (k)", "core": "core attention", "o_proj": "o-projection",
    "q_proj": "q projection", "k_proj": "k projection", "v_proj": "v projection",
    "router": "router and probabilities", "dispatch": "permute and dispatch", "combine": "combine and unpermute",
    "experts": "routed experts (gate/up, SwiGLU, down)", "proj": "MTP projection", "hidden_norm": "MTP hidden norm",
    "embed_norm": "MTP embedding norm", "word": "embedding", "output": "output layer", "norm": "final norm",
}


def label(op: OpAnnotation) -> str:
    """``op`` in the field's terms (``"shared expert up"``, ``"core attention"``, ``"norm"``…)."""
    parts = op.module_path.split(".") if op.module_path else []
    last = parts[-1] if parts else ""
    shared = "shared expert " if "shared" in parts else ""
    if op.op_kind == OpKind.NORM:
        return _LABELS.get(last, "norm")
    if last in ("w1", "w3", "w2"):
        return shared + ("FFN " if not shared else "") + {"w1": "gate", "w3": "up", "w2": "down"}[last]
    if op.op_kind == OpKind.ELEMENTWISE and "mlp" in parts and op.name.startswith(("silu", "mul", "gelu")):
        return shared + "SwiGLU activation"
    if op.op_kind == OpKind.LOSS:
        return "loss"
    return _LABELS.get(last, f"{op.module_path or 'residual'} {op.name}")


def flag_of(label_: str, decision: Decision, mla: bool) -> str | None:
    """The Megatron-LM / MindSpeed-LLM flag that expresses ``decision`` for ops named ``label_`` (docs/memory.md
    §4), None when neither runtime has one."""
    if decision == "recompute":
        if label_ == "core attention":
            return "--recompute-modules core_attn"
        if label_ == "norm":
            return "--recompute-modules layernorm / --recompute-norm"
        if label_ == "SwiGLU activation":
            return "--recompute-activation-function"
        if label_ == "shared expert SwiGLU activation":
            return "--recompute-modules shared_experts (the whole shared expert)"
        if mla and label_ in ("q up-projection", "kv up-projection", "rotary (q)", "rotary (k)"):
            return "--recompute-modules mla_up_proj / --recompute-mla-up-proj"
        if label_.startswith("shared expert"):
            return "--recompute-modules shared_experts"
    if decision == "swap" and label_ == "core attention":
        return "--mla-swap-core-attn-out" if mla else "--swap-attention"
    return None
