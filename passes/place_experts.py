"""Pass ``place-experts`` v1: which routed experts live on which rank of the expert group.

Contiguous placement: expert shard ``i`` of ``n = ep·tp/etp`` holds experts ``[i·E/n, (i+1)·E/n)`` — Megatron-LM's
``local_expert_indices``. With MoGE routing (Pangu Pro MoE, arXiv 2505.21411 §3.1) the groups are contiguous too, so
when ``n`` is a multiple or a divisor of the group count every group sits on whole shards and the per-device load is
balanced by construction (IS = 0); the pass records whether that holds. Load-aware placement from a routing
histogram (MindSpeed's greedy, docs/references.md §3.7) is a later version.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moeplan.state import ExpertPlacement, PlanState


def contiguous_placement(num_experts: int, num_shards: int) -> tuple[tuple[int, ...], ...]:
    """Experts per shard, contiguous ranges; ``num_shards`` must divide ``num_experts`` (checked by the layout)."""
    per = num_experts // num_shards
    return tuple(tuple(range(i * per, (i + 1) * per)) for i in range(num_shards))


@dataclass(frozen=True)
class PlaceExpertsPass:
    """Place routed experts on the expert-group ranks (see the module docstring)."""

    name: ClassVar[str] = "place-experts"
    requires: ClassVar[tuple[str, ...]] = ("sharding",)
    provides: ClassVar[tuple[str, ...]] = ("experts",)

    def run(self, state: PlanState) -> PlanState:
        spec, n = state.graph.spec, state.layout.expert_shards
        if not spec.is_moe:
            return state.with_(experts=ExpertPlacement(shards=(), groups_aligned=True))
        g = spec.num_expert_groups if spec.routing == "moge" else 1
        aligned = g == 1 or n % g == 0 or g % n == 0
        return state.with_(experts=ExpertPlacement(shards=contiguous_placement(spec.num_experts, n),
                                                   groups_aligned=aligned))
