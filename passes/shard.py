"""Pass ``shard``: price every layer kind under the layout — compute times, collectives, parameters and saved bytes
per device (cost_models/sharding.py: the work scaling per ShardHint, the training dtype, the layer's program).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moeplan.cost_models.layer_program import p2p_op
from moeplan.cost_models.sharding import layer_cost
from moeplan.state import PlanState, Sharding


@dataclass(frozen=True)
class ShardPass:
    """Price every layer kind under the layout: compute times, collectives, params and saved bytes per device."""

    name: ClassVar[str] = "shard"
    requires: ClassVar[tuple[str, ...]] = ()
    provides: ClassVar[tuple[str, ...]] = ("sharding",)

    def run(self, state: PlanState) -> PlanState:
        g, lay, tgt = state.graph, state.layout, state.target
        costs = {kind: layer_cost(lg, spec=g.spec, layout=lay, target=tgt, dispatcher=state.strategy.dispatcher,
                                  precision=state.strategy.precision)
                 for kind, lg in g.layers.items()}
        return state.with_(sharding=Sharding(layer_costs=costs, p2p=p2p_op(g.spec, lay, tgt)))
