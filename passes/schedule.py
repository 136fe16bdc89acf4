"""Pass ``schedule``: per-rank pipeline action lists (docs/architecture.md §4, §6; docs/step-model.md §4).

Actions use ``torch.distributed.pipelining``'s notation (``_Action.from_str``): ``{stage}F{mb}``, ``{stage}B{mb}``,
``{stage}I{mb}`` / ``{stage}W{mb}`` (backward split into input and weight gradients), ``({s}F{m};{s}B{m})OVERLAP_F_B``,
and the p2p actions ``{stage}SEND_F{mb}``, ``RECV_F``, ``SEND_B``, ``RECV_B``.

Schedules (the ``Strategy.schedule`` the search or the user chose):

- **1f1b** (PipeDream-Flush, Narayanan et al. SC'21 §2.2; Megatron-LM ``forward_backward_pipelining_without_
  interleaving``): rank r runs ``min(pp − r − 1, m)`` warm-up forwards, then pairs F, B, then the remaining B.
- **interleaved** (SC'21 §2.2.2; Megatron-LM ``forward_backward_pipelining_with_interleaving``): warm-up of
  ``(pp − r − 1)·2 + (vpp − 1)·pp`` forward chunks, micro-batches in groups of ``pp``; needs ``m mod pp = 0``. Equal
  to torch's ``ScheduleInterleaved1F1B`` for such m (tests/test_schedule.py).
- **zero-bubble**, **zbv**, **dualpipev**: the compute orders of torch's ``ScheduleInterleavedZeroBubble`` (Qi et
  al., "Zero Bubble Pipeline Parallelism", ICLR'24; vpp ≥ 2), ``ScheduleZBVZeroBubble`` (ZB-V, vpp = 2) and
  ``ScheduleDualPipeV`` (DeepSeek-V3 §3.2.1's DualPipe cut to a V; vpp = 2, m ≥ 2·pp, with ``OVERLAP_F_B`` pairs),
  generated offline by ``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops``. ZB-V and DualPipeV
  place stages in a V: rank r holds stages r and 2·pp − 1 − r; the others loop: stage ``c·pp + r``.

Mechanism ``fb`` (the forward of one micro-batch overlapped with the backward of another: Megatron-LM
``--overlap-moe-expert-parallel-comm``, MindSpeed ``--moe-fb-overlap``): on 1f1b and interleaved, one more warm-up
forward per rank (one more micro-batch in flight, as Megatron-LM's combined 1F1B needs), then every steady-state F
and the B that follows it become one ``OVERLAP_F_B`` action; DualPipeV's own pairs stay. Without ``fb`` a
DualPipeV pair runs as its F, then its B.

Communication: each compute action whose neighbour stage is on another rank gets its ``RECV`` right before it and
its ``SEND`` right after (torch's ``_add_send_recv`` with ``defer_pp_recv``).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar, Sequence

from cachetools import LRUCache, cached

from moeplan.actions import (OVERLAP, Action, action_kind, compute_parts, pair, parse_action, placement_of, stage_of,
                             with_comms)
from moeplan.cost_models.memory import peak_live_bytes, vectors_of
from moeplan.errors import LayoutError, PlanError
from moeplan.state import PlanState, Schedule, ScheduleKind

_Compute = tuple[str, int, int]  # (kind "F"/"B", stage, micro-batch)
_TORCH_NAMES = {"zero-bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if value < 1:
            raise LayoutError(f"{name}={value!r}: must be a positive integer")


@dataclass(frozen=True)
class ScheduleFit:
    """Whether a schedule kind can run a layout (:func:`schedule_fits`): ``fits``, else ``reason`` is the rule it
    breaks, one line."""

    fits: bool
    reason: str = ""


def schedule_fits(kind: ScheduleKind, *, pp: int, vpp: int, num_microbatches: int) -> ScheduleFit:
    """Whether ``kind`` can run ``pp`` ranks × ``vpp`` chunks with ``num_microbatches`` micro-batches."""
    rule = _broken_rule(kind, pp=pp, vpp=vpp, num_microbatches=num_microbatches)
    return ScheduleFit(True) if rule is None else ScheduleFit(False, rule)


def _broken_rule(kind: ScheduleKind, *, pp: int, vpp: int, num_microbatches: int) -> str | None:
    m = num_microbatches
    if kind == "1f1b":
        return None if vpp == 1 else "1f1b runs one chunk per rank (vpp=1)"
    if kind == "interleaved":
        if pp < 2 or vpp < 2:
            return "interleaved needs pp >= 2 and vpp >= 2"
        return None if m % pp == 0 else f"interleaved needs micro-batches ({m}) divisible by pp ({pp})"
    if kind == "zero-bubble":
        if vpp < 2:
            return "zero-bubble (torch's Interleaved Zero Bubble) needs vpp >= 2"
        rounds = max(1, m // pp)  # torch's ScheduleInterleavedZeroBubble runs m in rounds of about pp
        return None if m % rounds == 0 else (f"zero-bubble needs micro-batches ({m}) divisible by its rounds "
                                             f"(max(1, m // pp) = {rounds})")
    if kind in ("zbv", "dualpipev"):
        if vpp != 2:
            return f"{kind} places two chunks per rank in a V (vpp=2)"
        if kind == "dualpipev" and m < 2 * pp:
            return f"dualpipev needs at least 2·pp = {2 * pp} micro-batches (got {m})"
        return None
    return f"unknown schedule {kind!r}"


def _one_f_one_b_compute(pp: int, m: int, rank: int, extra: int = 0) -> list[_Compute]:
    warmup = min(pp - rank - 1 + extra, m)
    ops: list[_Compute] = [("F", rank, mb) for mb in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", rank, warmup + i), ("B", rank, i)]
    ops += [("B", rank, mb) for mb in range(m - warmup, m)]
    return ops


def _interleaved_compute(pp: int, vpp: int, m: int, rank: int, extra: int = 0) -> list[_Compute]:
    total = m * vpp
    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp + extra, total)

    def at(k: int, backward: bool) -> _Compute:
        chunk = (k % (pp * vpp)) // pp
        chunk = vpp - 1 - chunk if backward else chunk
        return ("B" if backward else "F", chunk * pp + rank, (k // (pp * vpp)) * pp + k % pp)

    ops = [at(k, False) for k in range(warmup)]
    for i in range(total - warmup):
        ops += [at(warmup + i, False), at(i, True)]
    ops += [at(k, True) for k in range(total - warmup, total)]
    return ops


class _Stage:
    """What torch's schedule classes read of their stages while they build ``pipeline_order``: the group's rank and
    size and the total stage count. torch's own ``get_schedule_ops`` passes ``mock.create_autospec(PipelineStage)``
    for this, whose construction was most of a schedule's cost (26 ms of 29 ms at pp 2–16 on the 2-core machine);
    tests/test_schedule.py checks the orders against ``get_schedule_ops``."""

    submod = None
    group_rank = 0

    def __init__(self, pp: int, num_stages: int) -> None:
        self.group_size, self.num_stages = pp, num_stages


@lru_cache(maxsize=64)
def torch_compute_order(kind: ScheduleKind, pp: int, vpp: int, num_microbatches: int) -> tuple[tuple[str, ...], ...]:
    """Per-rank compute actions of torch's schedule ``kind`` (zero-bubble, zbv, dualpipev), as strings.

    torch's runtime schedules (DualPipeV) also lower their order to p2p actions while constructed; moeplan adds its
    own (:func:`with_comms`), so that lowering, most of the construction time at pp 32, is skipped. So is the
    interleaved zero bubble's ``_add_bubbles_to_actions``, a third of its construction: it only inserts ``None``
    steps between a rank's actions (its source, torch/distributed/pipelining/schedules.py), which are dropped here."""
    return tuple(tuple(str(a) for a in actions) for actions in _torch_order(kind, pp, vpp, num_microbatches))


