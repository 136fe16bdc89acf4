"""Rank coordinates and torch.distributed process groups of a plan's layout (docs/architecture.md §7).

Dense ranks are laid out TP innermost, then CP, then DP, then PP (Megatron-LM's ``tp-cp-ep-dp-pp`` order,
moeplan.layout)::

    rank = tp_rank + tp · (cp_rank + cp · (dp_rank + dp · pp_rank))

Inside one PP stage the ``tp·cp·dp`` ranks have the local index ``l = rank mod tp·cp·dp``. The expert layout
re-reads the same ranks as etp innermost, then the expert group, then expert-DP (Megatron-LM's expert rank
generator, ``parallel_state.initialize_model_parallel`` with ``expert_tensor_parallel_size``)::

    l = etp_rank + etp · (expert_rank + expert_shards · expert_dp_rank)

so an etp group is a run of consecutive TP ranks (etp divides tp), the expert group (``expert_shards = ep·tp/etp``
ranks) spans the TP group when ``etp = 1 < tp`` (TP-extend-EP) and ``ep`` CP×DP ranks of one TP rank when
``etp = tp`` (expert-TP). Process-group ranks are global ranks sorted ascending (``new_group`` sorts them), which
is the order of the coordinate each group runs over.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import ClassVar, Mapping

import torch.distributed as dist

from moeplan.errors import PlanError
from moeplan.plan import PlanLayout

DEFAULT_GROUP_TIMEOUT = timedelta(seconds=60)

Ranks = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class RankCoords:
    """This rank's position in the layout (all 0-based). ``expert_rank`` indexes ``plan.experts.shards``."""

    rank: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int
    expert_rank: int
    etp_rank: int
    expert_dp_rank: int


