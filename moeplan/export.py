"""``moeplan export``: a plan as the launch configuration of another training runtime (docs/export.md).

Targets, each checked against the named source (the flags and keys are listed in tests/fixtures/):

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

import csv
import io
import json
import shlex
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from moeplan.actions import compute_parts
from moeplan.errors import PlanError
from moeplan.plan import Plan, load_plan

TARGETS = ("megatron", "mindspeed-llm", "torchtitan", "torch-pipelining")
SOURCES = {
    "megatron": "Megatron-LM d98e8a64 (github.com/NVIDIA/Megatron-LM, main, 2026-08-22)",
    "mindspeed-llm": "MindSpeed-LLM c77308a1 (github.com/Ascend/MindSpeed-LLM, master, 2026-08-21) with MindSpeed "
                     "028de58c and Megatron-LM core_v0.12.1",
    "torchtitan": "torchtitan v0.2.2 (github.com/pytorch/torchtitan, 73a0e697), TOML job config",
    "torch-pipelining": "torch.distributed.pipelining _PipelineScheduleRuntime._load_csv(format='compute_comms')",
}
#: --recompute-modules values each parser accepts (megatron/core/transformer/transformer_config.py, allowed_modules)
MEGATRON_MODULES = frozenset({"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"})
MEGATRON_012_MODULES = frozenset({"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe"})
#: MindSpeed / MindSpeed-LLM flags for single ops (mindspeed/features_manager/recompute, memory/swap_attention.py;
#: mindspeed_llm/features_manager/transformer/multi_latent_attention/mla_feature.py)
MINDSPEED_OP_FLAGS = frozenset({"--recompute-norm", "--recompute-activation-function", "--recompute-mla-up-proj",
                                "--swap-attention", "--mla-swap-core-attn-out"})
WHOLE_LAYER = ("none", "selective", "full")  # weakest first
TORCH_SCHEDULES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zero-bubble": "InterleavedZeroBubble",
                   "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}  # torch ... schedules.get_schedule_class
TORCHTITAN_FQNS = {"embedding": ["tok_embeddings"], "head": ["norm", "output"]}  # models/deepseek_v3/model/model.py


@dataclass(frozen=True)
class Export:
    """One export: ``text`` is the runtime's artifact (argument lines, TOML or CSV); ``notes`` one line each on what
    that runtime cannot express; ``commented`` whether the notes go into ``document()`` as ``#`` lines."""

    target: str
    text: str
    notes: tuple[str, ...]
    commented: bool

    def document(self) -> str:
        """The file to write: the notes as a ``#`` header (text formats only), then the artifact."""
        if not self.commented:
            return self.text
        head = [f"# moeplan export --to {self.target} · {SOURCES[self.target]}"]
        if self.notes:
            head.append("# not expressed by this runtime (as planned by moeplan):")
            head += [f"#   - {n}" for n in self.notes]
        return "\n".join(head) + "\n" + self.text


def export_file(path: str | Path, target: str) -> Export:
    """:func:`export_plan` of the plan file ``path``. Raises PlanError with one line for a file that is not a valid
    plan (:func:`moeplan.plan.load_plan`) or an unknown ``target``."""
    return export_plan(load_plan(path), target)


def export_plan(plan: Plan, target: str) -> Export:
    """The plan as ``target``'s configuration (module docstring). Raises PlanError naming ``to`` when ``target`` is
    not one of :data:`TARGETS`."""
    if target not in TARGETS:
        raise PlanError(f"to={target!r}: must be one of {', '.join(TARGETS)}")
    if target == "torch-pipelining":
        return _torch_pipelining(plan)
    if target == "torchtitan":
        return _torchtitan(plan)
    args = _megatron(plan) if target == "megatron" else _mindspeed(plan)
    return Export(target, args.shell(), tuple(args.notes), True)


# ---- shared views of the plan -------------------------------------------------------------------------------------
def pipeline_stages(plan: Plan) -> list[list[str]]:
    """Layer names of each pipeline stage, indexed by stage id (``PlanStages``: ``c·pp + r`` for the loop
    placement; ``r`` and ``2·pp − 1 − r`` for the ``v`` placement)."""
    lay = plan.layout
    stages: list[list[str]] = [[] for _ in range(lay.pp * lay.vpp)]
    for r, chunks in enumerate(plan.stages.chunks):
        for c, names in enumerate(chunks):
            stages[plan.stages.stage_of(r, c)] = list(names)
    return stages


