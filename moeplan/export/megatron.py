"""``--to megatron``: Megatron-LM command-line arguments (megatron/training/arguments.py)."""
from __future__ import annotations

from moeplan.export.common import (_Args, _common, _megatron_layout, _moe, _mtp_head_notes, _overlap, _recompute,
                                   _schedule_note, pipeline_stages)
from moeplan.export.registry import Export, register
from moeplan.plan import Plan
from moeplan.runtimes import RUNTIMES


@register("megatron", source="Megatron-LM d98e8a64 (github.com/NVIDIA/Megatron-LM, main, 2026-08-22)")
def export_megatron(plan: Plan) -> Export:
    """The plan as Megatron-LM arguments, one flag per line; what Megatron-LM cannot express, as notes."""
    args = _megatron(plan)
    return Export("megatron", args.shell(), tuple(args.notes), True)


def _megatron(plan: Plan) -> _Args:
    """Megatron-LM arguments. Sources: megatron/training/arguments.py and the TransformerConfig checks of
    megatron/core/transformer/transformer_config.py (EP A2A overlap), pipeline_parallel_layer_layout.py (layout)."""
    a, lay, spec = _Args(), plan.layout, plan.model.spec
    rt = "Megatron-LM"
    _common(plan, a)
    if lay.dp_shard > 1:  # Megatron-FSDP (megatron/core/distributed/fsdp): ZeRO-3 over the DP (× CP) group
        a.add("--use-megatron-fsdp")
        if lay.dp_shard < lay.dp:
            a.notes.append(f"layout.dp_shard={lay.dp_shard} < dp={lay.dp} (HSDP): Megatron-FSDP shards over the "
                           f"whole DP group; set its hybrid sharding by hand")
    if plan.memory.precision.fp8_activation_input:
        a.notes.append("memory.precision.fp8_activation_input: TransformerConfig.activation_func_fp8_input_store, "
                       "which has no command-line flag (megatron/training/arguments.py); set it in the config")
    a.add("--num-layers", spec.num_layers)
    if plan.target.training_dtype == "fp8":
        a.add("--fp8-format", "e4m3")  # 1x128-tile scaled e4m3 GEMMs (DeepSeek-V3 §3.3): TE's blockwise recipe
        a.add("--fp8-recipe", "blockwise")
    _megatron_stages(plan, a)
    if spec.is_moe:
        a.add("--expert-model-parallel-size", lay.expert_shards)  # MoE parallel folding: expert shards
        a.add("--expert-tensor-parallel-size", lay.etp)
        if spec.num_dense_layers:
            a.add("--moe-layer-freq", f"([0]*{spec.num_dense_layers}+[1]*{spec.num_moe_layers})")
        _moe(plan, a)
        disp = plan.comm.dispatcher
        if disp == "flat":
            a.add("--moe-token-dispatcher-type", "alltoall")
        elif disp == "dedup":
            a.add("--moe-token-dispatcher-type", "flex")
            a.add("--moe-flex-dispatcher-backend", "deepep")
        else:
            a.notes.append(f"comm.dispatcher={disp!r} (MindSpeed's hierarchical all-to-all-v): no Megatron-LM "
                           f"dispatcher; choose --moe-token-dispatcher-type")
    if spec.routing == "moge":
        a.notes.append("model.spec.routing='moge' (grouped top-k per expert group): no Megatron-LM router")
    _schedule_note(plan, a, rt, ("1f1b", "interleaved"))
    _recompute(plan, a, rt)
    _overlap(plan, a, "--overlap-moe-expert-parallel-comm", RUNTIMES["megatron-lm"])
    a.note_unused_spec(plan, rt)
    return a


def _megatron_stages(plan: Plan, a: _Args) -> None:
    lay, spec = plan.layout, plan.model.spec
    if lay.pp * lay.vpp == 1:
        return
    if plan.stages.placement == "v":
        a.notes.append("stages.placement='v': Megatron-LM places VPP chunks in a loop; the plan's stage split is "
                       "not passed")
        return
    stages = pipeline_stages(plan)
    decoders = [sum(n.startswith("layers.") for n in s) for s in stages]
    if not spec.num_mtp_layers and not plan.stages.empty_layers and len(set(decoders)) == 1:
        if lay.vpp > 1:
            a.add("--num-virtual-stages-per-pipeline-rank", lay.vpp)  # Megatron's own even split is the plan's
        return
    a.add("--pipeline-model-parallel-layout", _megatron_layout(stages))
    _mtp_head_notes(stages, lay.pp, a)
