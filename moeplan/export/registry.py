"""The exporters' registry: each format registers one :class:`Exporter` (its ``--to`` name, the source its flags or
keys were checked against, the function that builds it); :func:`export_plan` looks the format up here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moeplan.errors import PlanError
from moeplan.plan import Plan


@dataclass(frozen=True)
class Export:
    """One export: ``text`` is the runtime's artifact (argument lines, TOML or CSV); ``notes`` one line each on what
    that runtime cannot express; ``commented`` whether the notes go into ``document()`` as ``#`` lines."""

    target: str
    text: str
    notes: tuple[str, ...]
    commented: bool

    def document(self) -> str:
        """The file to write: the notes as a ``#`` header (text formats only), then the artifact."""
        if not self.commented:
            return self.text
        head = [f"# moeplan export --to {self.target} · {EXPORTERS[self.target].source}"]
        if self.notes:
            head.append("# not expressed by this runtime (as planned by moeplan):")
            head += [f"#   {'-' if i == 0 else ' '} {line}" for n in self.notes
                     for i, line in enumerate(n.splitlines() or [""])]  # a line break in a note stays commented
        return "\n".join(head) + "\n" + self.text


@dataclass(frozen=True)
class Exporter:
    """A registered format: ``name`` (``moeplan export --to NAME``), ``source`` (the runtime version its flags or keys
    were checked against, tests/fixtures/), ``build`` (the plan → its :class:`Export`)."""

    name: str
    source: str
    build: Callable[[Plan], Export]


EXPORTERS: dict[str, Exporter] = {}
"""The formats by ``--to`` name, in registration order (moeplan/export/__init__.py imports each format's module)."""


def register(name: str, *, source: str) -> Callable[[Callable[[Plan], Export]], Callable[[Plan], Export]]:
    """Decorator: register ``build`` as the exporter ``name``. Raises ValueError when the name is taken."""
    def add(build: Callable[[Plan], Export]) -> Callable[[Plan], Export]:
        if name in EXPORTERS:
            raise ValueError(f"exporter {name!r} is registered twice")
        EXPORTERS[name] = Exporter(name, source, build)
        return build
    return add


def export_plan(plan: Plan, target: str) -> Export:
    """The plan as ``target``'s configuration. Raises PlanError naming ``to`` when no exporter of that name is
    registered."""
    if target not in EXPORTERS:
        raise PlanError(f"to={target!r}: must be one of {', '.join(EXPORTERS)}")
    return EXPORTERS[target].build(plan)
