"""The option values of the ``moeplan`` command line (moeplan.cli): checked, and turned into what the commands pass
on (the search's fixed choices).

A refused value raises a one-line ``LayoutError`` (a ``ValueError`` subclass of MoeplanError) naming the option, the
value and the rule, which the command line reports with exit 2 (docs/architecture.md §8.7).
"""
from __future__ import annotations

from typing import Optional

from moeplan.errors import LayoutError

PIPELINE_HELP = ("compiler passes in order, comma-separated, each with options in braces: shard, partition-stages, "
                 "place-experts, schedule, plan-memory, simulate (the default, in this order); e.g. "
                 "'shard,partition-stages{layer_layout=free},place-experts,schedule,plan-memory,simulate'")


def choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``; else LayoutError naming ``name``, the value and the choices."""
    if value not in allowed:
        raise LayoutError(f"{name}={value!r}: must be one of {', '.join(allowed)}")
    return value


def strategy_options(*, schedule: str, dispatcher: str, overlap: str, recompute: str) -> dict:
    """Fixed-choice fields of :class:`moeplan.search.Fixed` from the CLI's strings (``auto`` leaves a choice to the
    search). Raises LayoutError naming the flag, the value and the choices."""
    from moeplan.mechanisms import MECHANISMS
    from moeplan.names import DISPATCHERS, SCHEDULES

    out: dict = {"recompute": recompute}
    if recompute.startswith("modules:"):
        from moeplan.cost_models.saved_tensors import MODULE_ALIASES, RECOMPUTE_MODULES

        names = [MODULE_ALIASES.get(n.strip(), n.strip()) for n in recompute.split(":", 1)[1].split(",") if n.strip()]
        if not names:
            raise LayoutError(f"recompute={recompute!r}: modules: needs a comma list of {', '.join(RECOMPUTE_MODULES)}")
        for n in names:
            choice("recompute module", n, tuple(RECOMPUTE_MODULES))
        out.update(recompute="modules", recompute_modules=tuple(sorted(set(names))))
    else:
        choice("recompute", recompute, ("auto", "none", "selective", "full", "mindspeed", "ilp-no-swap", "ilp",
                                        "modules:<list>"))
    if schedule != "auto":
        out["schedule"] = choice("schedule", schedule, SCHEDULES + ("auto",))
    if dispatcher != "auto":
        out["dispatcher"] = choice("dispatcher", dispatcher, DISPATCHERS + ("auto",))
    if overlap != "auto":
        names = [n.strip() for n in overlap.split(",") if n.strip()]
        if names == ["none"]:
            out["overlap"] = frozenset()
        elif names == ["all"]:
            out["overlap"] = frozenset(MECHANISMS)
        else:
            for n in names:
                choice("overlap", n, (*MECHANISMS, "none", "all", "auto"))
            if set(names) & {"none", "all", "auto"}:
                raise LayoutError(f"overlap={overlap!r}: none, all and auto stand alone, not in a list")
            out["overlap"] = frozenset(names)
    return out


def integer(name: str, text: str) -> int:
    """``text`` as an integer (an option that also takes ``auto``); else LayoutError."""
    try:
        return int(text)
    except ValueError:
        raise LayoutError(f"{name}={text!r}: must be a positive integer or auto") from None


def positive(name: str, value: Optional[int]) -> Optional[int]:
    """``value`` unless it is below 1 (None: not given); else LayoutError."""
    if value is not None and value < 1:
        raise LayoutError(f"{name}={value}: must be a positive integer")
    return value

