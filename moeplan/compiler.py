"""The compiler driver: runs a pipeline of passes over a PlanState (docs/architecture.md §4).

A pipeline is data — a comma-separated list of pass names, each with options in braces as xDSL and MLIR write them
(``shard,partition-stages{layer_layout=free},…,plan-memory{budget_fraction=0.9,enforce=false},simulate``) —
checked for names, options and order before it runs: every decision a pass ``requires`` must be provided by an
earlier pass. The driver, not the passes, times each pass and names the pass that failed.
"""
from __future__ import annotations

import dataclasses
import math
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


@dataclass(frozen=True)
class Pipeline:
    """A checked pipeline: configured passes in order, and per pass the options that were set (in the order set).
    ``str()`` prints it back in the pipeline syntax, as xDSL's ``PipelinePass`` specs go both ways: a pipeline
    changes as objects (:meth:`with_option`), never as text."""

    passes: tuple[Pass, ...]
    options: tuple[tuple[str, ...], ...]

    @classmethod
    def parse(cls, text: str) -> Pipeline:
        """Parse ``"shard,partition-stages{layer_layout=free},..."``; raise PlanError on an unknown pass or option,
        a value of the wrong type, or a pass whose required decisions no earlier pass makes."""
        registry = pass_registry()
        available = set(_INITIAL)
        passes: list[Pass] = []
        options: list[tuple[str, ...]] = []
        for name, opts in _items(text):
            if name not in registry:
                raise PlanError(f"pipeline={name!r}: unknown pass; known: {', '.join(sorted(registry))}")
            pass_cls = registry[name]
            missing = [r for r in pass_cls.requires if r not in available]
            if missing:
                raise PlanError(f"pipeline={name!r}: needs {', '.join(missing)} from an earlier pass")
            available.update(pass_cls.provides)
            values = _options(pass_cls, opts or "")
            passes.append(pass_cls(**values))
            options.append(tuple(values))
        return cls(tuple(passes), tuple(options))

    def __str__(self) -> str:
        return ",".join(p.name + ("{" + ",".join(f"{k}={_text(getattr(p, k))}" for k in opts) + "}" if opts else "")
                        for p, opts in zip(self.passes, self.options))

    def with_option(self, pass_name: str, key: str, value: object) -> Pipeline:
        """This pipeline with option ``key=value`` set on pass ``pass_name`` (how CLI flags become pass options: it
        overrides one set before). Raises PlanError when there is no such pass, option or value."""
        at = next((i for i, p in enumerate(self.passes) if p.name == pass_name), None)
        if at is None:
            raise PlanError(f"pipeline={str(self)!r}: has no {pass_name} pass to set {key} on")
        p = self.passes[at]
        values = _options(type(p), f"{key}={_text(value)}")
        opts = self.options[at] if key in self.options[at] else (*self.options[at], key)
        return Pipeline(self.passes[:at] + (dataclasses.replace(p, **values),) + self.passes[at + 1:],
                        self.options[:at] + (opts,) + self.options[at + 1:])

    def split_final(self, name: str) -> tuple[tuple[Pass, ...], Pass | None]:
        """(the passes before the last, the last) when the last pass is ``name``; else (every pass, None)."""
        if self.passes and self.passes[-1].name == name:
            return self.passes[:-1], self.passes[-1]
        return self.passes, None

    @property
    def provides(self) -> frozenset[str]:
        """Every decision some pass of the pipeline makes."""
        return frozenset(d for p in self.passes for d in p.provides)


def _text(value: object) -> str:
    """An option value in the pipeline syntax (``true``/``false`` for a bool)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def with_option(pipeline: str, pass_name: str, key: str, value: object) -> str:
    """Pipeline text ``pipeline`` with option ``key=value`` set on pass ``pass_name`` (:meth:`Pipeline.with_option`;
    raises PlanError)."""
    return str(Pipeline.parse(pipeline).with_option(pass_name, key, value))


def _options(cls: type, text: str) -> dict:
    """``k=v`` pairs of one pass, converted to its fields' types (bool, int, float, str or a Literal of them); a
    later value of a key overrides an earlier one."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if key not in fields:
            raise PlanError(f"pipeline={cls.name}{{{text}}}: {key!r} is not an option of {cls.name} (options: "
                            f"{', '.join(fields) or 'none'})")
        out.pop(key, None)
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
        value = hint(raw)  # type: ignore[operator]
        if isinstance(value, float) and not math.isfinite(value):  # no option means anything at nan or inf
            raise ValueError
        return value
    except ValueError:
        rule = f"one of {', '.join(map(str, choices))}" if choices else (
            "a finite number" if hint is float else f"a {getattr(hint, '__name__', hint)}")
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
