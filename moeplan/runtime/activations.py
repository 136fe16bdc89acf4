"""Per-tensor recompute and swap at run time: the plan's keep / recompute / swap decisions (docs/memory.md §5).

A per-tensor plan (``memory.ranks[r].recompute`` ``mindspeed``, ``ilp-no-swap`` or ``ilp``) names, per VPP chunk and
layer kind, the ops re-run in backward and the storages swapped to host, in the names of the compile-time trace
(moeplan/trace.py: the single-process layer's fx nodes). The runtime's layers are the parallel modules of
moeplan.runtime.build, whose code differs from the traced one (collectives, fused gathers, the EP dispatch), so the
decisions are carried over op by op:

1. **Reference**: the single-process layer runs once on the meta device through an fx Interpreter; every aten op it
   dispatches is tagged with its fx node and module path, the traced storages autograd saves for it and those it
   creates (:func:`reference_stream`).
2. **Probe**: the first time a rank runs a layer of a (chunk, kind), it runs it once more, outside the step and
   without keeping the graph, recording the aten op stream (module path, op), which op created each storage, which
   storages autograd saves for which op, and which a later op writes in place (:class:`_Probe`).
3. **Attribution** (:func:`layer_policy`): the two streams are aligned (difflib, on (module path, op), then on the
   op name inside the gaps), and each runtime storage takes a traced storage's name.
4. **Execution**: the layer runs under non-reentrant ``torch.utils.checkpoint`` with two dispatch modes of our own
   (a selective-checkpoint policy keyed by the op's index in the stream, as torch's SAC): the creator of a kept
   storage is cached, of a swapped one copied to host, everything else is re-run in backward; so are the storages
   a re-run op reads that the plan keeps. A storage written in place later in the forward is cached as a snapshot
   at creation (the in-place ops are re-run on it). Collectives are always re-issued (every rank of the group holds
   the same decisions). A swapped layer input leaves through the saved-tensor hooks checkpoint saves its inputs
   with.

Swapped tensors are fetched back when the layer's recompute begins, and the next layer's (the one before it in the
same stage) are prefetched then; on CUDA on a side stream into pinned memory (that path has not run on a GPU yet).
On the CPU emulator host and device are the same memory, counted apart. The meter (moeplan.runtime.metrics) counts
a layer's cached, fetched and re-made storages as device bytes until the next layer's recompute starts or the
backward action ends, and swapped bytes as host bytes.

Limits: the embedding and empty layers run as they are; torch's checkpoint re-runs every op up to the last one
needed, not only the closure the plan prices (more time, never more memory); a runtime storage no rule names is
kept.
"""
from __future__ import annotations

import bisect
import difflib
import functools
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import torch
import torch.fx
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import SAC_IGNORED_OPS, checkpoint

from moeplan.ir import LayerKind, kind_of
from moeplan.plan import Plan
from moeplan.runtime.expert_parallel import uncounted
from moeplan.spec import ModelSpec
from moeplan.trace import LeafTracer, module_path, representative_layer, storage_id, tensors_of

Decision = Literal["keep", "recompute", "swap"]
Action = Literal["save", "snapshot", "swap", "recompute"]
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


def storage_decisions(plan: Plan, pp_rank: int) -> dict[tuple[int, str], dict[str, Decision]]:
    """(chunk, layer kind) -> storage name -> decision, for the storages the plan does not keep: swapped ones,
    then the outputs and internals of the re-run ops (``<op>`` and ``<op>.internal``)."""
    out: dict[tuple[int, str], dict[str, Decision]] = {}
    for d in plan.memory.ranks[pp_rank].decisions:
        m: dict[str, Decision] = {s: "swap" for s in d.swapped}
        for op in d.recomputed:
            m.setdefault(op, "recompute")
            m.setdefault(f"{op}.internal", "recompute")
        out[(d.chunk, d.kind)] = m
    return out


# ---- the reference stream ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RefOp:
    """One aten op of the traced layer: the fx node that dispatched it, the module path it ran in (a module call's
    own path), its name, and the traced storages autograd saves for it, in save order (``<node>`` for a node's
    output, ``<node>.internal`` for a storage made inside a module call, ``hidden`` for the layer input)."""

    node: str
    path: str
    op: str
    saves: tuple[str, ...] = ()
    makes: tuple[str, ...] = ()  # the saved storages this op creates
    module_call: bool = False
    creates: tuple[str, ...] = ()  # the node outputs this op creates, saved or not
    reads: tuple[str, ...] = ()  # the storages its node reads (what re-running the node needs)


