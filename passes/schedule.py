"""Pass ``schedule``: per-rank pipeline action lists for 1F1B and interleaved 1F1B (DESIGN §4, §6).

Actions use ``torch.distributed.pipelining``'s notation (``_Action.from_str``): ``{stage}F{mb}``, ``{stage}B{mb}``,
``{stage}SEND_F{mb}``, ``{stage}RECV_F{mb}``, ``{stage}SEND_B{mb}``, ``{stage}RECV_B{mb}``. With ``pp`` ranks and
``vpp`` chunks per rank, pipeline stage ``s = chunk·pp + rank`` (Megatron-LM's looped / interleaved placement), so
rank ``r`` holds stages ``r, r+pp, ...``.

Compute order:

- **1F1B** (PipeDream-Flush, Narayanan et al. SC'21 §2.2; Megatron-LM ``forward_backward_pipelining_without_
  interleaving``): rank r runs ``min(pp − r − 1, m)`` warm-up forwards, then pairs F, B, then the remaining B.
  torch's ``Schedule1F1B`` runtime executes the same order (its warm-up of ``pp − r`` counts the first steady F).
- **Interleaved 1F1B** (SC'21 §2.2.2; Megatron-LM ``forward_backward_pipelining_with_interleaving``): warm-up of
  ``(pp − r − 1)·2 + (vpp − 1)·pp`` forward chunks (capped at ``m·vpp``), micro-batches in groups of ``pp``: the k-th
  forward is chunk ``(k mod pp·vpp) div pp`` of micro-batch ``(k div pp·vpp)·pp + k mod pp``; backwards walk the
  chunks in reverse. Needs ``m mod pp = 0``. This equals torch's ``ScheduleInterleaved1F1B`` order for such m (checked
  in tests/test_schedule.py); torch's "flex" variant for other m is not generated here.

Communication: each F of a stage whose successor is on another rank is followed by its ``SEND_F``; the consuming F
is immediately preceded by its ``RECV_F``; the same for B backwards with ``SEND_B`` / ``RECV_B``. (torch's
``_add_send_recv`` yields the same pairs; placing each RECV right before its consumer is its ``defer_pp_recv``.)
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import ClassVar, Literal, Sequence

from moeplan.cost_models.memory import peak_live_bytes
from moeplan.errors import LayoutError, PlanError
from moeplan.state import PlanState, Schedule

_Compute = tuple[str, int, int]  # (kind "F"/"B", stage, micro-batch)


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if value < 1:
            raise LayoutError(f"{name}={value!r}: must be a positive integer")


def _one_f_one_b_compute(pp: int, num_microbatches: int, rank: int) -> list[_Compute]:
    warmup = min(pp - rank - 1, num_microbatches)
    ops: list[_Compute] = [("F", rank, mb) for mb in range(warmup)]
    for i in range(num_microbatches - warmup):
        ops += [("F", rank, warmup + i), ("B", rank, i)]
    ops += [("B", rank, mb) for mb in range(num_microbatches - warmup, num_microbatches)]
    return ops


def _interleaved_compute(pp: int, vpp: int, num_microbatches: int, rank: int) -> list[_Compute]:
    total = num_microbatches * vpp
    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)

    def at(k: int, backward: bool) -> _Compute:
        chunk = (k % (pp * vpp)) // pp
        chunk = vpp - 1 - chunk if backward else chunk
        return ("B" if backward else "F", chunk * pp + rank, (k // (pp * vpp)) * pp + k % pp)

    ops = [at(k, False) for k in range(warmup)]
    for i in range(total - warmup):
        ops += [at(warmup + i, False), at(i, True)]
    ops += [at(k, True) for k in range(total - warmup, total)]
    return ops


def _with_comms(compute: Sequence[_Compute], pp: int, num_stages: int) -> tuple[str, ...]:
    """Insert RECV before and SEND after each compute action whose neighbour stage is on another rank."""
    out: list[str] = []
    for kind, stage, mb in compute:
        peer_in, peer_out = (stage - 1, stage + 1) if kind == "F" else (stage + 1, stage - 1)
        if 0 <= peer_in < num_stages and peer_in % pp != stage % pp:
            out.append(f"{stage}RECV_{kind}{mb}")
        out.append(f"{stage}{kind}{mb}")
        if 0 <= peer_out < num_stages and peer_out % pp != stage % pp:
            out.append(f"{stage}SEND_{kind}{mb}")
    return tuple(out)


def one_f_one_b(pp: int, num_microbatches: int) -> tuple[tuple[str, ...], ...]:
    """1F1B action lists, one tuple per PP rank, compute and p2p actions. Raises LayoutError on counts < 1."""
    _check_counts(pp=pp, num_microbatches=num_microbatches)
    return tuple(_with_comms(_one_f_one_b_compute(pp, num_microbatches, r), pp, pp) for r in range(pp))


def interleaved_1f1b(pp: int, vpp: int, num_microbatches: int) -> tuple[tuple[str, ...], ...]:
    """Interleaved 1F1B action lists (stage = chunk·pp + rank), one tuple per PP rank.

    Raises LayoutError unless pp ≥ 2, vpp ≥ 2 (use ``one_f_one_b`` for vpp = 1) and ``num_microbatches`` is a
    multiple of pp (Megatron-LM's rule; FACTS §4.3 bubble ((p−1)/v)/(m + (p−1)/v) holds under it).
    """
    _check_counts(pp=pp, vpp=vpp, num_microbatches=num_microbatches)
    if pp < 2 or vpp < 2:
        raise LayoutError(f"pp={pp}, vpp={vpp}: interleaved 1F1B needs pp >= 2 and vpp >= 2")
    if num_microbatches % pp:
        raise LayoutError(f"num_microbatches={num_microbatches}: interleaved 1F1B needs a multiple of pp ({pp})")
    return tuple(_with_comms(_interleaved_compute(pp, vpp, num_microbatches, r), pp, pp * vpp) for r in range(pp))


def build_actions(*, pp: int, vpp: int, num_microbatches: int) -> tuple[tuple[str, ...], ...]:
    """The default schedule of a layout: interleaved 1F1B when vpp > 1, else 1F1B (errors as theirs)."""
    if vpp > 1:
        return interleaved_1f1b(pp, vpp, num_microbatches)
    return one_f_one_b(pp, num_microbatches)


def max_in_flight(actions: Sequence[Sequence[str]], *, pp: int) -> tuple[int, ...]:
    """Per rank, the max over the list of (stage, micro-batch) forwards done whose backward is not yet done.

    Counts +1 at F and −1 at B (at W when the backward is split into I and W, as the timeline frees activations),
    in list order, which is time order on a rank's in-order compute stream. Activation memory of a rank is this
    count times one chunk's activations (FACTS §4.2). Raises PlanError if ``len(actions) != pp``.
    """
    if len(actions) != pp:
        raise PlanError(f"actions={len(actions)} ranks: must equal pp={pp}")
    ones = defaultdict(lambda: 1.0)  # every stage's micro-batch weighs 1
    return tuple(peak_live_bytes(rank_actions, ones)[1] for rank_actions in actions)


@dataclass(frozen=True)
class SchedulePass:
    """Build the per-rank action lists of the layout's pipeline schedule."""

    name: ClassVar[str] = "schedule"
    requires: ClassVar[tuple[str, ...]] = ("stages",)
    provides: ClassVar[tuple[str, ...]] = ("schedule",)

    kind: Literal["auto", "1f1b", "interleaved-1f1b"] = "auto"
    """Schedule to build: ``auto`` is interleaved-1f1b when vpp > 1, else 1f1b."""

    def run(self, state: PlanState) -> PlanState:
        """Raise LayoutError if the kind does not fit the layout's vpp, PlanError if stages disagree with it."""
        lay = state.layout
        if state.stages is None or (state.stages.pp, state.stages.vpp) != (lay.pp, lay.vpp):
            raise PlanError(f"stages={None if state.stages is None else (state.stages.pp, state.stages.vpp)}: "
                            f"must be a (pp, vpp) = {(lay.pp, lay.vpp)} stage plan")
        kind = self.kind if self.kind != "auto" else ("interleaved-1f1b" if lay.vpp > 1 else "1f1b")
        if kind == "1f1b":
            if lay.vpp != 1:
                raise LayoutError(f"vpp={lay.vpp}: schedule 1f1b runs one chunk per rank (vpp=1)")
            actions = one_f_one_b(lay.pp, lay.num_microbatches)
        else:
            actions = interleaved_1f1b(lay.pp, lay.vpp, lay.num_microbatches)
        return state.with_(schedule=Schedule(kind=kind, actions=actions))
