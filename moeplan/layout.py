"""Parallel layouts: how the devices are split (docs/architecture.md §4, "Layout search").

Rank order is TP innermost, then CP, then DP, then PP (Megatron-LM's default ``tp-cp-ep-dp-pp``), so a group's link
tier follows from its stride: TP has stride 1, CP stride ``tp``, DP stride ``tp·cp``, PP stride ``tp·cp·dp``.

Expert layout (MindSpeed / Megatron MoE parallel folding): ``ep`` is the expert-parallel degree taken from the
DP×CP ranks (MindSpeed's ``--expert-model-parallel-size``); ``etp`` is the expert tensor-parallel degree. The TP
group holds ``tp/etp`` different expert shards, so experts are split over ``expert_shards = ep·tp/etp`` ranks and
each expert's weights over ``etp`` ranks. ``etp == tp`` is expert-TP (Megatron's default); ``etp == 1 < tp`` is
MindSpeed's ``--moe-tp-extend-ep`` (Pangu Ultra MoE: TP 8, EP 4 → an expert group of 32, 8 experts per NPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from moeplan.errors import LayoutError


@dataclass(frozen=True)
class Layout:
    """One parallel layout. All fields are counts (degrees or sequences); ``global_batch`` is in sequences."""

    tp: int
    pp: int
    vpp: int
    ep: int
    etp: int
    cp: int
    dp: int
    micro_batch: int
    global_batch: int
    seq_len: int
    dp_shard: int = 1
    """FSDP / ZeRO-3 (torchtitan's ``data_parallel_shard_degree``): parameters, gradients and optimizer states
    sharded over ``dp_shard`` of the ``dp`` replicas (times cp), each layer's weights all-gathered for its forward
    and backward and its gradients reduce-scattered; ``dp / dp_shard`` replicas of that (HSDP). 1: ZeRO-1 (the
    distributed optimizer over dp·cp)."""
    expert_load: float = 1.0
    """Routed (token, expert) copies the busiest rank of the expert group computes per micro-batch, over the
    balanced share ``T·top_k/expert_shards`` (≥ 1; 1.0: balanced routing, every expert ``T·top_k/E`` tokens). Set
    from a load trace and the placement policy (moeplan.cost_models.load); the slowest rank sets the pace of the
    dispatch, the experts and the combine, and its activations are the ones that must fit (dropless routing)."""
    expert_replication: float = 1.0
    """Routed-expert parameters a device holds over its unreplicated share ``E/expert_shards`` (≥ 1; EPLB's
    redundant experts: ``(E/expert_shards + r)/(E/expert_shards)`` with ``r`` replicas per rank)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step on each pipeline: ``global_batch / (dp · micro_batch)``."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def sequence_parallel(self) -> bool:
        """Megatron sequence parallelism is on whenever tp > 1 (norms and dropout split over the sequence)."""
        return self.tp > 1

    @property
    def expert_shards(self) -> int:
        """Ranks the expert *count* is split over: ``ep · tp / etp``."""
        return self.ep * self.tp // self.etp

    @property
    def tp_extend_ep(self) -> bool:
        return self.etp < self.tp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel degree, ``world / (pp · ep · tp)`` (docs/references.md §4.2)."""
        return self.cp * self.dp // self.ep

    @property
    def fsdp_group(self) -> int:
        """Ranks a dense parameter is sharded over under FSDP: ``dp_shard · cp`` (torchtitan's ``dp_shard_cp``
        mesh); 1 without FSDP."""
        return self.dp_shard * self.cp if self.dp_shard > 1 else 1

    @property
    def expert_fsdp_group(self) -> int:
        """Ranks a routed expert's parameters are sharded over under FSDP: the FSDP group less what EP takes of it,
        ``dp_shard · cp / ep`` (torchtitan's ``dp_shard_mod_ep``), 1 when ep does not divide it."""
        f = self.fsdp_group
        return f // self.ep if f > 1 and f % self.ep == 0 else 1

    def short(self) -> str:
        return (f"tp{self.tp} pp{self.pp} vpp{self.vpp} ep{self.ep} etp{self.etp} cp{self.cp} dp{self.dp} "
                f"mb{self.micro_batch}" + (f" fsdp{self.dp_shard}" if self.dp_shard > 1 else ""))


MAX_DEVICES = 2**20
MAX_MICROBATCHES = 2**16
"""Micro-batches per replica and step: the schedule pass builds, and simulate walks, every rank's whole action list
(about 3·pp·vpp·m actions), so m must stay where a compile takes seconds (32,768 took 29 s on a 2-core machine);
published MoE runs use at most a few hundred (docs/inputs.md)."""
"""Largest device count: 1,048,576 (the largest clusters built: about 10^5 accelerators; docs/inputs.md)."""

REASONS = {
    "degree": "a degree below 1",
    "devices": "tp·cp·dp·pp is not the device count",
    "tp-heads": "tp does not divide the attention heads",
    "tp-kv-heads": "tp neither divides nor is a multiple of the KV heads",
    "tp-node": "tp exceeds the devices per node",
    "ep-dp-cp": "ep does not divide dp·cp",
    "etp-tp": "etp does not divide tp",
    "ep-experts": "the experts do not divide by ep·tp/etp",
    "ep-dense": "a dense model needs ep=1 and etp=tp",
    "cp-seq": "2·cp does not divide seq_len",
    "batch": "global_batch is not divisible by dp·micro_batch",
    "vpp-pp": "interleaving (vpp > 1) needs pp > 1",
    "microbatches": f"more than {2**16:,} micro-batches per replica",
    "dp-shard": "dp_shard does not divide dp",
    "chunks": "pp·vpp chunks exceed the layers",
    "model-states": "memory: model states exceed device memory",
    "memory": "memory: plan exceeds device memory under every recompute mode",
    "schedule": "schedule: no schedule the target runs fits pp, vpp and the micro-batches",
    "pass": "a pass of the pipeline refused the layout",
    "expert-load": "the placement policy cannot place the experts on this expert group (its replicas)",
    "runtime": "the target's runtime refuses the overlap in this setup (moeplan/runtimes.py)",
}
"""Each reason code of a :class:`Rejection`, in words: how the search reports its counts."""


@dataclass(frozen=True)
class Rejection:
    """Why a layout (or one option of it) was refused. ``reason``: a code of :data:`REASONS` (the search counts
    by it); ``figure``: the number the rule compared against (dp·cp for ``ep-dp-cp``, bytes per device for the
    memory reasons, ...), None when there is none; ``message``: the one line shown to the user, naming the field,
    its value and the rule."""

    reason: str
    figure: float | None
    message: str

    @property
    def summary(self) -> str:
        """The reason in words, without this layout's numbers."""
        return REASONS[self.reason]

    def error(self) -> LayoutError:
        """The LayoutError to raise for it (carrying it as ``rejection``)."""
        return LayoutError(self.message, rejection=self)


def _reject(reason: str, field: str, value: object, rule: str, figure: float | None = None) -> Rejection:
    return Rejection(reason, figure, f"{field}={value!r}: {rule}")


def layout_rejection(layout: Layout, *, num_devices: int, devices_per_node: int, num_heads: int, num_kv_heads: int,
                     num_experts: int, num_layer_slots: int) -> Rejection | None:
    """Why ``layout`` is invalid for the devices and the model (the first rule it breaks), or None when it is valid.

    ``num_layer_slots`` is the number of pipeline-placeable layers (decoder + MTP pieces), used to check that every
    one of the ``pp·vpp`` chunks can get at least one layer. Rules: every degree ≥ 1; the product of tp, cp, dp, pp
    equals ``num_devices``; tp divides the attention heads (and KV heads for GQA) and at most one node; ep divides
    dp·cp; etp divides tp; experts divide by ``ep·tp/etp``; the micro-batches divide the global batch; vpp > 1 needs
    pp > 1. Which schedules fit (pp, vpp, micro-batches) is the ``schedule`` pass's rule (passes/schedule.py).
    """
    lay = layout
    for f in ("tp", "pp", "vpp", "ep", "etp", "cp", "dp", "micro_batch", "global_batch", "seq_len"):
        v = getattr(lay, f)
        if v < 1:
            return _reject("degree", f, v, "must be a positive integer")
    if lay.world_size != num_devices:
        return _reject("devices", "devices", num_devices, f"must equal tp·cp·dp·pp = {lay.world_size} "
                       f"({lay.short()})", lay.world_size)
    if num_heads % lay.tp:
        return _reject("tp-heads", "tp", lay.tp, f"must divide the attention heads ({num_heads})", num_heads)
    if num_kv_heads and num_kv_heads % lay.tp and lay.tp % num_kv_heads:
        return _reject("tp-kv-heads", "tp", lay.tp, f"must divide or be a multiple of the KV heads ({num_kv_heads})",
                       num_kv_heads)
    if lay.tp > devices_per_node:
        return _reject("tp-node", "tp", lay.tp, f"must be <= devices per node ({devices_per_node})", devices_per_node)
    if (lay.dp * lay.cp) % lay.ep:
        return _reject("ep-dp-cp", "ep", lay.ep, f"must divide dp·cp ({lay.dp * lay.cp})", lay.dp * lay.cp)
    if lay.tp % lay.etp:
        return _reject("etp-tp", "etp", lay.etp, f"must divide tp ({lay.tp})", lay.tp)
    if num_experts and num_experts % lay.expert_shards:
        return _reject("ep-experts", "ep", lay.ep, f"experts ({num_experts}) must be divisible by ep·tp/etp = "
                       f"{lay.expert_shards}", lay.expert_shards)
    if not num_experts and (lay.ep > 1 or lay.etp != lay.tp):
        return _reject("ep-dense", "ep", lay.ep, "a dense model needs ep=1 and etp=tp")
    if lay.seq_len % lay.cp or (lay.cp > 1 and lay.seq_len % (2 * lay.cp)):
        return _reject("cp-seq", "cp", lay.cp, f"2·cp must divide seq_len ({lay.seq_len}) for load-balanced context "
                       f"parallel", lay.seq_len)
    if lay.global_batch % (lay.dp * lay.micro_batch):
        return _reject("batch", "global_batch", lay.global_batch,
                       f"must be divisible by dp·micro_batch = {lay.dp * lay.micro_batch}", lay.dp * lay.micro_batch)
    if lay.vpp > 1 and lay.pp == 1:
        return _reject("vpp-pp", "vpp", lay.vpp, "interleaving needs pp > 1")
    if lay.dp_shard < 1 or lay.dp % lay.dp_shard:
        return _reject("dp-shard", "dp_shard", lay.dp_shard, f"must divide dp = {lay.dp} (FSDP shards over dp_shard "
                       f"of the dp replicas)", lay.dp)
    if lay.num_microbatches > MAX_MICROBATCHES:
        return _reject("microbatches", "global_batch", lay.global_batch, f"gives {lay.num_microbatches:,} micro-batches "
                       f"per replica (global_batch / (dp·micro_batch)); at most {MAX_MICROBATCHES:,} (docs/inputs.md)",
                       MAX_MICROBATCHES)
    if lay.pp * lay.vpp > num_layer_slots:
        return _reject("chunks", "pp", lay.pp, f"pp·vpp = {lay.pp * lay.vpp} chunks exceed the {num_layer_slots} "
                       f"layers", num_layer_slots)
    return None


def check_layout(layout: Layout, **model: int) -> None:
    """Raise LayoutError (carrying its :class:`Rejection`) unless ``layout`` is valid; the arguments and rules are
    those of :func:`layout_rejection`."""
    rejection = layout_rejection(layout, **model)
    if rejection is not None:
        raise rejection.error()


def check_fixed_degrees(num_devices: int, *, tp: int | None = None, cp: int | None = None, pp: int | None = None,
                        ep: int | None = None) -> None:
    """Raise LayoutError when ``num_devices`` or the degrees the user fixed (None: searched) fit no layout at all,
    before any is enumerated: at most :data:`MAX_DEVICES` devices; the fixed tp, cp and pp must multiply to a
    divisor of the device count; a fixed ep must divide dp·cp, which divides ``devices / (tp·pp)``."""
    if num_devices > MAX_DEVICES:
        raise LayoutError(f"devices={num_devices}: must be <= 2^20 = {MAX_DEVICES:,} (more accelerators than any "
                          f"cluster holds; docs/inputs.md)")
    fixed = {n: v for n, v in (("tp", tp), ("cp", cp), ("pp", pp)) if v is not None}
    product = math.prod(fixed.values())
    if num_devices % product:
        names = "·".join(fixed)
        given = f" ({', '.join(f'{n}={v}' for n, v in fixed.items())})" if len(fixed) > 1 else ""
        raise LayoutError(f"devices={num_devices}: must be a multiple of {names} = {product}{given}")
    if ep is not None:
        outer = {n: v for n, v in fixed.items() if n != "cp"}
        rest = num_devices // math.prod(outer.values())
        if rest % ep:
            where = (f"the device count ({num_devices})" if not outer else
                     f"devices/{'·'.join(outer) if len(outer) == 1 else '(tp·pp)'} = {num_devices}/"
                     f"{math.prod(outer.values())} = {rest}")
            raise LayoutError(f"ep={ep}: must divide dp·cp, and every dp·cp divides {where}, which {ep} does not "
                              f"divide")