@functools.lru_cache(maxsize=32)
def reference_stream(spec_json: str, kind: LayerKind, seq_len: int) -> tuple[RefOp, ...]:
    """The aten ops the single-process layer of ``kind`` dispatches, in order, on the meta device (fp32), with
    what autograd saves for each."""
    from moeplan.models import build_layer

    spec = ModelSpec.model_validate_json(spec_json)
    module = build_layer(spec, representative_layer(spec, kind), device="meta", dtype=torch.float32)
    gm = torch.fx.GraphModule(module, LeafTracer().trace(module))
    tokens = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    hidden = torch.empty(1, seq_len, spec.hidden_size, device="meta", requires_grad=True)
    inputs = {LayerKind.EMBEDDING: (tokens,), LayerKind.DENSE: (hidden,), LayerKind.MOE: (hidden,)}.get(
        kind, (hidden, tokens))
    params = {storage_id(p) for p in module.parameters()}
    ops: list[list] = []  # [node, path, op, saved storage keys]
    node: list[torch.fx.Node] = []
    creator: dict[int, str | None] = {storage_id(t): None for t in inputs}  # storage -> node that created it
    creator[storage_id(hidden)] = "hidden"
    made_by: dict[int, int] = {}  # storage -> index of the op that created it
    outputs: dict[int, str] = {storage_id(hidden): "hidden"}  # storage -> node that returned it
    hold: list = []
    node_reads: dict[str, list[int]] = {}

    class Tag(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in SAC_IGNORED_OPS:
                return out
            n = node[-1]
            ops.append([n.name, module_path(n), _op_name(func), saves.take(out)])
            for t in tensors_of(out):
                if storage_id(t) not in creator:
                    creator[storage_id(t)], made_by[storage_id(t)] = n.name, len(ops) - 1
            hold.append(out)
            return out

    class Interp(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node):
            node.append(n)
            node_reads[n.name] = [storage_id(t) for a in n.all_input_nodes for t in tensors_of(self.env[a])]
            out = super().run_node(n)
            for t in tensors_of(out):
                outputs.setdefault(storage_id(t), n.name)
            return out

    saves = _SaveLog(params)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(saves.pack, lambda t: t), Tag():
        Interp(gm).run(*inputs)

    def name(k: int) -> str | None:
        if creator.get(k) is None:
            return None
        return creator[k] if outputs.get(k) == creator[k] else f"{creator[k]}.internal"

    makes: dict[int, list[str]] = {}
    for k in dict.fromkeys(k for *_, saves in ops for k in saves):
        if k in made_by:
            makes.setdefault(made_by[k], []).append(name(k))
    creates: dict[int, list[str]] = {}
    for k, i in made_by.items():
        if outputs.get(k) == creator[k]:
            creates.setdefault(i, []).append(creator[k])
    calls = {n.name for n in gm.graph.nodes if n.op == "call_module"}
    reads = {n: tuple(dict.fromkeys(x for x in map(name, keys) if x is not None)) for n, keys in node_reads.items()}
    return tuple(RefOp(n, path, op, tuple(x for x in map(name, saves) if x is not None), tuple(makes.get(i, ())),
                       n in calls, tuple(creates.get(i, ())), reads[n])
                 for i, (n, path, op, saves) in enumerate(ops))


class _SaveLog:
    """Which op each saved tensor is saved for. Autograd saves an op's inputs before the op is dispatched and its
    outputs after: a saved tensor that is not an output of the last op belongs to the next one."""

    def __init__(self, params: frozenset[int] | set[int]) -> None:
        self.params, self.pending, self.last_outputs = params, [], set()
        self.current: list[int] = []

    def take(self, out) -> list[int]:  # noqa: ANN001
        """The op that produced ``out`` was dispatched: its saves so far (inputs), and the list its output saves
        will join."""
        self.current, self.pending = self.pending, []
        self.last_outputs = {storage_id(t) for t in tensors_of(out)}
        return self.current

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        k = storage_id(t)
        if k not in self.params:
            (self.current if k in self.last_outputs else self.pending).append(k)
        return t


def _op_name(func) -> str:  # noqa: ANN001 (an OpOverload)
    return str(func.overloadpacket.__name__)


# ---- the probe -----------------------------------------------------------------------------------------------------
class _ModulePaths:
    """Forward pre/post hooks on every submodule of a layer: the innermost module path running now."""

    def __init__(self, layer: nn.Module) -> None:
        self.stack: list[str] = [""]
        self._handles = []
        for path, m in layer.named_modules():
            if path:
                self._handles.append(m.register_forward_pre_hook(functools.partial(self._enter, path)))
                self._handles.append(m.register_forward_hook(functools.partial(self._exit, path), always_call=True))

    def _enter(self, path: str, module: nn.Module, args) -> None:  # noqa: ANN001
        self.stack.append(path)

    def _exit(self, path: str, module: nn.Module, args, out) -> None:  # noqa: ANN001
        self.stack.pop()

    @property
    def path(self) -> str:
        return self.stack[-1]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@dataclass(eq=False)
class _Probe(TorchDispatchMode):
    """Records one forward of a layer (module docstring, step 2)."""

    paths: _ModulePaths
    params: frozenset[int] = frozenset()
    ops: list[tuple[str, str]] = field(default_factory=list)  # (module path, op name) per aten op
    funcs: list = field(default_factory=list)
    saves: list[list[int]] = field(default_factory=list)  # per op, the storages autograd saved for it, in order
    creator: dict[int, int] = field(default_factory=dict)  # storage -> index of the op that created it
    mutated: set[int] = field(default_factory=set)  # storages written in place after their creation
    hold: list = field(default_factory=list)  # every output, so that no storage id is reused during the probe

    def __post_init__(self) -> None:
        super().__init__()
        self.log = _SaveLog(self.params)

    @property
    def saved(self) -> set[int]:
        return {k for s in self.saves for k in s}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SAC_IGNORED_OPS:
            return out
        i = len(self.ops)
        self.ops.append((self.paths.path, _op_name(func)))
        self.funcs.append(func)
        self.saves.append(self.log.take(out))
        inputs = {storage_id(t) for t in tensors_of((args, kwargs))}
        for t in tensors_of(out):
            k = storage_id(t)
            if k in inputs:
                if func._schema.is_mutable:
                    self.mutated.add(k)
            elif k not in self.creator:
                self.creator[k] = i
        self.hold.append(out)
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        return self.log.pack(t)


def _align(ref: list[tuple[str, str]], run: list[tuple[str, str]]) -> dict[int, int]:
    """run index -> ref index: matching blocks on (path, op), then on the op name inside each gap."""
    pairs: dict[int, int] = {}
    a0 = b0 = 0
    for blk in difflib.SequenceMatcher(a=ref, b=run, autojunk=False).get_matching_blocks():
        gap = difflib.SequenceMatcher(a=[r[1] for r in ref[a0:blk.a]], b=[r[1] for r in run[b0:blk.b]],
                                      autojunk=False)
        for g in gap.get_matching_blocks():
            pairs.update({b0 + g.b + k: a0 + g.a + k for k in range(g.size)})
        pairs.update({blk.b + k: blk.a + k for k in range(blk.size)})
        a0, b0 = blk.a + blk.size, blk.b + blk.size
    return pairs


@dataclass(frozen=True)
class LayerPolicy:
    """What the runtime does with each aten op's output of one layer kind in one chunk: ``actions[i]`` for the
    i-th op of the layer's forward (``funcs[i]`` is that op); ``storages[i]`` the traced storage name of the
    storage it creates, when attributed (for reports and tests)."""

    actions: tuple[Action, ...]
    funcs: tuple
    storages: tuple[str | None, ...]


_RANK = {"recompute": 0, "swap": 1, "keep": 2}


def _fallback_names(probe: _Probe, ref: tuple[RefOp, ...], pairs: dict[int, int]) -> list[str | None]:
    """Per runtime op, the traced storage a saved storage it creates stands for when neither its creator nor the
    op it is saved for is aligned: the storage of the traced module op of the same module path, else of the
    reference op in the matching gap between two aligned ops (at the same relative place) that makes one, else of
    the node of the next aligned op; a ``.internal`` storage first. None when there is none."""
    def pick(names: Sequence[str]) -> str | None:
        internal = [n for n in names if n.endswith(".internal")]
        return (internal or list(names) or [None])[0]

    made: dict[str, list[str]] = {}
    for r in ref:
        made.setdefault(r.node, []).extend(r.makes)
    module_node = {r.path: r.node for r in ref if r.module_call}
    anchors = sorted(pairs)
    out: list[str | None] = []
    for i, (path, _) in enumerate(probe.ops):
        if path in module_node and made.get(module_node[path]):
            out.append(pick(made[module_node[path]]))
            continue
        at = bisect.bisect_left(anchors, i)
        lo, hi = (anchors[at - 1], pairs[anchors[at - 1]]) if at else (-1, -1)
        n_run, n_ref = (anchors[at], pairs[anchors[at]]) if at < len(anchors) else (len(probe.ops), len(ref))
        makers = [j for j in range(hi + 1, n_ref) if ref[j].makes]
        if not makers:  # an empty gap: the node of the next aligned op (the previous one at the end)
            near = n_ref if n_ref < len(ref) else hi
            out.append(pick(made.get(ref[near].node, [])) if near >= 0 else None)
            continue
        want = hi + (i - lo) / (n_run - lo) * (n_ref - hi)
        out.append(pick(ref[min(makers, key=lambda j: abs(j - want))].makes))
    return out


def layer_policy(probe: _Probe, ref: tuple[RefOp, ...], decisions: dict[str, Decision]) -> LayerPolicy:
    """The :class:`LayerPolicy` of a probed layer under ``decisions`` (module docstring, steps 3 and 4).

    A saved runtime storage takes the traced name of the saved storage its creator's aligned reference op
    creates; failing that, of what the aligned reference op it is saved for saves at the same position; failing
    that, when it is made outside a traced module and saved inside it, of that module's first input; failing
    that, :func:`_fallback_names`; a storage none of them names is kept. Where one creator makes storages with
    different decisions (or one storage has two names), the one that holds the most wins (keep, then swap, then
    recompute)."""
    pairs = _align([(r.path, r.op) for r in ref], probe.ops)
    names: dict[int, str] = {}
    for k, i in probe.creator.items():  # the storage an aligned op creates is the one its reference creates
        if i in pairs and (ref[pairs[i]].makes or ref[pairs[i]].creates):
            names[k] = (ref[pairs[i]].makes or ref[pairs[i]].creates)[0]
    for j, saved in enumerate(probe.saves):  # else: what the aligned op it is saved for saves there
        if j in pairs:
            for k, n in zip(saved, ref[pairs[j]].saves):
                names.setdefault(k, n)
    # else, a storage made outside a traced module and saved inside it is that module's input
    module_reads = {r.path: r.reads for r in ref if r.module_call}
    for j, saved in enumerate(probe.saves):
        path = probe.ops[j][0]
        for k in saved:
            made_in = probe.ops[probe.creator[k]][0] if k in probe.creator else ""
            if k not in names and module_reads.get(path) and not (made_in + ".").startswith(path + "."):
                names[k] = module_reads[path][0]
    fallback = _fallback_names(probe, ref, pairs)
    for k, i in probe.creator.items():
        if k not in names and k in probe.saved and fallback[i] is not None:
            names[k] = fallback[i]
    decision: dict[int, Decision] = {}  # creator op index -> decision
    label: dict[int, str | None] = {}
    # the plan keeps what a re-run op reads unless it is re-made or swapped: cache those creators too
    rerun = {r.node for r in ref if decisions.get(r.node) == "recompute"}
    held_reads = {x for r in ref if r.node in rerun for x in r.reads if x not in decisions}
    for k, i in probe.creator.items():
        if k not in probe.saved and names.get(k) in held_reads:
            decision[i], label[i] = "keep", names[k]
    for k in probe.saved:
        i = probe.creator.get(k)
        if i is None or probe.funcs[i].namespace in _COLLECTIVE_NAMESPACES:
            continue
        d = decisions.get(names[k], "keep") if k in names else "keep"
        if i not in decision or _RANK[d] > _RANK[decision[i]]:
            decision[i], label[i] = d, names.get(k)
    mutated = {probe.creator[k] for k in probe.mutated if k in probe.creator}
    actions: list[Action] = []
    for i in range(len(probe.ops)):
        d = decision.get(i, "recompute")
        actions.append("recompute" if d == "recompute" else "swap" if d == "swap"
                       else "snapshot" if i in mutated else "save")
    return LayerPolicy(tuple(actions), tuple(probe.funcs), tuple(label.get(i) for i in range(len(probe.ops))))


# ---- execution -----------------------------------------------------------------------------------------------------
class _Host:
    """A tensor swapped to host: the copy and, once fetched, the device tensor."""

    __slots__ = ("host", "device", "event", "nbytes")

    def __init__(self, t: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        self.device, self.event, self.nbytes = None, None, t.untyped_storage().nbytes()
        if stream is None:
            self.host = t.detach().clone()  # the CPU emulator: "host" is the same memory, counted apart
            return
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            self.host.copy_(t.detach(), non_blocking=True)
        t.record_stream(stream)

    def fetch(self, device: torch.device, stream: torch.cuda.Stream | None) -> None:
        if self.device is not None:
            return
        if stream is None:
            self.device = self.host.to(device, copy=True)
            return
        with torch.cuda.stream(stream):
            self.device = self.host.to(device, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def get(self) -> torch.Tensor:
        if self.event is not None:
            torch.cuda.current_stream(self.device.device).wait_event(self.event)
            self.device.record_stream(torch.cuda.current_stream(self.device.device))
        return self.device


@dataclass(eq=False)
class _Region:
    """One checkpointed layer call (one layer, one micro-batch): its cached outputs by op index, its swapped ones,
    and the meter records of what it holds on the device."""

    policy: LayerPolicy
    cache: dict[int, object] = field(default_factory=dict)
    host: dict[int, object] = field(default_factory=dict)
    device_record: list[int] = field(default_factory=list)
    host_record: list[int] = field(default_factory=list)


class _Caching(TorchDispatchMode):
    """Forward of a region: runs every op, caches the outputs its policy keeps, swaps those it swaps."""

    def __init__(self, region: _Region, owner: "PerTensorCalls") -> None:
        super().__init__()
        self.region, self.owner, self.i = region, owner, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SAC_IGNORED_OPS:
            return out
        i, pol = self.i, self.region.policy
        self.i += 1
        if i >= len(pol.actions) or pol.funcs[i] is not func or pol.actions[i] == "recompute":
            return out
        act, meter = pol.actions[i], self.owner.meter
        if act == "swap":
            self.region.host[i] = tree_map(lambda t: _Host(t, self.owner.stream) if isinstance(t, torch.Tensor)
                                           else t, out)
            for h in _leaves(self.region.host[i], _Host):
                meter.keep_host(h.nbytes, self.region.host_record)
            return out
        kept = tree_map(lambda t: (t.detach().clone() if act == "snapshot" else t.detach())
                        if isinstance(t, torch.Tensor) else t, out)
        self.region.cache[i] = kept
        for t in tensors_of(kept):
            meter.keep(t, self.region.device_record)
        return out


class _Cached(TorchDispatchMode):
    """Recompute of a region in backward: serves cached and fetched outputs, re-runs the rest (counting what it
    re-makes that autograd saves as device bytes)."""

    def __init__(self, region: _Region, owner: "PerTensorCalls") -> None:
        super().__init__()
        self.region, self.owner, self.i = region, owner, 0

    def __enter__(self):
        self.owner._recompute_starts(self.region)
        self.i = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SAC_IGNORED_OPS:
            return func(*args, **(kwargs or {}))
        i, r = self.i, self.region
        self.i += 1
        if i in r.cache:
            return r.cache.pop(i)
        if i in r.host:
            return tree_map(lambda h: h.get() if isinstance(h, _Host) else h, r.host.pop(i))
        out = func(*args, **(kwargs or {}))
        pol = r.policy
        if i < len(pol.actions) and pol.actions[i] == "recompute" and pol.storages[i] is not None:
            for t in tensors_of(out):
                self.owner.meter.keep(t, r.device_record)
        return out


def _leaves(tree, cls) -> list:  # noqa: ANN001
    out: list = []
    tree_map(lambda x: out.append(x) if isinstance(x, cls) else None, tree)
    return out


class PerTensorCalls:
    """The layer-call wrapper of a per-tensor plan on one PP rank (module docstring).

    The executor calls :meth:`start_forward` before each forward action and :meth:`backward_done` after each
    backward action; ``call(name, fn, args)`` runs one layer.
    """

    def __init__(self, plan: Plan, pp_rank: int, meter, device: torch.device,  # noqa: ANN001 (SavedActivationMeter)
                 modules: dict[str, nn.Module]) -> None:
        self.plan, self.meter, self.device = plan, meter, device
        spec = plan.model.spec
        self.spec_json, self.seq_len = spec.model_dump_json(), plan.layout.seq_len
        self.decisions = storage_decisions(plan, pp_rank)
        self.chunk_of = {n: c for c, names in enumerate(plan.stages.chunks[pp_rank]) for n in names}
        self.kind_of = {n: kind_of(spec, n) for n in self.chunk_of}
        self.modules = modules
        self.policies: dict[tuple[int, str], LayerPolicy] = {}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._forward_key: tuple[int, int] | None = None
        self._regions: dict[tuple[int, int], list[_Region]] = {}
        self._holding: _Region | None = None

    # ---- executor hooks ---------------------------------------------------------------------------------------
    def start_forward(self, stage: int, mb: int) -> None:
        self._forward_key = (stage, mb)
        self._regions[(stage, mb)] = []

    def backward_done(self, stage: int, mb: int) -> None:
        self._release_held()
        for r in self._regions.pop((stage, mb), []):  # regions whose recompute did not run (nothing needed)
            self._release(r)

    # ---- one layer --------------------------------------------------------------------------------------------
    def __call__(self, name: str, fn: Callable[..., torch.Tensor], args: tuple) -> torch.Tensor:
        kind = self.kind_of[name]
        key = (self.chunk_of[name], kind.value)
        decisions = self.decisions.get(key, {})
        if kind in (LayerKind.EMBEDDING, LayerKind.EMPTY) or not decisions:
            return fn(*args)
        if key not in self.policies:
            self.policies[key] = self._probe(name, fn, args, decisions)
        region = _Region(self.policies[key])
        self._regions[self._forward_key].append(region)

        def run() -> torch.Tensor:
            return checkpoint(fn, *args, use_reentrant=False,
                              context_fn=lambda: (_Caching(region, self), _Cached(region, self)))

        if decisions.get("hidden") != "swap" or not args or not isinstance(args[0], torch.Tensor):
            return run()
        # the layer input leaves with the region's inputs, which checkpoint saves through the outer hooks
        target = storage_id(args[0])

        def pack(t: torch.Tensor) -> object:
            if storage_id(t) != target:
                return self.meter.pack(t)
            h = _Host(t, self.stream)
            region.host[-1 - len(region.host)] = h
            self.meter.keep_host(h.nbytes, region.host_record)
            return h

        def unpack(p: object) -> torch.Tensor:
            if not isinstance(p, _Host):
                return self.meter.unpack(p)
            if p.device is None:
                self._fetch(region)
            return p.get()

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return run()

    def _probe(self, name: str, fn: Callable[..., torch.Tensor], args: tuple,
               decisions: dict[str, Decision]) -> LayerPolicy:
        kind = self.kind_of[name]
        module = self.modules[name]
        paths = _ModulePaths(module)
        probe = _Probe(paths, params=frozenset(storage_id(p) for p in module.parameters()))
        copies = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                       for a in args)
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t), probe, \
                    uncounted():  # an extra forward: the MoE blocks' token counts leave it out
                fn(*copies)
        finally:
            paths.remove()
        return layer_policy(probe, reference_stream(self.spec_json, kind, self.seq_len), decisions)

    # ---- swap and release -------------------------------------------------------------------------------------
    def _recompute_starts(self, region: _Region) -> None:
        """A region's recompute begins: the previous region's backward is over (release what it held); fetch this
        region's swapped outputs and prefetch the next region's (the one before it in the same forward)."""
        self._release_held()
        self._holding = region
        self._fetch(region)
        for regions in self._regions.values():
            if region in regions:
                i = regions.index(region)
                regions.pop(i)
                if i > 0:
                    self._fetch(regions[i - 1])
                break

    def _fetch(self, region: _Region) -> None:
        for h in (h for v in region.host.values() for h in _leaves(v, _Host)):
            if h.device is None:
                h.fetch(self.device, self.stream)
                self.meter.keep(h.device, region.device_record)

    def _release_held(self) -> None:
        if self._holding is not None:
            self._release(self._holding)
            self._holding = None

    def _release(self, region: _Region) -> None:
        self.meter.drop(region.device_record)
        self.meter.drop_host(region.host_record)
        region.cache.clear()
        region.host.clear()
