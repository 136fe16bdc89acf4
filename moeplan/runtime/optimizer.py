"""The distributed optimizer: ZeRO-1 style AdamW over data parallelism, with global-norm gradient clipping.

Per pipeline stage this rank holds, parameter class — dense parameters over the dense-gradient group ``dp_cp`` and
routed-expert parameters over ``expert_dp`` — and weight-decay class (matrices decay, 1-D norm gains do not), the
parameters' gradients are flattened into one bucket padded to a multiple of the group size and reduce-scattered
(SUM), so each rank owns one contiguous shard of each bucket (Rajbhandari et al., ZeRO, arXiv 1910.02054 §5.1 stage
1; Megatron-LM ``DistributedOptimizer``). The shard is scaled by ``grad_scale``, ``1/dp`` for both classes: the
layers of moeplan.runtime.build give each CP rank's share of the micro-batch loss gradient (ParallelHead), so a SUM
over cp and the mean over dp make the gradient of the global-batch mean loss; each expert accumulates the tokens of
every rank of its expert group, so the SUM over expert-DP covers each token once (the same rule as Megatron-LM
``DistributedDataParallel``, which scales expert gradients by ``1/(dp·cp)`` of a per-token-mean loss). Then the
global gradient norm (over every rank, each element counted once, see :class:`ParamEntry`) clips the shards,
``torch.optim.AdamW`` updates each fp32 shard, and the shards are all-gathered back into the parameters.

DP overlap (plan mechanism ``dp``, Megatron-LM ``--overlap-grad-reduce``): the executor calls
:meth:`~DistributedAdamW.grads_ready` once a stage's last backward has run; the buckets of that stage are then
reduce-scattered with ``async_op=True`` while the rest of the step runs, and :meth:`~DistributedAdamW.step` only
waits for the handles.
Megatron-LM does the same per bucket group (``_ParamAndGradBucketGroup.register_grad_ready`` issues
``start_grad_sync`` once every parameter of the group has its gradient; ``finish_grad_sync`` waits on the handle in
``finalize_model_grads``; megatron/core/distributed/param_and_grad_buffer.py). A parameter whose gradient other
collectives still change after the backward — a TP-replicated one (summed over TP, :class:`ReplicatedGrads`) or a
copy tied across PP ranks (:class:`TiedGrads`) — sits in an ``end`` bucket reduced at the step, after those sums.
Without the mechanism every bucket is reduced synchronously at the step. The buckets (and so the shards and the
checkpointed optimizer state) are the same either way.

Elementwise AdamW on a shard equals AdamW on the whole tensor, so the result matches single-process AdamW on the
same global batch (up to the summation order of the gradient reduction).
"""
from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Collection, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from moeplan.plan import Plan
from moeplan.runtime.metrics import CommTotals
from moeplan.runtime.parallel import all_gather_flat, reduce_scatter_flat


@dataclass(frozen=True)
class OptimConfig:
    """AdamW hyper-parameters (Loshchilov & Hutter, arXiv 1711.05101) and the clipping threshold.

    ``lr`` constant (no schedule); ``weight_decay`` applies to parameters with ≥ 2 dims; ``max_grad_norm`` is the
    global L2 norm threshold (``torch.nn.utils.clip_grad_norm_``: coefficient ``max/(norm + 1e-6)`` capped at 1).
    """

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0


@dataclass(frozen=True)
class ParamEntry:
    """One local parameter: ``name`` (full model name), how much its squared gradient counts in the global norm
    (``1/tp`` for a TP-replicated dense parameter, 0 for a tied copy whose owner is counted, else 1), and the local
    pipeline ``stages`` whose layers use it (its gradient is complete once each has run its last backward)."""

    name: str
    param: torch.nn.Parameter
    norm_weight: float
    stages: frozenset[int] = frozenset()


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


class _Completion:
    """When a posted gloo collective completed: a thread waits on its ``Work`` (``wait`` releases the GIL) and
    notes the time (``done_s``, ``time.perf_counter`` seconds); gloo's reduce-scatter ``Work`` has no future to
    call back. :meth:`wait` joins the thread and re-raises what the collective raised."""

    def __init__(self, work: dist.Work) -> None:
        self.done_s, self.error = 0.0, None
        self.thread = threading.Thread(target=self._watch, args=(work,), daemon=True)
        self.thread.start()

    def _watch(self, work: dist.Work) -> None:
        try:
            work.wait()
        except Exception as e:  # re-raised on the caller's thread by wait()
            self.error = e
        self.done_s = time.perf_counter()

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


