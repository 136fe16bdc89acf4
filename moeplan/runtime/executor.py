"""The action-list interpreter: runs this rank's ``plan.schedule.actions`` exactly as written (docs/architecture.md §7).

Actions (torch.distributed.pipelining notation, parsed by ``moeplan.actions.parse_action``):

- ``{s}F{m}``: forward of stage ``s``'s layers for micro-batch ``m``; autograd keeps what backward needs, or what
  the PP rank's recompute mode leaves (:func:`recompute_call`). The last stage's loss is scaled by
  ``1/num_microbatches`` so the per-micro-batch gradients accumulate into the gradient of the mean loss.
- ``{s}B{m}``: backward of that forward (the loss, or the stage outputs with the gradients received for them);
  parameter gradients accumulate across micro-batches.
- ``{s}I{m}`` / ``{s}W{m}``: backward split into the input-gradient part (``torch.autograd.grad`` w.r.t. the stage
  inputs, graph retained) and the weight-gradient part (``torch.autograd.backward`` w.r.t. the parameters). Eager
  PyTorch recomputes the shared part of the backward graph in W, so I+W costs more than B (the zero-bubble
  schedules of torch.distributed.pipelining split the graph instead). Autograd may traverse a selective or
  per-tensor recompute region only once (torch's selective checkpoint refuses a second backward), so on a PP rank
  with such a mode I runs the whole backward (dX and dW) and W does nothing: same gradients, no deferred dW.
- ``({s}F{m};{s'}B{m'})OVERLAP_F_B``: the overlapped pair of ``fb`` overlap (DualPipeV, and 1F1B / interleaved
  with ``fb``): the F and the B run on one compute stream from two host threads, each one's collectives in flight
  while the other computes (moeplan.runtime.overlap); its wall time is recorded under ``OVERLAP_F_B``. Without a
  :class:`~moeplan.runtime.overlap.PairRunner`, or on a PP rank with a per-tensor recompute mode (whose bookkeeping
  follows one forward at a time), the pair runs as its F, then its B.
- ``{s}SEND_F{m}`` / ``{s}SEND_B{m}``: ``isend`` of the stage's outputs to stage s+1 / of its input gradients to
  stage s−1 (contiguous tensors); completed at the end of the step.
- ``{s}RECV_F{m}`` / ``{s}RECV_B{m}``: ``irecv`` of the inputs of stage s / of the gradients of its outputs, waited
  for at the action (the schedule places each RECV right before its consumer, as torch's
  ``_PipelineScheduleRuntime``). With the ``pp`` overlap mechanism (``plan.comm.overlap``) the ``irecv`` is posted
  earlier, before the compute action that precedes the RECV runs, so the receiver is ready before the sender sends:
  gloo (and NCCL's p2p) move the data only once both sides have posted, so a receive posted late waits for a full
  handshake with the sender, while one posted early finds the data on its way (Megatron-LM likewise posts the next
  receive with the current send, ``send_forward_recv_backward``).

What crosses a stage boundary (:class:`CarryFields`) follows from the layers before it: the main hidden state until
``head``; the MTP hidden state from ``mtp.0`` until the last ``mtp_head``; the running MTP loss after the first
``mtp_head``. Stage ``s`` runs on PP rank ``plan.stages.rank_of(s)`` (``plan.stages.placement``: ``loop``, or
the V of ZB-V and DualPipeV, where rank r holds stages r and 2·pp − 1 − r, so the first and last stage share rank
0). Shapes
come from the plan: hidden states ``[micro_batch, seq_len/(cp·tp_sp), hidden]`` (tp_sp = tp
with sequence parallelism, else 1), the loss ``[1]``. Neighbour stages on the same rank hand over in memory.

Recompute (``plan.memory.ranks[pp_rank].recompute``) through ``torch.utils.checkpoint`` (non-reentrant), per layer
(the embedding and empty layers excepted): ``full`` keeps only each layer's inputs (Chen et al. arXiv 1604.06174);
``selective`` runs each layer under a selective-checkpoint policy that saves the outputs of matmuls, embedding
lookups and routing/dispatch index ops and recomputes the rest — norms, activation functions, elementwise ops and
everything inside ``scaled_dot_product_attention`` (Korthikanti et al. arXiv 2205.05198 §5; MindSpeed
``--recompute-norm`` / ``--recompute-activation-function``), the op classes ``cost_models/sharding.py`` prices as
recomputed. Collectives inside a region are re-issued by the recompute (in-place c10d ops cannot be cached), on
every rank of the group at the same schedule point. The per-tensor modes (``mindspeed``, ``ilp-no-swap``,
``ilp``) keep, re-run or swap each saved tensor as the plan decides (moeplan.runtime.activations).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
import traceback
import weakref
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Literal, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from moeplan.actions import OVERLAP, Action, parse_action
from moeplan.errors import PlanError
from moeplan.ir import LayerKind, kind_of
from moeplan.models import DEFAULT_MTP_WEIGHT
from moeplan.plan import Plan
from moeplan.runtime.activations import PerTensorCalls
from moeplan.runtime.data import MicroBatch
from moeplan.runtime.metrics import CommMeter, CommTotals, SavedActivationMeter
from moeplan.runtime.overlap import PairRunner


@dataclass(frozen=True)
class CarryFields:
    """Which tensors cross a stage boundary (see the module docstring)."""

    hidden: bool = False
    mtp_hidden: bool = False
    loss: bool = False


@dataclass(frozen=True)
class Carry:
    """The running state between layers: main hidden state, MTP hidden state, weighted MTP loss so far."""

    hidden: torch.Tensor | None = None
    mtp_hidden: torch.Tensor | None = None
    loss: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.hidden, self.mtp_hidden, self.loss) if t is not None)

    @staticmethod
    def from_tensors(fields: CarryFields, tensors: Sequence[torch.Tensor]) -> "Carry":
        it = iter(tensors)
        return Carry(hidden=next(it) if fields.hidden else None, mtp_hidden=next(it) if fields.mtp_hidden else None,
                     loss=next(it) if fields.loss else None)


def fields_after(plan: Plan, names: Sequence[str]) -> CarryFields:
    """The carry fields after running ``names`` (every layer before a boundary, in pipeline order)."""
    spec = plan.model.spec
    kinds = [kind_of(spec, n) for n in names]
    num_mtp = spec.num_mtp_layers
    heads_done = kinds.count(LayerKind.MTP_HEAD)
    return CarryFields(hidden=LayerKind.EMBEDDING in kinds and LayerKind.HEAD not in kinds,
                       mtp_hidden=LayerKind.MTP in kinds and heads_done < num_mtp,
                       loss=heads_done > 0 or LayerKind.HEAD in kinds)


def has_pairs(plan: Plan) -> bool:
    """Whether the schedule has OVERLAP_F_B pairs (on any PP rank: the same answer on every rank)."""
    return any(parse_action(a).kind == OVERLAP for actions in plan.schedule.actions for a in actions)


def stage_layers(plan: Plan, stage: int) -> list[str]:
    """Layer names of pipeline stage ``stage``: chunk ``stage // pp`` (under both placements) of PP rank
    ``plan.stages.rank_of(stage)``."""
    rank, chunk = plan.stages.rank_chunk(stage)
    return list(plan.stages.chunks[rank][chunk])


def boundary_shapes(plan: Plan, stage: int) -> list[tuple[int, ...]]:
    """Shapes of the tensors stage ``stage`` passes to stage ``stage + 1``."""
    lay = plan.layout
    names = [n for s in range(stage + 1) for n in stage_layers(plan, s)]
    f = fields_after(plan, names)
    sp = lay.tp if lay.sequence_parallel else 1
    hidden = (lay.micro_batch, lay.seq_len // (lay.cp * sp), plan.model.spec.hidden_size)
    return [hidden] * (int(f.hidden) + int(f.mtp_hidden)) + [(1,)] * int(f.loss)


LayerWrapper = Callable[[str, Callable[..., torch.Tensor], tuple], torch.Tensor]


def _plain(name: str, fn: Callable[..., torch.Tensor], args: tuple) -> torch.Tensor:
    return fn(*args)


def run_layer(name: str, kind: LayerKind, module: nn.Module, carry: Carry, mb: MicroBatch, *, num_mtp: int,
              mtp_weight: float, call: LayerWrapper = _plain) -> Carry:
    """Apply one layer to the carry (interfaces of moeplan.models.model); ``call`` wraps the module call
    (recompute). MTP losses enter the running loss weighted ``mtp_weight / num_mtp`` (DeepSeek-V3 eq. 25)."""
    if kind == LayerKind.EMBEDDING:
        return Carry(hidden=call(name, module, (mb.tokens,)))
    if kind in (LayerKind.DENSE, LayerKind.MOE):
        return replace(carry, hidden=call(name, module, (carry.hidden,)))
    if kind == LayerKind.MTP:
        prev = carry.mtp_hidden if carry.mtp_hidden is not None else carry.hidden
        return replace(carry, mtp_hidden=call(name, module, (prev, mb.tokens)))
    if kind == LayerKind.MTP_HEAD:
        term = call(name, module, (carry.mtp_hidden, mb.labels)) * (mtp_weight / num_mtp)
        index = int(name.rsplit(".", 1)[1])
        return Carry(hidden=carry.hidden, mtp_hidden=carry.mtp_hidden if index + 1 < num_mtp else None,
                     loss=term if carry.loss is None else carry.loss + term)
    if kind == LayerKind.HEAD:
        loss = call(name, module, (carry.hidden, mb.labels))
        return Carry(mtp_hidden=carry.mtp_hidden, loss=loss if carry.loss is None else loss + carry.loss)
    return carry


# ---- recompute -----------------------------------------------------------------------------------------------------
_aten = torch.ops.aten
#: ops whose outputs selective recompute keeps (outside attention): matmuls, embedding lookups, routing and dispatch
SAVED_OPS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
                       _aten.embedding.default, _aten.topk.default, _aten.sort.default, _aten.sort.stable,
                       _aten.argsort.default, _aten.argsort.stable, _aten.index_select.default,
                       _aten.gather.default, _aten.index_add.default, _aten.scatter_add.default,
                       _aten._grouped_mm.default})


class _AttentionScope(TorchFunctionMode):
    """Marks the ops run inside ``F.scaled_dot_product_attention`` (``depth > 0``, per thread: the halves of an
    OVERLAP_F_B pair run on two) for the selective policy."""

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()

    @property
    def depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        self._local.depth = self.depth + 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self._local.depth -= 1


_STOP_RECOMPUTATION = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())


class _Remade(TorchDispatchMode):
    """The recompute of a whole-layer checkpoint region in backward, for the meter: notes (weakly) every storage
    an op creates; when the recompute ends, the ones still alive are what autograd keeps for the layer's backward
    — the working set the plan charges (``memory.ranks[r].working_set_bytes``) — and the meter counts each of them
    until autograd frees it (:meth:`SavedActivationMeter.hold`). Transients that died during the recompute are not
    counted. Entered inside a selective policy's recompute context, so it sees the outputs that context serves from
    its cache too."""

    def __init__(self, meter: SavedActivationMeter) -> None:
        super().__init__()
        self.meter = meter
        self._made: list[weakref.ref] = []  # not keyed by address: a freed transient's address is reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(t, torch.Tensor) and not t.is_meta]
        if outs:  # new storages only: a view or in-place output is its input's (made before, or noted already)
            given = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor) and not t.is_meta}
            self._made += [weakref.ref(t.untyped_storage()) for t in outs
                           if t.untyped_storage().data_ptr() not in given]
        return out

    def __exit__(self, *exc):
        made, self._made = self._made, []
        if exc[0] is not None and issubclass(exc[0], _STOP_RECOMPUTATION):
            # checkpoint stopped the recompute after its last saved tensor (early stop) and swallows the exception;
            # the traceback keeps the stopped forward's locals (transients) alive until then: drop them first
            traceback.clear_frames(exc[2])
        try:
            return super().__exit__(*exc)
        finally:
            alive = {s.data_ptr(): s for s in (ref() for ref in made) if s is not None}
            for storage in alive.values():
                self.meter.hold(storage)


class _MeterRecompute:
    """A whole-layer region's recompute context: ``inner`` (the selective policy's, or none under ``full``) with
    :class:`_Remade` inside it; when the recompute ends, the outputs the policy kept are released from the meter
    (``record``) after :class:`_Remade` has counted those autograd still holds."""

    def __init__(self, meter: SavedActivationMeter, inner=None, record: list[int] | None = None) -> None:
        self.meter, self.inner, self.record = meter, inner, record
        self.remade = _Remade(meter)

    def __enter__(self):
        if self.inner is not None:
            self.inner.__enter__()
        self.remade.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self.remade.__exit__(*exc)
        finally:
            if self.record is not None:
                self.meter.drop(self.record)
            if self.inner is not None:
                self.inner.__exit__(*exc)
        return False


def _full_contexts(meter: SavedActivationMeter):
    return contextlib.nullcontext(), _MeterRecompute(meter)


def _selective_contexts(meter: SavedActivationMeter, scope: _AttentionScope):
    record: list[int] = []

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if scope.depth == 0 and op in SAVED_OPS:
            out = ctx.op_output
            for t in out if isinstance(out, (tuple, list)) else (out,):
                meter.keep(t, record)
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    forward, recompute = create_selective_checkpoint_contexts(policy)
    return forward, _MeterRecompute(meter, recompute, record)


def layer_calls(plan: Plan, pp_rank: int, meter: SavedActivationMeter, modules: Mapping[int, nn.ModuleDict],
                device: torch.device) -> LayerWrapper:
    """The layer-call wrapper of PP rank ``pp_rank``'s recompute mode: :func:`recompute_call` for a whole-layer
    mode, :class:`~moeplan.runtime.activations.PerTensorCalls` for a per-tensor one (``modules``: the rank's
    stage -> layer modules)."""
    mode = plan.memory.ranks[pp_rank].recompute
    if mode in ("none", "selective", "full"):
        return recompute_call(mode, meter)
    layers = {name: m for stage in modules.values() for name, m in stage.items()}
    return PerTensorCalls(plan, pp_rank, meter, device, layers)


def recompute_call(mode: Literal["none", "selective", "full"], meter: SavedActivationMeter) -> LayerWrapper:
    """The layer-call wrapper of a whole-layer recompute mode (see the module docstring)."""
    if mode == "none":
        return _plain
    scope = _AttentionScope()
    context_fn = functools.partial(_selective_contexts, meter, scope)
    full_contexts = functools.partial(_full_contexts, meter)

    def call(name: str, fn: Callable[..., torch.Tensor], args: tuple) -> torch.Tensor:
        if name == "embedding" or name.startswith("empty."):
            return fn(*args)
        if mode == "full":
            return checkpoint(fn, *args, use_reentrant=False, context_fn=full_contexts)
        with scope:
            return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)

    return call


@dataclass
class _Forward:
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


class PipelineExecutor:
    """Runs one PP rank's action list for one step.

    ``modules[stage]`` maps layer names to modules (moeplan.runtime.build); ``pp_ranks`` the global rank of every
    PP rank of this pipeline; ``localize`` turns a micro-batch of full sequences into what this rank's layers take
    (identity for moeplan.runtime.build, whose layers take whole micro-batches); ``call`` wraps each layer call
    (:func:`recompute_call`); ``comm_classes`` maps the names of this rank's in-layer process groups (TP, CP,
    EP...) to comm classes for :class:`CommMeter`; empty when it has none, which skips the meter. ``grads_ready(stage)``
    is called once per step as soon as the parameter gradients of ``stage`` are complete (after its last B or W
    action), so the DP reduction of that stage can start while later actions run. ``pairs`` runs the OVERLAP_F_B
    pairs overlapped (None: as F, then B).
    """

    def __init__(self, plan: Plan, *, pp_rank: int, pp_ranks: Sequence[int], modules: Mapping[int, nn.ModuleDict],
                 meter: SavedActivationMeter, comm_classes: Mapping[str, str],
                 localize: Callable[[MicroBatch], MicroBatch], call: LayerWrapper = _plain,
                 mtp_weight: float = DEFAULT_MTP_WEIGHT, device: torch.device = torch.device("cpu"),
                 grads_ready: Callable[[int], None] | None = None, pairs: PairRunner | None = None) -> None:
        self.plan, self.pp_rank, self.pp_ranks, self.device = plan, pp_rank, tuple(pp_ranks), device
        self.grads_ready = grads_ready
        self.pairs = None if isinstance(call, PerTensorCalls) else pairs
        self.modules, self.meter, self.localize, self.call = modules, meter, localize, call
        self.comm_classes, self.mtp_weight = dict(comm_classes), mtp_weight
        self.actions = [parse_action(a) for a in plan.schedule.actions[pp_rank]]
        self.num_stages = plan.layout.pp * plan.layout.vpp
        self.layers = {s: [(n, kind_of(plan.model.spec, n)) for n in stage_layers(plan, s)]
                       for s in range(self.num_stages) if plan.stages.rank_of(s) == pp_rank}
        missing = set(self.layers) - set(modules)
        if missing:
            raise PlanError(f"stages: pp rank {pp_rank} holds stages {sorted(self.layers)}, modules built for "
                            f"{sorted(modules)}")
        self.shapes = {s: boundary_shapes(plan, s) for s in range(self.num_stages - 1)}
        self.in_fields = {s: fields_after(plan, [n for p in range(s) for n in stage_layers(plan, p)])
                          for s in self.layers}
        # the action after which a stage's parameter gradients are complete for the step (its last B or W)
        self.last_grad_action = {}
        for i, a in enumerate(self.actions):
            for part in a.parts or (a,):
                if part.kind in ("B", "W"):
                    self.last_grad_action[part.stage] = (i, part.kind, part.microbatch)
        # "pp" overlap: action index -> the RECV actions to post before it runs (module docstring)
        self.post_before: dict[int, list[Action]] = {}
        if "pp" in plan.comm.overlap:
            last_compute = 0
            for i, a in enumerate(self.actions):
                if a.kind in ("RECV_F", "RECV_B"):
                    self.post_before.setdefault(last_compute, []).append(a)
                elif a.kind in ("F", "B", "I", "W") or a.parts:
                    last_compute = i
        # autograd traverses a selective or per-tensor recompute region once only: I then runs the whole backward
        self.one_pass_iw = plan.memory.ranks[pp_rank].recompute not in ("none", "full")

    # ---- one step ---------------------------------------------------------------------------------------------
    def run_step(self, microbatches: Sequence[MicroBatch], comm: CommTotals, *,
                 metered: bool = True) -> tuple[float, Counter]:
        """Execute the action list once. Returns (sum over micro-batches of the unscaled loss on the last stage,
        or 0 elsewhere; seconds per action kind). p2p bytes/seconds go to ``comm`` under ``pp``; when ``metered``,
        the in-layer collectives by class too, and the saved-activation meter runs (both slow a step down)."""
        self._metered = metered
        self._mbs = [self.localize(mb) for mb in microbatches]
        self._fwd: dict[tuple[int, int], _Forward] = {}
        self._in: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._grad_out: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._grad_in: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._posted: dict[tuple[str, int, int], tuple[tuple[torch.Tensor, ...], list[dist.Work]]] = {}
        self._dw_done: set[tuple[int, int]] = set()  # (stage, mb) whose one-pass I computed dW already
        self._loss_sum, times = 0.0, Counter()
        self._comm = comm
        for i, a in enumerate(self.actions):
            for recv in self.post_before.get(i, ()):
                self._posted[(recv.kind, recv.stage, recv.microbatch)] = self._post_recv(recv.kind, recv.stage,
                                                                                         recv.microbatch)
            if a.parts and self.pairs is not None:
                t0 = time.perf_counter()
                self._overlapped(*a.parts)
                times[a.kind] += time.perf_counter() - t0
                done = a.parts
            else:
                done = a.parts or (a,)  # without a PairRunner an OVERLAP_F_B pair runs its F, then its B
                for part in done:
                    t0 = time.perf_counter()
                    self._dispatch(part.kind, part.stage, part.microbatch)
                    times[part.kind] += time.perf_counter() - t0
            for part in done:
                if self.grads_ready is not None and self.last_grad_action.get(part.stage) == (i, part.kind,
                                                                                               part.microbatch):
                    self.grads_ready(part.stage)
        t0 = time.perf_counter()
        for work, _ in self._sends:
            work.wait()
        times["SEND_WAIT"] += time.perf_counter() - t0
        leftover = [k for k in self._fwd]
        assert not leftover, f"forwards without backward: {leftover}"
        return self._loss_sum, times

    def _comm_meter(self) -> CommMeter | contextlib.nullcontext:
        """The in-layer collective meter, or nothing (unmetered step, or no in-layer groups on this rank)."""
        if self._metered and self.comm_classes:
            return CommMeter(self.comm_classes, self._comm)
        return contextlib.nullcontext()

    def _dispatch(self, kind: str, stage: int, mb: int) -> None:
        if kind == "F":
            with self._comm_meter(), self.meter.hooks() if self._metered else contextlib.nullcontext():
                self._forward(stage, mb)
        elif kind in ("B", "I", "W"):
            with self._comm_meter():
                self._backward(stage, mb, kind)
        elif kind == "SEND_F":
            self._send(self._fwd[(stage, mb)].outputs, stage + 1, stage, mb, 0)
        elif kind == "SEND_B":
            self._send(self._grad_in.pop((stage, mb)), stage - 1, stage, mb, 1)
        elif kind == "RECV_F":
            self._in[(stage, mb)] = self._recv(kind, stage, mb)
        elif kind == "RECV_B":
            self._grad_out[(stage, mb)] = self._recv(kind, stage, mb)
        else:
            raise PlanError(f"schedule.actions[{self.pp_rank}]: action kind {kind!r} is not executable")

    def _overlapped(self, f, b) -> None:
        """One OVERLAP_F_B pair on :attr:`pairs` (its F and B parts)."""
        def forward() -> None:
            with self.meter.hooks() if self._metered else contextlib.nullcontext():
                self._forward(f.stage, f.microbatch)

        self.pairs.run(forward, lambda: self._backward(b.stage, b.microbatch, b.kind),
                       totals=self._comm if self._metered else None)

    # ---- compute ----------------------------------------------------------------------------------------------
    def _stage_inputs(self, stage: int, mb: int) -> tuple[torch.Tensor, ...]:
        if stage == 0:
            return ()
        received = self._in.pop((stage, mb), None)
        if received is None:
            raise PlanError(f"schedule.actions[{self.pp_rank}]: {stage}F{mb} runs before its input arrived "
                            f"(no {stage}RECV_F{mb} and stage {stage - 1} is not local)")
        return tuple(t.detach().requires_grad_(t.is_floating_point()) for t in received)

    def _forward(self, stage: int, mb: int) -> None:
        inputs = self._stage_inputs(stage, mb)
        if isinstance(self.call, PerTensorCalls):
            self.call.start_forward(stage, mb)
        carry = Carry.from_tensors(self.in_fields[stage], inputs) if stage else Carry()
        spec = self.plan.model.spec
        for name, kind in self.layers[stage]:
            carry = run_layer(name, kind, self.modules[stage][name], carry, self._mbs[mb],
                              num_mtp=spec.num_mtp_layers, mtp_weight=self.mtp_weight, call=self.call)
        if stage == self.num_stages - 1:
            self._loss_sum += float(carry.loss.detach())
            outputs = (carry.loss / self.plan.layout.num_microbatches,)
        else:
            outputs = tuple(t.reshape(1) if t.dim() == 0 else t for t in carry.tensors())
        self._fwd[(stage, mb)] = _Forward(inputs=inputs, outputs=outputs)
        if stage + 1 < self.num_stages and self.plan.stages.rank_of(stage + 1) == self.pp_rank:
            self._in[(stage + 1, mb)] = outputs  # same-rank neighbour: hand over in memory

    def _backward(self, stage: int, mb: int, kind: str) -> None:
        """B: full backward; I: input gradients only, graph kept for W; W: parameter gradients, graph freed. Under
        a selective or per-tensor recompute mode (``one_pass_iw``) I runs as B and its W does nothing."""
        key, last = (stage, mb), stage == self.num_stages - 1
        if kind == "W" and key in self._dw_done:
            self._dw_done.remove(key)
            return
        if kind == "I" and self.one_pass_iw:
            self._dw_done.add(key)
            kind = "B"
        fwd = self._fwd[key] if kind == "I" else self._fwd.pop(key)
        grads = (None,) if last else self._grad_out[key] if kind == "I" else self._grad_out.pop(key)
        need = [t for t in fwd.inputs if t.requires_grad]
        if kind == "I":
            got = torch.autograd.grad(fwd.outputs, need, grads, retain_graph=True, allow_unused=True) if need else ()
            self._store_input_grads(stage, mb, fwd.inputs, dict(zip(map(id, need), got)))
        elif kind == "W":
            params = {id(p): p for m in self.modules[stage].values() for p in m.parameters() if p.requires_grad}
            torch.autograd.backward(fwd.outputs, grads, inputs=list(params.values()))
        else:
            torch.autograd.backward(fwd.outputs, grads)
            self._store_input_grads(stage, mb, fwd.inputs, {id(t): t.grad for t in need})
        if kind != "I" and isinstance(self.call, PerTensorCalls):
            self.call.backward_done(stage, mb)

    def _store_input_grads(self, stage: int, mb: int, inputs: tuple[torch.Tensor, ...],
                           grads: dict[int, torch.Tensor | None]) -> None:
        if stage == 0:
            return
        out = tuple(grads.get(id(t)) if grads.get(id(t)) is not None else torch.zeros_like(t) for t in inputs)
        if self.plan.stages.rank_of(stage - 1) == self.pp_rank:
            self._grad_out[(stage - 1, mb)] = out
        else:
            self._grad_in[(stage, mb)] = out

    # ---- p2p --------------------------------------------------------------------------------------------------
    def _tag(self, stage: int, mb: int, direction: int, index: int) -> int:
        return ((mb * self.num_stages + stage) * 2 + direction) * 4 + index

    def _peer(self, stage: int) -> int:
        return self.pp_ranks[self.plan.stages.rank_of(stage)]

    def _send(self, tensors: Sequence[torch.Tensor], to_stage: int, stage: int, mb: int, direction: int) -> None:
        # tag by the sending stage for F (receiver's stage − 1) and by the receiving stage for B (its stage)
        tag_stage = stage if direction == 0 else to_stage
        for i, t in enumerate(tensors):
            buf = t.detach().contiguous()
            self._sends.append((dist.isend(buf, self._peer(to_stage), tag=self._tag(tag_stage, mb, direction, i)),
                                buf))
            self._comm.add("pp", 0.0, buf.numel() * buf.element_size())

    def _post_recv(self, kind: str, stage: int, mb: int) -> tuple[tuple[torch.Tensor, ...], list[dist.Work]]:
        """Post the ``irecv`` of RECV_F (the inputs of ``stage``) or RECV_B (the gradients of its outputs)."""
        if kind == "RECV_F":
            shapes, from_stage, direction, tag_stage = self.shapes[stage - 1], stage - 1, 0, stage - 1
        else:
            shapes, from_stage, direction, tag_stage = self.shapes[stage], stage + 1, 1, stage
        bufs = tuple(torch.empty(s, device=self.device) for s in shapes)
        works = [dist.irecv(b, self._peer(from_stage), tag=self._tag(tag_stage, mb, direction, i))
                 for i, b in enumerate(bufs)]
        return bufs, works

    def _recv(self, kind: str, stage: int, mb: int) -> tuple[torch.Tensor, ...]:
        """Wait for a RECV posted earlier (``pp`` overlap), or post it and wait; the wait is the ``pp`` time."""
        t0 = time.perf_counter()
        posted = self._posted.pop((kind, stage, mb), None)
        bufs, works = posted if posted is not None else self._post_recv(kind, stage, mb)
        for w in works:
            w.wait()
        self._comm.add("pp", time.perf_counter() - t0, 0)
        return bufs
