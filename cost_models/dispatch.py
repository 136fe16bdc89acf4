"""EP token dispatchers: bytes per link tier and time of one dispatch (or combine), docs/step-model.md §3.

The expert group has ``n`` ranks, ``g`` of them on each of ``n/g`` nodes (ranks are laid out TP innermost, so the
group's stride decides ``g``: :func:`moeplan.cost_models.comm.local_peer_range`). One rank dispatches ``T`` tokens
of ``h`` elements, each routed to ``top_k`` experts; routing is balanced (every expert gets ``T·top_k/E`` tokens in
expectation) and experts sit contiguously on the group's ranks (``place-experts``). ``p`` is the bytes per
element of the payload.

- **flat** (Megatron-LM ``alltoall``): every (token, expert) copy goes to the expert's rank: ``T·top_k·h·p`` sent,
  ``(n−g)/n`` of it off-node and ``(g−1)/n`` of it to the other ranks of the node. The two tiers run at once (NCCL
  posts all peers' sends together), so ``t = max(intra, inter)``.
- **hierarchical** (MindSpeed ``--moe-hierarchical-alltoallv``): an all-gather over the rank's peers on the other
  nodes (same position in each node) of the tokens and their routing (indices and probabilities), so every token
  crosses to each other node once (``(n/g − 1)·T·h·p`` off-node), then an all-to-all-v among the node's ``g``
  ranks of the copies routed to this node's experts (``top_k·T`` of them per rank under balanced routing:
  ``(g−1)/g`` of that over the intra-node link). The two steps run one after the other. Needs ``g > 1`` and more
  than one node. The combine mirrors it: all-to-all-v, then a reduce-scatter over the nodes.
- **dedup** (DeepEP's normal kernels; Megatron-LM's ``flex`` dispatcher): a token goes once to each remote node
  that holds at least one of its experts (over the inter-node link, to the rank with the same local index), and is
  forwarded over the intra-node link to the target ranks there; copies for the own node go over the intra-node
  link directly. Off-node: ``T·R·h·p`` with ``R`` the expected number of remote nodes a token's experts fall on
  (:func:`expected_bins_hit`); intra-node: the expected distinct target ranks per token, less the copies that land
  on the rank they arrive at (``1/g`` of them). RDMA and NVLink transfers are pipelined, so
  ``t = max(intra, inter)``.

Routing metadata travel with the tokens in the dedup and hierarchical dispatchers: ``top_k`` expert ids (int64)
and probabilities (fp32) per token, 12·top_k bytes (DeepEP ``topk_idx``/``topk_weights``; moeplan's fp32 runtime
sends a gate, an expert id and a keep flag per copy, also 12·top_k bytes). They go with the dispatch and with its
backward mirror (the gradient of the dispatched rows, routing columns included, returns the way they came), not
with the combine, which returns ``h`` values a row, nor with the combine's backward mirror (``metadata=False``).
The count exchange that sizes the dispatch is priced by moeplan.cost_models.layer_program.count_exchange.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import comb

from moeplan.cost_models.comm import all_to_all_time_s, collective_time_s, local_peer_range
from moeplan.state import Dispatcher
from moeplan.targets import Target

METADATA_BYTES_PER_EXPERT = 12  # int64 expert id + fp32 probability per routed copy (DeepEP topk_idx/topk_weights)


@dataclass(frozen=True)
class Routing:
    """How a token picks ``top_k`` of ``num_experts`` experts (moeplan.spec.ModelSpec's routing fields)."""

    num_experts: int
    top_k: int
    routing: str = "topk"  # topk | group_limited | moge
    num_groups: int = 1
    topk_groups: int = 1


@lru_cache(maxsize=4096)
def expected_bins_hit(routing: Routing, num_bins: int) -> float:
    """Expected number of distinct bins (nodes or ranks) that hold at least one of a token's ``top_k`` experts,
    when the experts are split contiguously into ``num_bins`` equal bins and routing is uniform:

    - ``topk``: a uniform ``k``-subset of ``E`` experts; a bin of ``b = E/bins`` experts is missed with probability
      ``C(E−b, k)/C(E, k)``.
    - ``group_limited`` (DeepSeek-V3's node-limited routing, arXiv 2412.19437 §2.1.2): ``M = topk_groups`` of ``G``
      contiguous groups are chosen uniformly, then ``k`` experts uniformly among their ``M·E/G``.
    - ``moge`` (Pangu Pro MoE, arXiv 2505.21411 §3.1): ``k/G`` experts uniformly inside each of the ``G`` groups.

    Raises ValueError if ``num_bins`` does not divide the experts.
    """
    e, k = routing.num_experts, routing.top_k
    if num_bins < 1 or e % num_bins:
        raise ValueError(f"num_bins={num_bins}: must divide num_experts ({e})")
    b = e // num_bins
    if routing.routing == "topk" or routing.num_groups == 1:
        return num_bins * (1 - comb(e - b, k) / comb(e, k))
    g = routing.num_groups
    per_group = e // g
    if routing.routing == "moge":
        kg = k // g
        if b >= per_group:  # a bin holds whole groups: always hit
            return float(num_bins)
        return num_bins * (1 - comb(per_group - b, kg) / comb(per_group, kg))
    m = routing.topk_groups
    pool = m * per_group
    if b <= per_group:  # a bin lies inside one group: hit if its group is chosen and one of its experts is picked
        return num_bins * (m / g) * (1 - comb(pool - b, k) / comb(pool, k))
    groups_in_bin = b // per_group  # j of the bin's groups chosen: hypergeometric over G groups, M draws
    total = 0.0
    for j in range(1, min(groups_in_bin, m) + 1):
        p_j = comb(groups_in_bin, j) * comb(g - groups_in_bin, m - j) / comb(g, m)
        total += p_j * (1 - comb(pool - j * per_group, k) / comb(pool, k))
    return num_bins * total


@dataclass(frozen=True)
class DispatchCost:
    """One dispatch (or its mirror, the combine) on one rank: bytes it sends over each tier, the seconds it holds
    each tier's stream, and its duration (``time_s``; the steps of a sequential dispatcher add up)."""

    dispatcher: Dispatcher
    wire_intra_bytes: float
    wire_inter_bytes: float
    busy_intra_s: float
    busy_inter_s: float
    time_s: float


def hierarchical_valid(*, group_size: int, stride: int, devices_per_node: int) -> bool:
    """The hierarchical dispatcher needs more than one rank of the expert group on a node and more than one node."""
    g_min, _ = local_peer_range(stride=stride, group_size=group_size, devices_per_node=devices_per_node)
    return 1 < g_min < group_size and group_size % g_min == 0


def _tier_time(nbytes: float, steps: int, tier: str, target: Target) -> float:
    link = target.intra_node if tier == "intra" else target.inter_node
    if nbytes <= 0:
        return 0.0
    return nbytes / (link.bandwidth_bytes_per_s * target.efficiency.comm) + steps * link.latency_s


def dispatch_cost(dispatcher: Dispatcher, *, tokens: float, hidden: int, payload_bytes: float, routing: Routing,
                  group_size: int, stride: int, target: Target, metadata: bool = True) -> DispatchCost:
    """Bytes per tier and time of one dispatch of ``tokens`` tokens by one rank (module docstring).

    ``payload_bytes``: bytes per element on the wire (2 for bf16; FP8 dispatch ≈ 1.03 with its scales);
    ``metadata``: whether the routing metadata travel with the rows (the dispatch and its backward mirror; not
    the combine and its mirror), for the hierarchical and dedup dispatchers;
    ``group_size``/``stride``: the expert group (``ep·tp/etp`` ranks at stride 1 with TP-extend-EP, else ``tp``).
    A group of one rank costs nothing. Raises ValueError for a dispatcher that does not fit the group (hierarchical
    within one node or with one rank per node) or an unknown name.
    """
    n = group_size
    if n == 1 or tokens <= 0:
        return DispatchCost(dispatcher, 0.0, 0.0, 0.0, 0.0, 0.0)
    g_min, g_max = local_peer_range(stride=stride, group_size=n, devices_per_node=target.devices_per_node)
    row = hidden * payload_bytes
    k = routing.top_k
    launch = target.launch.collective_s
    if dispatcher == "flat" or g_min == n and dispatcher == "dedup":
        send = tokens * k * row
        t = all_to_all_time_s(bytes=send, group_size=n, stride=stride, target=target)
        intra, inter = send * (g_max - 1) / n, send * (n - g_min) / n
        if g_min == n:
            return DispatchCost(dispatcher, intra, 0.0, t, 0.0, t)
        return DispatchCost(dispatcher, intra, inter, _tier_time(intra, g_max - 1, "intra", target) + launch,
                            _tier_time(inter, n - g_min, "inter", target) + launch, t)
    meta = k * METADATA_BYTES_PER_EXPERT if metadata else 0
    nodes = n // g_min
    if dispatcher == "dedup":
        remote_nodes = expected_bins_hit(routing, nodes) * (nodes - 1) / nodes
        ranks_hit = expected_bins_hit(routing, n)
        inter = tokens * remote_nodes * (row + meta)
        intra = tokens * ranks_hit * (g_min - 1) / g_min * (row + meta)
        t_in = _tier_time(intra, g_min - 1, "intra", target)
        t_out = _tier_time(inter, nodes - 1, "inter", target)
        return DispatchCost(dispatcher, intra, inter, t_in + launch, t_out + launch, max(t_in, t_out) + launch)
    if dispatcher == "hierarchical":
        if not hierarchical_valid(group_size=n, stride=stride, devices_per_node=target.devices_per_node):
            raise ValueError(f"dispatcher='hierarchical': needs an expert group of several ranks on each of several "
                             f"nodes (group {n} at stride {stride}, {target.devices_per_node} devices per node)")
        inter = tokens * (row + meta) * (nodes - 1)
        gather = collective_time_s(kind="all_gather", bytes=tokens * (row + meta), group_size=nodes, tier="inter",
                                   target=target)
        copies = tokens * k * row  # copies routed to this node's experts, per rank, under balanced routing
        intra = copies * (g_min - 1) / g_min
        a2a = collective_time_s(kind="all_to_all", bytes=copies, group_size=g_min, tier="intra", target=target)
        return DispatchCost(dispatcher, intra, inter, a2a, gather, gather + a2a)
    raise ValueError(f"dispatcher={dispatcher!r}: must be one of flat, hierarchical, dedup")
