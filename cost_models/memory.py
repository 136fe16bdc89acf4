"""Memory model: model states (params, grads, optimizer) and activations per device (docs/architecture.md §5, docs/references.md §4.2).

Mixed precision with Adam (Megatron Core distributed optimizer guide; ZeRO arXiv 1910.02054 §3.1;
docs/references.md §4.2): a bf16 parameter (2 bytes) and an fp32 gradient (4 bytes) per parameter on every holder,
plus fp32 main weights and Adam m, v (12 bytes) sharded by the distributed optimizer (ZeRO-1, Rajbhandari et al.
arXiv 1910.02054 §5.1) over the data-parallel group: dense parameters over dp·cp ranks, routed experts over the
expert-DP group. That is the "6 + 12/DP" bytes per parameter of docs/references.md §4.2.

Activations are not estimated by Megatron's dense formula: the planner sums the saved-for-backward bytes of each
traced operator (``LayerCost.saved_*_bytes``) times the micro-batches in flight, walked from the schedule's own
action order (:func:`peak_live_bytes`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from moeplan.cost_models.timeline import compute_parts

PARAM_BYTES = 2  # bf16 weights
GRAD_BYTES = 4  # fp32 gradient accumulation (Megatron --accumulate-allreduce-grads-in-fp32)
OPTIMIZER_BYTES = 12  # fp32 main weights + Adam m and v


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of parameters, gradients and optimizer states on one device."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def model_state_bytes(*, dense_params: float, expert_params: float, dense_dp: int, expert_dp: int,
                      distributed_optimizer: bool = True) -> ModelStateBytes:
    """Model-state bytes on one device holding ``dense_params`` + ``expert_params`` parameters.

    ``dense_dp`` is the group the dense optimizer states shard over (dp·cp), ``expert_dp`` the expert-DP group.
    Without the distributed optimizer every holder keeps all 18 bytes per parameter. Raises ValueError for a
    group size < 1.
    """
    if dense_dp < 1 or expert_dp < 1:
        raise ValueError(f"dense_dp={dense_dp}, expert_dp={expert_dp}: data-parallel groups must be >= 1")
    params = dense_params + expert_params
    if distributed_optimizer:
        opt = OPTIMIZER_BYTES * (dense_params / dense_dp + expert_params / expert_dp)
    else:
        opt = OPTIMIZER_BYTES * params
    return ModelStateBytes(PARAM_BYTES * params, GRAD_BYTES * params, opt)


def peak_live_bytes(actions: Sequence[str], stage_bytes: Mapping[int, float]) -> tuple[float, int]:
    """Walk one rank's action list: +activation bytes of the stage at each F, − at its B (or W for split backward).

    ``actions`` in torch.distributed.pipelining notation (``"3F7"``, ``"3B7"``, ``"3I7"``, ``"3W7"``, an
    ``OVERLAP_F_B`` pair counting its F before its B; comm actions are ignored). ``stage_bytes[s]`` is what one micro-batch keeps on stage ``s`` from F until its backward ends.
    Returns (peak bytes, peak number of in-flight (stage, micro-batch) pairs). The peak depends only on the order of
    the compute actions, not on their durations. Raises PlanError for an action that does not parse.
    """
    live = peak = 0.0
    count = peak_count = 0
    for text in actions:
        for a in compute_parts(text):
            if a.kind == "F":
                live += stage_bytes[a.stage]
                count += 1
            elif a.kind in ("B", "W"):
                live -= stage_bytes[a.stage]
                count -= 1
            peak = max(peak, live)
            peak_count = max(peak_count, count)
    return peak, peak_count