def _is_slot(name: str) -> bool:
    """A decoder-layer slot of moeplan's uniform split (passes/partition_stages.py SLOT_KINDS, plus empty layers)."""
    return name.startswith(("layers.", "mtp.", "empty."))


@dataclass
class _OpUse:
    ranks: set[int] = field(default_factory=set)
    saved_bytes: int = 0


def _op_decisions(plan: Plan) -> dict[tuple[str, str, str | None], _OpUse]:
    """(decision, op label, flag) → PP ranks that take it and the largest bytes it frees per layer and
    micro-batch, over the per-tensor decisions of every rank."""
    out: dict[tuple[str, str, str | None], _OpUse] = defaultdict(_OpUse)
    for r, rank in enumerate(plan.memory.ranks):
        for d in rank.decisions:
            for o in d.ops:
                use = out[(o.decision, o.label, o.flag)]
                use.ranks.add(r)
                use.saved_bytes = max(use.saved_bytes, o.saved_bytes)
    return dict(out)


def _alternatives(flag: str) -> list[tuple[str, tuple[str, ...]]]:
    """``PlanOpDecision.flag`` (``"--recompute-modules layernorm / --recompute-norm"``) as (flag, values) pairs,
    a parenthesised remark dropped."""
    out = []
    for alt in flag.split(" / "):
        words = alt.split(" (")[0].split()
        out.append((words[0], tuple(words[1:])))
    return out


def _ranks(ranks: set[int]) -> str:
    return ",".join(str(r) for r in sorted(ranks))


def _whole_layer_mode(plan: Plan, notes: list[str]) -> str | None:
    """The one whole-layer recompute mode a runtime with a single setting gets: the strongest of the ranks' modes
    (so every rank fits), noting ranks that planned less; None when the plan uses per-tensor modes."""
    modes = [m.recompute for m in plan.memory.ranks]
    if any(m not in WHOLE_LAYER for m in modes):
        return None
    mode = max(modes, key=WHOLE_LAYER.index)
    if len(set(modes)) > 1:
        notes.append(f"memory.ranks[*].recompute={modes}: one mode for every PP rank here; '{mode}' (the strongest) "
                     f"is set, so ranks that planned less recompute more")
    return mode


def _op_notes(plan: Plan, chosen: dict[str, str | None], runtime: str, notes: list[str]) -> None:
    """Notes for the per-tensor decisions: one line per decision listing the ops with no flag here (with their PP
    ranks and the largest bytes they free per layer and micro-batch), one per flag that applies to every layer
    while the plan takes the decision on some PP ranks only. ``chosen`` maps each decision's flag text to the flag
    emitted (None: none)."""
    all_ranks = {r for r, m in enumerate(plan.memory.ranks) if m.decisions}
    unflagged: dict[str, list[str]] = defaultdict(list)
    for (decision, label, flag), use in sorted(_op_decisions(plan).items(), key=lambda kv: kv[0][:2]):
        emitted = chosen.get(flag) if flag else None
        if emitted is None:
            unflagged[decision].append(f"'{label}' (ranks {_ranks(use.ranks)}; {use.saved_bytes:,} B)")
        elif use.ranks != all_ranks:
            notes.append(f"{decision} '{label}' on pp ranks {_ranks(use.ranks)} only: {emitted} applies to every "
                         f"layer")
    for decision, ops in unflagged.items():
        notes.append(f"{decision} with no {runtime} flag (pp ranks; largest bytes freed per layer and micro-batch): "
                     + ", ".join(ops))


# ---- Megatron-LM / MindSpeed-LLM argument lists ------------------------------------------------------------------
class _Args:
    """An ordered argument list with the notes that go with it."""

    def __init__(self) -> None:
        self.items: list[tuple[str, tuple[str, ...]]] = []
        self.notes: list[str] = []
        self.spec_used: set[str] = {"name", "seq_len", "global_batch"}

    def add(self, flag: str, *values: object) -> None:
        self.items.append((flag, tuple(str(v) for v in values)))

    def has(self, flag: str) -> bool:
        return any(f == flag for f, _ in self.items)

    def value(self, flag: str) -> tuple[str, ...] | None:
        return next((v for f, v in self.items if f == flag), None)

    def drop(self, flag: str, why: str) -> None:
        if self.has(flag):
            self.items = [(f, v) for f, v in self.items if f != flag]
            self.notes.append(f"{flag} left out: {why}")

    def shell(self) -> str:
        lines = [" ".join([f, *map(shlex.quote, v)]) for f, v in self.items]
        return "".join(f"{line} \\\n" for line in lines[:-1]) + (lines[-1] + "\n" if lines else "")

    def note_unused_spec(self, plan: Plan, runtime: str) -> None:
        spec = plan.model.spec
        left = [f"{k}={getattr(spec, k)!r}" for k, f in type(spec).model_fields.items()
                if k not in self.spec_used and getattr(spec, k) != f.default]
        if left:
            self.notes.append(f"model.spec {', '.join(left)}: no {runtime} flag")