def _torch_order(kind: ScheduleKind, pp: int, vpp: int, num_microbatches: int) -> list[list]:
    """Per rank, torch's compute actions (``_Action``) of schedule ``kind``, as :func:`torch_compute_order` builds
    them."""
    from unittest import mock

    from torch.distributed.pipelining.schedules import (ScheduleInterleavedZeroBubble, _PipelineScheduleRuntime,
                                                        get_schedule_class)

    with mock.patch.object(_PipelineScheduleRuntime, "_prepare_schedule_with_comms", lambda self, order: None), \
            mock.patch.object(ScheduleInterleavedZeroBubble, "_add_bubbles_to_actions",
                              lambda self, num_stages: self.pipeline_order):
        schedule = get_schedule_class(_TORCH_NAMES[kind])([_Stage(pp, pp * vpp)] * vpp, num_microbatches)
    return [[a for a in schedule.pipeline_order[r] if a is not None] for r in range(pp)]


def _texts(compute: Sequence[_Compute]) -> list[str]:
    return [str(Action(s, k, m)) for k, s, m in compute]


def pair_fb(compute: Sequence[str]) -> list[str]:
    """Merge every F immediately followed by a B of another micro-batch into one ``(F;B)OVERLAP_F_B`` action
    (steady state only: the warm-up forwards are followed by a forward, the cool-down backwards by a backward). A
    backward of micro-batch k waits, through the later stages and the loss, on every forward of k: paired with one,
    neither could start. With fewer micro-batches than the warm-up, the last forward is followed by the backward of
    the same micro-batch, and stays unpaired."""
    out: list[str] = []
    i = 0
    while i < len(compute):
        a = compute[i]
        if (i + 1 < len(compute) and action_kind(a) == "F" and action_kind(compute[i + 1]) == "B"
                and parse_action(a).microbatch != parse_action(compute[i + 1]).microbatch):
            out.append(pair(a, compute[i + 1]))
            i += 2
        else:
            out.append(a)
            i += 1
    return out


