"""What ``moeplan run`` asks every rank to do, as one typed value (docs/architecture.md §7).

The CLI checks the options of ``moeplan run`` (one line naming the field, the value and the rule; exit 2) and
builds one :class:`RunRequest` from them. Every rank gets that request as it is:

- :func:`moeplan.runtime.launch.launch_local` starts each rank as ``python -m moeplan.runtime.worker REQUEST``, with
  the request as one JSON argument (``model_dump_json``); the worker reads it back with ``model_validate_json``.
- Under ``torchrun``, each rank runs ``moeplan run`` itself, which builds the same request from the same options and
  hands it to the worker in-process. :meth:`RunRequest.cli_args` spells a request as those options, for the command
  :func:`moeplan.runtime.launch.torchrun_command` prints.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

DEFAULT_TIMEOUT_S = 60.0
AuxLossScope = Literal["sequence", "micro-batch", "ep-group", "dp-group", "global-batch"]
AUX_LOSS_SCOPES: tuple[AuxLossScope, ...] = ("sequence", "micro-batch", "ep-group", "dp-group", "global-batch")
"""``moeplan run --aux-loss-scope``: the tokens the auxiliary loss balances over, from the strictest (each sequence)
to the loosest (the step); defined in moeplan.runtime.expert_parallel.ParallelRouter."""


class RunRequest(BaseModel):
    """What ``moeplan run`` asks every rank to do: the plan, the steps and the training settings, and where the run
    reads and writes. Paths are as given (``moeplan run`` makes them absolute: the printed torchrun command may run
    in another directory). The fields are named as ``moeplan run`` spells its options (``checkpoint_every`` is
    ``--checkpoint-every``), except ``timeout_s``, which is ``--timeout``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    plan: str
    """The plan YAML."""
    steps: int
    """Steps to run, in total when resuming."""
    metrics: str | None = None
    """The JSONL file rank 0 writes one line per step to; None: none."""
    data: str | None = None
    """Token file (text, .npy, .pt); None: the Python standard library's sources, byte-level."""
    checkpoint_every: int = 0
    """Steps between checkpoints; 0: none."""
    checkpoint_dir: str | None = None
    """Folder of the checkpoints (written with ``checkpoint_every``, read with ``resume``)."""
    resume: bool = False
    """Continue from the newest complete checkpoint under ``checkpoint_dir``."""
    seed: int = 0
    """Seed of the parameter initialisation."""
    lr: float = 1e-3
    """AdamW learning rate."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Collective timeout, seconds."""
    meter_every: int = 1
    """Meter saved activations and in-layer collectives every K steps."""
    force_balanced_routing: bool = False
    """Benchmarking switch that changes training: every router picks its experts from random scores
    (moeplan.runtime.expert_parallel.ParallelRouter), so routing is balanced as the plan assumes."""
    no_pin: bool = False
    """On the ``cpu`` backend, leave the ranks free to move between cores (``pin_to_cpu`` is skipped)."""
    rebalance_every: int | None = None
    """Re-place the routed experts by their measured load every N steps (moeplan.runtime.rebalance); None or 0:
    never (0: said so, overriding the plan's ``experts.load.rebalance``)."""
    rebalance_threshold: float | None = None
    """The gain in predicted device imbalance (max/mean − 1, absolute) a layer's new placement must exceed to be
    applied; set exactly when ``rebalance_every`` is."""
    aux_loss_coeff: float | None = None
    """Weight of the MoE auxiliary load-balance loss; None: none (``--aux-loss-coeff 0``)."""
    aux_loss_scope: AuxLossScope | None = None
    """The tokens the auxiliary loss balances over; set exactly when ``aux_loss_coeff`` is."""
    record_load: str | None = None
    """The expert-load trace (moeplan.expert_load) rank 0 writes: every step's routed token copies per expert and
    MoE layer, summed over the ranks; None: none."""

    def cli_args(self) -> list[str]:
        """The arguments of ``moeplan run`` that ask for this request: the plan path, then every field that is set
        as its option (``--checkpoint-every 2``; a true flag alone, ``--resume``), in the fields' order."""
        out = [self.plan]
        for name in list(type(self).model_fields)[1:]:
            value = getattr(self, name)
            if isinstance(value, bool):
                out += [cli_option(name)] if value else []
            elif value is not None:
                out += [cli_option(name), str(value)]
        return out


def cli_option(name: str) -> str:
    """The ``moeplan run`` option of a :class:`RunRequest` field."""
    return "--timeout" if name == "timeout_s" else "--" + name.replace("_", "-")
