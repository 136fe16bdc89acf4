"""``moeplan export``: a plan as the launch configuration of another training runtime (docs/export.md).

One module per format registers its exporter (moeplan/export/registry.py). Targets, each checked against the named
source (the flags and keys are listed in tests/fixtures/):

- ``megatron``: Megatron-LM command-line arguments (NVIDIA/Megatron-LM d98e8a64, main 2026-08-22,
  ``megatron/training/arguments.py``).
- ``mindspeed-llm``: MindSpeed-LLM arguments (Ascend/MindSpeed-LLM c77308a1 on Ascend/MindSpeed 028de58c and
  Megatron-LM core_v0.12.1).
- ``torchtitan``: the ``[training]``, ``[parallelism]`` and ``[activation_checkpoint]`` sections of a torchtitan
  v0.2.2 TOML job config (``torchtitan/config/job_config.py``; the last release that reads TOML).
- ``torch-pipelining``: the per-PP-rank action CSV that torch.distributed.pipelining's
  ``_PipelineScheduleRuntime._load_csv(path, format="compute_comms")`` reads (torch/distributed/pipelining/
  schedules.py, ``_Action.from_str``): the plan's actions plus the REDUCE_GRAD actions torch's own lowering adds.

Every value comes from the plan (or from moeplan's own model of it, e.g. the distributed optimizer its memory plan
assumes). What the runtime cannot express is returned as notes, never dropped: ``#`` lines at the top of the text
formats; for the CSV, which torch reads cell by cell, the caller prints them apart.
"""
from __future__ import annotations

from pathlib import Path

# each format registers itself on import; this order is the order of TARGETS
from moeplan.export import megatron, mindspeed_llm, torchtitan, torch_pipelining  # noqa: F401
from moeplan.export.common import pipeline_stages
from moeplan.export.registry import EXPORTERS, Export, Exporter, export_plan, register
from moeplan.plan import load_plan

TARGETS = tuple(EXPORTERS)

__all__ = ["EXPORTERS", "TARGETS", "Export", "Exporter", "export_file", "export_plan", "pipeline_stages", "register"]


def export_file(path: str | Path, target: str) -> Export:
    """:func:`export_plan` of the plan file ``path``. Raises PlanError with one line for a file that is not a valid
    plan (:func:`moeplan.plan.load_plan`) or an unknown ``target``."""
    return export_plan(load_plan(path), target)
