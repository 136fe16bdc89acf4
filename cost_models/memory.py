"""Device memory: the one model of what one device of a PP rank holds at its fullest point (docs/memory.md §1).

The layout search's estimate (moeplan/estimate.py), the ``plan-memory`` pass (passes/plan_memory.py), the search's
pruning and the views all price memory with the functions here, so they cannot disagree. Per device, bytes:

- **Model states** (:func:`model_state_bytes`), by the recipe's :class:`~moeplan.state.Precision`:
  parameters in the training dtype (2 bytes in bf16, fp16 and fp8 — FP8 GEMMs cast their weights on the fly —, 4
  in fp32); gradients in ``grad_dtype`` (Megatron-LM accumulates into an fp32 ``main_grad`` buffer unless
  ``--grad-reduce-in-bf16``; an fp32 model has fp32 gradients); the optimizer's master weights in
  ``main_params_dtype`` (none when the model trains in fp32: its weights are the master) and Adam's two moments in
  ``moments_dtype``. The distributed optimizer (ZeRO-1, Rajbhandari et al. arXiv 1910.02054 §5.1; Megatron-LM
  ``DistributedOptimizer``) shards master weights and moments, not the gradient buffer, over the data-parallel
  group: dense parameters over dp·cp, routed experts over the expert-DP group. With the defaults that is the
  ``6 + 12/DP`` bytes per parameter of docs/references.md §4.2.
- **Activations**: the saved-for-backward bytes of each traced operator (``LayerCost.saved_*_bytes``, or the
  per-tensor decisions of moeplan/memory_ilp.py) times the micro-batches each chunk holds, at the fullest point of
  the rank's action list (:func:`peak_live_bytes`); plus the **working set** of one layer's backward (what it
  re-makes under recompute, what comes back from host and the next layer's prefetch).
- **Workspace**: the largest op's output and its gradient alive at once (``LayerCost.workspace_bytes``).
- **FSDP** (``layout.dp_shard > 1``, :func:`fsdp_state_bytes`): parameters, gradients and moments live as shards
  only; the **gathered** term holds the unsharded copies in use (:func:`fsdp_gathered_bytes`).
- **Communication buffers** (:func:`comm_buffer_bytes`): each communicator the rank belongs to holds
  ``target.memory_overheads.communicator_bytes`` (HCCL: 2 × HCCL_BUFFSIZE; NCCL: channels × buffers); the expert
  group's all-to-all connects to every peer of the node, and a DeepEP ``dedup`` dispatcher holds its NVLink and
  RDMA buffers instead.
- **Runtime**: the device memory a training process holds before its first tensor (CUDA context, kernel
  modules, library workspaces; ``memory_overheads.runtime_bytes``).
- **Allocator**: the caching allocator's reserved-but-unallocated share (fragmentation,
  ``memory_overheads.allocator_fraction``) of what the step allocates and frees — activations, working set,
  workspace —, not of the model states' buffers, which are allocated once.

Each target figure carries its source in its YAML file and in docs/targets.md.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from operator import attrgetter, mul, sub
from typing import Iterable, Mapping, Sequence

from cachetools import LRUCache

from moeplan.actions import compute_parts
from moeplan.layout import Layout
from moeplan.state import LayerCost, Precision, Recompute, StageMemory, Strategy
from moeplan.targets import RuntimeSupport, Target

MODES: tuple[Recompute, ...] = ("none", "selective", "full")
"""The whole-layer recompute modes, cheapest first: keep every saved tensor; re-run norms, activation functions
and core attention (Megatron-LM selective recompute, arXiv 2205.05198 §5); keep only each layer's input (Chen et
al. arXiv 1604.06174)."""

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
GIB = 2**30


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of parameters, gradients and optimizer states (master weights + Adam moments) on one device."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def state_bytes_per_param(param_bytes: int, precision: Precision, always_master: bool = False
                          ) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter before sharding of the optimizer (module docstring):
    the optimizer's master weights exist when the parameters are narrower than them, or ``always_master`` (a
    runtime that copies them anyway: ``target.runtime.master_copy``)."""
    grad = max(param_bytes, DTYPE_BYTES[precision.grad_dtype])
    main = DTYPE_BYTES[precision.main_params_dtype]
    master = main if main > param_bytes or always_master else 0
    return param_bytes, grad, master + 2 * DTYPE_BYTES[precision.moments_dtype]


