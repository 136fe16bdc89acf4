"""Communication cost model: α–β time of collectives per link tier (docs/architecture.md §5 "comm", docs/references.md §2).

Byte convention (the one ``CommOp`` in moeplan/state.py uses): ``bytes`` is the per-rank payload, the tensor ONE rank
holds BEFORE the op — the full input of an all-reduce or reduce-scatter, the local shard of an all-gather, the send
buffer of an all-to-all, the message of a p2p transfer. With ``n`` ranks, ``B = link bandwidth · efficiency.comm``
(bytes/s) and ``α = link latency`` (s), the bandwidth-optimal ring / pairwise algorithms take::

    all_reduce      2(n−1)/n · S/B + 2(n−1)·α      (ring: reduce-scatter then all-gather)
    reduce_scatter   (n−1)/n · S/B +  (n−1)·α      (S = the full input)
    all_gather        (n−1)  · S/B +  (n−1)·α      (S = the shard; the output is n·S)
    all_to_all       (n−1)/n · S/B +  (n−1)·α      (pairwise exchange; S = the send buffer)
    p2p                        S/B +        α

plus ``target.launch.collective_s`` per op; a group of one rank or an empty payload costs 0. A calibrated target may
list a measured 2-rank latency per kind (``launch.collective_latency_s``), which then replaces ``steps·α +
collective_s``, scaled by the kind's α steps at n ranks over those at 2. Sources: Thakur,
Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH", IJHPCA 19(1), 2005, §2–4
(the α–β costs of ring/recursive algorithms); NCCL's performance notes (nccl-tests ``doc/PERFORMANCE.md``: bus
bandwidth = algorithm bandwidth × 2(n−1)/n for all-reduce, (n−1)/n for all-gather / reduce-scatter).

``B`` is the per-device (aggregate, unidirectional) bandwidth of the tier: what NCCL's rings over NVSwitch and HCCL's
mesh algorithms over the HCCS full mesh attain; a single HCCS link is a seventh of it. Ranks are laid out TP
innermost (moeplan/layout.py), so a group is described by its rank ``stride`` and size; a ring over a group that
spans nodes runs at the inter-node tier (each step waits for its slowest hop), which :func:`group_tier` decides.
EP all-to-alls split their traffic over both tiers instead (:func:`all_to_all_time_s`).
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Literal

from moeplan.targets import Link, Target

CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]
Tier = Literal["intra", "inter"]


def _check_group(*, bytes: float, group_size: int) -> None:
    if bytes < 0:
        raise ValueError(f"bytes={bytes!r}: must be >= 0")
    if group_size < 1:
        raise ValueError(f"group_size={group_size!r}: must be a positive integer")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")


def _link(target: Target, tier: Tier) -> Link:
    if tier == "intra":
        return target.intra_node
    if tier == "inter":
        return target.inter_node
    raise ValueError(f"tier={tier!r}: must be 'intra' or 'inter'")


def _volume_and_steps(kind: CollectiveKind, n: int) -> tuple[float, int]:
    """(multiple of S/B each rank sends, number of latency steps) of the algorithm (Thakur et al. 2005)."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n, 2 * (n - 1)
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) / n, n - 1
    if kind == "all_gather":
        return float(n - 1), n - 1
    if kind == "p2p":
        return 1.0, 1
    raise ValueError(f"kind={kind!r}: must be one of all_reduce, all_gather, reduce_scatter, all_to_all, p2p")


def wire_bytes(*, kind: CollectiveKind, bytes: float, group_size: int) -> float:
    """Bytes one rank sends for one collective of ``kind`` (per-rank payload ``bytes``, module doc) over
    ``group_size`` ranks by the ring / pairwise algorithms: the volume factor of the module doc's table times
    ``bytes`` (the algorithm bandwidth to bus bandwidth factors of nccl-tests ``doc/PERFORMANCE.md``); 0 for one rank.
    An all-to-all's factor assumes equal parts to every member (balanced routing). Raises ValueError as
    :func:`collective_time_s`."""
    _check_group(bytes=bytes, group_size=group_size)
    return _volume_and_steps(kind, group_size)[0] * bytes if group_size > 1 else 0.0


def collective_time_s(*, kind: CollectiveKind, bytes: float, group_size: int, tier: Tier, target: Target) -> float:
    """Seconds for one collective of ``kind`` over ``group_size`` ranks on link ``tier`` (formulas in the module doc).

    ``bytes``: per-rank payload before the op (module doc). ``p2p`` is one transfer of ``bytes`` (any group_size ≥ 2).
    Returns 0 for ``group_size == 1`` or ``bytes == 0`` (no op is issued).

    Raises ValueError: unknown kind or tier, negative bytes, group_size < 1.
    """
    _check_group(bytes=bytes, group_size=group_size)
    volume, steps = _volume_and_steps(kind, group_size)
    link = _link(target, tier)
    if group_size == 1 or bytes == 0:
        return 0.0
    bandwidth = link.bandwidth_bytes_per_s * target.efficiency.comm
    measured = target.launch.collective_latency_s.get(kind)
    if measured is not None:  # a calibrated 2-rank latency, scaled by the algorithm's α steps
        return volume * bytes / bandwidth + measured * steps / _volume_and_steps(kind, 2)[1]
    return volume * bytes / bandwidth + steps * link.latency_s + target.launch.collective_s


