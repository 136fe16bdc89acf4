"""The option values of the ``moeplan`` command line (moeplan.cli): checked, and turned into what the commands pass
on (the search's fixed choices, the run request).

A refused value raises a one-line ``ValueError`` subclass of MoeplanError naming the option, the value and the rule
(``LayoutError``, or ``PlanError`` for ``moeplan run``'s), which the command line reports with exit 2
(docs/architecture.md §8.7).
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Optional

from moeplan.errors import LayoutError, PlanError
from moeplan.files import check_output
from moeplan.mechanisms import MECHANISMS
from moeplan.placement import DEFAULT_REBALANCE_THRESHOLD

if TYPE_CHECKING:
    from moeplan.runtime.request import RunRequest

RAY_HELP = ("evaluate on a Ray cluster: 'local' starts one on this machine, 'auto' joins the one running here, or "
            "give its address (needs pip install \"moeplan[ray]\"; docs/search.md)")
PIPELINE_HELP = ("compiler passes in order, comma-separated, each with options in braces: shard, partition-stages, "
                 "place-experts, schedule, plan-memory, simulate (the default, in this order); e.g. "
                 "'shard,partition-stages{layer_layout=free},place-experts,schedule,plan-memory,simulate'")
OVERLAP_HELP = ("comma list of the overlap mechanisms: "
                + "; ".join(f"{m.name}: {m.summary}" for m in MECHANISMS.values()) + "; or none, all, auto")


def choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``; else LayoutError naming ``name``, the value and the choices."""
    if value not in allowed:
        raise LayoutError(f"{name}={value!r}: must be one of {', '.join(allowed)}")
    return value


def strategy_options(*, schedule: str, dispatcher: str, overlap: str, recompute: str) -> dict:
    """Fixed-choice fields of :class:`moeplan.search.Fixed` from the CLI's strings (``auto`` leaves a choice to the
    search). Raises LayoutError naming the flag, the value and the choices."""
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


def expert_load_model(path: str, *, window: Optional[str], spec, target):  # noqa: ANN001, ANN201
    """``--expert-load PATH`` and ``--expert-load-window START:STOP`` as a :class:`moeplan.load_model.LoadModel` for
    ``spec`` on ``target``. Raises LoadError (one line) for a trace moeplan cannot read, one of another model
    (expert count, layers) or a window outside it."""
    from moeplan.errors import LoadError
    from moeplan.expert_load import read_trace
    from moeplan.load_model import LoadModel

    trace = read_trace(path, spec=spec)  # checked against the model too
    span = None
    if window is not None:
        parts = window.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise LoadError(f"expert_load_window={window!r}: must be START:STOP, two step positions")
        span = (int(parts[0]), int(parts[1]))
    return LoadModel(trace, path=path, window=span, groups=spec.num_expert_groups,
                     ranks_per_node=target.devices_per_node)


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


