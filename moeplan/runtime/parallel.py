"""Autograd-aware collectives and shard bookkeeping shared by the TP/SP, EP and CP layers.

Every collective is a ``torch.autograd.Function`` whose backward is the transposed collective (Megatron-LM
``core/tensor_parallel/mappings.py``), so gradients through a sharded layer are exact:

=====================  ===========================  ===========================
function               forward                      backward
=====================  ===========================  ===========================
``all_gather``         all-gather along ``dim``     reduce-scatter (sum)
``gather_linears``     all-gather, then linears     all-gather of the saved slice, reduce-scatter
``reduce_scatter``     reduce-scatter (sum)         all-gather
``value_all_reduce``   all-reduce (sum)             identity
``all_to_all``         all_to_all_single (splits)   all_to_all_single (splits swapped)
``all_to_all_async``   posted; rows from ``wait``   all_to_all_single (splits swapped)
``all_gather_v``       uneven all-gather of rows    uneven reduce-scatter (sum)
``reduce_scatter_v``   uneven reduce-scatter (sum)  uneven all-gather
=====================  ===========================  ===========================

Each takes a :class:`Link` (a group, and the comm class its payload bytes are tallied under in an optional
:class:`CommLog`); a group of ``None`` means one rank and the function is the identity. Outputs are plain contiguous
tensors (gloo needs contiguous buffers; the flat all-gather / reduce-scatter work on dim 0 only, so the gathered dim
is moved to the front and back). All-gather / reduce-scatter take equal sizes only (gloo has no uneven all-gather);
``all_to_all`` takes uneven and zero splits, and the ``_v`` forms of all-gather / reduce-scatter run on it.

Parameters replicated over TP whose ranks see different tokens (sequence-parallel norms, MLA down projections,
the router, the MTP projection) are marked with :class:`TPReplicated`; their gradients are per-rank partial sums
that :func:`all_reduce_grads` sums over TP ONCE per step, after the last backward, in one flat buffer (Megatron-LM
``finalize_model_grads`` → ``_allreduce_layernorm_grads``), instead of one all-reduce per use and micro-batch.

:class:`ParamShard` records which part of the single-process parameter a rank holds, so one rule materialises it
(moeplan.runtime.build) and a checkpoint can name it.
"""
from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Literal, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeplan.cost_models.comm import wire_bytes

Group = dist.ProcessGroup | None
CommClass = Literal["tp", "ep", "cp", "dp", "pp"]
# torch 2.13 renamed the flat collectives (the old names warn); older torch (e.g. with torch_npu) has only the old.
all_gather_flat = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor
reduce_scatter_flat = dist.reduce_scatter_single if hasattr(dist, "reduce_scatter_single") else dist.reduce_scatter_tensor


_STREAM = threading.local()


def use_stream_groups(clones: Mapping[tuple[int, ...], dist.ProcessGroup] | None) -> None:
    """From now on in this thread, run every collective of this module on the group of ``clones`` with the same
    members (moeplan.runtime.groups.StreamGroups) instead of the group the layer names (None: the layer's group)."""
    _STREAM.clones, _STREAM.cache = clones, {}


def use_comm_hook(hook: Callable[[dist.ProcessGroup, Callable[[], object]], None] | None) -> None:
    """From now on in this thread, run every collective of this module as ``hook(group, run)`` (``run`` issues it
    and returns once it completed; moeplan.runtime.overlap gives the compute stream up around it); None: directly."""
    _STREAM.hook = hook


def _collective(group: dist.ProcessGroup, run: Callable[[], object]) -> None:
    """Issue one collective on ``group`` and wait for it, through this thread's hook (:func:`use_comm_hook`)."""
    hook = getattr(_STREAM, "hook", None)
    if hook is None:
        run()
    else:
        hook(group, run)


