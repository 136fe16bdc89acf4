"""Pass ``simulate``: predict the step from the schedule with the timeline simulator (docs/architecture.md §5 "timeline";
docs/step-model.md).

It builds each stage's program and the DP and optimizer figures with cost_models/step.py, simulates one PP group's
action lists (cost_models/timeline.py) and sums the step.

MFU uses Megatron-LM's causal model FLOPs without MTP (docs/references.md §4.1): flops_per_token · tokens / (step · devices ·
bf16 peak). HFU counts what the devices execute: traced forward + backward FLOPs of every layer (MTP and router
included) plus recompute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

from moeplan.cost_models.timeline import simulate
from moeplan.cost_models.timeline_types import Timeline, overlap_rate_of
from moeplan.flops import flops_per_token
from moeplan.state import PlanState, Prediction

from moeplan.cost_models.step import (DpCollective, dp_collectives, dp_exposure, optimizer_s, run_settings,
                                     stage_programs)


@dataclass(frozen=True)
class SimulatePass:
    """Simulate one PP group's step and fill ``prediction``. ``stop_above_s``: raise
    :class:`~moeplan.cost_models.timeline.StepExceeded` once the step is known to exceed it (the layout search)."""

    name: ClassVar[str] = "simulate"
    requires: ClassVar[tuple[str, ...]] = ("sharding", "stages", "memory", "schedule")
    provides: ClassVar[tuple[str, ...]] = ("prediction",)
    stop_above_s: float = float("inf")

    def run(self, state: PlanState) -> PlanState:
        assert state.sharding and state.stages and state.memory and state.schedule
        lay, spec, tgt = state.layout, state.graph.spec, state.target
        programs, flops_per_mb = stage_programs(state)
        tl = simulate(state.schedule.actions, stages=programs, settings=run_settings(state),
                      stop_above_s=self.stop_above_s)
        overlap = "dp" in state.strategy.overlap
        dp = [dp_collectives(state, r) for r in range(lay.pp)]
        exposure = [dp_exposure(dp[r], tl=tl, rank=r, overlap=overlap) for r in range(lay.pp)]
        opt = [optimizer_s(state, r) for r in range(lay.pp)]
        rank_step = [tl.rank_end_s[r] + exposure[r][0] + exposure[r][1] + opt[r] for r in range(lay.pp)]
        step = max(max(rank_step), tl.step_time_s + max(w for _, w in exposure))
        tokens = lay.global_batch * lay.seq_len
        peak = tgt.cube_flops
        model_flops = flops_per_token(spec, seq_len=lay.seq_len) * tokens
        executed = sum(flops_per_mb) * lay.num_microbatches * lay.tp * lay.cp * lay.dp
        comm = _comm_summary(tl, dp, exposure, opt, lay.pp)
        pred = Prediction(
            step_time_s=step, tokens_per_s=tokens / step, mfu=model_flops / (step * lay.world_size * peak),
            hfu=executed / (step * lay.world_size * peak), bubble=tl.bubble,
            peak_memory_bytes=tuple(m.total_bytes for m in state.memory.stages),
            exposed_comm_s={c: v["exposed_s"] for c, v in comm.items()}, model_flops_per_step=model_flops,
            comm=comm, host_wait_s=sum(tl.host_wait_s) / lay.pp, optimizer_s=max(opt))
        return state.with_(prediction=pred)


def _comm_summary(tl: Timeline, dp: Sequence[Sequence[DpCollective]], exposure: Sequence[tuple[float, float]],
                  opt: Sequence[float], pp: int) -> dict[str, dict[str, float | None]]:
    """Per comm class, averaged over PP ranks: total and exposed seconds and overlap rate over the step and in the
    steady state, and bytes per tier; ``dp`` from the DP collectives (exposed: what they add to the step) plus, under
    FSDP, the per-layer gathers and reduce-scatters the timeline ran (class ``dp`` there too)."""
    out: dict[str, dict[str, float | None]] = {}
    for cls, s in tl.comm.items():
        out[cls] = {"total_s": s.total_s, "exposed_s": s.exposed_s, "overlap_rate": s.overlap_rate,
                    "steady_total_s": s.steady_total_s, "steady_exposed_s": s.steady_exposed_s,
                    "steady_overlap_rate": s.steady_overlap_rate, "intra_bytes": s.intra_bytes,
                    "inter_bytes": s.inter_bytes}
    layers = out.get("dp", {})  # FSDP's per-layer gathers and reduce-scatters, simulated in the timeline
    total = sum(o.time_s for ops in dp for o in ops) / pp + (layers.get("total_s") or 0.0)
    exposed = sum(a + b for a, b in exposure) / pp + (layers.get("exposed_s") or 0.0)
    out["dp"] = {"total_s": total, "exposed_s": exposed,
                 "overlap_rate": overlap_rate_of(exposed, total),
                 "steady_total_s": layers.get("steady_total_s") or 0.0,
                 "steady_exposed_s": layers.get("steady_exposed_s") or 0.0,
                 "steady_overlap_rate": layers.get("steady_overlap_rate"),
                 "intra_bytes": sum(o.wire_bytes for ops in dp for o in ops if o.tier == "intra") / pp
                 + (layers.get("intra_bytes") or 0.0),
                 "inter_bytes": sum(o.wire_bytes for ops in dp for o in ops if o.tier == "inter") / pp
                 + (layers.get("inter_bytes") or 0.0)}
    return out
