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
layout was priced with. ``rebalance_every=N`` prices a run that re-places the experts every N steps
(``moeplan run --rebalance-every``, which then takes N from the plan): the trace is replayed as the runtime would
rebalance it, and moeplan.compile prices the migrations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moeplan.errors import LoadError, PlanError
from moeplan.placement import DEFAULT_REBALANCE_THRESHOLD, POLICIES, contiguous
from moeplan.state import ExpertPlacement, PlanState


@dataclass(frozen=True)
class PlaceExpertsPass:
    """Place routed experts on the expert-group ranks (see the module docstring). ``policy``: contiguous, greedy or
    eplb; ``replicas``: EPLB's extra expert slots per EP rank; ``rebalance_every``: steps between rebalances while
    training (0: never) and ``rebalance_threshold`` the imbalance gain a layer's new placement must exceed. Raises
    PlanError for another policy, replicas without eplb or with rebalancing, a negative ``rebalance_every`` or
    ``rebalance_threshold``, or a load-aware policy or rebalancing without a load trace."""

    name: ClassVar[str] = "place-experts"
    requires: ClassVar[tuple[str, ...]] = ("sharding",)
    provides: ClassVar[tuple[str, ...]] = ("experts",)
    policy: str = "contiguous"
    replicas: int = 0
    rebalance_every: int = 0
    rebalance_threshold: float = DEFAULT_REBALANCE_THRESHOLD

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise PlanError(f"place-experts{{policy={self.policy}}}: must be one of {', '.join(POLICIES)}")
        if self.replicas < 0 or (self.replicas and self.policy != "eplb"):
            raise PlanError(f"place-experts{{replicas={self.replicas}}}: replica slots need policy=eplb and must "
                            f"be ≥ 0")
        if self.rebalance_every < 0 or not self.rebalance_threshold >= 0:
            raise PlanError(f"place-experts{{rebalance_every={self.rebalance_every}, rebalance_threshold="
                            f"{self.rebalance_threshold}}}: must be ≥ 0 (rebalance_every 0: never)")
        if self.rebalance_every and self.replicas:
            raise PlanError(f"place-experts{{replicas={self.replicas}}}: rebalancing moves each expert's one copy; "
                            f"it takes no replicas")

    @property
    def placing(self) -> tuple[str, int, int, float]:
        """The arguments of moeplan.load_model.LoadModel.at after the shard count."""
        return self.policy, self.replicas, self.rebalance_every, self.rebalance_threshold

    def run(self, state: PlanState) -> PlanState:
        spec, n = state.graph.spec, state.layout.expert_shards
        if not spec.is_moe:
            return state.with_(experts=ExpertPlacement(shards=(), groups_aligned=True))
        g = spec.num_expert_groups if spec.routing == "moge" else 1
        aligned = g == 1 or n % g == 0 or g % n == 0
        if state.load is None:
            if self.policy != "contiguous" or self.rebalance_every:
                what = f"policy={self.policy}" if self.policy != "contiguous" else \
                    f"rebalance_every={self.rebalance_every}"
                raise PlanError(f"place-experts{{{what}}}: places experts by their load, which needs a load trace "
                                f"(--expert-load FILE)")
            load = None
        else:
            try:
                load = state.load.at(n, *self.placing)
            except LoadError as e:
                raise PlanError(str(e)) from None
        return state.with_(experts=ExpertPlacement(shards=contiguous(spec.num_experts, n).shards,
                                                   groups_aligned=aligned, load=load))
