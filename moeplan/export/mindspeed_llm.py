"""``--to mindspeed-llm``: MindSpeed-LLM arguments (Megatron-LM's plus MindSpeed's own)."""
from __future__ import annotations

from moeplan.export.common import (_Args, _common, _is_slot, _megatron_layout, _moe, _mtp_head_notes, _overlap,
                                   _recompute, _schedule_note, pipeline_stages, plan_setup)
from moeplan.export.registry import Export, register
from moeplan.plan import Plan
from moeplan.runtimes import RUNTIMES


@register("mindspeed-llm", source="MindSpeed-LLM c77308a1 (github.com/Ascend/MindSpeed-LLM, master, 2026-08-21) "
                                  "with MindSpeed 028de58c and Megatron-LM core_v0.12.1")
def export_mindspeed(plan: Plan) -> Export:
    """The plan as MindSpeed-LLM arguments, one flag per line; what MindSpeed-LLM cannot express, as notes."""
    args = _mindspeed(plan)
    return Export("mindspeed-llm", args.shell(), tuple(args.notes), True)


def _mindspeed(plan: Plan) -> _Args:
    """MindSpeed-LLM arguments: Megatron-LM core_v0.12.1's plus MindSpeed's (noop layers, num-layer-list,
    tp-extend-ep, fb overlap, DualPipeV, per-op recompute and swap). Conflicts follow MindSpeed's feature checks
    (mindspeed/features_manager/moe/fb_overlap.py, pipeline_parallel/dualpipev_feature.py)."""
    a, lay, spec = _Args(), plan.layout, plan.model.spec
    rt = "MindSpeed-LLM"
    fb = "fb" in RUNTIMES["mindspeed-llm"].allowed(plan_setup(plan))  # fb as exported: not when MindSpeed refuses it
    _common(plan, a)
    if lay.dp_shard > 1:
        a.drop("--data-parallel-sharding-strategy", f"layout.dp_shard={lay.dp_shard}: MindSpeed-LLM runs ZeRO-1 "
                                                     f"only (no Megatron-FSDP); this plan's FSDP layout cannot run")
    if plan.memory.precision.fp8_activation_input:
        a.notes.append("memory.precision.fp8_activation_input: no MindSpeed-LLM flag keeps the SwiGLU input in FP8")
    if plan.target.training_dtype == "fp8":
        a.notes.append("target.training_dtype='fp8': no FP8 GEMM recipe exported for MindSpeed-LLM (bf16 set)")
    if plan.schedule.kind == "dualpipev":
        a.add("--schedules-method", "dualpipev")
    _mindspeed_stages(plan, a)
    if spec.is_moe:
        if lay.tp_extend_ep and not fb:
            a.add("--expert-model-parallel-size", lay.ep)
            a.add("--moe-tp-extend-ep")
        else:
            a.add("--expert-model-parallel-size", lay.expert_shards)
            a.add("--expert-tensor-parallel-size", lay.etp)
            if lay.tp_extend_ep:
                a.notes.append("layout.tp_extend_ep: --moe-tp-extend-ep is refused with --moe-fb-overlap; the same "
                               "expert grid is set by MoE parallel folding (expert-model-parallel-size ep·tp/etp)")
        _moe(plan, a)
        disp = plan.comm.dispatcher
        if disp == "flat":
            a.add("--moe-token-dispatcher-type", "alltoall")
        else:
            a.notes.append(f"comm.dispatcher={disp!r}: no flag of this MindSpeed-LLM selects it ("
                           + ("--moe-hierarchical-alltoallv exists only up to MindSpeed 2.0.0_core_r0.8.0"
                              if disp == "hierarchical" else "DeepEP's deduplicating dispatch is CUDA-only")
                           + "); choose --moe-token-dispatcher-type")
    if spec.sandwich_norm:
        a.add("--post-norm")  # mindspeed_llm/features_manager/models/module.py: a norm after attention and MLP
        a.spec_used.add("sandwich_norm")
    if spec.routing == "moge":
        a.notes.append("model.spec.routing='moge' (grouped top-k per expert group): no MindSpeed-LLM router flag")
    _schedule_note(plan, a, rt, ("1f1b", "interleaved", "dualpipev"))
    _recompute(plan, a, rt)
    _overlap(plan, a, "--moe-fb-overlap", RUNTIMES["mindspeed-llm"])
    if a.has("--moe-fb-overlap"):
        a.drop("--swap-attention", "MindSpeed refuses it with --moe-fb-overlap (mindspeed/features_manager/moe/"
                                   "fb_overlap.py)")
        per_stage = a.value("--num-layers-per-virtual-pipeline-stage")
        if a.has("--noop-layers") and per_stage:
            noop = [int(i) for i in a.value("--noop-layers")[0].split(",")]
            if min(noop) < int(a.value("--num-layers")[0]) - int(per_stage[0]):
                a.drop("--moe-fb-overlap", "MindSpeed refuses --noop-layers outside the last VPP stage with it "
                                           "under VPP (fb_overlap.py); the plan's prediction counts fb")
    if plan.schedule.kind == "dualpipev":
        a.drop("--swap-attention", "MindSpeed refuses it with DualPipeV (dualpipev_feature.py)")
    a.note_unused_spec(plan, rt)
    return a


