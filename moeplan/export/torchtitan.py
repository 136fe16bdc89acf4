"""``--to torchtitan``: the ``[training]``, ``[parallelism]`` and ``[activation_checkpoint]`` sections of a torchtitan
TOML job config (torchtitan/config/job_config.py)."""
from __future__ import annotations

import json

from moeplan.export.common import _op_notes, _whole_layer_mode, pipeline_stages, placement_note
from moeplan.export.registry import Export, register
from moeplan.plan import Plan

TORCH_SCHEDULES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zero-bubble": "InterleavedZeroBubble",
                   "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}  # torch ... schedules.get_schedule_class
TORCHTITAN_FQNS = {"embedding": ["tok_embeddings"], "head": ["norm", "output"]}  # models/deepseek_v3/model/model.py




# ---- torchtitan -------------------------------------------------------------------------------------------------
def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # strings and lists of strings: JSON's syntax is TOML's for these


@register("torchtitan", source="torchtitan v0.2.2 (github.com/pytorch/torchtitan, 73a0e697), TOML job config")
def _torchtitan(plan: Plan) -> Export:
    """torchtitan v0.2.2 job-config sections (torchtitan/config/job_config.py: Training, Parallelism,
    ActivationCheckpoint; distributed/parallel_dims.py for ep / etp; distributed/pipeline_parallel.py for
    module_fqns_per_model_part and the schedule)."""
    lay, spec, notes = plan.layout, plan.model.spec, []
    if placed := placement_note(plan, "torchtitan"):
        notes.append(placed)
    pipelined = lay.pp > 1
    training = {"local_batch_size": lay.micro_batch * (lay.num_microbatches if pipelined else 1),
                "global_batch_size": lay.global_batch, "seq_len": lay.seq_len}
    fsdp = lay.dp_shard > 1
    par: dict[str, object] = {"data_parallel_replicate_degree": lay.dp // lay.dp_shard if fsdp else 1,
                              "data_parallel_shard_degree": lay.dp_shard if fsdp else lay.dp,
                              "tensor_parallel_degree": lay.tp, "context_parallel_degree": lay.cp,
                              "pipeline_parallel_degree": lay.pp}
    if fsdp:
        par["fsdp_reshard_after_forward"] = "default"  # after forward except under PP: what moeplan prices
    elif lay.dp > 1:
        notes.append("layout.dp: moeplan plans ZeRO-1 (replicated parameters, sharded optimizer states); torchtitan "
                     "shards with FSDP2 (parameters and gradients too), so its memory and DP traffic differ "
                     "(compile with --dp-shard for an FSDP plan)")
    if pipelined:
        par["pipeline_parallel_schedule"] = TORCH_SCHEDULES[plan.schedule.kind]
        par["pipeline_parallel_microbatch_size"] = lay.micro_batch
        fqns = []
        for s, names in enumerate(pipeline_stages(plan)):
            part = [f for n in names for f in TORCHTITAN_FQNS.get(n, [n] if n.startswith("layers.") else [])]
            fqns.append(part)
            if not part:
                notes.append(f"stage {s} ({', '.join(names)}) holds no torchtitan module")
        par["module_fqns_per_model_part"] = fqns
        notes.append(f"schedule.actions: torchtitan builds torch's own {par['pipeline_parallel_schedule']} order "
                     "and reads a schedule CSV only as compute_only; the plan's exact lists are `--to "
                     "torch-pipelining` (compute_comms)")
    if spec.num_mtp_layers:
        notes.append(f"model.spec.num_mtp_layers={spec.num_mtp_layers}: torchtitan's deepseek_v3 has no MTP module")
    if spec.is_moe:
        par["expert_parallel_degree"] = lay.expert_shards
        par["expert_tensor_parallel_degree"] = lay.etp
        if lay.etp not in (1, lay.tp):
            notes.append(f"layout.etp={lay.etp}: torchtitan supports etp = 1 or etp = tp only")
        disp = plan.comm.dispatcher
        if disp == "hierarchical":
            notes.append("comm.dispatcher='hierarchical': no torchtitan backend")
        else:
            par["expert_parallel_comm_backend"] = "deepep" if disp == "dedup" else "standard"
    if plan.schedule.kind == "dualpipev":
        par["pipeline_parallel_expert_parallel_overlap"] = "fb" in plan.comm.overlap
    for mech in plan.comm.overlap:
        if mech == "fb" and plan.schedule.kind != "dualpipev":
            notes.append("comm.overlap fb: torchtitan overlaps F and B only under DualPipeV")
        elif mech in ("shared-expert", "dp", "pp"):
            notes.append(f"comm.overlap {mech}: no torchtitan key (its own defaults apply)")
        elif mech != "fb":
            notes.append(f"comm.overlap {mech}: no torchtitan key")
    ac = _torchtitan_ac(plan, notes)
    body = "\n".join(f"[{name}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in sec.items())
                     for name, sec in (("training", training), ("parallelism", par), ("activation_checkpoint", ac)))
    return Export("torchtitan", body, tuple(notes), True)


def _torchtitan_ac(plan: Plan, notes: list[str]) -> dict[str, object]:
    mode = _whole_layer_mode(plan, notes)
    if mode == "selective":
        notes.append("recompute 'selective': torchtitan's op-level policy ('op') keeps attention and every other "
                     "matmul and re-runs the rest, not moeplan's set (norms, element-wise ops, core attention)")
        return {"mode": "selective", "selective_ac_option": "op"}
    if mode is not None:
        return {"mode": mode}
    notes.append(f"memory.ranks[*].recompute={[m.recompute for m in plan.memory.ranks]}: torchtitan has no per-op "
                 f"recompute or swap; 'full' keeps only each layer's input, at least what the plan frees")
    _op_notes(plan, {}, "torchtitan", notes)
    return {"mode": "full"}