def model_state_bytes(*, dense_params: float, expert_params: float, dense_dp: int, expert_dp: int,
                      param_bytes: int = 2, precision: Precision = Precision(),
                      runtime: RuntimeSupport = RuntimeSupport()) -> ModelStateBytes:
    """Model-state bytes on one device holding ``dense_params`` + ``expert_params`` parameters (counts) whose
    weights are ``param_bytes`` wide, under the optimizer of ``runtime`` (what it copies: ``master_copy``,
    ``grad_shard_copy``, ``norm_weight_shard``).

    ``dense_dp`` is the group the dense optimizer states shard over (dp·cp), ``expert_dp`` the expert-DP group.
    Without the distributed optimizer every holder keeps the whole optimizer state. Raises ValueError for a group
    size < 1."""
    if dense_dp < 1 or expert_dp < 1:
        raise ValueError(f"dense_dp={dense_dp}, expert_dp={expert_dp}: data-parallel groups must be >= 1")
    p, g, o = state_bytes_per_param(param_bytes, precision, runtime.master_copy == "always")
    params = dense_params + expert_params
    shard = dense_params / dense_dp + expert_params / expert_dp if precision.distributed_optimizer else params
    grads = g * params + (4 * shard if runtime.grad_shard_copy else 0.0)
    return ModelStateBytes(p * params, grads, (o + (4 if runtime.norm_weight_shard else 0)) * shard)