def _mindspeed_stages(plan: Plan, a: _Args) -> None:
    """Layer split: equal decoder-slot counts → ``--num-layers`` with ``--noop-layers`` (empty layers, and the MTP
    block's slot: MindSpeed-LLM runs the MTP module after the last decoder layer, on the last stage); otherwise
    ``--num-layer-list`` (no VPP) or the Megatron layout string MindSpeed accepts (pipeline_model_parallel_layout
    feature; not with DualPipeV, whose split is even)."""
    lay, spec = plan.layout, plan.model.spec
    stages = pipeline_stages(plan)
    slots = [[n for n in names if _is_slot(n)] for names in stages]
    v, dualpipev = plan.stages.placement == "v", plan.schedule.kind == "dualpipev"
    dense = spec.is_moe and spec.num_dense_layers
    if v and not dualpipev:
        a.notes.append("stages.placement='v' without DualPipeV: MindSpeed-LLM places VPP chunks in a loop; the "
                       "plan's stage split is not passed")
    uniform = len({len(s) for s in slots}) == 1 and (not v or dualpipev)
    if uniform or (lay.vpp == 1 and not v):
        _mtp_on_last_stage(stages, a)
    if uniform:
        flat = [n for s in slots for n in s]
        a.add("--num-layers", len(flat))
        noop = [i for i, n in enumerate(flat) if not n.startswith("layers.")]
        if noop:
            a.add("--noop-layers", ",".join(map(str, noop)))
        if lay.vpp > 1 and not v:
            a.add("--num-layers-per-virtual-pipeline-stage", len(slots[0]))
        if dense:
            a.add("--first-k-dense-replace", flat.index(f"layers.{spec.num_dense_layers}"))
            a.add("--moe-layer-freq", 1)
        return
    a.add("--num-layers", spec.num_layers)
    if dense:
        a.add("--first-k-dense-replace", spec.num_dense_layers)
        a.add("--moe-layer-freq", 1)
    if v:
        if dualpipev:
            a.notes.append("stages: uneven decoder-layer counts under DualPipeV; MindSpeed-LLM splits the layers "
                           "evenly")
    elif lay.vpp == 1:
        a.add("--num-layer-list", ",".join(str(sum(n.startswith("layers.") for n in s)) for s in stages))
    else:
        a.add("--pipeline-model-parallel-layout", _megatron_layout(stages))
        _mtp_head_notes(stages, lay.pp, a)


def _mtp_on_last_stage(stages: list[list[str]], a: _Args) -> None:
    last = len(stages) - 1
    for s, names in enumerate(stages):
        for n in names:
            if n.startswith(("mtp.", "mtp_head.")) and s != last:
                a.notes.append(f"{n} on stage {s}: MindSpeed-LLM runs the MTP module on the last stage ({last})")