def unpair_blocked(compute: Sequence[Sequence[str]], *, num_stages: int) -> list[list[str]]:
    """``compute`` (per rank, compute actions) with every ``OVERLAP_F_B`` pair that could never start run as its F
    then its B instead. A pair starts once both halves' inputs are done before it: F of (stage s, micro-batch k)
    needs F (s − 1, k); B (s, k) needs F (s, k) and B (s + 1, k) (the loss at the last stage). Pairing is per rank,
    so two ranks' pairs can wait on each other (rank 0's ``(4F1;4B0)`` needs ``5B0``, paired on rank 1 with ``5F1``,
    which needs ``4F1``): the lists are swept as the ranks would run them, and a pair at the head of a stuck rank
    is split, until every list runs to its end or no stuck head is a pair (a deadlock of the schedule itself, which
    the simulator reports)."""
    out = [list(c) for c in compute]
    while True:
        done: set[tuple[str, int, int]] = set()
        ptr = [0] * len(out)
        moved = True
        while moved:
            moved = False
            for r, acts in enumerate(out):
                while ptr[r] < len(acts):
                    parts = [(p.kind, p.stage, p.microbatch) for p in compute_parts(acts[ptr[r]])]
                    if not all(_input_done(p, done, num_stages) for p in parts):
                        break
                    done.update(parts)
                    ptr[r] += 1
                    moved = True
        stuck = [(r, ptr[r]) for r, acts in enumerate(out)
                 if ptr[r] < len(acts) and parse_action(acts[ptr[r]]).kind == OVERLAP]
        if not stuck:
            return out
        r, i = stuck[0]
        out[r][i:i + 1] = [str(p) for p in compute_parts(out[r][i])]


def _input_done(part: tuple[str, int, int], done: set[tuple[str, int, int]], num_stages: int) -> bool:
    kind, s, k = part
    if kind == "F":
        return s == 0 or ("F", s - 1, k) in done
    if kind in ("B", "I"):
        later = ("F", s, k) if s == num_stages - 1 else ("B", s + 1, k)
        return ("F", s, k) in done and (later in done or ("I", s + 1, k) in done)
    return ("I", s, k) in done or ("B", s, k) in done  # W after its stage's input gradient