def peak_live_bytes(actions: Sequence[str], stage_bytes: Mapping[int, float]) -> tuple[float, int]:
    """Walk one rank's action list: +activation bytes of the stage at each F, − at its B (or W for split backward).

    ``actions`` in torch.distributed.pipelining notation (``"3F7"``, ``"3B7"``, ``"3I7"``, ``"3W7"``, an
    ``OVERLAP_F_B`` pair counting its F before its B; comm actions are ignored). ``stage_bytes[s]`` is what one
    micro-batch keeps on stage ``s`` from F until its backward ends. Returns (peak bytes, peak number of in-flight
    (stage, micro-batch) pairs). The peak depends only on the order of the compute actions, not on their
    durations. Raises PlanError for an action that does not parse.
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


def in_flight_vectors(actions: Sequence[str], stages: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """The distinct counts of micro-batches in flight per chunk (``stages[c]``: chunk c's pipeline stage) after
    each forward of one rank's action list, without those another one covers (every count ≤ its counts). The
    activation peak of any per-chunk bytes is the largest of these vectors' sums (bytes are not negative). Cached
    per (list, stages), weighed by the list's length: the memory pass asks for each rank under each mode it tries,
    and a search for every layout of one schedule."""
    key = (tuple(actions), tuple(stages))
    found = _VECTORS.get(key)
    if found is None:
        found = (len(key[0]), vectors_of(((a.kind, a.stage) for text in key[0] for a in compute_parts(text)), stages))
        if found[0] <= _VECTORS.maxsize:
            _VECTORS[key] = found
    return found[1]


_VECTORS: LRUCache = LRUCache(maxsize=1 << 20, getsizeof=lambda found: found[0])
"""(actions its key holds, vectors) per (list, stages): at most 2^20 actions held (passes/schedule.py
``ACTIONS_HELD``)."""


def vectors_of(events: Iterable[tuple[str, int]], stages: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """:func:`in_flight_vectors` of a rank's compute actions given as (kind, stage) pairs in order."""
    where = {s: c for c, s in enumerate(stages)}
    live = [0] * len(stages)
    seen: set[tuple[int, ...]] = set()
    for kind, stage in events:
        if kind == "F":
            live[where[stage]] += 1
            seen.add(tuple(live))
        elif kind in ("B", "W"):
            live[where[stage]] -= 1
    # a vector another covers is covered by one of the vectors nothing covers (covering is transitive), and a
    # covering vector has the larger sum (counts are integers): so, by decreasing sum, keep each vector none of
    # those kept before covers
    kept: list[tuple[int, ...]] = []
    for v in sorted(seen, key=sum, reverse=True):
        if not any(all(x >= y for x, y in zip(w, v)) for w in kept):
            kept.append(v)
    return tuple(sorted(kept))


def activation_peak(vectors: Sequence[Sequence[int]], chunk_bytes: Sequence[float]) -> tuple[float, int]:
    """(bytes, micro-batch chunks in flight) at the fullest of ``vectors`` (:func:`in_flight_vectors`) when one
    micro-batch keeps ``chunk_bytes[c]`` on chunk ``c``."""
    best, count = 0.0, 0
    for v in vectors:
        b = sum(map(mul, v, chunk_bytes))
        if b > best or (b == best and sum(v) > count):
            best, count = b, sum(v)
    return best, count


@lru_cache(maxsize=1 << 16)
def _peak_bytes(vectors: tuple[tuple[int, ...], ...], chunk_bytes: tuple[float, ...]) -> float:
    """:func:`activation_peak`'s bytes, kept per arguments: the layout search asks it of the same in-flight vectors
    and chunk bytes for many layouts (moeplan/estimate.py)."""
    return activation_peak(vectors, chunk_bytes)[0]


def communicator_groups(layout: Layout) -> dict[str, int]:
    """The process groups of more than one rank a device belongs to, by name, with their sizes: the ones
    Megatron-LM's ``parallel_state`` and moeplan's runtime run collectives on (tp, cp, the dense DP group dp·cp,
    pp, the expert group ep·tp/etp, expert tensor parallelism etp when it is not the TP group, expert DP)."""
    groups = {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp * layout.cp, "pp": layout.pp,
              "ep": layout.expert_shards, "etp": layout.etp if layout.tp_extend_ep else 1,
              "expert_dp": layout.expert_dp}
    return {k: v for k, v in groups.items() if v > 1}


# DeepEP's buffers as Megatron-LM allocates them (megatron/core/transformer/moe/fused_a2a.py ``get_buffer`` @
# core_v0.15.0: the larger of the dispatch and combine configs' size hints), by DeepEP v1.2.1 (deep_ep/buffer.py,
# csrc/config.hpp): 20 SMs (Megatron ``moe_deepep_num_sms``) → 10 channels; up to 8 NVLink peers; 288 tokens
# buffered per channel and NVLink peer, 128 per RDMA rank (140 at 64 ranks); per token the hidden bytes plus 2 int
# source metadata, 128 × 8 + 128 × 4 + 128 × 4 bytes of top-k indices, weights and FP8 scales (16 more over RDMA,
# twice for send and receive); plus a fixed 32 MiB workspace (csrc/kernels/configs.cuh).
DEEPEP_CHANNELS, DEEPEP_NVL_TOKENS, DEEPEP_WORKSPACE = 10, 288, 2**25
DEEPEP_META_BYTES = 8 + 128 * 8 + 128 * 4 + 128 * 4


def deepep_bytes(*, hidden_size: int, group_size: int, stride: int, devices_per_node: int) -> float:
    """Device bytes of DeepEP's NVLink and RDMA buffers and workspace for an expert group of ``group_size`` ranks
    ``stride`` apart, rows of ``hidden_size`` bf16 values (the comment above; for DeepSeek-V3 at EP 64 the size
    hints are 377,677,824 + 367,550,720 bytes: tests/test_memory_model.py)."""
    hb = hidden_size * 2
    nvl = min(group_size, max(1, devices_per_node // stride), 8)
    rdma = -(-group_size * stride // devices_per_node) if group_size * stride > devices_per_node else 0
    nvl_bytes = (DEEPEP_CHANNELS * nvl * (2 * rdma + 3) * 4
                 + DEEPEP_CHANNELS * nvl * DEEPEP_NVL_TOKENS * (hb + DEEPEP_META_BYTES))
    tokens = 140 if rdma >= 8 else 128
    rdma_bytes = (DEEPEP_CHANNELS * rdma * 18 * 2 * 4 + DEEPEP_CHANNELS * rdma * tokens
                  * (hb + DEEPEP_META_BYTES + 16) * 2) if rdma else 0
    return -(-nvl_bytes // 128) * 128 + -(-rdma_bytes // 128) * 128 + DEEPEP_WORKSPACE  # 128-byte aligned


def comm_buffer_bytes(layout: Layout, strategy: Strategy, target: Target, *, hidden_size: int) -> float:
    """Device bytes the communication libraries hold (module docstring): one communicator per group of
    :func:`communicator_groups`; for the expert group's token exchange, DeepEP's buffers under the ``dedup``
    dispatcher on a CUDA target (:func:`deepep_bytes`), else the all-to-all's connections to each peer of the
    node (``memory_overheads.all_to_all_peer_bytes``)."""
    ovh = target.memory_overheads
    groups = communicator_groups(layout)
    total = len(groups) * ovh.communicator_bytes
    if "ep" in groups:
        from moeplan.cost_models.layer_program import expert_group

        n, stride = expert_group(layout)
        if strategy.dispatcher == "dedup" and target.backend == "cuda":
            total += deepep_bytes(hidden_size=hidden_size, group_size=n, stride=stride,
                                  devices_per_node=target.devices_per_node)
        else:
            total += (min(n, max(1, target.devices_per_node // stride)) - 1) * ovh.all_to_all_peer_bytes
    return total


@dataclass(frozen=True)
class Overheads:
    """The terms of a device that do not depend on the recompute choice: communication buffers and the runtime's
    fixed bytes, and the allocator's fraction of what the process allocates."""

    comm_buffer_bytes: float
    runtime_bytes: float
    allocator_fraction: float

    def allocator_bytes(self, transient: float) -> float:
        """The allocator's share for ``transient`` bytes allocated and freed during the step."""
        return self.allocator_fraction * transient

    def activation_budget(self, budget: float, states: float, transient: float) -> float:
        """Bytes left for activations and the working set under ``budget`` once the model states, the other
        ``transient`` bytes (workspace, FSDP's gathered copies) and the overheads are counted: the largest ``a``
        with ``total(a) ≤ budget``."""
        fixed = self.runtime_bytes + self.comm_buffer_bytes + states
        return (budget - fixed) / (1 + self.allocator_fraction) - transient


def overheads(layout: Layout, strategy: Strategy, target: Target, *, hidden_size: int) -> Overheads:
    """:class:`Overheads` of a device of ``layout`` on ``target``."""
    ovh = target.memory_overheads
    return Overheads(comm_buffer_bytes(layout, strategy, target, hidden_size=hidden_size), ovh.runtime_bytes,
                     ovh.allocator_fraction)


def gib_text(nbytes: float) -> str:
    """``nbytes`` in GiB for a message: one decimal from 1 GiB up, else three significant digits (a budget of a
    few MiB on the cpu emulator must not read "0.0 GiB")."""
    x = nbytes / GIB
    return f"{x:.1f} GiB" if x >= 1 else f"{x:.3g} GiB"


def budget_bytes(target: Target, budget_gib: float = 0.0, fraction: float = 1.0) -> float:
    """The bytes per device a plan may fill: ``budget_gib`` GiB when set (``--memory-budget``), else ``fraction``
    of the device's memory. Raises ValueError when the budget exceeds the device's memory, naming both."""
    if budget_gib:
        b = budget_gib * GIB
        if b > target.memory_bytes:
            raise ValueError(f"memory_budget={budget_gib:g}: must not exceed the device memory of {target.name} "
                             f"({target.memory_bytes / GIB:.1f} GiB)")
        return b
    return target.memory_bytes * fraction


_SAVED = {"none": attrgetter("saved_bytes"), "selective": attrgetter("saved_selective_bytes"),
          "full": attrgetter("saved_full_bytes")}  # per whole-layer mode, a layer's saved bytes under it


def saved_bytes(cost: LayerCost, mode: Recompute) -> int:
    """Activation bytes one micro-batch keeps on one device for this layer under whole-layer ``mode``."""
    return _SAVED[mode](cost)


def recompute_working_set(layers: Sequence[LayerCost], mode: Recompute) -> int:
    """Bytes one layer's backward re-makes under whole-layer ``mode`` (the largest of ``layers``): what it keeps
    under ``none`` less what ``mode`` keeps. Charged on top of the in-flight activations, as the per-tensor
    modes charge theirs (moeplan/memory_ilp.py), so the two families are priced alike."""
    return max([0, *map(sub, map(_SAVED["none"], layers), map(_SAVED[mode], layers))])


def fsdp_state_bytes(*, dense_params: float, expert_params: float, layout: Layout, precision: Precision
                     ) -> ModelStateBytes:
    """Model-state bytes on one device under FSDP (``layout.dp_shard > 1``; ZeRO-3, Rajbhandari et al. arXiv
    1910.02054 §5.3): the parameters live only as shards, dense ones over ``layout.fsdp_group``, routed experts over
    ``layout.expert_fsdp_group``; a shard is the optimizer's master copy, in ``main_params_dtype`` (torchtitan keeps
    fp32 shards and gathers bf16 copies, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), its
    gradient in ``grad_dtype`` and its two moments in ``moments_dtype``. The gathered copies are
    :func:`fsdp_gathered_bytes`."""
    shard = dense_params / layout.fsdp_group + expert_params / layout.expert_fsdp_group
    return ModelStateBytes(shard * DTYPE_BYTES[precision.main_params_dtype], shard * DTYPE_BYTES[precision.grad_dtype],
                           shard * 2 * DTYPE_BYTES[precision.moments_dtype])


def fsdp_reshards(layout: Layout) -> bool:
    """Whether FSDP gathers and reduces each layer's weights inside every micro-batch — frees the gathered weights
    after the forward, gathers them again for the backward and reduce-scatters the gradients after it (torchtitan's
    default without PP). Under pipeline parallelism it does neither: torchtitan does not reshard after forward ("For
    PP, do not reshard after forward", ``parallelize_llama.py``) and torch.distributed.pipelining runs every stage
    backward without gradient sync and without resharding (``PipelineStage.backward_maybe_with_nosync``:
    ``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``), reduce-scattering once after the
    last micro-batch (``perform_reduce_grad``): once per step, as ZeRO-1 does (cost_models/step.py
    ``step_sync_groups``)."""
    return layout.pp == 1


def fsdp_gathered_bytes(layers: Sequence[LayerCost], layout: Layout, precision: Precision, target: Target) -> float:
    """Bytes of FSDP's unsharded copies on one device at its fullest point. Resharding per micro-batch
    (:func:`fsdp_reshards`): the layer running and the next one prefetched (two layers' weights in the training
    dtype) plus one layer's unsharded gradients before their reduce-scatter. Under PP: every weight of the rank's
    stages (gathered at their first forward, freed after the reduce-scatter) and their unsharded gradients,
    accumulated over the step's micro-batches (torch FSDP2 accumulates them in the reduce dtype, taken here as the
    recipe's ``grad_dtype``). 0 without FSDP."""
    return _gathered(tuple(sorted((lc.params for lc in layers), reverse=True)), layout, precision, target)


def _gathered(per_layer: Sequence[int], layout: Layout, precision: Precision, target: Target) -> float:
    """:func:`fsdp_gathered_bytes` of layers of ``per_layer`` parameters (largest first)."""
    if layout.dp_shard <= 1 or not per_layer:
        return 0.0
    if fsdp_reshards(layout):
        return sum(per_layer[:2]) * target.dtype_bytes + per_layer[0] * DTYPE_BYTES[precision.grad_dtype]
    return sum(per_layer) * (target.dtype_bytes + DTYPE_BYTES[precision.grad_dtype])


def rank_model_states(layers: Sequence[LayerCost], layout: Layout, precision: Precision, target: Target
                      ) -> tuple[ModelStateBytes, int]:
    """(model states, largest op workspace) of one device holding ``layers`` (every chunk of its PP rank). A layer's
    copy of another's weights (the MTP's embedding, the MTP head's output layer) is a tensor of its own only on a
    rank without the owner: with it, the runtimes share the owner's (moeplan/runtime/build.py; Megatron-LM)."""
    lp = layer_parts([layers], modes=())
    return layout_states(lp.dense_params, lp.expert_params, layout, precision, target), lp.workspace


def layout_states(dense_params: float, expert_params: float, layout: Layout, precision: Precision, target: Target
                  ) -> ModelStateBytes:
    """Model-state bytes of a device of ``layout`` holding ``dense_params`` + ``expert_params`` parameters (counts):
    :func:`fsdp_state_bytes` under FSDP, else :func:`model_state_bytes` over dp·cp and expert-DP with the target's
    weight width and runtime."""
    if layout.dp_shard > 1:
        return fsdp_state_bytes(dense_params=dense_params, expert_params=expert_params, layout=layout,
                                precision=precision)
    return model_state_bytes(dense_params=dense_params, expert_params=expert_params, dense_dp=layout.dp * layout.cp,
                             expert_dp=layout.expert_dp, param_bytes=target.dtype_bytes, precision=precision,
                             runtime=target.runtime)


@dataclass(frozen=True)
class RankParts:
    """What a device's memory needs of its layers (:func:`rank_parts`): its model states, largest workspace and
    FSDP's gathered copies, and per whole-layer mode the bytes one micro-batch keeps on each chunk and the
    backward working set."""

    states: ModelStateBytes
    workspace: int
    gathered: float
    chunk_bytes: Mapping[str, tuple[float, ...]]
    working: Mapping[str, int]

    def total(self, vectors: Sequence[Sequence[int]], mode: Recompute, over: Overheads) -> float:
        """:meth:`memory`'s ``total_bytes``, without building it."""
        act = _peak_bytes(vectors, self.chunk_bytes[mode])  # type: ignore[arg-type]
        transient = act + self.working[mode] + self.workspace + self.gathered
        return (self.states.total_bytes + transient + over.comm_buffer_bytes + over.runtime_bytes
                + over.allocator_bytes(transient))

    def memory(self, rank: int, vectors: Sequence[Sequence[int]], mode: Recompute, over: Overheads) -> StageMemory:
        """Every term of one device of PP rank ``rank`` under ``mode`` with ``vectors`` in flight."""
        act, held = activation_peak(vectors, self.chunk_bytes[mode])
        ms = self.states
        return with_overheads(StageMemory(
            pp_rank=rank, recompute=mode, params_bytes=ms.params_bytes, grads_bytes=ms.grads_bytes,
            optimizer_bytes=ms.optimizer_bytes, activation_bytes=act, workspace_bytes=self.workspace,
            in_flight_microbatches=held, working_set_bytes=self.working[mode], gathered_bytes=self.gathered), over)


@dataclass(frozen=True)
class LayerParts:
    """What a device's memory needs of the layers it holds, whatever the layout (:func:`layer_parts`): its dense
    and routed-expert parameter counts (a copy of weights whose owner it holds not counted: :func:`rank_model_states`),
    each layer's parameters (largest first: FSDP's gathered copies), its largest workspace and, per whole-layer mode,
    the bytes one micro-batch keeps on each chunk and the backward working set. Integers only, so the layout search
    may keep one per distinct chunk layers (moeplan/estimate.py) and build :class:`RankParts` from it
    (:func:`parts_on`) for every layout that splits its stages alike."""

    dense_params: int
    expert_params: int
    params: tuple[int, ...]
    workspace: int
    chunk_bytes: Mapping[str, tuple[int, ...]]
    working: Mapping[str, int]


def layer_parts(chunks: Sequence[Sequence[LayerCost]], *, modes: Sequence[Recompute] = MODES) -> LayerParts:
    """:class:`LayerParts` of a device whose chunk ``c`` holds the layers ``chunks[c]``."""
    layers = [lc for lcs in chunks for lc in lcs]
    kinds = {lc.kind for lc in layers}
    copies = sum(lc.shared_params for lc in layers if lc.shared_owner in kinds)
    dense = sum(lc.params - lc.expert_params for lc in layers) - copies
    expert = sum(lc.expert_params for lc in layers)
    return LayerParts(dense, expert, tuple(sorted((lc.params for lc in layers), reverse=True)),
                      max([0, *(lc.workspace_bytes for lc in layers)]),
                      {m: tuple(sum(map(_SAVED[m], lcs)) for lcs in chunks) for m in modes},
                      {m: recompute_working_set(layers, m) for m in modes})


def parts_on(parts: LayerParts, layout: Layout, precision: Precision, target: Target) -> RankParts:
    """:class:`RankParts` of a device of ``layout`` holding the layers of ``parts``."""
    return RankParts(layout_states(parts.dense_params, parts.expert_params, layout, precision, target),
                     parts.workspace, _gathered(parts.params, layout, precision, target), parts.chunk_bytes,
                     parts.working)


def rank_parts(chunks: Sequence[Sequence[LayerCost]], *, layout: Layout, precision: Precision, target: Target,
               modes: Sequence[Recompute] = MODES) -> RankParts:
    """:class:`RankParts` of a device whose chunk ``c`` holds the layers ``chunks[c]``."""
    return parts_on(layer_parts(chunks, modes=modes), layout, precision, target)


def device_memory(rank: int, chunks: Sequence[Sequence[LayerCost]], vectors: Sequence[Sequence[int]], *,
                  mode: Recompute, layout: Layout, precision: Precision, target: Target, over: Overheads
                  ) -> StageMemory:
    """Every term of one device of PP rank ``rank`` (module docstring) under whole-layer ``mode``: ``chunks[c]``
    the layer costs of its chunk ``c``, ``vectors`` its in-flight micro-batches per chunk
    (:func:`in_flight_vectors` of its action list)."""
    parts = rank_parts(chunks, layout=layout, precision=precision, target=target, modes=(mode,))
    return parts.memory(rank, vectors, mode, over)


def with_overheads(m: StageMemory, over: Overheads) -> StageMemory:
    """``m`` with its communication buffers, runtime bytes and the allocator's share filled in."""
    return replace(m, comm_buffer_bytes=over.comm_buffer_bytes, runtime_bytes=over.runtime_bytes,
                   allocator_bytes=over.allocator_bytes(m.activation_bytes + m.working_set_bytes
                                                        + m.workspace_bytes + m.gathered_bytes))
