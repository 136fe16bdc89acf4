"""``--to torch-pipelining``: the per-PP-rank action CSV torch.distributed.pipelining's
``_PipelineScheduleRuntime._load_csv(path, format="compute_comms")`` reads."""
from __future__ import annotations

import csv
import io
from collections import defaultdict

from moeplan.actions import OVERLAP, compute_parts, parse_action
from moeplan.export.registry import Export, register
from moeplan.plan import Plan

# ---- torch.distributed.pipelining CSV ------------------------------------------------------------------------------
def with_reduce_grad(plan: Plan) -> list[list[str]]:
    """The plan's action lists with ``{s}REDUCE_GRAD`` right after stage ``s``'s last backward (B or W, also inside
    an OVERLAP_F_B pair), as torch's compute_only lowering ``_add_reduce_grad`` places it. In the compute_comms
    format nothing adds it, and it is where ``_PipelineScheduleRuntime`` scales the gradients by 1/n_microbatches
    (``scale_grads``) and finishes an FSDP stage's gradient reduction (``perform_reduce_grad``)."""
    out = []
    for row in plan.schedule.actions:
        done: dict[int, int] = defaultdict(int)
        lowered = []
        for action in row:
            lowered.append(action)
            for part in compute_parts(action):
                if part.kind in ("B", "W"):
                    done[part.stage] += 1
                    if done[part.stage] == plan.layout.num_microbatches:
                        lowered.append(f"{part.stage}REDUCE_GRAD")
        out.append(lowered)
    return out


@register("torch-pipelining",
          source="torch.distributed.pipelining _PipelineScheduleRuntime._load_csv(format='compute_comms')")
def _torch_pipelining(plan: Plan) -> Export:
    """One CSV row per PP rank: the plan's actions, already in ``_Action.from_str`` notation (OVERLAP_F_B included;
    a V placement's hand-over between a rank's own stages carries no SEND/RECV, torch's "V-schedule special case"),
    plus the REDUCE_GRAD actions of :func:`with_reduce_grad`."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(with_reduce_grad(plan))
    lay = plan.layout
    notes = [f"load on every PP rank with _PipelineScheduleRuntime(stages, n_microbatches={lay.num_microbatches}, "
             f"...)._load_csv(path, format='compute_comms'); {lay.pp * lay.vpp} stages, "
             f"{plan.stages.placement} placement, layers per stage as in the plan's stages; REDUCE_GRAD added "
             f"after each stage's last backward"]
    if any(parse_action(a).kind == OVERLAP for row in plan.schedule.actions for a in row):
        notes.append("OVERLAP_F_B: the runtime runs a pair's F and B one after the other unless a function is "
                     "registered for it (register_custom_function), so the plan's fb overlap is not reproduced")
    return Export("torch-pipelining", out.getvalue(), tuple(notes), False)
