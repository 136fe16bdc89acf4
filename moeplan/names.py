"""The field's names for the choices a plan makes beside its degrees (shared by the state, targets and plan)."""
from __future__ import annotations

from typing import Literal

ScheduleKind = Literal["1f1b", "interleaved", "zero-bubble", "zbv", "dualpipev"]
Dispatcher = Literal["flat", "hierarchical", "dedup"]
SCHEDULES: tuple[ScheduleKind, ...] = ("1f1b", "interleaved", "zero-bubble", "zbv", "dualpipev")
DISPATCHERS: tuple[Dispatcher, ...] = ("flat", "hierarchical", "dedup")