def group_tier(*, stride: int, group_size: int, devices_per_node: int) -> Tier:
    """``"intra"`` if every group of ``group_size`` ranks at rank ``stride`` lies within one node, else ``"inter"``.

    A group ``{r, r+stride, …, r+stride·(n−1)}`` spans ``stride·(n−1)+1`` consecutive ranks. Aligned-node assumption:
    nodes hold ranks ``[k·devices_per_node, (k+1)·devices_per_node)`` and the groups of one stride tile the ranks in
    blocks of ``stride·n`` consecutive ranks (true for the TP/CP/DP/PP and EP groups of moeplan/layout.py). So every
    group is inside a node iff the span fits in a node AND the block ``stride·n`` divides ``devices_per_node``; when
    the span fits but the blocks do not (e.g. tp = 3 on 8-device nodes) some groups straddle two nodes, and since
    the collective runs in lock-step across groups the slowest (straddling) one sets the pace: ``"inter"``.

    Raises ValueError: a non-positive argument.
    """
    _check_positive(stride=stride, group_size=group_size, devices_per_node=devices_per_node)
    if group_size == 1:
        return "intra"
    span = stride * (group_size - 1) + 1
    fits = span <= devices_per_node and devices_per_node % (stride * group_size) == 0
    return "intra" if fits else "inter"


def local_peer_range(*, stride: int, group_size: int, devices_per_node: int) -> tuple[int, int]:
    """(min, max) over all ranks of the number of group members (itself included) on the rank's own node.

    Closed form for aligned groups (module doc of :func:`group_tier`); otherwise counted exactly over one period
    ``lcm(stride·n, devices_per_node)`` of the rank layout.

    Raises ValueError: a non-positive argument.
    """
    _check_positive(stride=stride, group_size=group_size, devices_per_node=devices_per_node)
    n, dpn = group_size, devices_per_node
    block = stride * n
    if dpn % block == 0:
        return n, n
    if block % dpn == 0 and dpn % stride == 0:
        local = dpn // stride
        return local, local
    if stride % dpn == 0:
        return 1, 1
    counts: list[int] = []
    for start in range(0, math.lcm(block, dpn), block):
        for offset in range(stride):
            nodes = Counter((start + offset + stride * j) // dpn for j in range(n))
            counts.extend(nodes.values())
    return min(counts), max(counts)


def all_to_all_time_s(*, bytes: float, group_size: int, stride: int, target: Target) -> float:
    """Seconds for a flat all-to-all (EP dispatch or combine) over a group that may span several nodes.

    ``bytes``: one rank's send buffer (e.g. ``tokens · topk · hidden · 2`` for a bf16 dispatch). Balanced routing:
    each rank sends ``S/n`` to every member. A rank with ``g`` members on its node (itself included) sends
    ``(g−1)/n · S`` over the intra-node link and ``(n−g)/n · S`` over its inter-node link::

        t = max((g−1)/n · S/B_intra + (g−1)·α_intra,  (n−g)/n · S/B_inter + (n−g)·α_inter) + launch.collective_s

    ``max``, not the sum: the two shares use different hardware (HCCS/NVLink vs the RoCE/IB NIC) and NCCL/HCCL post
    all peers' sends at once, so they proceed concurrently; the all-to-all ends when its slowest rank does (``g`` is
    taken at its extremes over ranks, :func:`local_peer_range`). Within one node (g = n) this is exactly
    ``collective_time_s("all_to_all", tier="intra")``; with one member per node exactly the inter-node one.

    Raises ValueError: negative bytes, non-positive group_size or stride.
    """
    _check_group(bytes=bytes, group_size=group_size)
    _check_positive(stride=stride)
    if group_size == 1 or bytes == 0:
        return 0.0
    n = group_size
    g_min, g_max = local_peer_range(stride=stride, group_size=n, devices_per_node=target.devices_per_node)
    if g_min == n:
        return collective_time_s(kind="all_to_all", bytes=bytes, group_size=n, tier="intra", target=target)
    eff = target.efficiency.comm
    intra, inter = target.intra_node, target.inter_node
    intra_s = (g_max - 1) / n * bytes / (intra.bandwidth_bytes_per_s * eff) + (g_max - 1) * intra.latency_s
    inter_s = (n - g_min) / n * bytes / (inter.bandwidth_bytes_per_s * eff) + (n - g_min) * inter.latency_s
    return max(intra_s, inter_s) + target.launch.collective_s