def run_request(plan_path: str, *, steps: int, metrics: Optional[str], data: Optional[str], checkpoint_every: int,
                checkpoint_dir: Optional[str], resume: bool, seed: int, lr: float, timeout: float, meter_every: int,
                force_balanced_routing: bool, no_pin: bool, rebalance_every: Optional[int] = None,
                rebalance_threshold: Optional[float] = None, aux_loss_coeff: float = 0.0,
                aux_loss_scope: Optional[str] = None, record_load: Optional[str] = None) -> RunRequest:
    """The :class:`RunRequest` of ``moeplan run``'s options, its paths made absolute (the printed torchrun command
    may run in another directory). Raises PlanError for a negative ``checkpoint_every``, a ``timeout`` or ``lr``
    that is not a finite positive number, checkpoints asked for without ``checkpoint_dir`` or into a file, and a
    ``metrics`` file that cannot be written or is the run's plan or data file; OutputError for a ``metrics`` path
    :func:`~moeplan.files.check_output` refuses. ``steps`` and ``meter_every`` are the caller's to check
    (:func:`positive`). ``rebalance_every`` None or 0 is off (0 is kept in the request, so that the ranks a printed
    command starts do not take a plan's rebalancing either); PlanError for a negative one, a
    ``rebalance_threshold`` that is not a finite number ≥ 0 or is given without it (default with it:
    moeplan.placement.DEFAULT_REBALANCE_THRESHOLD).
    ``aux_loss_coeff`` 0 is off; PlanError for one that is not a finite number ≥ 0, an ``aux_loss_scope`` not in
    moeplan.runtime.request.AUX_LOSS_SCOPES or given without it (default with it: ``micro-batch``), and a
    ``record_load`` file that is the run's plan, data or metrics file; OutputError for one check_output refuses."""
    from moeplan.runtime.request import RunRequest  # pydantic: not imported for the other commands

    if checkpoint_every < 0:
        raise PlanError(f"checkpoint_every={checkpoint_every}: must be >= 0")
    if rebalance_every is not None and rebalance_every < 0:
        raise PlanError(f"rebalance_every={rebalance_every}: must be >= 0 (0: never)")
    if rebalance_threshold is not None and not (math.isfinite(rebalance_threshold) and rebalance_threshold >= 0):
        raise PlanError(f"rebalance_threshold={rebalance_threshold}: must be a finite number >= 0")
    if rebalance_threshold is not None and not rebalance_every:
        raise PlanError(f"rebalance_threshold={rebalance_threshold}: applies to --rebalance-every, which is off")
    if not (math.isfinite(aux_loss_coeff) and aux_loss_coeff >= 0):
        raise PlanError(f"aux_loss_coeff={aux_loss_coeff}: must be a finite number >= 0 (0: no auxiliary loss)")
    if aux_loss_scope is not None:
        from moeplan.runtime.request import AUX_LOSS_SCOPES

        if aux_loss_scope not in AUX_LOSS_SCOPES:
            raise PlanError(f"aux_loss_scope={aux_loss_scope!r}: must be one of {', '.join(AUX_LOSS_SCOPES)}")
        if not aux_loss_coeff:
            raise PlanError(f"aux_loss_scope={aux_loss_scope}: applies to --aux-loss-coeff, which is 0")
    for name, value in (("timeout", timeout), ("lr", lr)):
        if not (math.isfinite(value) and value > 0):
            raise PlanError(f"{name}={value}: must be a finite number > 0")
    if (checkpoint_every or resume) and not checkpoint_dir:
        raise PlanError("checkpoint_dir=None: --checkpoint-every and --resume need --checkpoint-dir")
    if checkpoint_dir and os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
        raise PlanError(f"checkpoint_dir={checkpoint_dir!r}: is a file; name a folder")
    for field, out, others in (("metrics", metrics, (("plan", plan_path), ("data", data))),
                               ("record_load", record_load, (("plan", plan_path), ("data", data),
                                                             ("metrics", metrics)))):
        if out:  # before launch: the ranks would fail on it one by one
            check_output(out, field=field)
            for name, other in others:
                if other and os.path.realpath(out) == os.path.realpath(other):
                    raise PlanError(f"{field}={out!r}: is the {name} file of this run; name another file")

    def absolute(path: Optional[str]) -> Optional[str]:
        return os.path.abspath(path) if path else None

    return RunRequest(plan=os.path.abspath(plan_path), steps=steps, metrics=absolute(metrics), data=absolute(data),
                      checkpoint_every=checkpoint_every, checkpoint_dir=absolute(checkpoint_dir), resume=resume,
                      seed=seed, lr=lr, timeout_s=timeout, meter_every=meter_every,
                      force_balanced_routing=force_balanced_routing, no_pin=no_pin,
                      rebalance_every=rebalance_every,
                      rebalance_threshold=(DEFAULT_REBALANCE_THRESHOLD if rebalance_threshold is None
                                           else rebalance_threshold) if rebalance_every else None,
                      aux_loss_coeff=aux_loss_coeff or None,
                      aux_loss_scope=(aux_loss_scope or "micro-batch") if aux_loss_coeff else None,
                      record_load=absolute(record_load))

