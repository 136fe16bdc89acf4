"""What a load trace means for a layout: each MoE layer's placement under a policy and the busiest EP rank's load
(docs/load-balance.md).

The step model prices one micro-batch on one rank; with imbalanced routing the rank of the expert group that
receives the most routed copies sets the pace of the dispatch, the grouped GEMMs and the combine (every other rank
waits for it at the combine), and its activations are the ones that must fit (dropless routing). :class:`LoadModel`
turns a :class:`~moeplan.expert_load.LoadTrace` into that figure for a given expert-group size ``n``:

1. the predicted load of each layer is the trace window's mean count per expert;
2. the policy (moeplan.placement: ``contiguous``, ``greedy`` or ``eplb``) places
   the experts of each layer on the ``n`` ranks from that prediction;
3. for every step of the window, each rank's tokens are the counts of its experts (a replicated expert's split
   evenly over its copies); the layer's **ratio** is the mean over the steps of max/mean tokens per rank.

``Layout.expert_load`` is the mean ratio over the trace's layers: the layers of one kind share one price in the
step model, and a stage's time is the sum of its layers', so the mean keeps the total exact under that linear
model (how the ratio varies between stages is not priced). ``Layout.expert_replication`` is the memory of the
replicas, ``(E + n·replicas)/E``. The trace counts a whole step (every micro-batch and DP rank); one micro-batch's
counts are noisier, so the ratio priced is a lower bound of what one micro-batch sees.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from moeplan import placement
from moeplan.errors import LoadError
from moeplan.expert_load import LoadTrace, balancedness, cv, imbalance, rank_tokens


@dataclass(frozen=True)
class LayerLoad:
    """One MoE layer under a placement: ``layer`` (decoder-layer index), ``shards`` (logical experts on each rank),
    and over the window's steps the means of ``imbalance`` (max/mean − 1 of tokens per rank), ``balancedness``
    (mean/max) and ``cv`` (std/mean)."""

    layer: int
    shards: tuple[tuple[int, ...], ...]
    imbalance: float
    balancedness: float
    cv: float

    @property
    def ratio(self) -> float:
        """Busiest rank's tokens over the mean: ``1 + imbalance``."""
        return 1.0 + self.imbalance


@dataclass(frozen=True)
class ShardLoad:
    """Every layer of the trace placed on ``shards`` ranks by ``policy`` (``replicas`` extra slots per rank):
    ``expert_load`` (Layout.expert_load) and ``expert_replication`` (Layout.expert_replication)."""

    shards: int
    policy: str
    replicas: int
    layers: tuple[LayerLoad, ...]
    expert_replication: float

    @property
    def expert_load(self) -> float:
        return float(np.mean([x.ratio for x in self.layers])) if self.layers else 1.0


@dataclass(frozen=True, eq=False)
class LoadModel:
    """A load trace window (module docstring). ``path``: the file it came from (the plan records it); ``window``:
    the positions ``[start, stop)`` of the trace's steps used (None: all); ``groups``/``ranks_per_node``: EPLB's
    hierarchy (expert groups of the model, ranks of the expert group on one node).

    Raises LoadError for a window outside the trace."""

    trace: LoadTrace
    path: str = ""
    window: tuple[int, int] | None = None
    groups: int = 1
    ranks_per_node: int = 0
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        n = len(self.trace.steps)
        start, stop = self.window if self.window is not None else (0, n)
        if not 0 <= start < stop <= n:
            raise LoadError(f"expert_load_window={start}:{stop}: must select steps of the trace's {n}")
        object.__setattr__(self, "window", (start, stop))

    @cached_property
    def counts(self) -> np.ndarray:
        """The window's counts ``[steps, layers, experts]``."""
        start, stop = self.window  # type: ignore[misc]
        return self.trace.counts[start:stop]

    def at(self, shards: int, policy: str = "contiguous", replicas: int = 0) -> ShardLoad:
        """Each layer placed on ``shards`` ranks by ``policy`` (with ``replicas`` extra expert slots per rank,
        ``eplb`` only) and scored over the window; cached. Raises LoadError for an unknown policy, replicas with
        another policy, or a placement the policy cannot make."""
        key = (shards, policy, replicas)
        if key not in self._cache:
            if policy not in placement.POLICIES:
                raise LoadError(f"expert_policy={policy!r}: must be one of {', '.join(placement.POLICIES)}")
            if replicas < 0 or (replicas and policy != "eplb"):
                raise LoadError(f"expert_replicas={replicas}: replicas need the eplb policy and must be ≥ 0")
            self._cache[key] = self._place(shards, policy, replicas)
        return self._cache[key]

    def _place(self, n: int, policy: str, replicas: int) -> ShardLoad:
        e = self.trace.num_experts
        predicted = self.counts.mean(axis=0)  # [layers, experts]
        if n == 1:
            replicas = 0
        nodes = max(1, n // self.ranks_per_node) if self.ranks_per_node else 1
        placed = placement.place(policy, predicted, n,  # type: ignore[arg-type]
                                 num_replicas=e + n * replicas if policy == "eplb" else None, num_groups=self.groups,
                                 num_nodes=nodes)
        if placed.status != "ok":
            raise LoadError(f"expert_policy={policy}: {placed.reason}")
        per_layer = [x.shards for x in placed.layers]
        layers = []
        for i, layer in enumerate(self.trace.layers):
            tokens = rank_tokens(self.counts[:, i, :], per_layer[i])  # [steps, ranks]
            layers.append(LayerLoad(layer, per_layer[i], float(np.mean(imbalance(tokens))),
                                    float(np.mean(balancedness(tokens))), float(np.mean(cv(tokens)))))
        return ShardLoad(n, policy, replicas, tuple(layers), (e + n * replicas) / e)