def _precision(plan: Plan, a: _Args) -> None:
    """The recipe's model-state precision (``memory.precision``, cost_models/memory.py) in Megatron-LM's flags
    (megatron/training/arguments.py: ``--use-distributed-optimizer``, ``--grad-reduce-in-bf16``,
    ``--use-precision-aware-optimizer`` with ``--main-params-dtype`` fp32|fp16 and ``--exp-avg-dtype`` /
    ``--exp-avg-sq-dtype``; MindSpeed-LLM reads the same)."""
    prec = plan.memory.precision
    if plan.layout.dp_shard == 1 and prec.distributed_optimizer:
        a.add("--use-distributed-optimizer")
    if prec.grad_dtype == "bf16":
        a.add("--grad-reduce-in-bf16")
    if prec.main_params_dtype != "fp32" or prec.moments_dtype != "fp32":
        a.add("--use-precision-aware-optimizer")
        if prec.main_params_dtype == "fp16":
            a.add("--main-params-dtype", "fp16")
        elif prec.main_params_dtype == "bf16":
            a.notes.append("memory.precision.main_params_dtype='bf16': --main-params-dtype takes fp32 or fp16 only")
        if prec.moments_dtype != "fp32":
            a.add("--exp-avg-dtype", prec.moments_dtype)
            a.add("--exp-avg-sq-dtype", prec.moments_dtype)


def _common(plan: Plan, a: _Args) -> None:
    """Flags Megatron-LM and MindSpeed-LLM share: degrees, batch, precision, the dense model and MLA/GQA attention
    (megatron/training/arguments.py; the spec's fields per moeplan/spec.py)."""
    lay, spec, tgt = plan.layout, plan.model.spec, plan.target
    a.add("--tensor-model-parallel-size", lay.tp)
    a.add("--pipeline-model-parallel-size", lay.pp)
    a.add("--context-parallel-size", lay.cp)
    if lay.sequence_parallel:
        a.add("--sequence-parallel")
    _precision(plan, a)
    if lay.dp_shard > 1:
        a.add("--data-parallel-sharding-strategy", "optim_grads_params")  # ZeRO-3 sharding
    a.add("--micro-batch-size", lay.micro_batch)
    a.add("--global-batch-size", lay.global_batch)
    a.add("--seq-length", lay.seq_len)
    a.add("--max-position-embeddings", lay.seq_len)
    if tgt.training_dtype in ("bf16", "fp16", "fp8"):
        a.add("--fp16" if tgt.training_dtype == "fp16" else "--bf16")
    a.add("--hidden-size", spec.hidden_size)
    a.add("--num-attention-heads", spec.num_heads)
    if spec.num_dense_layers:
        a.add("--ffn-hidden-size", spec.dense_ffn_size)
    a.add("--vocab-size", spec.vocab_size)
    a.add("--normalization", "RMSNorm")  # moeplan/models/layers.py RMSNorm, SwiGLU, no biases, RoPE
    a.add("--norm-epsilon", spec.norm_eps)
    a.add("--swiglu")
    a.add("--disable-bias-linear")
    a.add("--position-embedding-type", "rope")
    if float(spec.rope_theta).is_integer():
        a.add("--rotary-base", int(spec.rope_theta))  # an int flag
        a.spec_used.add("rope_theta")
    if not spec.tie_embeddings:
        a.add("--untie-embeddings-and-output-weights")
    a.spec_used |= {"vocab_size", "hidden_size", "num_layers", "num_heads", "num_dense_layers", "dense_ffn_size",
                    "norm_eps", "tie_embeddings", "attention"}
    if spec.attention == "mla":
        a.add("--multi-latent-attention")
        if spec.q_lora_rank:
            a.add("--q-lora-rank", spec.q_lora_rank)
        a.add("--kv-lora-rank", spec.kv_lora_rank)
        a.add("--qk-head-dim", spec.qk_nope_head_dim)
        a.add("--qk-pos-emb-head-dim", spec.qk_rope_head_dim)
        a.add("--v-head-dim", spec.v_head_dim)
        a.add("--qk-layernorm")  # the q / kv latent norms (moeplan/models/attention.py q_a_norm, kv_norm)
        a.spec_used |= {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}
    else:
        a.add("--group-query-attention")
        a.add("--num-query-groups", spec.num_kv_heads)
        a.add("--kv-channels", spec.head_dim)
        a.spec_used |= {"num_kv_heads", "head_dim"}
    if spec.num_mtp_layers:
        a.add("--mtp-num-layers", spec.num_mtp_layers)
        a.spec_used.add("num_mtp_layers")


