"""The price of rebalancing experts while training (``moeplan run --rebalance-every N``; docs/load-balance.md §7).

Between two steps, every N steps, the runtime (moeplan.runtime.rebalance) does two things that take time:

1. **Counts.** The window's routed-token counts ``[MoE layers, experts]`` (int64) are all-reduced over the world:
   ``collective_time_s("all_reduce", bytes = L·E·8, group = world)`` on the tier the world spans.
2. **Migration.** Each moved expert's weights and optimizer state (the fp32 master copy and Adam's two moments)
   go to its new rank in one all-to-all over the expert group. Per expert ``3·h·f/etp`` parameters (``w1``,
   ``w3``, ``w2``, this rank's etp part) times the bytes of weight + master + moments per parameter
   (cost_models/memory.py ``state_bytes_per_param``). The PP stages migrate their own layers at the same time, so
   the busiest stage sets the time, and inside it the rank that sends or receives the most bytes ``S``:
   ``all_to_all_time_s(bytes = S·n/(n−1), group = n)`` (that function's ``bytes`` is a send buffer spread over
   all ``n`` members, ``(n−1)/n`` of it leaving the rank).

Not priced: planning the placements (the greedy of every layer, CPU-side), the two 16-byte all-reduces that
gather the record's times and bytes, and, with expert-DP > 1 and the distributed optimizer, the all-gather of the
changed layers' optimizer shards over expert-DP that the runtime does before sending
(moeplan.runtime.optimizer.DistributedAdamW.unsharded_states). The runtime's rows are fp32 whatever the training
dtype; this prices the plan's dtypes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moeplan.cost_models.comm import all_to_all_time_s, collective_time_s, group_tier
from moeplan.cost_models.layer_program import expert_group
from moeplan.cost_models.memory import state_bytes_per_param
from moeplan.layout import Layout
from moeplan.spec import ModelSpec
from moeplan.state import Precision
from moeplan.targets import Target

COUNT_BYTES = 8
"""An int64 token count (moeplan.runtime.rebalance.Rebalancer's window)."""


@dataclass(frozen=True)
class RebalanceCost:
    """One rebalance: ``count_s`` (the counts' all-reduce), ``migrate_s`` (the all-to-all of the moved experts) and
    ``sent_bytes`` (the busiest rank's larger of sent and received bytes, on the busiest stage), seconds and
    bytes."""

    count_s: float
    migrate_s: float
    sent_bytes: float

    @property
    def seconds(self) -> float:
        return self.count_s + self.migrate_s


def expert_state_bytes(spec: ModelSpec, layout: Layout, target: Target, precision: Precision) -> float:
    """Bytes one expert-group rank holds for one routed expert: its weights, master copy and Adam moments
    (``3·h·f/etp`` parameters; module docstring)."""
    p, _, o = state_bytes_per_param(target.dtype_bytes, precision, target.runtime.master_copy == "always")
    return 3 * spec.hidden_size * spec.moe_ffn_size / layout.etp * (p + o)


def rebalance_cost(*, spec: ModelSpec, layout: Layout, target: Target, precision: Precision,
                   stage_layers: Sequence[Sequence[int]], sent: np.ndarray, received: np.ndarray) -> RebalanceCost:
    """One rebalance (module docstring). ``stage_layers[s]``: the positions, in ``sent``/``received``'s first
    axis, of the traced MoE layers on PP rank ``s``; ``sent``/``received`` ``[layers, ranks]``: the experts each
    expert-group rank sends and receives in each layer. Raises ValueError for a layout without an expert group
    of at least two ranks."""
    n, stride = expert_group(layout)
    if n < 2:
        raise ValueError(f"expert_shards={n}: rebalancing needs an expert group of at least 2 ranks")
    per_expert = expert_state_bytes(spec, layout, target, precision)
    moved = max((max(sent[list(ls)].sum(axis=0).max(), received[list(ls)].sum(axis=0).max())
                 for ls in stage_layers if len(ls)), default=0)
    size = moved * per_expert
    world = layout.world_size
    tier = group_tier(stride=1, group_size=world, devices_per_node=target.devices_per_node)
    count_s = collective_time_s(kind="all_reduce", bytes=sent.shape[0] * spec.num_experts * COUNT_BYTES,
                                group_size=world, tier=tier, target=target)
    migrate_s = all_to_all_time_s(bytes=size * n / (n - 1), group_size=n, stride=stride, target=target)
    return RebalanceCost(count_s=count_s, migrate_s=migrate_s, sent_bytes=float(size))
