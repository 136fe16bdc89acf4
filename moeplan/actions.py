"""The pipeline's action grammar and stage↔rank shape, shared by the schedule pass, the simulator, the plan file, the
views, the exporters and the runtime (docs/architecture.md §6).

Actions follow ``torch.distributed.pipelining``'s notation: ``{stage}F{mb}``, ``{stage}B{mb}`` (full backward),
``{stage}I{mb}`` / ``{stage}W{mb}`` (input / weight gradient), ``({stage}F{mb};{stage}B{mb})OVERLAP_F_B`` (a forward
and a backward of two micro-batches run as one action), ``{stage}SEND_F{mb}`` / ``RECV_F`` / ``SEND_B`` /
``RECV_B``, and the no-ops ``REDUCE_GRAD``, ``UNSHARD``, ``RESHARD`` of torch's lowered lists.

Stages sit on PP ranks in a ``loop`` (stage ``s`` on rank ``s mod pp``, chunk ``s // pp``: Megatron-LM's interleaved
1F1B) or a ``v`` (rank ``r`` holds stages ``r`` and ``2·pp − 1 − r``: ZB-V and DualPipeV).
"""
from __future__ import annotations

import functools
import re
from typing import Literal, NamedTuple, Sequence

from moeplan.errors import PlanError
from moeplan.names import ScheduleKind

COMPUTE_KINDS = ("F", "B", "I", "W")
SEND_KINDS = ("SEND_F", "SEND_B")
RECV_KINDS = ("RECV_F", "RECV_B")
NOOP_KINDS = ("REDUCE_GRAD", "UNSHARD", "RESHARD")
OVERLAP = "OVERLAP_F_B"
_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|REDUCE_GRAD|UNSHARD|RESHARD|F|B|I|W)(\d*)")
_OVERLAP_RE = re.compile(r"\((\d+F\d+);(\d+B\d+)\)OVERLAP_F_B")


class Action(NamedTuple):
    """One parsed action: ``stage`` (pipeline stage id), ``kind`` (``F``, ``SEND_F``, ...), ``microbatch`` (−1 for
    the no-op kinds, which carry none). An ``OVERLAP_F_B`` pair has stage and micro-batch −1 and its two parts in
    ``parts``."""

    stage: int
    kind: str
    microbatch: int
    parts: tuple["Action", ...] = ()

    def __str__(self) -> str:
        """The action in the plan's notation: ``parse_action(str(a)) == a``."""
        if self.kind == OVERLAP:
            return f"({self.parts[0]};{self.parts[1]}){OVERLAP}"
        return f"{self.stage}{self.kind}{self.microbatch if self.microbatch >= 0 else ''}"


def pair(forward: str, backward: str) -> str:
    """The ``OVERLAP_F_B`` action of a forward and a backward action (raises PlanError if they are not an F and a
    B)."""
    f, b = parse_action(forward), parse_action(backward)
    if (f.kind, b.kind) != ("F", "B"):
        raise PlanError(f"action=({forward};{backward}): an {OVERLAP} pair is an F then a B")
    return str(Action(-1, OVERLAP, -1, (f, b)))


@functools.lru_cache(maxsize=1 << 18)
def parse_action(text: str) -> Action:
    """Parse ``"3F12"`` → ``Action(3, "F", 12)`` and ``"(3F1;4B0)OVERLAP_F_B"`` → its pair; raise PlanError on
    anything else. Cached: the schedule, memory and simulate passes each read the same lists."""
    text = text.strip()
    pair = _OVERLAP_RE.fullmatch(text)
    if pair is not None:
        return Action(-1, OVERLAP, -1, (parse_action(pair.group(1)), parse_action(pair.group(2))))
    match = _ACTION_RE.fullmatch(text)
    if match is None or (match.group(3) == "") != (match.group(2) in NOOP_KINDS):
        raise PlanError(f"action={text!r}: must be '{{stage}}{{kind}}{{microbatch}}' with kind one of "
                        f"{', '.join(COMPUTE_KINDS + SEND_KINDS + RECV_KINDS)}, or '({{s}}F{{m}};{{s}}B{{m}})"
                        f"OVERLAP_F_B'")
    return Action(int(match.group(1)), match.group(2), int(match.group(3)) if match.group(3) else -1)


def compute_parts(text: str) -> tuple[Action, ...]:
    """The compute actions of ``text``: one for F/B/I/W, two for an OVERLAP_F_B pair, none otherwise."""
    a = parse_action(text)
    return a.parts if a.kind == OVERLAP else (a,) if a.kind in COMPUTE_KINDS else ()


def action_kind(text: str) -> str:
    """The kind of a compute action: F, B, I or W, or OVERLAP_F_B for a pair."""
    parts = compute_parts(text)
    return parts[0].kind if len(parts) == 1 else OVERLAP


def with_comms(compute: Sequence[str], *, pp: int, num_stages: int, placement: Placement) -> tuple[str, ...]:
    """Insert RECVs before and SENDs after each compute action whose neighbour stage is on another rank."""
    out: list[str] = []
    for text in compute:
        parts = compute_parts(text)
        recvs, sends = [], []
        for p in parts:
            if p.kind == "W":
                continue
            peer_in, peer_out = (p.stage - 1, p.stage + 1) if p.kind == "F" else (p.stage + 1, p.stage - 1)
            here = stage_rank(p.stage, pp=pp, placement=placement)
            d = "F" if p.kind == "F" else "B"
            if 0 <= peer_in < num_stages and stage_rank(peer_in, pp=pp, placement=placement) != here:
                recvs.append(str(Action(p.stage, f"RECV_{d}", p.microbatch)))
            if 0 <= peer_out < num_stages and stage_rank(peer_out, pp=pp, placement=placement) != here:
                sends.append(str(Action(p.stage, f"SEND_{d}", p.microbatch)))
        out += recvs + [text] + sends
    return tuple(out)


# ---- stage <-> rank ----------------------------------------------------------------------------------------------
Placement = Literal["loop", "v"]


def placement_of(kind: ScheduleKind) -> Placement:
    """``v`` for the V-shaped schedules (zbv, dualpipev), else ``loop``."""
    return "v" if kind in ("zbv", "dualpipev") else "loop"


def stage_rank(stage: int, *, pp: int, placement: Placement) -> int:
    """PP rank that holds pipeline stage ``stage``."""
    if placement == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def stage_of(rank: int, chunk: int, *, pp: int, placement: Placement) -> int:
    """Pipeline stage of PP rank ``rank``'s chunk ``chunk``."""
    if placement == "v":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def rank_chunk(stage: int, *, pp: int, placement: Placement) -> tuple[int, int]:
    """(PP rank, chunk on that rank) of pipeline stage ``stage``."""
    if placement == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp
