"""Expert placement policies: which logical experts each rank of the expert-parallel group holds (numpy only).

Vocabulary. A MoE layer has ``E`` logical (routed) experts. The expert-parallel group has ``n`` ranks, called
*shards* here as in ``passes/place_experts.py``; each shard holds *slots*, and each slot holds one physical copy of
a logical expert. A logical expert held by several slots has *replicas*; the router's tokens for it are then split
evenly between them. Loads are routed-token counts (or any non-negative weight proportional to them).

Policies (:func:`place` runs one on every MoE layer and returns a :class:`Placement`):

- ``contiguous`` — shard ``i`` holds experts ``[i·E/n, (i+1)·E/n)``: Megatron-LM's ``local_expert_indices`` and the
  ``place-experts`` pass v1. Ignores the load.
- ``greedy`` — MindSpeed's light greedy (docs/references.md §3.7): heaviest expert first, each to the least-loaded
  shard that still has a free slot, ``E/n`` slots per shard, no replicas.
- ``eplb`` — DeepSeek's Expert Parallelism Load Balancer (github.com/deepseek-ai/EPLB, MIT licence), ported from
  torch to numpy: replicates hot experts to ``num_replicas`` physical experts and packs them on GPUs, keeping whole
  expert groups on one node when it can.

Scoring (tokens per rank, imbalance) lives in moeplan.expert_load; :attr:`LayerPlacement.extra_slots` gives the
memory of replicas in expert slots per rank.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

Policy = Literal["contiguous", "greedy", "eplb"]
POLICIES: tuple[Policy, ...] = ("contiguous", "greedy", "eplb")
_EVEN = "each shard holds num_experts/num_shards experts"


@dataclass(frozen=True)
class LayerPlacement:
    """One MoE layer's placement: ``shards[s]`` lists the logical expert ids in shard ``s``'s slots, in slot order.

    A logical expert may sit in several slots (replicas, on one shard or several); every expert in
    ``[0, num_experts)`` has at least one slot. Raises ValueError when an id is out of range or an expert has no
    slot. Build it with Python ints.
    """

    num_experts: int
    shards: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts={self.num_experts}: must be ≥ 1")
        if not self.shards:
            raise ValueError("shards=(): must hold at least one shard")
        held = {e for shard in self.shards for e in shard}
        outside = sorted(e for e in held if not 0 <= e < self.num_experts)
        if outside:
            raise ValueError(f"shards expert={outside[0]}: must be in [0, {self.num_experts})")
        missing = sorted(set(range(self.num_experts)) - held)
        if missing:
            raise ValueError(f"shards missing={missing[:8]}: every logical expert needs at least one slot")

    @property
    def num_shards(self) -> int:
        """Ranks of the expert-parallel group."""
        return len(self.shards)

    @property
    def slots_per_shard(self) -> tuple[int, ...]:
        """Expert slots (physical experts) on each shard, ``[num_shards]``."""
        return tuple(len(shard) for shard in self.shards)

    @property
    def extra_slots(self) -> int:
        """Expert slots per rank beyond one copy of each expert: max slots per shard − ⌈E/n⌉ (≥ 0).

        ⌈E/n⌉ is what a placement without replicas needs on its fullest rank, so this is the replica memory a
        caller must price, in experts' weights (and their gradients and optimizer states) per rank.
        """
        return max(0, max(self.slots_per_shard) - -(-self.num_experts // self.num_shards))

    def replicas(self) -> np.ndarray:
        """Slots holding each logical expert, ``[num_experts]`` int64, every entry ≥ 1."""
        held = [e for shard in self.shards for e in shard]
        return np.bincount(np.asarray(held, dtype=np.int64), minlength=self.num_experts)


@dataclass(frozen=True)
class Placement:
    """A policy's placement of every MoE layer: ``status`` "ok" with one :class:`LayerPlacement` per layer, or
    "not-applicable" with ``reason`` (one line, ``field=value: rule``) and no layers."""

    policy: Policy
    status: Literal["ok", "not-applicable"]
    reason: str = ""
    layers: tuple[LayerPlacement, ...] = ()

    @property
    def extra_slots(self) -> int:
        """Replica slots per rank on the fullest layer (:attr:`LayerPlacement.extra_slots`); 0 without layers."""
        return max((layer.extra_slots for layer in self.layers), default=0)


# ---- argument checks -----------------------------------------------------------------------------------------------
def _loads(value: object, ndim: int, field: str, dtype: type = np.float64) -> np.ndarray:
    """``value`` as a ``dtype`` array of ``ndim`` dimensions, non-empty, finite and ≥ 0; else ValueError."""
    a = np.asarray(value, dtype=dtype)
    if a.ndim != ndim or a.size == 0:
        raise ValueError(f"{field} shape={a.shape}: must be a non-empty {ndim}-D array")
    if not np.isfinite(a).all() or (a < 0).any():
        raise ValueError(f"{field}={a.min() if np.isfinite(a).all() else 'non-finite'}: loads must be finite and ≥ 0")
    return a


def _count(value: object, field: str) -> int:
    """``value`` as an int ≥ 1; else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{field}={value!r}: must be an integer ≥ 1")
    return int(value)


