"""The compiler driver: runs a pipeline of passes over a PlanState (DESIGN §4).

A pipeline is data — a comma-separated list of pass names — checked for order before it runs: every decision a pass
``requires`` must be provided by an earlier pass. The driver, not the passes, times each pass and names the pass
that failed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar, Protocol

from moeplan.errors import MoeplanError, PlanError
from moeplan.state import PlanState

DEFAULT_PIPELINE = "shard,partition-stages,place-experts,plan-memory,schedule,simulate"
_INITIAL = ("graph", "target", "layout")


class Pass(Protocol):
    """A compiler pass: a frozen dataclass with these class variables and ``run``."""

    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]]
    provides: ClassVar[tuple[str, ...]]

    def run(self, state: PlanState) -> PlanState: ...


@dataclass(frozen=True)
class PassTiming:
    name: str
    seconds: float


def pass_registry() -> dict[str, type]:
    """Map pass names to pass classes (imported lazily: the passes import the cost models)."""
    from moeplan.passes import ALL_PASSES

    return {p.name: p for p in ALL_PASSES}


def parse_pipeline(text: str) -> tuple[type, ...]:
    """Parse ``"shard,partition-stages,..."`` into pass classes; raise PlanError on unknown names or bad order."""
    registry = pass_registry()
    names = [n.strip() for n in text.split(",") if n.strip()]
    available = set(_INITIAL)
    classes = []
    for n in names:
        if n not in registry:
            raise PlanError(f"pipeline={n!r}: unknown pass; known: {', '.join(sorted(registry))}")
        cls = registry[n]
        missing = [r for r in cls.requires if r not in available]
        if missing:
            raise PlanError(f"pipeline={n!r}: needs {', '.join(missing)} from an earlier pass")
        available.update(cls.provides)
        classes.append(cls)
    return tuple(classes)


class PassFailed(MoeplanError):
    """Wraps an unexpected exception with the name of the pass that raised it."""


def run_pipeline(state: PlanState, passes: tuple[Pass, ...]) -> tuple[PlanState, tuple[PassTiming, ...]]:
    """Run the passes in order; return the final state and the wall time of each pass.

    moeplan's own errors (bad input, infeasible) propagate unchanged; anything else is re-raised as PassFailed
    naming the pass.
    """
    timings = []
    for p in passes:
        t0 = time.perf_counter()
        try:
            state = p.run(state)
        except MoeplanError:
            raise
        except Exception as e:  # an internal bug: name the pass, keep the cause
            raise PassFailed(f"pass {p.name!r} failed: {type(e).__name__}: {e}") from e
        timings.append(PassTiming(p.name, time.perf_counter() - t0))
    return state, tuple(timings)
