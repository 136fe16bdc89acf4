"""Checkpoints with ``torch.distributed.checkpoint`` (docs/architecture.md §7): complete or absent, never half-written.

Layout on disk: ``{dir}/step-{NNNNNNNN}/`` holds one DCP checkpoint (``.metadata`` plus one file per rank) and
``moeplan.json`` (the step and the layout that wrote it). Every rank writes into ``{dir}/.step-{NNNNNNNN}.tmp/``;
after ``dcp.save`` returns on every rank (the coordinator has written ``.metadata``) and a barrier, rank 0 renames
the folder (an atomic ``rename`` on one filesystem), so a crash at any point leaves either the complete folder or
no folder of that step. :func:`newest_checkpoint` ignores temporary folders.

State keys are prefixed with the global rank (``rank3/model/1/layers.4.mlp.experts.w1``), so nothing is treated as
replicated across ranks and every rank restores exactly its own tensors; resuming therefore needs the same layout,
which :func:`load_checkpoint` checks.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from moeplan.errors import PlanError
from moeplan.plan import PlanLayout

_STEP_DIR = re.compile(r"^step-(\d{8})$")
INFO_FILE = "moeplan.json"


@dataclass(frozen=True)
class CheckpointRef:
    """A complete checkpoint: the step it was taken after (1-based count of finished steps) and its folder."""

    step: int
    path: Path


def rank_state(rank: int, modules: Mapping[int, nn.ModuleDict], optim_state: Mapping[str, torch.Tensor],
               step: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of this rank to save or load into (live tensors: loading restores them in place)."""
    state: dict[str, torch.Tensor] = {f"rank{rank}/step": step}
    for stage, layers in modules.items():
        for name, p in layers.named_parameters():
            state[f"rank{rank}/model/{stage}/{name}"] = p.data
    for name, t in optim_state.items():
        state[f"rank{rank}/optim/{name}"] = t
    return state


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def save_checkpoint(state: dict[str, torch.Tensor], *, root: str | Path, step: int, layout: PlanLayout) -> Path:
    """Collective: write ``state`` of every rank as the checkpoint of ``step``; returns its final folder."""
    root = Path(root)
    tmp, final = root / f".step-{step:08d}.tmp", _step_dir(root, step)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a killed run
    dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / INFO_FILE).write_text(json.dumps({"step": step, "layout": layout.model_dump()}))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    dist.barrier()
    return final


def newest_checkpoint(root: str | Path) -> CheckpointRef | None:
    """The complete checkpoint with the highest step under ``root``, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = [CheckpointRef(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / ".metadata").is_file() and (p / INFO_FILE).is_file()]
    return max(found, key=lambda c: c.step, default=None)


def check_layout(ref: CheckpointRef, layout: PlanLayout) -> None:
    """Raise PlanError (one line) unless ``ref`` was written by ``layout``."""
    info = json.loads((ref.path / INFO_FILE).read_text())
    if info["layout"] != layout.model_dump():
        changed = sorted(k for k, v in layout.model_dump().items() if info["layout"].get(k) != v)
        raise PlanError(f"checkpoint={str(ref.path)!r}: written by another layout ("
                        + ", ".join(f"{k}={info['layout'].get(k)} vs {getattr(layout, k)}" for k in changed)
                        + "); resume needs the same layout")


def load_checkpoint(state: dict[str, torch.Tensor], ref: CheckpointRef, *, layout: PlanLayout) -> None:
    """Collective: restore ``state`` in place from ``ref``. Raises PlanError if another layout wrote it."""
    check_layout(ref, layout)
    dcp.load(state, checkpoint_id=str(ref.path))
