"""The plan's schedule on disk (``PlanSchedule`` in moeplan/plan.py; docs/architecture.md §6): the one-line-per-rank
encoding of an action list (:func:`encode_actions`, :func:`decode_actions`: ``A*N`` and ``<A B>*N`` runs, each
repeat with every micro-batch number one higher) and the rule of ``p2p: derived`` lines (:func:`_with_p2p`: the
SEND/RECV actions that :func:`moeplan.actions.with_comms` puts around the compute actions).
"""
from __future__ import annotations

import re
from typing import Sequence

from moeplan.actions import compute_parts, parse_action, placement_of, with_comms
from moeplan.errors import PlanError
from moeplan.names import ScheduleKind


def _is_p2p(action: str) -> bool:
    return "SEND_" in action or "RECV_" in action


def _with_p2p(kind: ScheduleKind, compute: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    stages = [p.stage for acts in compute for a in acts for p in compute_parts(a)]
    return [with_comms(acts, pp=len(compute), num_stages=1 + max(stages, default=0), placement=placement_of(kind))
            for acts in compute]


_MICROBATCH = re.compile(r"(?<=[A-Z_])\d+")  # a micro-batch number follows its action kind; a stage number does not
_RUN = re.compile(r"<([^<>]+)>\*(\d+)|(\S+)")


def _shift(action: str, by: int) -> str:
    return _MICROBATCH.sub(lambda m: str(int(m.group()) + by), action)


def encode_actions(actions: Sequence[str], *, longest_block: int = 12) -> str:
    """One line for an action list: runs of an action (or of a block of up to ``longest_block`` actions) repeated
    with every micro-batch number one higher each time are written ``A*N`` / ``<A B>*N`` (``PlanSchedule.ranks``);
    greedy, taking at each position the run that covers the most actions. ``decode_actions`` inverts it."""
    out: list[str] = []
    i, n = 0, len(actions)
    while i < n:
        best_k, best_r = 1, 1
        for k in range(1, min(longest_block, (n - i) // 2) + 1):
            r = 1
            while i + (r + 1) * k <= n and all(_shift(actions[i + j], r) == actions[i + r * k + j] for j in range(k)):
                r += 1
            if r > 1 and k * r > best_k * best_r:
                best_k, best_r = k, r
        block = actions[i:i + best_k]
        out.append(block[0] if best_r == 1 else f"{block[0]}*{best_r}" if best_k == 1
                   else f"<{' '.join(block)}>*{best_r}")
        i += best_k * best_r
    return " ".join(out)


#: the most actions one rank's line may hold per (chunk, micro-batch): F, I and W (or F and B), each with a RECV
#: before and a SEND after it when the p2p actions are listed
ACTIONS_PER_CHUNK_MICROBATCH = 9


def decode_actions(line: str, *, where: str = "schedule.ranks", limit: int | None = None) -> list[str]:
    """The action list of one ``PlanSchedule.ranks`` line, at most ``limit`` actions (checked on the runs' counts
    before any run is expanded). Raises PlanError naming ``where`` and the token on a malformed run or action, or
    the count when the line holds more than ``limit``."""
    runs: list[tuple[list[str], int]] = []
    total = 0
    for m in _RUN.finditer(line):
        block, count, token = m.group(1), m.group(2), m.group(3)
        if token is not None:
            block, _, count = token.rpartition("*") if "*" in token else ("", "", "1")
            block = block or token
        if not count.isdigit() or int(count) < 1:
            raise PlanError(f"{where}: {m.group()!r} is not a run (A*N or <A B>*N, N >= 1)")
        acts = block.split()
        for a in acts:
            try:
                parse_action(a)
            except PlanError:
                raise PlanError(f"{where}: {a!r} is not an action (e.g. 0F1, 0B1, 0SEND_F1)") from None
        total += int(count) * len(acts)
        if limit is not None and total > limit:
            raise PlanError(f"{where}: {m.group()[:40]!r} makes the line more than {limit} actions, the most a rank "
                            f"runs per step ({ACTIONS_PER_CHUNK_MICROBATCH} per chunk and micro-batch)")
        runs.append((acts, int(count)))
    return [_shift(a, r) for acts, count in runs for r in range(count) for a in acts]
