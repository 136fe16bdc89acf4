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

With rebalancing (``rebalance_every`` N, the ``place-experts`` pass's and ``moeplan run --rebalance-every``'s), the
run is replayed over the trace from its first step: the policy's placement at the start, then after every N-th
step each layer re-placed by moeplan.placement.rebalance_layer from the counts of the N steps before, as the
runtime does; each step of the window is scored under the placement in force at that step (predicted from the
past, scored on what followed), and every rebalance that precedes a step of the window records the experts each
rank sends and receives (:class:`Rebalancing`), which moeplan.compile prices as the migration.

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
from moeplan.placement import DEFAULT_REBALANCE_THRESHOLD, rebalance_layer


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
class Rebalancing:
    """The rebalances of a replayed run that precede a step of the window (module docstring): ``every`` N steps,
    ``threshold`` the imbalance gain a layer's new placement must exceed, and per rebalance ``after`` (the trace
    step it follows), ``sent [layers, ranks]`` and ``received [layers, ranks]`` (experts each expert-group rank
    sends and receives in each traced layer). ``window_steps``: the steps of the window, over which the
    migrations are spread."""

    every: int
    threshold: float
    window_steps: int
    after: tuple[int, ...] = ()
    sent: tuple[np.ndarray, ...] = ()
    received: tuple[np.ndarray, ...] = ()

    @property
    def moved_experts(self) -> tuple[int, ...]:
        """Experts that changed rank at each rebalance, summed over the layers."""
        return tuple(int(s.sum()) for s in self.sent)


@dataclass(frozen=True)
class ShardLoad:
    """Every layer of the trace placed on ``shards`` ranks by ``policy`` (``replicas`` extra slots per rank):
    ``expert_load`` (Layout.expert_load) and ``expert_replication`` (Layout.expert_replication); ``layers[i].shards``
    is where a run starts, and ``rebalancing`` the replayed rebalances (None: the placement stays)."""

    shards: int
    policy: str
    replicas: int
    layers: tuple[LayerLoad, ...]
    expert_replication: float
    rebalancing: Rebalancing | None = None

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

    def at(self, shards: int, policy: str = "contiguous", replicas: int = 0, rebalance_every: int = 0,
           rebalance_threshold: float = DEFAULT_REBALANCE_THRESHOLD) -> ShardLoad:
        """Each layer placed on ``shards`` ranks by ``policy`` (with ``replicas`` extra expert slots per rank,
        ``eplb`` only), with ``rebalance_every`` > 0 re-placed every that many steps (module docstring), and scored
        over the window; cached. Raises LoadError for an unknown policy, replicas with another policy or with
        rebalancing (a run holds each expert once), a negative ``rebalance_every`` or ``rebalance_threshold``, or a
        placement the policy cannot make."""
        key = (shards, policy, replicas, rebalance_every, rebalance_threshold)
        if key not in self._cache:
            if policy not in placement.POLICIES:
                raise LoadError(f"expert_policy={policy!r}: must be one of {', '.join(placement.POLICIES)}")
            if replicas < 0 or (replicas and policy != "eplb"):
                raise LoadError(f"expert_replicas={replicas}: replicas need the eplb policy and must be ≥ 0")
            if rebalance_every < 0 or not rebalance_threshold >= 0:
                raise LoadError(f"rebalance_every={rebalance_every}, rebalance_threshold={rebalance_threshold}: "
                                f"must be ≥ 0 (0: never)")
            if rebalance_every and replicas:
                raise LoadError(f"expert_replicas={replicas}: rebalancing moves each expert's one copy; it takes no "
                                f"replicas")
            self._cache[key] = self._place(shards, policy, replicas, rebalance_every, rebalance_threshold)
        return self._cache[key]

    def _place(self, n: int, policy: str, replicas: int, every: int, threshold: float) -> ShardLoad:
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
        rebalancing = None
        if every and n > 1:
            tokens, rebalancing = self._replay(per_layer, every, threshold)
        else:
            tokens = [rank_tokens(self.counts[:, i, :], per_layer[i]) for i in range(len(per_layer))]
        layers = tuple(LayerLoad(layer, per_layer[i], float(np.mean(imbalance(tokens[i]))),
                                 float(np.mean(balancedness(tokens[i]))), float(np.mean(cv(tokens[i]))))
                       for i, layer in enumerate(self.trace.layers))
        return ShardLoad(n, policy, replicas, layers, (e + n * replicas) / e, rebalancing)

    def _replay(self, start_at: list, every: int, threshold: float) -> tuple[list[np.ndarray], Rebalancing]:
        """The run replayed from the trace's first step (module docstring): each layer's tokens per rank
        ``[window steps, ranks]`` under the placement in force, and the rebalances before a step of the window."""
        start, stop = self.window  # type: ignore[misc]
        current = [tuple(tuple(s) for s in x) for x in start_at]
        n = len(current[0])
        seen = np.zeros(self.trace.counts.shape[1:], dtype=np.int64)  # [layers, experts] since the last rebalance
        tokens: list[list[np.ndarray]] = [[] for _ in current]
        after, sent, received = [], [], []
        for p in range(stop):
            if p >= start:
                for i, shards in enumerate(current):
                    tokens[i].append(rank_tokens(self.trace.counts[p, i][None], shards)[0])
            seen += self.trace.counts[p]
            if (p + 1) % every or p + 1 >= stop:
                continue  # no rebalance here, or none before a step of the window
            out, into = np.zeros((len(current), n), np.int64), np.zeros((len(current), n), np.int64)
            for i, before in enumerate(current):
                d = rebalance_layer(seen[i], before, threshold)
                for e in d.moved:
                    out[i, next(r for r, s in enumerate(before) if e in s)] += 1
                    into[i, next(r for r, s in enumerate(d.placement) if e in s)] += 1
                current[i] = d.placement
            seen[:] = 0
            if p + 1 >= start:
                after.append(self.trace.steps[p])
                sent.append(out)
                received.append(into)
        return ([np.asarray(t) for t in tokens],
                Rebalancing(every, threshold, stop - start, tuple(after), tuple(sent), tuple(received)))