def _moe(plan: Plan, a: _Args) -> None:
    """Experts and router (Megatron-LM router semantics: moe_utils.topk_routing_with_score_function normalises the
    top-k probabilities of a sigmoid router and of a softmax over the top-k logits)."""
    spec = plan.model.spec
    if not spec.is_moe:
        return
    a.add("--num-experts", spec.num_experts)
    a.add("--moe-router-topk", spec.top_k)
    a.add("--moe-ffn-hidden-size", spec.moe_ffn_size)
    a.add("--moe-grouped-gemm")  # moeplan's IR runs the routed experts as one grouped GEMM
    if spec.num_shared_experts:
        a.add("--moe-shared-expert-intermediate-size", spec.shared_ffn_size)
    a.add("--moe-router-score-function", spec.router)
    if spec.router_scale != 1.0:
        a.add("--moe-router-topk-scaling-factor", spec.router_scale)
    if spec.routing == "group_limited":
        a.add("--moe-router-num-groups", spec.num_expert_groups)
        a.add("--moe-router-group-topk", spec.topk_groups)
        a.spec_used |= {"routing", "num_expert_groups", "topk_groups"}
    if spec.capacity_factor is not None:
        a.add("--moe-expert-capacity-factor", spec.capacity_factor)
    if spec.norm_topk_prob:
        a.spec_used.add("norm_topk_prob")
    elif spec.router == "softmax":
        a.add("--moe-router-pre-softmax")
        a.spec_used.add("norm_topk_prob")
    a.spec_used |= {"num_experts", "top_k", "moe_ffn_size", "num_shared_experts", "shared_ffn_size", "router",
                    "router_scale", "capacity_factor"}


def _schedule_note(plan: Plan, a: _Args, runtime: str, supported: tuple[str, ...]) -> None:
    kind = plan.schedule.kind
    if kind not in supported:
        a.notes.append(f"schedule.kind={kind!r}: {runtime} has no such schedule (it runs 1F1B, or interleaved 1F1B "
                       f"with VPP); the exact action lists are in `--to torch-pipelining`")


MINDSPEED_MODULE_FLAGS = {"layernorm": "--recompute-norm", "moe_act": "--recompute-activation-function",
                          "mla_up_proj": "--recompute-mla-up-proj"}
"""MindSpeed-LLM's own flags for Megatron-LM's recompute modules (mindspeed/features_manager/recompute)."""


def _recompute_modules(plan: Plan, a: _Args, megatron: bool) -> None:
    """``--recompute modules:…``: Megatron-LM's ``--recompute-granularity selective --recompute-modules`` as
    planned; MindSpeed-LLM takes its own flag where it has one and the core_v0.12 modules otherwise."""
    modules = list(plan.memory.recompute_modules)
    if not megatron:
        for m in [m for m in modules if m in MINDSPEED_MODULE_FLAGS]:
            a.add(MINDSPEED_MODULE_FLAGS[m])
            modules.remove(m)
        for m in [m for m in modules if m not in MEGATRON_012_MODULES]:
            a.notes.append(f"memory.recompute_modules: {m!r} is not a MindSpeed-LLM (core_v0.12) recompute module")
            modules.remove(m)
    if modules:
        a.add("--recompute-granularity", "selective")
        a.add("--recompute-modules", *modules)