def split_fb(compute: Sequence[str]) -> list[str]:
    """Run each OVERLAP_F_B pair as its F, then its B."""
    out: list[str] = []
    for a in compute:
        out += [str(p) for p in compute_parts(a)] if parse_action(a).kind == OVERLAP else [a]
    return out


ACTIONS_HELD = 1 << 20
"""Actions the per-process caches of action lists and their in-flight vectors hold at most, each (about 60 MB of
strings): a search builds the same lists for every layout of one schedule, pp, vpp and micro-batch count, and one
layout's lists can hold 10^5 actions."""


@cached(LRUCache(maxsize=ACTIONS_HELD, getsizeof=lambda lists: sum(map(len, lists))))
def build_actions(kind: ScheduleKind, *, pp: int, vpp: int, num_microbatches: int,
                  fb: bool = False) -> tuple[tuple[str, ...], ...]:
    """Per-rank action lists (compute and p2p) of schedule ``kind`` (module docstring). Raises LayoutError when the
    schedule does not fit the layout (:func:`schedule_fits`) or a count is < 1. Cached per arguments: a search
    builds the same lists for every layout of one (pp, vpp, micro-batch count)."""
    _check_counts(pp=pp, vpp=vpp, num_microbatches=num_microbatches)
    fit = schedule_fits(kind, pp=pp, vpp=vpp, num_microbatches=num_microbatches)
    if not fit.fits:
        raise LayoutError(f"schedule={kind!r}: {fit.reason}")
    m, extra = num_microbatches, int(fb)
    if kind == "1f1b":
        compute = [_texts(_one_f_one_b_compute(pp, m, r, extra)) for r in range(pp)]
    elif kind == "interleaved":
        compute = [_texts(_interleaved_compute(pp, vpp, m, r, extra)) for r in range(pp)]
    else:
        compute = [list(r) for r in torch_compute_order(kind, pp, vpp, m)]
    if kind in ("1f1b", "interleaved") and fb:
        compute = unpair_blocked([pair_fb(c) for c in compute], num_stages=pp * vpp)
    elif kind == "dualpipev" and not fb:
        compute = [split_fb(c) for c in compute]
    placement = placement_of(kind)
    return tuple(with_comms(c, pp=pp, num_stages=pp * vpp, placement=placement) for c in compute)


def one_f_one_b(pp: int, num_microbatches: int) -> tuple[tuple[str, ...], ...]:
    """1F1B action lists, one tuple per PP rank, compute and p2p actions. Raises LayoutError on counts < 1."""
    return build_actions("1f1b", pp=pp, vpp=1, num_microbatches=num_microbatches)


def interleaved_1f1b(pp: int, vpp: int, num_microbatches: int) -> tuple[tuple[str, ...], ...]:
    """Interleaved 1F1B action lists (stage = chunk·pp + rank), one tuple per PP rank. Raises LayoutError unless
    pp ≥ 2, vpp ≥ 2 and ``num_microbatches`` is a multiple of pp (Megatron-LM's rule)."""
    return build_actions("interleaved", pp=pp, vpp=vpp, num_microbatches=num_microbatches)


def max_in_flight(actions: Sequence[Sequence[str]], *, pp: int) -> tuple[int, ...]:
    """Per rank, the max over the list of (stage, micro-batch) forwards done whose backward is not yet done (+1 at
    F, −1 at B or W, in list order; an OVERLAP_F_B pair counts its F before its B). Raises PlanError if
    ``len(actions) != pp``."""
    if len(actions) != pp:
        raise PlanError(f"actions={len(actions)} ranks: must equal pp={pp}")
    ones = defaultdict(lambda: 1.0)  # every stage's micro-batch weighs 1
    return tuple(peak_live_bytes(rank_actions, ones)[1] for rank_actions in actions)


