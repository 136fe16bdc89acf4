"""The compiler driver: runs a pipeline of passes over a PlanState (docs/architecture.md §4).

A pipeline is data — a comma-separated list of pass names, each with options in braces as xDSL and MLIR write them
(``shard,partition-stages{layer_layout=free},…,plan-memory{budget_fraction=0.9,enforce=false},simulate``) —
checked for names, options and order before it runs: every decision a pass ``requires`` must be provided by an
earlier pass. The driver, not the passes, times each pass and names the pass that failed.
"""
from __future__ import annotations

import dataclasses
import re
import time
import typing
from dataclasses import dataclass
from typing import ClassVar, Protocol

from moeplan.errors import MoeplanError, PlanError
from moeplan.state import PlanState

DEFAULT_PIPELINE = "shard,partition-stages,place-experts,schedule,plan-memory,simulate"
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


_ITEM = re.compile(r"\s*([\w-]+)\s*(?:\{([^{}]*)\})?\s*(?:,|$)")


def _items(text: str) -> list[tuple[str, str | None]]:
    """``(pass name, options text or None)`` of each item of a pipeline string; PlanError where it does not
    parse."""
    out, pos, text = [], 0, text.strip()
    while pos < len(text):
        m = _ITEM.match(text, pos)
        if m is None or m.end() == pos:
            raise PlanError(f"pipeline={text!r}: expected 'name' or 'name{{option=value,...}}' at position {pos}")
        pos = m.end()
        out.append((m.group(1), m.group(2)))
    return out


def parse_pipeline(text: str) -> tuple[Pass, ...]:
    """Parse ``"shard,partition-stages{layer_layout=free},..."`` into configured passes; raise PlanError on an
    unknown pass or option, a value of the wrong type, or a pass whose required decisions no earlier pass makes."""
    registry = pass_registry()
    available = set(_INITIAL)
    passes: list[Pass] = []
    for name, opts in _items(text):
        if name not in registry:
            raise PlanError(f"pipeline={name!r}: unknown pass; known: {', '.join(sorted(registry))}")
        cls = registry[name]
        missing = [r for r in cls.requires if r not in available]
        if missing:
            raise PlanError(f"pipeline={name!r}: needs {', '.join(missing)} from an earlier pass")
        available.update(cls.provides)
        passes.append(cls(**_options(cls, opts or "")))
    return tuple(passes)


def with_option(pipeline: str, pass_name: str, key: str, value: object) -> str:
    """``pipeline`` with option ``key=value`` set on pass ``pass_name`` (how CLI flags become pass options: a
    later option overrides an earlier one). Raises PlanError when the pipeline has no such pass."""
    items = _items(pipeline)
    if all(name != pass_name for name, _ in items):
        raise PlanError(f"pipeline={pipeline!r}: has no {pass_name} pass to set {key} on")
    out = []
    for name, opts in items:
        if name == pass_name:
            opts = f"{opts},{key}={value}" if opts and opts.strip() else f"{key}={value}"
        out.append(f"{name}{{{opts}}}" if opts else name)
    return ",".join(out)


def _options(cls: type, text: str) -> dict:
    """``k=v`` pairs of one pass, converted to its fields' types (bool, int, float, str or a Literal of them)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if key not in fields:
            raise PlanError(f"pipeline={cls.name}{{{text}}}: {key!r} is not an option of {cls.name} (options: "
                            f"{', '.join(fields) or 'none'})")
        out[key] = _convert(cls.name, key, raw, hints[key])
    return out


def _convert(name: str, key: str, raw: str, hint: object) -> object:
    choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
    try:
        if choices is not None:
            if raw not in choices:
                raise ValueError
            return raw
        if hint is bool:
            if raw.lower() not in ("true", "false"):
                raise ValueError
            return raw.lower() == "true"
        return hint(raw)  # type: ignore[operator]
    except ValueError:
        rule = f"one of {', '.join(map(str, choices))}" if choices else f"a {getattr(hint, '__name__', hint)}"
        raise PlanError(f"pipeline={name}{{{key}={raw}}}: must be {rule}") from None


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