def _recompute(plan: Plan, a: _Args, runtime: str) -> None:
    """Recompute and swap flags: one whole-layer mode for every rank, or the per-op decisions' own flags
    (``PlanOpDecision.flag``, cost_models/saved_tensors.py flag_of)."""
    mode = _whole_layer_mode(plan, a.notes)
    megatron = runtime == "Megatron-LM"
    if plan.memory.recompute == "modules":
        _recompute_modules(plan, a, megatron)
        return
    if mode == "full":
        a.add("--recompute-granularity", "full")
        a.add("--recompute-method", "uniform")
        a.add("--recompute-num-layers", 1)
    elif mode == "selective":
        a.add("--recompute-granularity", "selective")
        if megatron:
            a.add("--recompute-modules", "core_attn", "layernorm")
            a.notes.append("recompute 'selective': moeplan also re-runs the SwiGLU activations of the dense FFN and "
                           "shared experts and other element-wise ops (rotary, residual adds); no module here")
        else:
            a.add("--recompute-modules", "core_attn")
            a.add("--recompute-norm")
            a.add("--recompute-activation-function")
            a.notes.append("recompute 'selective': moeplan also re-runs element-wise ops other than the "
                           "activations (rotary, residual adds); no flag here")
    if mode is not None:
        return
    modules: list[str] = []
    chosen: dict[str, str | None] = {}
    allowed = MEGATRON_MODULES if megatron else MEGATRON_012_MODULES
    for (_, _, flag) in _op_decisions(plan):
        if flag is None or flag in chosen:
            continue
        alts = _alternatives(flag)
        own = [n for n, _ in alts if n in MINDSPEED_OP_FLAGS and not megatron]  # MindSpeed's own flag first
        mods = [v[0] for n, v in alts if n == "--recompute-modules" and v and v[0] in allowed]
        chosen[flag] = own[0] if own else f"--recompute-modules {mods[0]}" if mods else None
        if own and not a.has(own[0]):
            a.add(own[0])
        elif not own and mods and mods[0] not in modules:
            modules.append(mods[0])
    if modules:
        a.add("--recompute-granularity", "selective")
        a.add("--recompute-modules", *modules)
    _op_notes(plan, chosen, runtime, a.notes)


def _overlap(plan: Plan, a: _Args, fb_flag: str, runtime: str) -> None:
    """Overlap mechanisms (docs/step-model.md §2): shared-expert, fb, dp as flags; pp as Megatron's p2p overlap,
    which exists only in the interleaved schedule and cannot be turned off at pp 2 (megatron/training/arguments.py
    validate_args)."""
    lay, spec, overlap = plan.layout, plan.model.spec, plan.comm.overlap
    if "shared-expert" in overlap:
        if spec.num_shared_experts:
            a.add("--moe-shared-expert-overlap")
        else:
            a.notes.append("comm.overlap shared-expert: the model has no shared experts")
    if "fb" in overlap:
        a.add(fb_flag)
    if "dp" in overlap:
        a.add("--overlap-grad-reduce")
        a.add("--overlap-param-gather")
    interleaved = lay.vpp > 1 and plan.stages.placement == "loop"
    if lay.pp > 1 and ("pp" in overlap) != interleaved:
        if interleaved and lay.pp > 2:
            a.add("--no-overlap-p2p-communication")
        else:
            a.notes.append(f"comm.overlap {'with' if 'pp' in overlap else 'without'} pp: {runtime} overlaps p2p "
                           f"{'only' if 'pp' in overlap else 'always'} in the interleaved schedule"
                           + (" at pp 2" if interleaved else ""))


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
    _overlap(plan, a, "--overlap-moe-expert-parallel-comm", rt)
    if a.has("--overlap-moe-expert-parallel-comm"):
        a.drop("--moe-shared-expert-overlap", "Megatron-LM refuses it with --overlap-moe-expert-parallel-comm")
        why = []
        if lay.expert_shards == 1:
            why.append("expert-model-parallel-size > 1")
        if lay.pp > 1 and (lay.vpp == 1 or plan.stages.placement == "v"):
            why.append("virtual pipeline stages when pp > 1")
        if a.has("--recompute-method"):
            why.append("no whole-layer recompute")
        if not a.has("--moe-token-dispatcher-type"):
            why.append("the alltoall or flex dispatcher")
        if why:
            a.notes.append(f"--overlap-moe-expert-parallel-comm needs {', '.join(why)}; Megatron-LM refuses this "
                           f"combination as planned")
    a.note_unused_spec(plan, rt)
    return a