def in_flight_by_rank(kind: ScheduleKind, *, pp: int, vpp: int, num_microbatches: int, fb: bool = False
                      ) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per PP rank, the in-flight vectors of its action list (micro-batches in flight per VPP chunk after each
    forward, dominated ones dropped: cost_models/memory.py ``in_flight_vectors``), which is what a rank's activation
    peak depends on. Past a warm-up, a schedule repeats a fixed pattern, so the vectors stop changing with the
    micro-batch count: from ``m = pp`` (1F1B, ``pp + 1`` with fb pairs), ``2·pp`` (interleaved, ZB-V, DualPipeV),
    ``pp²`` (torch's interleaved zero bubble) on — counted for pp 2–8 and every vpp the search tries
    (tests/test_schedule.py) —, so they are counted on the schedule of ``min(m, cap)`` micro-batches, ``cap`` the
    smallest runnable count from ``2·pp·vpp`` on (``max(2·pp·vpp, pp²)`` for zero bubble): the same vectors,
    without building a schedule of thousands of micro-batches. Cached per arguments."""
    return _in_flight_by_rank(kind, pp, vpp, _equivalent_count(kind, pp, vpp, num_microbatches), fb)


def _equivalent_count(kind: ScheduleKind, pp: int, vpp: int, m: int) -> int:
    """The micro-batch count whose in-flight vectors equal ``m``'s (:func:`in_flight_by_rank`)."""
    cap = max(2 * pp * vpp, pp * pp) if kind == "zero-bubble" else 2 * pp * vpp
    if m <= cap:
        return m
    return next((c for c in range(cap, m) if schedule_fits(kind, pp=pp, vpp=vpp, num_microbatches=c).fits), m)


@lru_cache(maxsize=512)
def _in_flight_by_rank(kind: ScheduleKind, pp: int, vpp: int, m: int, fb: bool
                       ) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The vectors from each rank's compute order alone, as :func:`build_actions` orders it: p2p actions and the
    pairing of a forward with the next backward do not move any forward or backward."""
    placement = placement_of(kind)
    order = _torch_order(kind, pp, vpp, m) if kind not in ("1f1b", "interleaved") else None
    out = []
    for r in range(pp):
        if kind == "1f1b":
            events = ((k, s) for k, s, _ in _one_f_one_b_compute(pp, m, r, int(fb)))
        elif kind == "interleaved":
            events = ((k, s) for k, s, _ in _interleaved_compute(pp, vpp, m, r, int(fb)))
        else:  # torch's actions as they are: a pair's halves in order (what compute_parts reads of their text)
            events = ((b.computation_type.value, b.stage_index) for a in order[r]  # type: ignore[index]
                      for b in (a.sub_actions or (a,)))
        out.append(vectors_of(events, [stage_of(r, c, pp=pp, placement=placement) for c in range(vpp)]))
    return tuple(out)


@dataclass(frozen=True)
class SchedulePass:
    """Build the per-rank action lists of the strategy's schedule on the stage plan's placement."""

    name: ClassVar[str] = "schedule"
    requires: ClassVar[tuple[str, ...]] = ("stages",)
    provides: ClassVar[tuple[str, ...]] = ("schedule",)

    def run(self, state: PlanState) -> PlanState:
        """Raise LayoutError if the schedule does not fit the layout, PlanError if the stages disagree with it."""
        lay, kind = state.layout, state.strategy.schedule
        stages = state.stages
        if stages is None or (stages.pp, stages.vpp) != (lay.pp, lay.vpp):
            raise PlanError(f"stages={None if stages is None else (stages.pp, stages.vpp)}: must be a (pp, vpp) = "
                            f"{(lay.pp, lay.vpp)} stage plan")
        if stages.placement != placement_of(kind):
            raise PlanError(f"stages.placement={stages.placement!r}: schedule {kind!r} places stages "
                            f"{placement_of(kind)!r}")
        actions = build_actions(kind, pp=lay.pp, vpp=lay.vpp, num_microbatches=lay.num_microbatches,
                                fb="fb" in state.strategy.overlap)
        return state.with_(schedule=Schedule(kind=kind, actions=actions))
