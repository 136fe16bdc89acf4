"""Pass ``partition-stages``: layers onto PP × VPP chunks, minimising the slowest chunk.

The pieces, in pipeline order, are the embedding, the decoder layers, each MTP module as two pieces (its block and
its logits + loss, so the MTP "layer" can be split across stages, as Pangu Ultra MoE does — arXiv 2505.04519 §4)
and the head with the loss. Chunk ``c`` of PP rank ``r`` is pipeline stage ``c·pp + r`` (Megatron's interleaved
placement), so stage order is chunk-major. Each piece costs its forward + backward time on one micro-batch
including its in-layer communication (``shard``'s LayerCost, no recompute yet).

Min-max contiguous partition: the optimum is one of the O(n²) contiguous sums; binary search over them with the
greedy feasibility test (fill a chunk until the bound would be exceeded) finds it exactly (the linear partition
problem, Skiena, *The Algorithm Design Manual* §8.5). Chunks left empty by the greedy fill are split off the
largest chunks, which never raises the maximum.

Empty layers (MindSpeed ``--noop-layers``, FACTS §3): runtimes that need the same number of decoder layers in
every chunk get the chunks holding fewer layers (those with the embedding, the MTP pieces or the head) padded with
zero-cost empty layers — where padding is what lets the heavy non-layer pieces sit on lighter chunks. Padding is
applied when it costs at most one empty layer per chunk; otherwise the layout stays uneven (Megatron-LM's
``--pipeline-model-parallel-layout`` expresses it) and the reason says so.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from typing import ClassVar

from moeplan.errors import LayoutError
from moeplan.ir import LayerKind, named_layers
from moeplan.state import LayerCost, PlanState, StagePlan

SLOT_KINDS = frozenset({LayerKind.DENSE, LayerKind.MOE, LayerKind.MTP, LayerKind.EMPTY})


def piece_time_s(cost: LayerCost) -> float:
    """Forward + backward (dX + dW) + in-layer communication of one layer for one micro-batch, seconds."""
    return cost.fwd_s + cost.bwd_input_s + cost.bwd_weight_s + cost.comm_s("fwd") + cost.comm_s("bwd")


def min_max_partition(times: list[float], num_chunks: int) -> list[int]:
    """Split ``times`` into ``num_chunks`` non-empty contiguous runs minimising the largest sum.

    Returns the run lengths. Raises LayoutError if there are fewer items than chunks.
    """
    n = len(times)
    if n < num_chunks:
        raise LayoutError(f"chunks={num_chunks}: more pipeline chunks than the {n} layers to place")
    prefix = [0.0, *accumulate(times)]
    bounds = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo = bisect_left(bounds, max(max(times), prefix[-1] / num_chunks) - 1e-12)
    hi = len(bounds) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy(times, bounds[mid])) <= num_chunks:
            hi = mid
        else:
            lo = mid + 1
    runs = _greedy(times, bounds[lo])
    while len(runs) < num_chunks:  # split the run with the largest sum among those of length > 1
        k = max((i for i, r in enumerate(runs) if r > 1), key=lambda i: sum(times[sum(runs[:i]):sum(runs[:i + 1])]))
        runs[k:k + 1] = [runs[k] - 1, 1]
    return runs


def _greedy(times: list[float], bound: float) -> list[int]:
    runs, acc, count = [], 0.0, 0
    for t in times:
        if count and acc + t > bound * (1 + 1e-12):
            runs.append(count)
            acc, count = 0.0, 0
        acc += t
        count += 1
    runs.append(count)
    return runs


@dataclass(frozen=True)
class PartitionStagesPass:
    """Assign layers to PP × VPP chunks (see the module docstring)."""

    name: ClassVar[str] = "partition-stages"
    requires: ClassVar[tuple[str, ...]] = ("sharding",)
    provides: ClassVar[tuple[str, ...]] = ("stages",)
    pad_empty_layers: bool = True
    """Pad chunks to the same decoder-layer count with empty layers when it costs at most one per chunk."""

    def run(self, state: PlanState) -> PlanState:
        assert state.sharding is not None
        pp, vpp = state.layout.pp, state.layout.vpp
        layers = named_layers(state.graph.spec)
        costs = state.sharding.layer_costs
        times = [piece_time_s(costs[k]) for _, k in layers]
        runs = min_max_partition(times, pp * vpp)
        stage_names, stage_times, start = [], [], 0
        for r in runs:
            stage_names.append([n for n, _ in layers[start:start + r]])
            stage_times.append(sum(times[start:start + r]))
            start += r
        empties = self._pad(stage_names, layers) if self.pad_empty_layers else []
        chunks = tuple(tuple(tuple(stage_names[c * pp + r]) for c in range(vpp)) for r in range(pp))
        chunk_t = tuple(tuple(stage_times[c * pp + r] for c in range(vpp)) for r in range(pp))
        mean = sum(stage_times) / len(stage_times)
        imbalance = max(stage_times) / mean - 1 if mean > 0 else 0.0
        plan = StagePlan(chunks=chunks, chunk_time_s=chunk_t, imbalance=imbalance, empty_layers=tuple(empties),
                         reason="")
        return state.with_(stages=StagePlan(**{**plan.__dict__, "reason": _reason(plan, stage_names, empties)}))

    @staticmethod
    def _pad(stage_names: list[list[str]], layers) -> list[str]:
        kinds = dict(layers)
        slots = [sum(kinds[n] in SLOT_KINDS for n in names) for names in stage_names]
        need = sum(max(slots) - s for s in slots)
        if need == 0 or need > len(stage_names):
            return []
        empties = []
        for names, s in zip(stage_names, slots):
            for _ in range(max(slots) - s):
                name = f"empty.{len(empties)}"
                empties.append(name)
                last_slot = max((i for i, n in enumerate(names) if kinds.get(n) in SLOT_KINDS), default=-1)
                names.insert(last_slot + 1 if last_slot >= 0 else len(names) - (names[-1] == "head"), name)
                kinds[name] = LayerKind.EMPTY
        return empties


def _reason(plan: StagePlan, stage_names: list[list[str]], empties: list[str]) -> str:
    def where(prefix: str) -> str:
        locs = [f"{n} on stage {s} (pp rank {s % plan.pp}, chunk {s // plan.pp})"
                for s, names in enumerate(stage_names) for n in names if n.startswith(prefix)]
        return "; ".join(locs)

    parts = [p for p in (where("mtp."), where("mtp_head.")) if p]
    if empties:
        parts.append(f"{len(empties)} empty layer(s) pad chunks to equal decoder-layer counts: {where('empty.')}")
    else:
        slots = {sum(not n.startswith(("embedding", "head", "mtp_head")) for n in names) for names in stage_names}
        parts.append("no empty layers: chunks already hold equal layer counts" if len(slots) == 1 else
                     "no empty layers: uneven layer counts (Megatron --pipeline-model-parallel-layout)")
    return "; ".join(parts) + f"; slowest chunk {plan.imbalance:+.1%} over the mean"