@dataclass(frozen=True)
class GroupRanks:
    """Every group of each kind as tuples of global ranks (ascending). Pure function of the layout."""

    tp: Ranks
    cp: Ranks
    dp: Ranks
    dp_cp: Ranks
    tp_cp: Ranks
    expert: Ranks
    etp: Ranks
    expert_dp: Ranks
    pp: Ranks

    KINDS: ClassVar[tuple[str, ...]] = ("tp", "cp", "dp", "dp_cp", "tp_cp", "expert", "etp", "expert_dp", "pp")


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process groups; ``None`` where the group has one rank.

    ``dp_cp``: dense-gradient group (dp × cp ranks of one tp/pp rank). ``tp_cp``: the ranks that share one
    micro-batch (tp × cp of one dp/pp rank; used for capacity-factor routing and loss statistics). ``expert``: the
    dispatch/combine all-to-all group (``expert_shards`` ranks). ``etp``: expert tensor-parallel group.
    ``expert_dp``: ranks holding the same expert shard (expert-gradient group). ``pp``: this rank's pipeline, whose
    global ranks by pp_rank are ``pp_ranks``. ``expert_inter`` / ``expert_intra``: the expert group split by node
    (:func:`make_node_groups`, only for the hierarchical and dedup dispatchers).
    """

    tp: dist.ProcessGroup | None
    cp: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None
    dp_cp: dist.ProcessGroup | None
    tp_cp: dist.ProcessGroup | None
    expert: dist.ProcessGroup | None
    etp: dist.ProcessGroup | None
    expert_dp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None
    pp_ranks: tuple[int, ...]
    expert_inter: dist.ProcessGroup | None = None
    expert_intra: dist.ProcessGroup | None = None


def check_layout_for_runtime(layout: PlanLayout) -> None:
    """Raise PlanError unless the runtime can execute ``layout`` (degrees that divide, SP exactly when tp > 1)."""
    stage = layout.tp * layout.cp * layout.dp
    if stage * layout.pp != layout.num_devices:
        raise PlanError(f"layout.num_devices={layout.num_devices}: must equal tp·cp·dp·pp = {stage * layout.pp}")
    if layout.tp % layout.etp or (layout.cp * layout.dp) % layout.ep:
        raise PlanError(f"layout.etp={layout.etp}, ep={layout.ep}: etp must divide tp ({layout.tp}) and ep must "
                        f"divide cp·dp ({layout.cp * layout.dp})")
    if layout.sequence_parallel != (layout.tp > 1):
        raise PlanError(f"layout.sequence_parallel={layout.sequence_parallel}: the runtime runs TP with sequence "
                        f"parallelism, so it must be true exactly when tp > 1 (tp={layout.tp})")
    if layout.seq_len % (layout.cp * layout.tp) or (layout.cp > 1 and layout.seq_len % (2 * layout.cp)):
        raise PlanError(f"layout.seq_len={layout.seq_len}: must be divisible by cp·tp = {layout.cp * layout.tp} "
                        f"and by 2·cp for load-balanced context parallelism")


def rank_coords(layout: PlanLayout, rank: int) -> RankCoords:
    """Coordinates of global ``rank`` (see the module docstring). Raises PlanError for a rank outside the layout."""
    if not 0 <= rank < layout.num_devices:
        raise PlanError(f"rank={rank}: must be in 0..{layout.num_devices - 1} (layout.num_devices)")
    stage = layout.tp * layout.cp * layout.dp
    local = rank % stage
    shards = layout.expert_shards
    return RankCoords(rank=rank, tp_rank=local % layout.tp, cp_rank=(local // layout.tp) % layout.cp,
                      dp_rank=local // (layout.tp * layout.cp), pp_rank=rank // stage,
                      etp_rank=local % layout.etp, expert_rank=(local // layout.etp) % shards,
                      expert_dp_rank=local // (layout.etp * shards))


def _groups(world: int, key) -> Ranks:
    """Partition ranks ``0..world-1`` by ``key(rank)``; groups in order of first member, members ascending."""
    out: dict[object, list[int]] = {}
    for r in range(world):
        out.setdefault(key(r), []).append(r)
    return tuple(tuple(v) for v in out.values())


def group_ranks(layout: PlanLayout) -> GroupRanks:
    """All groups of every kind for ``layout`` (no processes needed)."""
    world = layout.num_devices

    def c(r: int) -> RankCoords:
        return rank_coords(layout, r)

    return GroupRanks(
        tp=_groups(world, lambda r: (c(r).cp_rank, c(r).dp_rank, c(r).pp_rank)),
        cp=_groups(world, lambda r: (c(r).tp_rank, c(r).dp_rank, c(r).pp_rank)),
        dp=_groups(world, lambda r: (c(r).tp_rank, c(r).cp_rank, c(r).pp_rank)),
        dp_cp=_groups(world, lambda r: (c(r).tp_rank, c(r).pp_rank)),
        tp_cp=_groups(world, lambda r: (c(r).dp_rank, c(r).pp_rank)),
        expert=_groups(world, lambda r: (c(r).etp_rank, c(r).expert_dp_rank, c(r).pp_rank)),
        etp=_groups(world, lambda r: (c(r).expert_rank, c(r).expert_dp_rank, c(r).pp_rank)),
        expert_dp=_groups(world, lambda r: (c(r).etp_rank, c(r).expert_rank, c(r).pp_rank)),
        pp=_groups(world, lambda r: r % (layout.tp * layout.cp * layout.dp)))


def make_groups(layout: PlanLayout, rank: int, *,
                timeout: timedelta = DEFAULT_GROUP_TIMEOUT) -> tuple[RankCoords, ParallelGroups]:
    """Create every process group of ``layout`` and return this rank's coordinates and groups.

    Collective over the default process group (already initialised): every rank calls ``new_group`` for every
    group of more than one rank, kinds in :attr:`GroupRanks.KINDS` order, so the calls match on all ranks.
    ``timeout`` bounds every collective of the new groups (a dead peer fails them instead of hanging).
    Raises PlanError when the layout does not fit the launched world.
    """
    check_layout_for_runtime(layout)
    if dist.get_world_size() != layout.num_devices:
        raise PlanError(f"layout.num_devices={layout.num_devices}: {dist.get_world_size()} processes were launched")
    coords, ranks = rank_coords(layout, rank), group_ranks(layout)
    mine: dict[str, dist.ProcessGroup | None] = {}
    for kind in GroupRanks.KINDS:
        mine[kind] = None
        for members in getattr(ranks, kind):
            if len(members) > 1:
                group = dist.new_group(list(members), timeout=timeout)
                if rank in members:
                    mine[kind] = group
    pp_ranks = next(m for m in ranks.pp if rank in m)
    return coords, ParallelGroups(**mine, pp_ranks=pp_ranks)


def expert_node_ranks(layout: PlanLayout, devices_per_node: int, *, min_per_node: int = 2) -> tuple[Ranks, Ranks]:
    """(inter, intra) groups of the expert groups, nodes being runs of ``devices_per_node`` global ranks: ``intra``
    holds the expert group's ranks on one node, ``inter`` its ranks at the same position on every node (MindSpeed
    ``--moe-hierarchical-alltoallv``). Raises PlanError unless every node holds the same number ``g`` of the group's
    ranks, ``g ≥ min_per_node`` (2 for the hierarchical dispatcher, moeplan.cost_models.dispatch.hierarchical_valid;
    1 for dedup), on at least two nodes."""
    inter: list[tuple[int, ...]] = []
    intra: list[tuple[int, ...]] = []
    for members in group_ranks(layout).expert:
        nodes = _groups(len(members), lambda i: members[i] // devices_per_node)
        if len(nodes) < 2 or len({len(n) for n in nodes}) > 1 or len(nodes[0]) < min_per_node:
            raise PlanError(f"comm.dispatcher: the hierarchical and dedup dispatchers need the expert group "
                            f"{members} to have the same number (≥{min_per_node}) of ranks on each of several "
                            f"nodes of {devices_per_node} devices")
        intra += [tuple(members[i] for i in n) for n in nodes]
        inter += [tuple(members[n[j]] for n in nodes) for j in range(len(nodes[0]))]
    return tuple(inter), tuple(intra)


def spans_nodes(layout: PlanLayout, devices_per_node: int) -> bool:
    """Whether the expert groups reach over more than one node of ``devices_per_node`` ranks."""
    return any(len({r // devices_per_node for r in m}) > 1 for m in group_ranks(layout).expert)


def make_node_groups(layout: PlanLayout, devices_per_node: int, groups: ParallelGroups, *, min_per_node: int = 2,
                     timeout: timedelta = DEFAULT_GROUP_TIMEOUT) -> ParallelGroups:
    """``groups`` with this rank's ``expert_inter`` and ``expert_intra`` groups (:func:`expert_node_ranks`; None for
    a group of one rank).

    Collective over the default process group, like :func:`make_groups`. Raises PlanError as expert_node_ranks."""
    rank = dist.get_rank()
    mine: dict[str, dist.ProcessGroup | None] = {}
    node_ranks = expert_node_ranks(layout, devices_per_node, min_per_node=min_per_node)
    for kind, ranks in zip(("expert_inter", "expert_intra"), node_ranks):
        mine[kind] = None
        for members in ranks:
            if len(members) > 1:
                group = dist.new_group(list(members), timeout=timeout)
                if rank in members:
                    mine[kind] = group
    return replace(groups, **mine)


#: (GroupRanks kind, comm class) of the groups the layers run collectives on; the first class wins for a member set
#: two kinds share (cost_models/sharding.py prices the routing statistics over tp_cp and the expert-TP gathers as EP)
IN_LAYER_KINDS = (("cp", "cp"), ("tp", "tp"), ("tp_cp", "ep"), ("expert", "ep"), ("etp", "ep"))


@dataclass(frozen=True)
class StreamGroups:
    """A second process group for each in-layer group of this rank (same members), on which the backward half of an
    ``OVERLAP_F_B`` pair runs its collectives while the forward half uses the first set
    (moeplan.runtime.overlap): collectives of the two halves are then never interleaved on one group, so their
    order can differ between ranks. ``clones`` and ``classes`` are keyed by the group's global ranks (ascending)."""

    clones: Mapping[tuple[int, ...], dist.ProcessGroup]
    classes: Mapping[tuple[int, ...], str]


def make_stream_groups(layout: PlanLayout, node_ranks: tuple[Ranks, Ranks] | None = None, *,
                       timeout: timedelta = DEFAULT_GROUP_TIMEOUT) -> StreamGroups:
    """Create the :class:`StreamGroups` of ``layout`` (plus the expert node groups ``node_ranks`` of
    :func:`expert_node_ranks`, comm class ep). Collective over the default process group, like :func:`make_groups`:
    every rank calls ``new_group`` for every distinct member set of more than one rank, in the same order."""
    rank, ranks = dist.get_rank(), group_ranks(layout)
    sets: dict[tuple[int, ...], str] = {}
    for kind, cls in IN_LAYER_KINDS:
        for members in getattr(ranks, kind):
            sets.setdefault(members, cls)
    for members in (node_ranks[0] + node_ranks[1]) if node_ranks else ():
        sets.setdefault(members, "ep")
    clones: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for members in sets:
        if len(members) > 1:
            group = dist.new_group(list(members), timeout=timeout)
            if rank in members:
                clones[members] = group
    return StreamGroups(clones=clones, classes={m: sets[m] for m in clones})
