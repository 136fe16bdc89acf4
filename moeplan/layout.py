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
    def tokens_per_microbatch(self) -> int:
        """Tokens of one micro-batch on one DP replica: ``micro_batch · seq_len``."""
        return self.micro_batch * self.seq_len

    def short(self) -> str:
        return (f"tp{self.tp} pp{self.pp} vpp{self.vpp} ep{self.ep} etp{self.etp} cp{self.cp} dp{self.dp} "
                f"mb{self.micro_batch}")


def _fail(field: str, value: object, rule: str) -> LayoutError:
    return LayoutError(f"{field}={value!r}: {rule}")


def check_layout(layout: Layout, *, num_devices: int, devices_per_node: int, num_heads: int, num_kv_heads: int,
                 num_experts: int, num_layer_slots: int) -> None:
    """Raise LayoutError unless ``layout`` is valid for the devices and the model.

    ``num_layer_slots`` is the number of pipeline-placeable layers (decoder + MTP pieces), used to check that every
    one of the ``pp·vpp`` chunks can get at least one layer. Rules: every degree ≥ 1; the product of tp, cp, dp, pp
    equals ``num_devices``; tp divides the attention heads (and KV heads for GQA) and at most one node; ep divides
    dp·cp; etp divides tp; experts divide by ``ep·tp/etp``; the micro-batches divide the global batch; vpp > 1 needs
    pp > 1. Which schedules fit (pp, vpp, micro-batches) is the ``schedule`` pass's rule (passes/schedule.py).
    """
    for f in ("tp", "pp", "vpp", "ep", "etp", "cp", "dp", "micro_batch", "global_batch", "seq_len"):
        v = getattr(layout, f)
        if v < 1:
            raise _fail(f, v, "must be a positive integer")
    if layout.world_size != num_devices:
        raise _fail("devices", num_devices, f"must equal tp·cp·dp·pp = {layout.world_size} ({layout.short()})")
    if num_heads % layout.tp:
        raise _fail("tp", layout.tp, f"must divide the attention heads ({num_heads})")
    if num_kv_heads and num_kv_heads % layout.tp and layout.tp % num_kv_heads:
        raise _fail("tp", layout.tp, f"must divide or be a multiple of the KV heads ({num_kv_heads})")
    if layout.tp > devices_per_node:
        raise _fail("tp", layout.tp, f"must be <= devices per node ({devices_per_node})")
    if (layout.dp * layout.cp) % layout.ep:
        raise _fail("ep", layout.ep, f"must divide dp·cp ({layout.dp * layout.cp})")
    if layout.tp % layout.etp:
        raise _fail("etp", layout.etp, f"must divide tp ({layout.tp})")
    if num_experts and num_experts % layout.expert_shards:
        raise _fail("ep", layout.ep, f"experts ({num_experts}) must be divisible by ep·tp/etp = {layout.expert_shards}")
    if not num_experts and (layout.ep > 1 or layout.etp != layout.tp):
        raise _fail("ep", layout.ep, "a dense model needs ep=1 and etp=tp")
    if layout.seq_len % layout.cp or (layout.cp > 1 and layout.seq_len % (2 * layout.cp)):
        raise _fail("cp", layout.cp, f"2·cp must divide seq_len ({layout.seq_len}) for load-balanced context parallel")
    if layout.global_batch % (layout.dp * layout.micro_batch):
        raise _fail("global_batch", layout.global_batch,
                    f"must be divisible by dp·micro_batch = {layout.dp * layout.micro_batch}")
    if layout.vpp > 1 and layout.pp == 1:
        raise _fail("vpp", layout.vpp, "interleaving needs pp > 1")
    if layout.pp * layout.vpp > num_layer_slots:
        raise _fail("pp", layout.pp, f"pp·vpp = {layout.pp * layout.vpp} chunks exceed the {num_layer_slots} layers")
