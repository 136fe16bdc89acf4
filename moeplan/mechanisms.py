"""Overlap mechanisms as descriptors: the one registry of what a plan may run beside compute (docs/step-model.md §2).

Each :class:`OverlapMechanism` says where it has something to overlap (the layout search's ``auto`` turns on every
mechanism of the target's runtime that applies), whether moeplan's own runtime executes it, and which collectives of
the layer program it runs beside compute. The CLI's choices, the target and plan schemas (:data:`Mechanism`), the
layout search, the runtime's check and the exporters read :data:`MECHANISMS`; a name it does not hold is an error,
never a default.

How the step model prices a mechanism: the collectives it ``hides`` carry ``async_by=<name>`` in the layer program
(cost_models/layer_program.py), and the timeline, the bound and the estimate let the compute stream go on beside a
collective whose mechanism is on, until a segment needs its result. Three of the four mechanisms also have pricing of
their own, in one place each: ``fb`` pairs actions in the schedule pass (passes/schedule.py ``pair_fb``; inside a
pair no collective holds compute), ``dp`` moves the DP collectives beside the backward (cost_models/step.py
``dp_exposure``), ``pp`` runs the p2p transfers beside compute (cost_models/timeline.py).

To add a mechanism: its descriptor here (:func:`register`), the collectives it hides (``hides``, or pricing of its
own), and its runtime in moeplan/runtime/ when ``runtime`` is true. Exporters note a mechanism they have no flag for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Callable

from pydantic import AfterValidator

if TYPE_CHECKING:
    from moeplan.layout import Layout
    from moeplan.spec import ModelSpec

FB_PAIRED: frozenset[str] = frozenset({"1f1b", "interleaved", "dualpipev"})
"""The schedules whose actions carry ``OVERLAP_F_B`` pairs under ``fb`` (passes/schedule.py); zero-bubble and ZB-V
never pair."""

Applies = Callable[[str, "Layout", "ModelSpec", bool], bool]


@dataclass(frozen=True)
class OverlapMechanism:
    """One overlap mechanism.

    ``applies(schedule, layout, spec, ep)``: whether it has anything to overlap under pipeline schedule ``schedule``
    (``ep``: the layout's expert group spans more than one device). ``runtime``: moeplan's own runtime executes it
    (moeplan/runtime/launch.py refuses a plan with a mechanism it does not run). ``hides``: names of layer-program
    steps (cost_models/layer_program.py) whose collectives it runs beside compute, tagged only in layers that have
    the step ``behind`` (the compute it hides them behind; ``None``: any layer). ``summary``: one line for docs and
    messages.
    """

    name: str
    summary: str
    applies: Applies
    runtime: bool = False
    hides: tuple[str, ...] = ()
    behind: str | None = None


MECHANISMS: dict[str, OverlapMechanism] = {}
"""The registry, in the order plans print their mechanisms."""


def register(mechanism: OverlapMechanism) -> OverlapMechanism:
    """Add ``mechanism`` to :data:`MECHANISMS`; raises ValueError if its name is taken."""
    if mechanism.name in MECHANISMS:
        raise ValueError(f"overlap mechanism {mechanism.name!r}: already registered")
    MECHANISMS[mechanism.name] = mechanism
    return mechanism


def mechanism(name: str) -> OverlapMechanism:
    """The descriptor named ``name``; raises ValueError naming the known ones."""
    try:
        return MECHANISMS[name]
    except KeyError:
        raise ValueError(f"overlap mechanism {name!r}: unknown; the known ones are {', '.join(MECHANISMS)}") from None


def ordered(names: frozenset[str] | set[str] | list[str] | tuple[str, ...]) -> list[str]:
    """``names`` in registry order (how plans and summaries print them)."""
    return [m for m in MECHANISMS if m in names]


def runtime_mechanisms() -> tuple[str, ...]:
    """The mechanisms moeplan's own runtime executes (``runtime``), in registry order."""
    return tuple(m.name for m in MECHANISMS.values() if m.runtime)


Mechanism = Annotated[str, AfterValidator(lambda name: mechanism(name).name)]
"""A registered mechanism's name, for pydantic fields (an unknown name fails validation)."""


register(OverlapMechanism(
    "shared-expert", "the shared experts run beside the token dispatch and combine (Megatron-LM "
    "--moe-shared-expert-overlap)",
    applies=lambda schedule, layout, spec, ep: ep and spec.num_shared_experts > 0,
    runtime=True, hides=("dispatch", "combine"), behind="shared_fc1"))
register(OverlapMechanism(
    "fb", "one micro-batch's forward beside another's backward (DualPipe, Megatron-LM "
    "--overlap-moe-expert-parallel-comm)",
    # a pair hides in-layer collectives only: without EP, TP or CP it has nothing to hide
    applies=lambda schedule, layout, spec, ep: (schedule in FB_PAIRED and layout.num_microbatches > layout.pp
                                                and (ep or layout.tp > 1 or layout.cp > 1)),
    runtime=True))
register(OverlapMechanism(
    "dp", "the gradient reduce-scatter and parameter all-gather beside compute (Megatron-LM --overlap-grad-reduce, "
    "--overlap-param-gather)",
    applies=lambda schedule, layout, spec, ep: layout.dp * layout.cp > 1, runtime=True))
register(OverlapMechanism(
    "pp", "the pipeline's p2p sends and receives beside compute",
    applies=lambda schedule, layout, spec, ep: layout.pp > 1, runtime=True))
