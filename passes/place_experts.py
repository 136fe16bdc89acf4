"""Pass ``place-experts``: which routed experts live on which rank of the expert group (docs/load-balance.md).

``policy=contiguous`` (the default): expert shard ``i`` of ``n = ep·tp/etp`` holds experts ``[i·E/n, (i+1)·E/n)``
— Megatron-LM's ``local_expert_indices``. With MoGE routing (Pangu Pro MoE, arXiv 2505.21411 §3.1) the groups are
contiguous too, so when ``n`` is a multiple or a divisor of the group count every group sits on whole shards and the
per-device load is balanced by construction (IS = 0); the pass records whether that holds.

With a load trace (``moeplan compile --expert-load``, :class:`moeplan.load_model.LoadModel`) each traced MoE layer
is placed from its predicted load: ``greedy`` (the Pangu Ultra MoE planner's and MindSpeed's: heaviest expert to
the least-loaded rank with a free slot) or ``eplb`` (DeepSeek EPLB's hierarchical packing, with ``replicas``
extra expert slots per rank for copies of the heaviest experts); ``contiguous`` keeps the ranges. The decision
records each layer's placement and its imbalance over the trace window (moeplan.load_model), the figures the
layout was priced with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moeplan.errors import LoadError, PlanError
from moeplan.placement import POLICIES, contiguous
from moeplan.state import ExpertPlacement, PlanState


@dataclass(frozen=True)
class PlaceExpertsPass:
    """Place routed experts on the expert-group ranks (see the module docstring). ``policy``: contiguous, greedy or
    eplb; ``replicas``: EPLB's extra expert slots per EP rank. Raises PlanError for another
    policy, replicas without eplb, or a load-aware policy without a load trace."""

    name: ClassVar[str] = "place-experts"
    requires: ClassVar[tuple[str, ...]] = ("sharding",)
    provides: ClassVar[tuple[str, ...]] = ("experts",)
    policy: str = "contiguous"
    replicas: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise PlanError(f"place-experts{{policy={self.policy}}}: must be one of {', '.join(POLICIES)}")
        if self.replicas < 0 or (self.replicas and self.policy != "eplb"):
            raise PlanError(f"place-experts{{replicas={self.replicas}}}: replica slots need policy=eplb and must "
                            f"be ≥ 0")

    def run(self, state: PlanState) -> PlanState:
        spec, n = state.graph.spec, state.layout.expert_shards
        if not spec.is_moe:
            return state.with_(experts=ExpertPlacement(shards=(), groups_aligned=True))
        g = spec.num_expert_groups if spec.routing == "moge" else 1
        aligned = g == 1 or n % g == 0 or g % n == 0
        if state.load is None:
            if self.policy != "contiguous":
                raise PlanError(f"place-experts{{policy={self.policy}}}: places experts by their load, which needs "
                                f"a load trace (--expert-load FILE)")
            load = None
        else:
            try:
                load = state.load.at(n, self.policy, self.replicas)
            except LoadError as e:
                raise PlanError(str(e)) from None
        return state.with_(experts=ExpertPlacement(shards=contiguous(spec.num_experts, n).shards,
                                                   groups_aligned=aligned, load=load))
