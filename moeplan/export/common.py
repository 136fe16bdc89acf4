"""What the exporters share: views of the plan (its pipeline stages, its per-op recompute and swap decisions) and
the argument list and flags Megatron-LM and MindSpeed-LLM have in common."""
from __future__ import annotations

import shlex
from collections import defaultdict
from dataclasses import dataclass, field

from moeplan.plan import Plan
from moeplan.runtimes import Runtime, Setup

#: --recompute-modules values each parser accepts (megatron/core/transformer/transformer_config.py, allowed_modules)
MEGATRON_MODULES = frozenset({"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"})
MEGATRON_012_MODULES = frozenset({"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe"})
#: MindSpeed / MindSpeed-LLM flags for single ops (mindspeed/features_manager/recompute, memory/swap_attention.py;
#: mindspeed_llm/features_manager/transformer/multi_latent_attention/mla_feature.py)
MINDSPEED_OP_FLAGS = frozenset({"--recompute-norm", "--recompute-activation-function", "--recompute-mla-up-proj",
                                "--swap-attention", "--mla-swap-core-attn-out"})
WHOLE_LAYER = ("none", "selective", "full")  # weakest first


# ---- shared views of the plan -------------------------------------------------------------------------------------
def pipeline_stages(plan: Plan) -> list[list[str]]:
    """Layer names of each pipeline stage, indexed by stage id (``PlanStages``: ``c·pp + r`` for the loop
    placement; ``r`` and ``2·pp − 1 − r`` for the ``v`` placement)."""
    return plan.stages.by_stage()


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
        placed = placement_note(plan, runtime)
        if placed:
            self.notes.append(placed)


def placement_note(plan: Plan, runtime: str) -> str | None:
    """What an export cannot carry of a plan whose experts are placed by their load (docs/load-balance.md §4): the
    runtimes place routed experts contiguously and do not rebalance them, so the plan's per-layer placement, its
    rebalancing and the step it predicts with them hold in moeplan's runtime only. None for a contiguous placement
    that stays."""
    load = plan.experts.load
    if load is None or (load.policy == "contiguous" and load.rebalance is None):
        return None
    what = (f"experts.load.policy={load.policy!r}" if load.rebalance is None else
            f"experts.load.rebalance.every={load.rebalance.every}")
    return (f"{what}: {runtime} places the routed experts contiguously and does not move them; the plan's "
            f"per-layer placement and rebalancing are not passed and its predicted step assumes them (MindSpeed's "
            f"own dynamic placement is --enable-expert-placement)")


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


OVERLAP_FLAGS = {"shared-expert": ("--moe-shared-expert-overlap",), "dp": ("--overlap-grad-reduce",
                                                                          "--overlap-param-gather")}
"""Megatron-LM's (and MindSpeed-LLM's) flags of the overlap mechanisms but fb, whose flag differs between them."""


def plan_setup(plan: Plan) -> Setup:
    """The plan as the rules of moeplan/runtimes.py see it (the recompute modes of its PP ranks included)."""
    return Setup.of(plan.layout, plan.schedule.kind, plan.comm.dispatcher, plan.comm.overlap,
                    tuple(m.recompute for m in plan.memory.ranks))


def _overlap(plan: Plan, a: _Args, fb_flag: str, rt: Runtime) -> None:
    """Overlap mechanisms (docs/step-model.md §2): shared-expert, fb, dp as flags; pp as Megatron's p2p overlap,
    which exists only in the interleaved schedule and cannot be turned off at pp 2 (megatron/training/arguments.py
    validate_args); a note for any other registered mechanism (moeplan/mechanisms.py). A mechanism the runtime
    refuses in the plan's setup (moeplan/runtimes.py, the rules the search obeys for a target of this runtime) gets
    no flag, only a note: the export never asks for a combination the runtime refuses at start-up."""
    lay, spec, overlap = plan.layout, plan.model.spec, plan.comm.overlap
    refused: dict[str, list[str]] = {}
    for r in rt.decide(plan_setup(plan))[1]:
        refused.setdefault(r.mechanism, []).append(r.reason)
    for mech, reasons in refused.items():
        a.notes.append(f"comm.overlap {mech} left out: {'; '.join(reasons)}; the plan's prediction counts it "
                       f"(a target with runtime.name {rt.name} plans without it)")
    flags = {**OVERLAP_FLAGS, "fb": (fb_flag,)}
    for mech in ("shared-expert", "fb", "dp"):
        if mech not in overlap or mech in refused:
            continue
        if mech == "shared-expert" and not spec.num_shared_experts:
            a.notes.append("comm.overlap shared-expert: the model has no shared experts")
            continue
        for flag in flags[mech]:
            a.add(flag)
    interleaved = lay.vpp > 1 and plan.stages.placement == "loop"
    for mech in overlap:
        if mech not in ("shared-expert", "fb", "dp", "pp"):
            a.notes.append(f"comm.overlap {mech}: no {rt.title} flag")
    if lay.pp > 1 and ("pp" in overlap) != interleaved:
        if interleaved and lay.pp > 2:
            a.add("--no-overlap-p2p-communication")
        else:
            a.notes.append(f"comm.overlap {'with' if 'pp' in overlap else 'without'} pp: {rt.title} overlaps p2p "
                           f"{'only' if 'pp' in overlap else 'always'} in the interleaved schedule"
                           + (" at pp 2" if interleaved else ""))


def _megatron_layout(stages: list[list[str]]) -> str:
    """``--pipeline-model-parallel-layout``: per stage E (embedding), t (decoder layer), m (MTP block), L (head and
    loss), stages split by ``|`` (Megatron-LM pipeline_parallel_layer_layout.py parse_str_to_list). Empty layers
    and the MTP heads have no letter: the MTP loss is computed in the L stage."""
    def letter(n: str) -> str:
        return ("t" if n.startswith("layers.") else "m" if n.startswith("mtp.") else
                {"embedding": "E", "head": "L"}.get(n, ""))
    return "|".join("".join(letter(n) for n in names) for names in stages)


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