def _megatron_layout(stages: list[list[str]]) -> str:
    """``--pipeline-model-parallel-layout``: per stage E (embedding), t (decoder layer), m (MTP block), L (head and
    loss), stages split by ``|`` (Megatron-LM pipeline_parallel_layer_layout.py parse_str_to_list). Empty layers
    and the MTP heads have no letter: the MTP loss is computed in the L stage."""
    def letter(n: str) -> str:
        return ("t" if n.startswith("layers.") else "m" if n.startswith("mtp.") else
                {"embedding": "E", "head": "L"}.get(n, ""))
    return "|".join("".join(letter(n) for n in names) for names in stages)


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


def _mtp_head_notes(stages: list[list[str]], pp: int, a: _Args) -> None:
    """What a Megatron layout string cannot place as planned: an MTP head away from the loss stage, an MTP block
    outside its rank's last VPP chunk (pipeline_parallel_layer_layout.py validate_layer_layout)."""
    loss = next(s for s, names in enumerate(stages) if "head" in names)
    vpp = len(stages) // pp
    for s, names in enumerate(stages):
        for n in names:
            if n.startswith("mtp_head.") and s != loss:
                a.notes.append(f"{n} on stage {s}: the layout computes the MTP logits and loss in the loss stage "
                               f"({loss})")
            if n.startswith("mtp.") and s // pp != vpp - 1:
                a.notes.append(f"{n} on pp rank {s % pp} chunk {s // pp}: the layout needs MTP in the last VPP "
                               f"chunk of its rank and is refused")


def _mindspeed(plan: Plan) -> _Args:
    """MindSpeed-LLM arguments: Megatron-LM core_v0.12.1's plus MindSpeed's (noop layers, num-layer-list,
    tp-extend-ep, fb overlap, DualPipeV, per-op recompute and swap). Conflicts follow MindSpeed's feature checks
    (mindspeed/features_manager/moe/fb_overlap.py, pipeline_parallel/dualpipev_feature.py)."""
    a, lay, spec = _Args(), plan.layout, plan.model.spec
    rt = "MindSpeed-LLM"
    fb = "fb" in plan.comm.overlap
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
    _overlap(plan, a, "--moe-fb-overlap", rt)
    if fb:
        why = "MindSpeed refuses it with --moe-fb-overlap (mindspeed/features_manager/moe/fb_overlap.py)"
        for flag in ("--overlap-grad-reduce", "--overlap-param-gather", "--swap-attention"):
            a.drop(flag, why)
        if lay.pp > 1 and lay.vpp == 1 and plan.schedule.kind != "dualpipev":
            a.notes.append("--moe-fb-overlap with pp > 1 needs virtual pipeline stages or DualPipeV; MindSpeed "
                           "refuses this combination as planned")
        per_stage = a.value("--num-layers-per-virtual-pipeline-stage")
        if a.has("--noop-layers") and per_stage:
            noop = [int(i) for i in a.value("--noop-layers")[0].split(",")]
            if min(noop) < int(a.value("--num-layers")[0]) - int(per_stage[0]):
                a.notes.append("--noop-layers outside the last VPP stage: MindSpeed refuses them with "
                               "--moe-fb-overlap under VPP (fb_overlap.py)")
        if spec.is_moe and (lay.etp != 1 or lay.expert_shards == 1):
            a.notes.append("--moe-fb-overlap needs expert-tensor-parallel-size 1 and expert parallelism; MindSpeed "
                           "refuses this combination as planned")
    if plan.schedule.kind == "dualpipev":
        a.drop("--overlap-grad-reduce", "MindSpeed refuses it with DualPipeV (dualpipev_feature.py)")
        a.drop("--overlap-param-gather", "it needs --overlap-grad-reduce")
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


# ---- torchtitan -------------------------------------------------------------------------------------------------
def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # strings and lists of strings: JSON's syntax is TOML's for these


def _torchtitan(plan: Plan) -> Export:
    """torchtitan v0.2.2 job-config sections (torchtitan/config/job_config.py: Training, Parallelism,
    ActivationCheckpoint; distributed/parallel_dims.py for ep / etp; distributed/pipeline_parallel.py for
    module_fqns_per_model_part and the schedule)."""
    lay, spec, notes = plan.layout, plan.model.spec, []
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
    if any("OVERLAP_F_B" in a for row in plan.schedule.actions for a in row):
        notes.append("OVERLAP_F_B: the runtime runs a pair's F and B one after the other unless a function is "
                     "registered for it (register_custom_function), so the plan's fb overlap is not reproduced")
    return Export("torch-pipelining", out.getvalue(), tuple(notes), False)