def _pg(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group this thread runs ``group``'s collectives on (:func:`stream_groups`)."""
    clones = getattr(_STREAM, "clones", None)
    if clones is None:
        return group
    cache = _STREAM.cache
    clone = cache.get(id(group))
    if clone is None:
        clone = cache[id(group)] = clones[tuple(sorted(dist.get_process_group_ranks(group)))]
    return clone


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    group = _pg(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((group_size(group) * front.shape[0], *front.shape[1:]))
    _collective(group, lambda: all_gather_flat(out, front, group=group))
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    group = _pg(group)
    front = x.movedim(dim, 0).contiguous()
    world = group_size(group)
    assert front.shape[0] % world == 0, f"reduce-scatter of {front.shape[0]} rows over {world} ranks"
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    _collective(group, lambda: reduce_scatter_flat(out, front, op=dist.ReduceOp.SUM, group=group))
    return out.movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.contiguous().clone()
    group = _pg(group)
    _collective(group, lambda: dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group))
    return out


@dataclass(frozen=True)
class Link:
    """A process group (``None``: one rank) and where its traffic is tallied (``comm_class`` of ``log``)."""

    group: Group
    comm_class: CommClass
    log: "CommLog | None" = None

    @property
    def size(self) -> int:
        return group_size(self.group)

    def record(self, kind: str, phase: str, x: torch.Tensor, rows: list[int] | None = None) -> None:
        """Tally the payload ``x`` of one collective of ``kind``; ``rows``: an all-to-all's rows of ``x`` to each
        group rank (None: equal parts)."""
        if self.log is not None:
            row = x.element_size() * math.prod(x.shape[1:])
            self.log.add(self.comm_class, kind, phase, x.numel() * x.element_size(), group=self.group,
                         sends=None if rows is None else [n * row for n in rows])


class CommLog:
    """One rank's tally of collective payloads: bytes and calls by ``(comm_class, kind, phase)``, and the bytes it
    sends over each link tier by ``(comm_class, tier)`` (``tier_bytes``; with ``devices_per_node``).

    The payload is the tensor one rank holds before the op (moeplan.state.CommOp's ``bytes``): the input of an
    all-gather, all-reduce or all-to-all and the full input of a reduce-scatter. Sent bytes by tier: a peer is on
    this rank's node when ``global rank // devices_per_node`` is equal; an all-to-all sends its parts to each other
    member (the part to itself crosses no link); an all-gather, reduce-scatter or all-reduce sends the wire bytes of
    the ring algorithm (moeplan.cost_models.comm.wire_bytes), all on the group's slowest tier (inter-node when one
    member is on another node), as the planner counts them. Mutable; one per process, passed explicitly
    (moeplan.runtime.build.build_rank_modules).
    """

    def __init__(self, devices_per_node: int | None = None) -> None:
        self.bytes: Counter[tuple[str, str, str]] = Counter()
        self.calls: Counter[tuple[str, str, str]] = Counter()
        self.tier_bytes: Counter[tuple[str, str]] = Counter()
        self.devices_per_node = devices_per_node
        self._members: dict[str, tuple[int, tuple[bool, ...]]] = {}

    def add(self, comm_class: str, kind: str, phase: str, nbytes: int, *, group: Group = None,
            sends: list[int] | None = None) -> None:
        """Tally one collective of ``kind`` on ``group`` (None: no peer; the sent bytes are not tallied) with a
        payload of ``nbytes``; ``sends``: an all-to-all's bytes to each group rank (None: equal parts)."""
        self.bytes[(comm_class, kind, phase)] += nbytes
        self.calls[(comm_class, kind, phase)] += 1
        if group is None or not self.devices_per_node:
            return
        me, same = self._peers(group)
        if kind == "all_to_all":
            for i, sent in enumerate(sends if sends is not None else [nbytes / len(same)] * len(same)):
                if i != me:
                    self.tier_bytes[(comm_class, "intra" if same[i] else "inter")] += sent
        else:
            self.tier_bytes[(comm_class, "intra" if all(same) else "inter")] += wire_bytes(
                kind=kind, bytes=nbytes, group_size=len(same))  # type: ignore[arg-type]

    def _peers(self, group: dist.ProcessGroup) -> tuple[int, tuple[bool, ...]]:
        """(this rank's index in ``group``, whether each member is on this rank's node)."""
        if group.group_name not in self._members:
            me, per = dist.get_rank(), self.devices_per_node
            ranks = dist.get_process_group_ranks(group)
            self._members[group.group_name] = (ranks.index(me), tuple(r // per == me // per for r in ranks))
        return self._members[group.group_name]

    def tier_bytes_by_class(self) -> dict[str, dict[str, int]]:
        """``{comm_class: {"intra": bytes, "inter": bytes}}`` sent since the last :meth:`clear`."""
        out: dict[str, dict[str, int]] = {}
        for (comm_class, tier), n in self.tier_bytes.items():
            out.setdefault(comm_class, {"intra": 0, "inter": 0})[tier] = round(n)
        return out

    def bytes_by_class(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for (comm_class, _, _), n in self.bytes.items():
            out[comm_class] += n
        return dict(out)

    def clear(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.tier_bytes.clear()


class _Mirrored(torch.autograd.Function):
    """An all-gather or a reduce-scatter, along ``dim`` (``sizes`` None) or of uneven rows (``sizes``: rows per
    group rank), whose backward runs its mirror on the gradient: the reduce-scatter of an all-gather, the
    all-gather of a reduce-scatter."""

    @staticmethod
    def forward(ctx, x, kind, dim, sizes, link):
        ctx.kind, ctx.dim, ctx.sizes, ctx.link = kind, dim, sizes, link
        return _mirrored(kind, "fwd", x, dim, sizes, link)

    @staticmethod
    def backward(ctx, grad):
        mirror = "reduce_scatter" if ctx.kind == "all_gather" else "all_gather"
        return _mirrored(mirror, "bwd", grad, ctx.dim, ctx.sizes, ctx.link), None, None, None, None


def _mirrored(kind: str, phase: str, x: torch.Tensor, dim: int, sizes: list[int] | None, link: Link) -> torch.Tensor:
    link.record(kind, phase, x)
    if kind == "all_gather":
        return _gather(x, dim, link.group) if sizes is None else _gather_v(x, sizes, link.group)
    return _reduce_scatter(x, dim, link.group) if sizes is None else _reduce_scatter_v(x, sizes, link.group)


class _GatherLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, link, *weights):
        ctx.dim, ctx.link = dim, link
        link.record("all_gather", "fwd", x)
        full = _gather(x, dim, link.group)
        ctx.save_for_backward(x, *weights)  # the slice, not the gathered input
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        ctx.link.record("all_gather", "bwd", x)
        full = _gather(x, ctx.dim, ctx.link.group).flatten(0, -2)
        dfull, dweights = None, []
        for g, w in zip(grads, weights):
            if g is None:
                dweights.append(None)
                continue
            dweights.append(g.flatten(0, -2).t() @ full)
            dfull = g @ w if dfull is None else dfull + g @ w
        ctx.link.record("reduce_scatter", "bwd", dfull)
        return (_reduce_scatter(dfull, ctx.dim, ctx.link.group), None, None, *dweights)


class _ValueAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, link):
        link.record("all_reduce", "fwd", x)
        return _all_reduce(x, link.group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _a2a(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    group = _pg(group)
    _collective(group, lambda: dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send,
                                                      group=group))
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, link):
        ctx.send, ctx.recv, ctx.link = send, recv, link
        link.record("all_to_all", "fwd", x, send)
        return _a2a(x, send, recv, link.group)

    @staticmethod
    def backward(ctx, grad):
        ctx.link.record("all_to_all", "bwd", grad, ctx.recv)
        return _a2a(grad, ctx.recv, ctx.send, ctx.link.group), None, None, None


def all_gather(x: torch.Tensor, dim: int, link: Link) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in group-rank order (equal shapes); backward reduce-scatters."""
    return x if link.group is None else _Mirrored.apply(x, "all_gather", dim, None, link)


def gather_linears(x: torch.Tensor, dim: int, link: Link, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``F.linear(all_gather(x, dim), w)`` for each weight ``w [out, in]`` (column-parallel layers sharing one
    sequence-parallel input): ONE all-gather in forward, and backward keeps only this rank's slice ``x`` and
    all-gathers it again for the weight gradients, then reduce-scatters the input gradient (Megatron-LM
    ``LinearWithGradAccumulationAndAsyncCommunication`` under ``sequence_parallel``: activation memory 1/tp of the
    gathered input for one more all-gather per backward)."""
    if link.group is None:
        return tuple(F.linear(x, w) for w in weights)
    return _GatherLinears.apply(x, dim, link, *weights)


def reduce_scatter(x: torch.Tensor, dim: int, link: Link) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's ``1/world`` slice of ``dim``; backward all-gathers."""
    return x if link.group is None else _Mirrored.apply(x, "reduce_scatter", dim, None, link)


def value_all_reduce(x: torch.Tensor, link: Link) -> torch.Tensor:
    """Sum ``x`` over the group; backward passes the gradient through unchanged (each rank keeps its own part)."""
    return x if link.group is None else _ValueAllReduce.apply(x, link)


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], link: Link) -> torch.Tensor:
    """``all_to_all_single`` of the rows of ``x``: ``send[i]`` rows to group rank i, ``recv[i]`` rows from it.

    Uneven and zero splits are allowed; the split lists must agree across ranks (exchange the counts first with
    :func:`exchange_counts`). Backward sends the gradient rows back the same way.
    """
    return x if link.group is None else _AllToAll.apply(x, send, recv, link)


class _AllToAllStart(torch.autograd.Function):
    """Posts ``all_to_all_single`` with ``async_op=True`` and returns its output buffer, valid once
    ``pending.work`` has been waited for; backward is :class:`_AllToAll`'s (on the group of the thread that runs it,
    :func:`use_stream_groups`)."""

    @staticmethod
    def forward(ctx, x, send, recv, link, pending):
        ctx.send, ctx.recv, ctx.link = send, recv, link
        link.record("all_to_all", "fwd", x, send)
        pending.input = x.contiguous()  # kept alive until the exchange is waited for
        out = x.new_empty((sum(recv), *x.shape[1:]))
        pending.group = _pg(link.group)
        pending.work = dist.all_to_all_single(out, pending.input, output_split_sizes=recv, input_split_sizes=send,
                                              group=pending.group, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.link.record("all_to_all", "bwd", grad, ctx.recv)
        return _a2a(grad, ctx.recv, ctx.send, ctx.link.group), None, None, None, None


class _Pending:
    """An all-to-all in flight (:func:`all_to_all_async`)."""

    group: dist.ProcessGroup
    work: dist.Work
    input: torch.Tensor


def all_to_all_async(x: torch.Tensor, send: list[int], recv: list[int], link: Link) -> Callable[[], torch.Tensor]:
    """:func:`all_to_all` posted without waiting (``async_op=True``, https://pytorch.org/docs/stable/distributed.html
    "Synchronous and asynchronous collective operations"); returns ``wait``, which waits for the exchange and
    returns the received rows: call it where they are first needed, so the work issued in between runs while the
    rows are in flight. Same result, gradient and tallied bytes as :func:`all_to_all`; the backward exchange is
    synchronous."""
    if link.group is None:
        return lambda: x
    pending = _Pending()
    out = _AllToAllStart.apply(x, send, recv, link, pending)

    def wait() -> torch.Tensor:
        _collective(pending.group, pending.work.wait)
        del pending.input
        return out

    return wait


def _gather_v(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's rows, ``sizes[i]`` from group rank i, in group-rank order: an all-to-all that sends this rank's
    rows to every member (gloo has no uneven all-gather); the same bytes to each peer as an all-gather."""
    return _a2a(x.repeat(len(sizes), *(1,) * (x.dim() - 1)), [x.shape[0]] * len(sizes), sizes, group)


def _reduce_scatter_v(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Block i of ``x`` (``sizes[i]`` rows) summed over the group lands on group rank i: an all-to-all of the
    blocks, then the sum of the received copies in group-rank order."""
    mine = sizes[group_rank(group)]
    out = _a2a(x, sizes, [mine] * len(sizes), group)
    return out.view(len(sizes), mine, *x.shape[1:]).sum(0)


def all_gather_v(x: torch.Tensor, sizes: list[int], link: Link) -> torch.Tensor:
    """Uneven all-gather of rows: ``x [sizes[r], ...]`` on group rank r -> ``[Σ sizes, ...]``, every rank's rows in
    group-rank order (Megatron-LM ``gather_from_sequence_parallel_region`` with ``output_split_sizes``); backward
    :func:`reduce_scatter_v`. ``sizes`` must agree across ranks."""
    return x if link.group is None else _Mirrored.apply(x, "all_gather", 0, sizes, link)


def reduce_scatter_v(x: torch.Tensor, sizes: list[int], link: Link) -> torch.Tensor:
    """Uneven reduce-scatter of rows: ``x [Σ sizes, ...]`` summed over the group, group rank r keeps rows
    ``[Σ sizes[:r], Σ sizes[:r+1])`` (Megatron-LM ``reduce_scatter_to_sequence_parallel_region`` with
    ``input_split_sizes``); backward :func:`all_gather_v`."""
    return x if link.group is None else _Mirrored.apply(x, "reduce_scatter", 0, sizes, link)


def exchange_counts(counts: torch.Tensor, link: Link) -> torch.Tensor:
    """``counts [world, n]`` int64 (row i: what this rank sends to rank i) -> ``[world, n]`` received (row i: what
    rank i sends here). No gradient."""
    if link.group is None:
        return counts.clone()
    link.record("all_to_all", "fwd", counts)
    out = torch.empty_like(counts)
    group = _pg(link.group)
    _collective(group, lambda: dist.all_to_all_single(out.view(-1), counts.contiguous().view(-1), group=group))
    return out


def gather_no_grad(x: torch.Tensor, link: Link) -> torch.Tensor:
    """All-gather along dim 0 without autograd (indices, counts)."""
    if link.group is None:
        return x
    link.record("all_gather", "fwd", x)
    return _gather(x.detach(), 0, link.group)


class TPReplicated:
    """Mixin of a module whose parameters (recursively) are replicated whole over TP while each TP rank feeds them
    different tokens or head shards: their gradients are per-rank partial sums until :func:`all_reduce_grads` sums
    them (collected by moeplan.runtime.build.tp_replicated_params)."""


def all_reduce_grads(params: list[torch.nn.Parameter], group: Group) -> int:
    """Sum the gradients of ``params`` over ``group`` in one flat all-reduce (``None`` grads count as zero and are
    filled); returns the payload bytes (0 for one rank or no parameters). Every rank of the group must pass the
    same parameters in the same order (Megatron-LM ``_allreduce_layernorm_grads``: flatten, all-reduce, unflatten).
    """
    if group is None or group_size(group) == 1 or not params:
        return 0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()
    return flat.numel() * flat.element_size()


# ---- shards -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamShard:
    """The part of a single-process parameter a rank holds.

    First, for routed experts, ``experts`` picks global expert indices along dim 0 of the stacked ``[E, ...]``
    tensor; then ``full.narrow(dim, start, size)`` when ``dim`` is not None. A parameter without a ParamShard is
    replicated whole.
    """

    dim: int | None = None
    start: int = 0
    size: int = 0
    experts: tuple[int, ...] | None = None

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This shard of the full tensor ``full`` (experts already selected when ``experts`` is set)."""
        return full if self.dim is None else full.narrow(self.dim, self.start, self.size)


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, size)`` of part ``index`` of ``total`` split into ``parts`` equal contiguous parts."""
    assert total % parts == 0, f"{total} is not divisible by {parts}"
    size = total // parts
    return index * size, size


class Sharded:
    """Mixin of a parallel module: ``param_shards`` maps its own (non-recursive) parameter names to ParamShards."""

    param_shards: dict[str, ParamShard]
