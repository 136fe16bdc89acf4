"""Pass ``partition-stages``: layers onto PP × VPP chunks, minimising the slowest chunk.

The pieces, in pipeline order, are the embedding, the decoder layers, each MTP module as two pieces (its block and
its logits + loss, so the MTP "layer" can be split across stages, as Pangu Ultra MoE does — arXiv 2505.04519 §4)
and the head with the loss. The pieces fill pipeline stages 0, 1, … in order; stage ``c·pp + r`` is chunk ``c`` of
PP rank ``r`` (Megatron's interleaved placement), or, for the V-shaped schedules (ZB-V, DualPipeV), stage ``r`` and
``2·pp − 1 − r`` are the two chunks of rank ``r`` (passes/schedule.py). Each piece costs its forward + backward
time on one micro-batch including its in-layer communication (``shard``'s LayerCost, no recompute yet).

Min-max contiguous partition: the optimum is one of the O(n²) contiguous sums; binary search over them with the
greedy feasibility test (fill a chunk until the bound would be exceeded) finds it exactly (the linear partition
problem, Skiena, *The Algorithm Design Manual* §8.5). Chunks left empty by the greedy fill are split off the
largest chunks, which never raises the maximum.

V placement (ZB-V, DualPipeV) puts both ends of the pipeline on rank 0 — the embedding's stage and the head's — and
stage ``r`` with stage ``2·pp − 1 − r`` on rank ``r``, so the min-max split can leave one rank with two heavy
chunks: in the steady state a rank runs each of its chunks once per micro-batch, and the busiest rank sets the pace.
:func:`balance_ranks` then moves pieces off the busiest rank's stages while that lowers its total. (With the loop
placement of interleaving the min-max split is kept: its ranks' totals differ by at most the chunk granularity.)

Empty layers (MindSpeed ``--noop-layers``, docs/references.md §3): runtimes such as MindSpeed-LLM need the same number of
decoder layers (dense, MoE, MTP block) in every chunk. The uniform mode gives every chunk ``capacity`` slots and
solves the same min-max problem with at most ``capacity`` decoder layers per chunk; the chunks that hold the
embedding, the MTP logits or the head take fewer real layers and the rest of their slots become zero-cost empty
layers — the padding is what lets the heavy non-layer pieces sit on lighter chunks. ``capacity`` is the fewest
slots that hold every decoder layer, ceil(layers / chunks). ``auto`` keeps the uniform split when its slowest chunk
is within 1% of the free optimum, else the free split (Megatron-LM's ``--pipeline-model-parallel-layout`` expresses
uneven chunks), and the reason says which and what equal counts would cost.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from typing import ClassVar, Literal, Sequence

from moeplan.cost_models.timeline import RunSettings, action_time_s
from moeplan.errors import LayoutError
from moeplan.ir import LayerKind, named_layers
from moeplan.passes.schedule import Placement, placement_of, stage_of, stage_rank
from moeplan.passes.simulate import beside_compute
from moeplan.state import LayerCost, PlanState, StagePlan

SLOT_KINDS = frozenset({LayerKind.DENSE, LayerKind.MOE, LayerKind.MTP})
UNIFORM_TOLERANCE = 0.01  # auto mode: accept equal layer counts when the slowest chunk is at most 1% slower


def piece_time_s(cost: LayerCost, settings: RunSettings = RunSettings(mechanisms=frozenset())) -> float:
    """Seconds of one layer's forward and full backward for one micro-batch, its collectives beside or blocking
    its compute as ``settings`` say (cost_models/timeline.py). Under ``fb`` the steady state pairs one micro-batch's
    forward with another's backward, so a layer costs what its busiest resource holds: its compute, slowed for as
    long as its collectives can run beside it, or one link tier's collectives. Otherwise its forward and its
    backward on an idle rank, one after the other. The default settings overlap nothing: compute plus every
    collective."""
    prog = cost.program
    if "fb" in settings.mechanisms:
        segs = prog.fwd + prog.backward
        comms = [x.comm for x in segs if x.comm is not None]
        tiers = [sum(c.busy_s(t) for c in comms) for t in ("intra", "inter")]
        compute = sum(x.seconds for x in segs if x.kind == "compute")
        return max(compute + settings.compute_slowdown * min(compute, max(tiers)), *tiers)
    return action_time_s([prog.fwd], settings) + action_time_s([prog.backward], settings)


def min_max_partition(times: list[float], num_chunks: int, *, slots: list[int] | None = None,
                      capacity: int | None = None) -> list[int] | None:
    """Split ``times`` into ``num_chunks`` non-empty contiguous runs minimising the largest sum.

    With ``slots`` and ``capacity`` a run may hold at most ``capacity`` slots (the greedy feasibility test stays
    exact: both sums are additive and monotone, so the longest feasible first run never hurts). Returns the run
    lengths, or None when the capacity makes it impossible. Raises LayoutError if there are fewer items than
    chunks.
    """
    n = len(times)
    if n < num_chunks:
        raise LayoutError(f"chunks={num_chunks}: more pipeline chunks than the {n} layers to place")
    slots = slots or [0] * n
    cap = capacity if capacity is not None else n
    if max(slots) > cap or sum(slots) > cap * num_chunks:
        return None
    prefix = [0.0, *accumulate(times)]
    bounds = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo = bisect_left(bounds, max(max(times), prefix[-1] / num_chunks) - 1e-12)
    hi = len(bounds) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy(times, slots, bounds[mid], cap)) <= num_chunks:
            hi = mid
        else:
            lo = mid + 1
    runs = _greedy(times, slots, bounds[lo], cap)
    if len(runs) > num_chunks:
        return None
    while len(runs) < num_chunks:  # split the run with the largest sum among those of length > 1
        k = max((i for i, r in enumerate(runs) if r > 1), key=lambda i: sum(times[sum(runs[:i]):sum(runs[:i + 1])]))
        runs[k:k + 1] = [runs[k] - 1, 1]
    return runs


def balance_ranks(times: Sequence[float], runs: Sequence[int], *, pp: int, placement: Placement,
                  slots: Sequence[int] | None = None, capacity: int | None = None) -> list[int]:
    """Lower the busiest PP rank's total (the sum of its chunks, stages placed ``loop`` or ``v``) of a contiguous
    split (``runs``: pieces per stage, in stage order). Local search: move one piece from a stage of the busiest rank
    to any other stage, shifting the boundaries between them by one piece (every stage stays contiguous and
    non-empty, and holds at most ``capacity`` decoder slots when given); of the moves that lower the busiest rank's
    total, take the one with the least (busiest rank, slowest stage, sum of squared rank totals); repeat until none
    does. Deterministic; at most ``len(times)·len(runs)`` moves."""
    n, k = len(times), len(runs)
    prefix = [0.0, *accumulate(times)]
    sl = [0, *accumulate(slots)] if slots is not None else None
    owner = [stage_rank(s, pp=pp, placement=placement) for s in range(k)]
    bounds = [0, *accumulate(runs)]

    def key(b: list[int]) -> tuple[float, float, float]:
        stage = [prefix[b[s + 1]] - prefix[b[s]] for s in range(k)]
        rank = [0.0] * pp
        for s, t in enumerate(stage):
            rank[owner[s]] += t
        return (round(max(rank), 12), round(max(stage), 12), round(sum(x * x for x in rank), 12))

    def valid(b: list[int], lo: int, hi: int) -> bool:
        return all(b[s + 1] > b[s] and (sl is None or capacity is None or sl[b[s + 1]] - sl[b[s]] <= capacity)
                   for s in range(lo, hi + 1))

    best = key(bounds)
    for _ in range(n * k):
        rank_t = [0.0] * pp
        for s in range(k):
            rank_t[owner[s]] += prefix[bounds[s + 1]] - prefix[bounds[s]]
        busiest = max(range(pp), key=lambda r: rank_t[r])
        move = None
        for src in (s for s in range(k) if owner[s] == busiest):
            for dst in range(k):
                if dst == src:
                    continue
                b = bounds[:]
                lo, hi = min(src, dst), max(src, dst)
                for j in range(lo + 1, hi + 1):  # the boundaries between src and dst shift one piece toward dst
                    b[j] += -1 if dst > src else 1
                if not valid(b, lo, hi):
                    continue
                cand = key(b)
                if cand[0] < best[0] and (move is None or cand < move[0]):
                    move = (cand, b)
        if move is None:
            break
        best, bounds = move
    return [bounds[s + 1] - bounds[s] for s in range(k)]


def _greedy(times: list[float], slots: list[int], bound: float, capacity: int) -> list[int]:
    runs, acc, used, count = [], 0.0, 0, 0
    for t, sl in zip(times, slots):
        if count and (acc + t > bound * (1 + 1e-12) or used + sl > capacity):
            runs.append(count)
            acc, used, count = 0.0, 0, 0
        acc += t
        used += sl
        count += 1
    runs.append(count)
    return runs


@dataclass(frozen=True)
class PartitionStagesPass:
    """Assign layers to PP × VPP chunks (see the module docstring)."""

    name: ClassVar[str] = "partition-stages"
    requires: ClassVar[tuple[str, ...]] = ("sharding",)
    provides: ClassVar[tuple[str, ...]] = ("stages",)
    layer_layout: Literal["auto", "free", "uniform"] = "auto"
    """``uniform``: every chunk holds the same number of decoder-layer slots (dense, MoE, MTP block), padded with
    empty layers; ``free``: any contiguous split; ``auto``: uniform when its slowest chunk is within
    ``UNIFORM_TOLERANCE`` of the free optimum."""

    def run(self, state: PlanState) -> PlanState:
        assert state.sharding is not None
        pp, vpp = state.layout.pp, state.layout.vpp
        layers = named_layers(state.graph.spec)
        costs = state.sharding.layer_costs
        settings = beside_compute(state.target, state.strategy.overlap)
        per_kind = {k: piece_time_s(c, settings) for k, c in costs.items()}
        times = [per_kind[k] for _, k in layers]
        slots = [int(k in SLOT_KINDS) for _, k in layers]
        placement = placement_of(state.strategy.schedule)
        runs, capacity, note = split_runs(times, slots, pp=pp, vpp=vpp, placement=placement,
                                          layer_layout=self.layer_layout)
        stage_names, stage_times, empties, start = [], [], [], 0
        for r in runs:
            names = [n for n, _ in layers[start:start + r]]
            if capacity is not None:
                names = _pad(names, capacity - sum(slots[start:start + r]), empties)
            stage_names.append(names)
            stage_times.append(sum(times[start:start + r]))
            start += r
        at = [[stage_of(r, c, pp=pp, placement=placement) for c in range(vpp)] for r in range(pp)]
        chunks = tuple(tuple(tuple(stage_names[s]) for s in row) for row in at)
        chunk_t = tuple(tuple(stage_times[s] for s in row) for row in at)
        mean = sum(stage_times) / len(stage_times)
        imbalance = max(stage_times) / mean - 1 if mean > 0 else 0.0
        reason = _reason(stage_names, pp, placement, imbalance, empties, capacity, note)
        return state.with_(stages=StagePlan(chunks=chunks, chunk_time_s=chunk_t, imbalance=imbalance,
                                            empty_layers=tuple(empties), reason=reason, placement=placement))


def split_runs(times: list[float], slots: list[int], *, pp: int, vpp: int, placement: Placement,
               layer_layout: Literal["auto", "free", "uniform"] = "auto") -> tuple[list[int], int | None, str]:
    """(run lengths of the ``pp·vpp`` stages in pipeline order, decoder slots per chunk when the split is uniform
    else None, a note on what equal counts would cost) for pieces of ``times`` seconds of which ``slots`` are
    decoder layers (module docstring). Raises LayoutError for ``uniform`` when the slots cannot be spread evenly,
    or when there are fewer pieces than chunks."""
    free = min_max_partition(times, pp * vpp)
    assert free is not None
    if placement == "v":
        free = balance_ranks(times, free, pp=pp, placement=placement)
    if layer_layout == "free":
        return free, None, ""
    uniform, cap = _uniform(times, slots, pp * vpp)
    if uniform is not None and placement == "v":
        uniform = balance_ranks(times, uniform, pp=pp, placement=placement, slots=slots, capacity=cap)
    if uniform is None:
        if layer_layout == "uniform":
            raise LayoutError(f"layer_layout='uniform': {sum(slots)} decoder layers cannot be spread "
                              f"{cap} per chunk over {pp * vpp} chunks")
        return free, None, ""
    slowdown = _max_run(times, uniform) / _max_run(times, free) - 1
    if layer_layout == "uniform" or slowdown <= UNIFORM_TOLERANCE:
        return uniform, cap, ""
    return free, None, (f"equal counts ({cap} per chunk, {cap * pp * vpp - sum(slots)} empty layers) would make the "
                        f"slowest chunk {slowdown:+.1%} slower")


def _max_run(times: list[float], runs: list[int]) -> float:
    starts = [sum(runs[:i]) for i in range(len(runs))]
    return max(sum(times[s:s + r]) for s, r in zip(starts, runs))


def _uniform(times: list[float], slots: list[int], num_chunks: int) -> tuple[list[int] | None, int]:
    """The best partition with the fewest decoder slots per chunk that can hold them all, ceil(slots / chunks)
    (more slots would be a different split, not padding), and that slot count; None if the capacity is too small
    for the pieces' order."""
    cap = -(-sum(slots) // num_chunks)
    return min_max_partition(times, num_chunks, slots=slots, capacity=cap), cap


def _pad(names: list[str], missing: int, empties: list[str]) -> list[str]:
    """Insert ``missing`` empty layers after the chunk's last decoder layer (before any head)."""
    new = []
    for _ in range(missing):
        new.append(f"empty.{len(empties)}")
        empties.append(new[-1])
    heads = [i for i, n in enumerate(names) if n in ("head",) or n.startswith("mtp_head.")]
    at = heads[0] if heads else len(names)
    return names[:at] + new + names[at:]


def _reason(stage_names: list[list[str]], pp: int, placement: Placement, imbalance: float, empties: list[str],
            capacity: int | None, note: str) -> str:
    def where(prefix: str) -> str:
        return "; ".join(f"{n} on stage {s} (pp rank {stage_rank(s, pp=pp, placement=placement)}, chunk "
                         f"{int(s >= pp) if placement == 'v' else s // pp})"
                         for s, names in enumerate(stage_names) for n in names if n.startswith(prefix))

    parts = [p for p in (where("mtp."), where("mtp_head.")) if p]
    if capacity is None:
        parts.append("no empty layers: uneven decoder-layer counts per chunk (Megatron-LM "
                     "--pipeline-model-parallel-layout)" + (f"; {note}" if note else ""))
    elif empties:
        parts.append(f"{capacity} decoder-layer slots per chunk; {len(empties)} empty layer(s) fill the chunks that "
                     f"hold the embedding, MTP or head: {where('empty.')}")
    else:
        parts.append(f"{capacity} decoder-layer slots per chunk; no empty layers needed")
    return "; ".join(parts) + f"; slowest chunk {imbalance:+.1%} over the mean"