class FlatParams:
    """Parameters flattened into one padded bucket, reduce-scattered over ``group``; this rank owns one shard.

    ``master`` (fp32, ``shard_numel`` elements) is the owned shard of the parameters; ``norm_weight`` the per-element
    weight of the squared gradient in the global norm; ``stages`` the local pipeline stages whose backward must have
    finished before the bucket can be reduced (empty: reduced at the optimizer step).
    """

    def __init__(self, entries: Sequence[ParamEntry], group: dist.ProcessGroup | None, *, grad_scale: float,
                 comm: CommTotals, device: torch.device, stages: frozenset[int] = frozenset()) -> None:
        self.entries, self.group, self.grad_scale, self.comm = tuple(entries), group, grad_scale, comm
        self.device, self.stages = device, stages
        self.world, self.rank = _group_size(group), _group_rank(group)
        numels = [e.param.numel() for e in self.entries]
        self.offsets = [sum(numels[:i]) for i in range(len(numels))]
        total = sum(numels)
        self.shard_numel = math.ceil(total / self.world) if total else 0
        self.padded = self.shard_numel * self.world
        lo, hi = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        with torch.no_grad():
            self.master = self._flat(lambda p: p.detach())[lo:hi].float().clone()
            weights = torch.cat([torch.full((n,), e.norm_weight, device=device) for e, n in zip(self.entries, numels)]
                                + [torch.zeros(self.padded - total, device=device)])
        self.norm_weight = weights[lo:hi].clone()
        self.grad = torch.zeros_like(self.master)
        self.started = False
        self._pending: tuple[dist.Work | _Completion, torch.Tensor, float] | None = None

    def _flat(self, get) -> torch.Tensor:
        parts = [get(e.param).reshape(-1).float() for e in self.entries]
        pad = self.padded - sum(p.numel() for p in parts)
        return torch.cat(parts + [torch.zeros(pad, device=self.device)])

    def start_reduce(self, *, async_op: bool) -> None:
        """Flatten the gradients and sum them over the group into this rank's shard: with ``async_op`` post the
        reduce-scatter and return (:meth:`finish_reduce` waits), else run it now, its seconds tallied as ``dp``."""
        flat = self._flat(lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
        self.started = True
        if self.world == 1 or not self.padded:
            self.grad.copy_(flat)
            return
        t0 = time.perf_counter()
        work = reduce_scatter_flat(self.grad, flat, group=self.group, async_op=async_op)
        if not async_op:
            self.comm.add("dp", time.perf_counter() - t0, flat.numel() * flat.element_size())
            return
        self._pending = (_Completion(work) if dist.get_backend(self.group) == "gloo" else work, flat, t0)

    def finish_reduce(self) -> None:
        """Wait for a posted reduce-scatter (the wait tallied as ``dp`` seconds; its time in flight, from posting to
        completion, as ``dp`` busy seconds: exact on gloo, elsewhere up to the end of the wait), then scale the
        shard by ``grad_scale`` and get ready for the next step."""
        if self._pending is not None:
            work, flat, posted = self._pending
            t0 = time.perf_counter()
            work.wait()
            t1 = time.perf_counter()
            done = work.done_s if isinstance(work, _Completion) else t1
            self.comm.add("dp", t1 - t0, flat.numel() * flat.element_size(), busy_s=done - posted)
            self._pending = None
        self.grad.mul_(self.grad_scale)
        self.started = False

    def norm_sq(self) -> torch.Tensor:
        """This shard's weighted sum of squared gradients (float64 scalar)."""
        return (self.grad.double().square() * self.norm_weight.double()).sum()

    def gathered(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's ``shard`` (a tensor of ``shard_numel`` elements: the master or an AdamW moment) concatenated in
        group order: ``[padded]``, element ``offsets[i] + j`` belonging to element ``j`` of parameter ``i``; the shard
        itself on one rank. The all-gather's seconds and payload are tallied as ``dp``."""
        if self.world == 1 or not self.padded:
            return shard
        flat = torch.empty(self.padded, dtype=shard.dtype, device=self.device)
        t0 = time.perf_counter()
        all_gather_flat(flat, shard, group=self.group)
        self.comm.add("dp", time.perf_counter() - t0, shard.numel() * shard.element_size())
        return flat

    def all_gather_params(self) -> None:
        """Gather every rank's updated shard and copy it into the parameters."""
        flat = self.gathered(self.master)
        with torch.no_grad():
            for e, off in zip(self.entries, self.offsets):
                e.param.copy_(flat[off:off + e.param.numel()].view_as(e.param))


def _bucket_name(stages: frozenset[int]) -> str:
    return "stage" + "+".join(map(str, sorted(stages))) if stages else "end"


class DistributedAdamW:
    """ZeRO-1 AdamW over the dense and expert parameter buckets (see the module docstring).

    ``dense`` / ``expert``: this rank's parameters of each class; ``dense_group`` / ``expert_group``: their
    gradient groups (``None`` = one rank); ``grad_scale``: ``1/dp`` (module docstring); ``reduce_at_step``:
    parameters whose gradients other collectives change after the backward (:func:`synced_after_backward`), kept in
    the ``end`` buckets. :meth:`step` returns the global gradient norm before clipping; every rank must call it (the
    norm is all-reduced over the world).
    """

    def __init__(self, *, dense: Sequence[ParamEntry], expert: Sequence[ParamEntry],
                 dense_group: dist.ProcessGroup | None, expert_group: dist.ProcessGroup | None, grad_scale: float,
                 config: OptimConfig, comm: CommTotals, device: torch.device = torch.device("cpu"),
                 reduce_at_step: Collection[nn.Parameter] = ()) -> None:
        self.config, self.device = config, device
        at_step = {id(p) for p in reduce_at_step}

        def key(e: ParamEntry) -> frozenset[int]:
            return frozenset() if id(e.param) in at_step else e.stages

        keys = sorted({key(e) for e in (*dense, *expert)}, key=lambda k: (not k, sorted(k)))
        self.buffers: dict[str, FlatParams] = {}
        groups = []
        for stages in keys:
            for cls, entries, group in (("dense", dense, dense_group), ("expert", expert, expert_group)):
                for decay in (True, False):
                    mine = [e for e in entries if key(e) == stages and (e.param.dim() >= 2) == decay]
                    if not mine:
                        continue
                    buf = FlatParams(mine, group, grad_scale=grad_scale, comm=comm, device=device, stages=stages)
                    self.buffers[f"{_bucket_name(stages)}.{cls}_{'decay' if decay else 'no_decay'}"] = buf
                    groups.append({"params": [buf.master], "weight_decay": config.weight_decay if decay else 0.0})
        self.adamw = torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                                       foreach=False)
        for buf in self.buffers.values():  # eager state (as AdamW's lazy init), so a checkpoint can load into it
            self.adamw.state[buf.master] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(buf.master),
                                            "exp_avg_sq": torch.zeros_like(buf.master)}
        self._ready: set[int] = set()

    def grads_ready(self, stage: int) -> None:
        """Pipeline stage ``stage``'s gradients are final for this step: post the asynchronous reduce-scatter of
        every bucket whose stages are all final now (the executor's ``grads_ready`` hook under DP overlap). Every
        rank of a bucket's group calls it at the same point of the same action list, so they post in one order."""
        self._ready.add(stage)
        for b in self.buffers.values():
            if b.stages and not b.started and b.stages <= self._ready:
                b.start_reduce(async_op=True)

    def step(self) -> float:
        """Reduce-scatter the buckets not posted yet (synchronously), wait for the posted ones, clip by the global
        norm, AdamW on the shards, all-gather. Returns the norm."""
        for b in self.buffers.values():
            if not b.started:
                b.start_reduce(async_op=False)
        for b in self.buffers.values():
            b.finish_reduce()
        self._ready.clear()
        norm_sq = sum((b.norm_sq() for b in self.buffers.values()), torch.zeros((), dtype=torch.float64,
                                                                                device=self.device))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(norm_sq)
        norm = float(norm_sq.sqrt())
        coef = min(1.0, self.config.max_grad_norm / (norm + 1e-6))
        for b in self.buffers.values():
            b.master.grad = b.grad.mul_(coef) if coef < 1.0 else b.grad
        self.adamw.step()
        for b in self.buffers.values():
            b.all_gather_params()
        return norm

    def zero_grad(self) -> None:
        for b in self.buffers.values():
            for e in b.entries:
                e.param.grad = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's optimizer state by stable name: each shard's fp32 master, AdamW moments and step count.
        The tensors are the live ones: loading a checkpoint into them (then :meth:`sync_params`) restores the state."""
        out: dict[str, torch.Tensor] = {}
        for key, b in self.buffers.items():
            out[f"{key}.master"] = b.master
            for name, value in self.adamw.state[b.master].items():
                out[f"{key}.{name}"] = value
        return out

    def state_storages(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """For the model-state meter (moeplan.runtime.metrics.model_state_bytes): (the flat gradient shards it keeps
        beside the parameters' ``.grad``, every other tensor it keeps from step to step: master shards, norm-weight
        shards, AdamW's moments and step counts). Reads only."""
        grads = [b.grad for b in self.buffers.values()]
        state = [b.master for b in self.buffers.values()] + [b.norm_weight for b in self.buffers.values()]
        state += [v for s in self.adamw.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return grads, state

    def sync_params(self) -> None:
        """Copy the (restored) master shards back into the parameters of every rank."""
        for b in self.buffers.values():
            b.all_gather_params()

    @contextmanager
    def unsharded_states(self, params: Collection[nn.Parameter]) -> Iterator[dict[int, tuple[torch.Tensor, ...]]]:
        """The whole optimizer state of ``params`` while the block runs: ``{id(param): (master, exp_avg,
        exp_avg_sq)}``, fp32 tensors shaped like the parameter, views into the buckets' state all-gathered over
        their groups (the shards themselves on one rank). What the block writes into them is this rank's state
        afterwards: each rank keeps its shard of the (changed) whole. Collective over the groups of the buckets
        holding ``params`` (every rank of a group must pass parameters of the same buckets). Used between steps,
        when no reduction is in flight (moeplan.runtime.rebalance moves experts' states with it)."""
        wanted = {id(p) for p in params}
        views: dict[int, tuple[torch.Tensor, ...]] = {}
        whole: list[tuple[FlatParams, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = []
        for b in self.buffers.values():
            hits = [(e.param, off) for e, off in zip(b.entries, b.offsets) if id(e.param) in wanted]
            if not hits:
                continue
            shards = (b.master, self.adamw.state[b.master]["exp_avg"], self.adamw.state[b.master]["exp_avg_sq"])
            fulls = tuple(b.gathered(t) for t in shards)
            for p, off in hits:
                views[id(p)] = tuple(f[off:off + p.numel()].view(p.shape) for f in fulls)
            whole.append((b, shards, fulls))
        yield views
        for b, shards, fulls in whole:
            lo = b.rank * b.shard_numel
            for shard, full in zip(shards, fulls):
                if full is not shard:
                    shard.copy_(full[lo:lo + b.shard_numel])


# ---- building the optimizer's inputs from a rank's modules -----------------------------------------------------------
def _layer_of(full_name: str, layers: Sequence[str]) -> str:
    """The layer a full parameter name belongs to (the longest layer name that prefixes it)."""
    return max((n for n in layers if full_name.startswith(n + ".")), key=len)


def param_entries(plan: Plan, modules: Mapping[int, nn.ModuleDict]) -> tuple[list[ParamEntry], list[ParamEntry]]:
    """(dense, expert) entries of this rank's parameters with their norm weights and stages: a dense parameter
    replicated over TP (no TP shard) counts ``1/tp`` (every TP rank holds the same full gradient), a copy whose owner
    lives on another PP rank counts 0 (the owner is counted), everything else 1; ``stages`` are the keys of
    ``modules`` (pipeline stages) whose layers hold the parameter (several for a copy sharing its owner's
    Parameter on the same rank)."""
    from moeplan.runtime.build import rank_parameters

    spec, tp = plan.model.spec, plan.layout.tp
    local = [n for layers in modules.values() for n in layers.keys()]
    every = [n for rank in plan.stages.chunks for chunk in rank for n in chunk]
    stages: dict[int, set[int]] = {}
    for stage, layers in modules.items():
        for p in layers.parameters():
            stages.setdefault(id(p), set()).add(stage)
    dense, expert = [], []
    for rp in rank_parameters(dict(modules), spec):
        owner_here = _layer_of(rp.name, every) in local
        if not owner_here:
            weight = 0.0
        elif rp.expert or rp.shard.dim is not None:
            weight = 1.0
        else:
            weight = 1.0 / tp
        (expert if rp.expert else dense).append(ParamEntry(name=rp.name, param=rp.param, norm_weight=weight,
                                                           stages=frozenset(stages[id(rp.param)])))
    return dense, expert


def synced_after_backward(replicated: "ReplicatedGrads", ties: "TiedGrads") -> list[nn.Parameter]:
    """The parameters whose gradients collectives after the backward still change — the TP-replicated ones when TP
    has more than one rank, the copies tied across PP ranks — so their DP reduction must wait for the step
    (:class:`DistributedAdamW` ``reduce_at_step``)."""
    synced = list(replicated.params) if _group_size(replicated.group) > 1 else []
    return synced + [param for _, param in ties.jobs]


class ReplicatedGrads:
    """Sums the gradients of this rank's TP-replicated parameters (moeplan.runtime.build.tp_replicated_params) over
    its TP group once per step, after the last backward and before the optimizer: one flat all-reduce (Megatron-LM
    ``finalize_model_grads`` / ``_allreduce_layernorm_grads`` for sequence parallelism), tallied as ``tp``."""

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, *, comm: CommTotals) -> None:
        self.params, self.group, self.comm = list(params), group, comm

    def sync(self) -> None:
        from moeplan.runtime.parallel import all_reduce_grads

        t0 = time.perf_counter()
        nbytes = all_reduce_grads(self.params, self.group)
        if nbytes:
            self.comm.add("tp", time.perf_counter() - t0, nbytes)


class TiedGrads:
    """Sums the gradients of parameter copies with their owners across PP ranks (moeplan.models.tied_parameters:
    the MTP embedding, the MTP head's output layer). Copies on the owner's rank share its Parameter (build.py) and
    need nothing. Collective at construction: one 2-rank group per tied PP-rank pair and pipeline, created in the
    same order on every rank."""

    def __init__(self, plan: Plan, modules: Mapping[int, nn.ModuleDict], *, rank: int, comm: CommTotals,
                 timeout: timedelta) -> None:
        from moeplan.models import tied_parameters
        from moeplan.runtime.groups import group_ranks

        self.comm = comm
        pp_of = {n: r for r, chunks in enumerate(plan.stages.chunks) for chunk in chunks for n in chunk}
        every = list(pp_of)
        mine = {n: m for layers in modules.values() for n, m in layers.items()}
        self.jobs: list[tuple[dist.ProcessGroup, nn.Parameter]] = []
        for copy, owner in tied_parameters(plan.model.spec):
            a, b = _layer_of(copy, every), _layer_of(owner, every)
            if pp_of[a] == pp_of[b]:
                continue
            for pipe in group_ranks(plan.layout).pp:
                group = dist.new_group(sorted((pipe[pp_of[a]], pipe[pp_of[b]])), timeout=timeout)
                if rank in pipe:
                    layer = a if pipe[pp_of[a]] == rank else b if pipe[pp_of[b]] == rank else None
                    if layer is not None:
                        full = copy if layer == a else owner
                        self.jobs.append((group, mine[layer].get_parameter(full[len(layer) + 1:])))

    def sync(self) -> None:
        """All-reduce (sum) each tied parameter's gradient with its twin on the other PP rank (tallied as ``dp``:
        gradient-synchronisation traffic of the optimizer phase, as Megatron-LM's embedding-group all-reduce)."""
        for group, param in self.jobs:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            t0 = time.perf_counter()
            dist.all_reduce(param.grad, group=group)
            self.comm.add("dp", time.perf_counter() - t0, param.grad.numel() * param.grad.element_size())