def _multiple(field: str, value: int, of: str, divisor: int, why: str) -> str:
    """The one-line reason when ``value`` is not a multiple of ``divisor``, else ""."""
    return f"{field}={value}: must be a multiple of {of}={divisor} ({why})" if value % divisor else ""


def _eplb_reason(num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> str:
    """Why EPLB cannot run on these sizes (the original's asserts, per policy), or "" when it can."""
    if num_replicas < num_experts:
        return f"num_replicas={num_replicas}: must be ≥ num_experts={num_experts} (each expert needs a slot)"
    reason = _multiple("num_replicas", num_replicas, "num_gpus", num_gpus, "equal slots per GPU")
    if not reason and num_groups % num_nodes == 0:  # the hierarchical policy
        reason = (_multiple("num_experts", num_experts, "num_groups", num_groups, "equal expert groups")
                  or _multiple("num_gpus", num_gpus, "num_nodes", num_nodes, "equal GPUs per node"))
    return reason


def _layer(num_experts: int, shards: object) -> LayerPlacement:
    """A :class:`LayerPlacement` from rows of integer ids (numpy or Python)."""
    return LayerPlacement(num_experts, tuple(tuple(int(e) for e in shard) for shard in shards))


# ---- contiguous and greedy -----------------------------------------------------------------------------------------
def contiguous(num_experts: int, num_shards: int) -> LayerPlacement:
    """Shard ``i`` holds experts ``[i·E/n, (i+1)·E/n)`` (Megatron-LM's ``local_expert_indices``).

    Raises ValueError when a count is not an integer ≥ 1 or ``num_shards`` does not divide ``num_experts``.
    """
    e, n = _count(num_experts, "num_experts"), _count(num_shards, "num_shards")
    reason = _multiple("num_experts", e, "num_shards", n, _EVEN)
    if reason:
        raise ValueError(reason)
    return _layer(e, (range(i * e // n, (i + 1) * e // n) for i in range(n)))


def _lpt_pack(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing of ``weight [n]`` into ``num_packs`` packs of ``n/num_packs`` items: items by weight, heaviest
    first (ties: lower index first), each to the lightest pack with a free slot (ties: lower pack index). Returns
    ``pack_index [n]`` and ``rank_in_pack [n]`` (the order items entered their pack), int64. Pack loads accumulate in
    ``weight.dtype``. The heap of (load, pack) pairs picks exactly the pack that ``min(open packs, key=load)`` picks
    in the MindSpeed and EPLB loops, in O(n log m) instead of O(n·m)."""
    per = weight.size // num_packs
    pack_index = np.empty(weight.size, dtype=np.int64)
    rank_in_pack = np.empty(weight.size, dtype=np.int64)
    heap = [(weight.dtype.type(0), p, 0) for p in range(num_packs)]  # (load, pack, items): sorted, so a heap
    for item in np.argsort(-weight, kind="stable"):
        load, p, items = heapq.heappop(heap)
        pack_index[item], rank_in_pack[item] = p, items
        if items + 1 < per:
            heapq.heappush(heap, (load + weight[item], p, items + 1))
    return pack_index, rank_in_pack


def greedy(load: object, num_shards: int) -> LayerPlacement:
    """MindSpeed's light greedy placement of one layer's experts, ``E/n`` slots per shard and no replicas.

    ``load [E]``: predicted tokens per logical expert (≥ 0). Experts are taken heaviest first and each goes to the
    least-loaded shard that still has a free slot. Ties, deterministic: equal loads keep expert-id order (lower id
    first), equal shard loads go to the lower shard index; each shard lists its experts in ascending id order.

    Source: ``ExpertDynamicplacement.expert_placement_greedy`` in Ascend/MindSpeed
    ``mindspeed/core/transformer/moe/expert_placement/planner.py`` (commit 028de58c), whose Python ``sorted(...,
    reverse=True)`` is stable, whose strict ``<`` scan picks the first least-loaded device, and whose device→experts
    map lists experts in id order; the method of the Pangu Ultra MoE report (arXiv 2505.04519; docs/references.md
    §3.7). Loads are summed in float64.

    Raises ValueError when ``load`` is not a non-empty 1-D array of finite loads ≥ 0, ``num_shards`` is not an
    integer ≥ 1 or does not divide ``E``.
    """
    w = _loads(load, 1, "load")
    n = _count(num_shards, "num_shards")
    reason = _multiple("num_experts", w.size, "num_shards", n, _EVEN)
    if reason:
        raise ValueError(reason)
    pack_index, _ = _lpt_pack(w, n)
    return _layer(w.size, (np.flatnonzero(pack_index == s) for s in range(n)))


# ---- EPLB ----------------------------------------------------------------------------------------------------------
def balanced_packing(weight: object, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """EPLB's ``balanced_packing``: pack ``n`` weighted items into ``num_packs`` packs of exactly ``n/num_packs``
    items each, heaviest first to the lightest pack with room.

    ``weight [X, n]`` (float32, as in the original's call path). Returns ``pack_index [X, n]`` (pack of each item)
    and ``rank_in_pack [X, n]`` (the order it entered the pack), int64. With one item per pack, item ``i`` goes to
    pack ``i`` (the original's shortcut). Ties: equal weights in index order, equal pack loads to the lower pack.
    Port of deepseek-ai/EPLB ``eplb.py`` (commit d52c72d5; MIT licence, notice in :func:`rebalance_experts`).

    Raises ValueError when ``weight`` is not a non-empty 2-D array of finite loads ≥ 0, or ``num_packs`` is not an
    integer ≥ 1 that divides ``n``.
    """
    w = _loads(weight, 2, "weight", np.float32)
    m = _count(num_packs, "num_packs")
    reason = _multiple("items", w.shape[1], "num_packs", m, "equal items per pack")
    if reason:
        raise ValueError(reason)
    if w.shape[1] == m:
        return np.broadcast_to(np.arange(m, dtype=np.int64), w.shape).copy(), np.zeros(w.shape, dtype=np.int64)
    packed = [_lpt_pack(row, m) for row in w]
    return np.stack([p for p, _ in packed]), np.stack([r for _, r in packed])


def replicate_experts(weight: object, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB's ``replicate_experts``: grow ``num_log`` logical experts to ``num_phy`` physical ones, each new replica
    going to the expert with the largest load per replica (ties: the lower expert id), which minimises the maximum
    load per replica.

    ``weight [X, num_log]`` (float32). Returns ``phy2log [X, num_phy]`` (logical expert of each physical one; the
    first ``num_log`` are the experts themselves), ``rank [X, num_phy]`` (replica index within its expert) and
    ``logcnt [X, num_log]`` (replicas per logical expert), int64. Port of deepseek-ai/EPLB ``eplb.py`` (commit
    d52c72d5; MIT licence, notice in :func:`rebalance_experts`).

    Raises ValueError when ``weight`` is not a non-empty 2-D array of finite loads ≥ 0, or ``num_phy`` is not an
    integer ≥ ``num_log``.
    """
    w = _loads(weight, 2, "weight", np.float32)
    layers, num_log = w.shape
    if _count(num_phy, "num_phy") < num_log:
        raise ValueError(f"num_phy={num_phy}: must be ≥ num_log={num_log}")
    phy2log = np.tile(np.arange(num_phy, dtype=np.int64), (layers, 1))
    rank = np.zeros((layers, num_phy), dtype=np.int64)
    logcnt = np.ones((layers, num_log), dtype=np.int64)
    rows = np.arange(layers)
    for i in range(num_log, num_phy):
        redundant = np.argmax(w / logcnt.astype(np.float32), axis=-1)  # float32 like torch; first max on ties
        phy2log[:, i] = redundant
        rank[:, i] = logcnt[rows, redundant]
        logcnt[rows, redundant] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse of permutations ``perm [X, n]``."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def _hierarchical(weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int,
                  num_gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB's ``rebalance_experts_hierarchical`` on float32 ``weight [L, E]`` (sizes checked by the caller): returns
    ``phy2log [L, R]``, ``phyrank [L, R]``, ``logcnt [L, E]``. "mlog" numbers experts node by node (the experts of
    node ``k`` are ``[k·E/nodes, (k+1)·E/nodes)``), "pphy" numbers physical experts GPU by GPU."""
    layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    per_node = num_logical // num_nodes
    phy_per_gpu = num_physical // num_gpus

    # Step 1: pack expert groups to nodes.
    tokens_per_group = weight.reshape(layers, num_groups, group_size).sum(-1)
    group_pack, group_rank = balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size)[..., None]
                + np.arange(group_size)).reshape(layers, num_logical)
    mlog2log = _inverse(log2mlog)

    # Step 2: replicate experts within each node; rows are (layer, node) pairs.
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, -1).reshape(-1, per_node)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_physical // num_nodes)

    # Step 3: pack the physical experts of each node to its GPUs.
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt.astype(np.float32), phy2mlog, -1)
    pack_index, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    pphy2phy = _inverse(pack_index * phy_per_gpu + rank_in_pack)

    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, -1)
    pphy2mlog = (pphy2mlog.reshape(layers, num_nodes, -1)
                 + np.arange(0, num_logical, per_node).reshape(1, -1, 1)).reshape(layers, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, -1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, -1).reshape(layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(layers, -1), log2mlog, -1)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(weight: object, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek's EPLB entry point, ported from torch to numpy (same algorithm, float32 arithmetic, same ties).

    ``weight [L, E]``: load per layer and logical expert (tokens, ≥ 0). ``num_replicas``: physical experts per layer
    (R ≥ E, a multiple of ``num_gpus``); ``num_groups``: expert groups of group-limited routing; ``num_nodes``:
    server nodes (fast intra-node links); ``num_gpus``: ranks of the expert-parallel group.

    When ``num_groups % num_nodes == 0`` the hierarchical policy runs: pack expert groups to nodes (balanced), then
    replicate experts within each node, then pack each node's physical experts to its GPUs; else the global policy
    (the same with one group and one node). Returns ``phy2log [L, R]`` (logical expert of each physical expert;
    GPU ``g`` holds ``phy2log[:, g·R/num_gpus:(g+1)·R/num_gpus]``), ``log2phy [L, E, max replicas]`` (physical ids
    of each expert's replicas, padded with −1) and ``logcnt [L, E]`` (replicas per expert), int64.

    Raises ValueError when ``weight`` is not a non-empty 2-D array of finite loads ≥ 0, a count is not an integer
    ≥ 1, or the sizes break the original's asserts (R < E, R not a multiple of ``num_gpus``; hierarchical: E not a
    multiple of ``num_groups`` or ``num_gpus`` not a multiple of ``num_nodes``).

    Source: https://github.com/deepseek-ai/EPLB ``eplb.py`` (commit d52c72d5, March 2025), ``rebalance_experts``,
    ``rebalance_experts_hierarchical``, ``replicate_experts`` and ``balanced_packing``, under this licence:

        MIT License

        Copyright (c) 2025 DeepSeek

        Permission is hereby granted, free of charge, to any person obtaining a copy
        of this software and associated documentation files (the "Software"), to deal
        in the Software without restriction, including without limitation the rights
        to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
        copies of the Software, and to permit persons to whom the Software is
        furnished to do so, subject to the following conditions:

        The above copyright notice and this permission notice shall be included in all
        copies or substantial portions of the Software.

        THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
        IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
        FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
        AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
        LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
        OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
        SOFTWARE.
    """
    w = _loads(weight, 2, "weight", np.float32)
    counts = [_count(v, f) for v, f in ((num_replicas, "num_replicas"), (num_groups, "num_groups"),
                                        (num_nodes, "num_nodes"), (num_gpus, "num_gpus"))]
    reason = _eplb_reason(w.shape[1], *counts)
    if reason:
        raise ValueError(reason)
    replicas, groups, nodes, gpus = counts
    if groups % nodes == 0:
        phy2log, phyrank, logcnt = _hierarchical(w, replicas, groups, nodes, gpus)
    else:
        phy2log, phyrank, logcnt = _hierarchical(w, replicas, 1, 1, gpus)
    layers, num_logical = w.shape
    maxcnt = int(logcnt.max())
    log2phy = np.full((layers, num_logical * maxcnt), -1, dtype=np.int64)
    np.put_along_axis(log2phy, phy2log * maxcnt + phyrank,
                      np.broadcast_to(np.arange(replicas, dtype=np.int64), (layers, replicas)), axis=1)
    return phy2log, log2phy.reshape(layers, num_logical, maxcnt), logcnt


def eplb(weight: object, num_replicas: int, num_groups: int, num_nodes: int,
         num_gpus: int) -> tuple[LayerPlacement, ...]:
    """EPLB's placement (:func:`rebalance_experts`, same arguments and errors) as one :class:`LayerPlacement` per
    layer: GPU ``g``'s slots hold ``phy2log[l, g·R/num_gpus:(g+1)·R/num_gpus]``."""
    phy2log, _, _ = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    per = phy2log.shape[1] // num_gpus
    return tuple(_layer(np.shape(weight)[1], (row[g * per:(g + 1) * per] for g in range(num_gpus)))
                 for row in phy2log)


# ---- per model -----------------------------------------------------------------------------------------------------
def place(policy: Policy, load: object, num_shards: int, *, num_replicas: int | None = None, num_groups: int = 1,
          num_nodes: int = 1) -> Placement:
    """Run ``policy`` on every MoE layer of a model.

    ``load [L, E]``: predicted tokens per layer and logical expert (≥ 0; ``contiguous`` reads only its shape).
    ``num_shards``: ranks of the expert-parallel group. ``eplb`` only: ``num_replicas`` physical experts per layer
    (default ``E``: no replicas), ``num_groups`` and ``num_nodes`` as in :func:`rebalance_experts`.

    Returns status "not-applicable" with the one-line reason when the sizes do not fit the policy (``contiguous``
    and ``greedy``: ``num_shards`` must divide ``E``; ``eplb``: the rules of :func:`rebalance_experts`). Raises
    ValueError for a bad argument: an unknown policy, a load that is not a non-empty 2-D array of finite values
    ≥ 0, a count that is not an integer ≥ 1, or ``num_replicas`` ≠ ``E`` with a policy that does not replicate.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}: must be one of {list(POLICIES)}")
    w = _loads(load, 2, "load")
    n = _count(num_shards, "num_shards")
    num_experts = w.shape[1]
    replicas = num_experts if num_replicas is None else _count(num_replicas, "num_replicas")
    if policy != "eplb" and replicas != num_experts:
        raise ValueError(f"num_replicas={replicas}: only policy 'eplb' replicates experts (num_experts={num_experts})")
    if policy == "eplb":
        reason = _eplb_reason(num_experts, replicas, _count(num_groups, "num_groups"),
                              _count(num_nodes, "num_nodes"), n)
    else:
        reason = _multiple("num_experts", num_experts, "num_shards", n, _EVEN)
    if reason:
        return Placement(policy, "not-applicable", reason)
    if policy == "contiguous":
        layers = (contiguous(num_experts, n),) * w.shape[0]
    elif policy == "greedy":
        layers = tuple(greedy(row, n) for row in w)
    else:
        layers = eplb(w, replicas, num_groups, num_nodes, n)
    return Placement(policy, "ok", "", layers)


# ---- rebalancing while training ------------------------------------------------------------------------------------
DEFAULT_REBALANCE_THRESHOLD = 0.05
"""A layer's new placement is applied when it lowers the predicted device imbalance (max/mean − 1) by more than
0.05, i.e. the busiest expert rank by 5% of the mean (``moeplan run --rebalance-threshold``'s default, and the
``place-experts`` pass's when it prices rebalancing)."""


@dataclass(frozen=True)
class LayerRebalance:
    """One MoE layer at a rebalance (:func:`rebalance_layer`): the predicted device imbalance (max/mean − 1 of the
    window's routed token copies per expert rank) under the placement it had and under the planned one, whether the
    plan was applied (the gain exceeded the threshold), the logical experts that changed rank, and the placement
    from then on (expert-group rank -> logical experts by local slot)."""

    imbalance_before: float
    imbalance_after: float
    applied: bool
    moved: tuple[int, ...]
    placement: tuple[tuple[int, ...], ...]


def arrange(before: Sequence[Sequence[int]], planned: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """The planned expert sets ``planned[r]`` in slot order: an expert that stays on rank ``r`` keeps its slot of
    ``before``, the arrivals take the vacated slots in ascending expert order. Raises ValueError when a planned set
    has another size than the rank's slots."""
    out = []
    for r, (old, new) in enumerate(zip(before, planned)):
        if len(old) != len(new):
            raise ValueError(f"placement[{r}]={list(new)}: must hold {len(old)} experts, as the rank's slots")
        arrivals = iter(sorted(set(new) - set(old)))
        out.append(tuple(e if e in new else next(arrivals) for e in old))
    return tuple(out)


def rebalance_layer(load: object, before: Sequence[Sequence[int]], threshold: float) -> LayerRebalance:
    """One layer's rebalancing decision from its window ``load [E]`` (token copies per logical expert) and current
    placement ``before`` (one copy of each expert): the :func:`greedy` placement in ``before``'s slots
    (:func:`arrange`), applied when it lowers the predicted imbalance (moeplan.expert_load.imbalance) by more than
    ``threshold``. ``placement`` is the layer's placement from then on either way. The decision of
    ``moeplan run --rebalance-every`` (moeplan.runtime.rebalance) and of its price (moeplan.load_model)."""
    from moeplan.expert_load import imbalance, rank_tokens

    before = tuple(tuple(int(e) for e in s) for s in before)
    planned = arrange(before, greedy(load, len(before)).shards)
    was, will = (float(imbalance(rank_tokens(np.asarray(load, dtype=np.float64)[None], p))[0])
                 for p in (before, planned))
    applied = was - will > threshold
    moved = tuple(sorted(e for r, s in enumerate(planned) for e in s if e not in before[r])) if applied else ()
    return LayerRebalance(imbalance_before=was, imbalance_after=will, applied=applied, moved=moved,
                          placement=planned if applied else before)
