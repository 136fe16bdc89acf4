"""Build one rank's modules from a plan: its PP chunks, each layer sharded for its TP/EP/CP position (docs/architecture.md §7).

Every layer is built on the meta device in its parallel form (moeplan.runtime.tensor_parallel / expert_parallel),
then materialised on ``device``: each parameter's full single-process initial value is computed from the model
family's per-name seeding (moeplan.models.init: ``(seed, full parameter name)``; routed experts one expert at a
time, so a rank never draws experts it does not hold) and the rank's :class:`ParamShard` of it is copied in. So
every layout starts from exactly the weights of ``MoEModel(spec, seed)``.

Forward conventions are those of moeplan.models (chain a stage's layers as MoEModel.losses does), with:

- ``tokens`` and ``labels`` always the WHOLE micro-batch ``[micro_batch, seq_len]`` on every rank;
- hidden states (between layers and across PP ranks) this rank's slice ``[micro_batch, seq_len/(cp·tp), h]``
  (:func:`hidden_shape`; positions in moeplan.runtime.context_parallel), plain contiguous tensors;
- ``head`` / ``mtp_head.j`` return the micro-batch mean loss; backward gives this rank's share (ParallelHead).

Parameter copies (the MTP embedding, the MTP head's output layer, a tied output layer) share their owner's
Parameter when the owner is on the same rank; otherwise the copy starts equal to the owner and the executor must
sum their gradients across PP ranks (moeplan.models.tied_parameters). :func:`rank_parameters` names every
parameter by the single-process parameter it is a shard of (a copy by its owner's name).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

import torch
from torch import nn

from moeplan.errors import PlanError
from moeplan.ir import LayerKind
from moeplan.models import DecoderLayer, EmptyLayer, GroupedExperts, build_layer, parse_layer_name, shared_sources
from moeplan.models.init import initial_value
from moeplan.plan import Plan
from moeplan.runtime.expert_parallel import LocalExperts, ParallelMoE
from moeplan.runtime.groups import (ParallelGroups, RankCoords, check_layout_for_runtime,
                                    Ranks, expert_node_ranks, make_node_groups, spans_nodes)
from moeplan.runtime.parallel import CommLog, ParamShard, Sharded, TPReplicated
from moeplan.runtime.tensor_parallel import (ParallelEmbedding, ParallelHead, ParallelSwiGLU, ReplicatedLinear,
                                             ShardEnv, parallel_attention, sp_norm)
from moeplan.spec import ModelSpec


class ParallelDecoderLayer(DecoderLayer):
    """moeplan.models.DecoderLayer on the SP slice: ``forward(hidden [b, s/(cp·tp), h]) -> same``."""

    def __init__(self, env: ShardEnv, *, moe: bool, aux_loss_coeff: float = 0.0, **dispatch) -> None:
        nn.Module.__init__(self)  # DecoderLayer.forward runs on these sharded parts
        spec = env.spec
        self.input_norm = sp_norm(env)
        self.attn = parallel_attention(env)
        self.post_attn_norm = sp_norm(env) if spec.sandwich_norm else None
        self.pre_mlp_norm = sp_norm(env)
        self.mlp = (ParallelMoE(env, aux_loss_coeff=aux_loss_coeff, **dispatch) if moe
                    else ParallelSwiGLU(spec.hidden_size, spec.dense_ffn_size, env))
        self.post_mlp_norm = sp_norm(env) if spec.sandwich_norm else None


class ParallelMTPBlock(nn.Module):
    """moeplan.models.MTPBlock: ``forward(h_prev [b, s/(cp·tp), h], tokens [b, s]) -> [b, s/(cp·tp), h]``.

    The ``2h → h`` projection is replicated over TP and runs on the SP slice.
    """

    def __init__(self, env: ShardEnv, *, depth: int, aux_loss_coeff: float = 0.0, **dispatch) -> None:
        super().__init__()
        h = env.spec.hidden_size
        self.depth = depth
        self.embedding = ParallelEmbedding(env)
        self.hidden_norm = sp_norm(env)
        self.embed_norm = sp_norm(env)
        self.proj = ReplicatedLinear(2 * h, h, bias=False)
        self.layer = ParallelDecoderLayer(env, moe=True, aux_loss_coeff=aux_loss_coeff, **dispatch)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        emb = self.embed_norm(self.embedding(tokens.roll(-self.depth, dims=1)))
        return self.layer(self.proj(torch.cat((self.hidden_norm(hidden), emb), dim=-1)))


class LayerDict(nn.ModuleDict):
    """A ModuleDict keyed by layer names (``layers.3``): ``.`` is stored as ``/`` because nn.Module names cannot
    hold dots; indexing, ``in``, iteration, ``keys`` and ``items`` use the real names."""

    @staticmethod
    def _key(name: str) -> str:
        return name.replace(".", "/")

    def __getitem__(self, name: str) -> nn.Module:
        return super().__getitem__(self._key(name))

    def __setitem__(self, name: str, module: nn.Module) -> None:
        super().__setitem__(self._key(name), module)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(self._key(name))

    def __iter__(self) -> Iterator[str]:
        return (k.replace("/", ".") for k in super().__iter__())

    def keys(self) -> list[str]:  # type: ignore[override]
        return list(iter(self))

    def items(self) -> list[tuple[str, nn.Module]]:  # type: ignore[override]
        return [(k, self[k]) for k in self]


@dataclass(frozen=True)
class RankParam:
    """One parameter of this rank: ``name`` of the single-process parameter it shards (``layers.3.attn.q_b.weight``),
    the ``shard`` it holds, and whether it belongs to the routed experts (gradient group expert_dp)."""

    name: str
    param: nn.Parameter
    shard: ParamShard
    expert: bool


def hidden_shape(plan: Plan) -> tuple[int, int, int]:
    """Shape of a hidden state between layers / PP ranks: ``(micro_batch, seq_len/(cp·tp), hidden)``."""
    lay = plan.layout
    return lay.micro_batch, lay.seq_len // (lay.cp * lay.tp), plan.model.spec.hidden_size


def stage_ids(plan: Plan, pp_rank: int) -> list[int]:
    """Pipeline stage ids held by ``pp_rank``, by chunk: chunk c is stage ``c·pp + pp_rank`` (``loop`` placement),
    or ``pp_rank`` and ``2·pp − 1 − pp_rank`` (``v`` placement of ZB-V and DualPipeV)."""
    return [plan.stages.stage_of(pp_rank, c) for c in range(plan.layout.vpp)]


def layer_placement(plan: Plan, name: str) -> tuple[tuple[int, ...], ...]:
    """The experts each expert-group rank holds in layer ``name`` at the start of a run: the plan's placement of
    that layer (``experts.load`` under a load trace, else ``experts.shards``; docs/load-balance.md §4)."""
    kind, index = parse_layer_name(plan.model.spec, name)
    layer = plan.model.spec.num_layers + index if kind == LayerKind.MTP else index
    return tuple(tuple(s) for s in plan.experts.layer_shards(layer))


def _parallel_layer(env: ShardEnv, name: str, aux_loss_coeff: float, dispatch: dict, plan: Plan) -> nn.Module:
    kind, index = parse_layer_name(env.spec, name)
    if env.spec.is_moe and kind in (LayerKind.MOE, LayerKind.MTP):
        env = replace(env, expert_placement=layer_placement(plan, name))
    if kind == LayerKind.EMBEDDING:
        return ParallelEmbedding(env)
    if kind in (LayerKind.DENSE, LayerKind.MOE):
        return ParallelDecoderLayer(env, moe=kind == LayerKind.MOE, aux_loss_coeff=aux_loss_coeff, **dispatch)
    if kind == LayerKind.MTP:
        return ParallelMTPBlock(env, depth=index + 1, aux_loss_coeff=aux_loss_coeff, **dispatch)
    if kind in (LayerKind.MTP_HEAD, LayerKind.HEAD):
        return ParallelHead(env, depth=index + 1 if kind == LayerKind.MTP_HEAD else 0)
    return EmptyLayer()


def _full_value(full_module: nn.Module, pname: str, shape: torch.Size, shard: ParamShard, *, seed: int,
                name: str) -> torch.Tensor:
    """The fp32 CPU initial value of the single-process parameter (only the shard's experts for routed experts)."""
    if shard.experts is None:
        return initial_value(full_module, pname, shape, seed=seed, name=name)
    values = []
    for e in shard.experts:
        with torch.device("meta"):
            one = GroupedExperts(num_experts=1, hidden=1, ffn=1, equal_split=False, first_expert=e)
        values.append(initial_value(one, pname, torch.Size((1, *shape[1:])), seed=seed, name=name)[0])
    return torch.stack(values)


def _own_params(layer: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Parameter, ParamShard]]:
    """``(local name, owning module, attribute, parameter, shard)`` for every parameter of ``layer``."""
    for mod_name, mod in layer.named_modules():
        shards = mod.param_shards if isinstance(mod, Sharded) else {}
        for pname, param in mod.named_parameters(recurse=False):
            local = f"{mod_name}.{pname}" if mod_name else pname
            yield local, mod, pname, param, shards.get(pname, ParamShard())


def materialize_(module: nn.Module, spec: ModelSpec, name: str, *, seed: int) -> None:
    """Fill every parameter of the parallel layer ``name`` with its shard of the single-process initial value."""
    full = build_layer(spec, name, device="meta")
    sources = shared_sources(spec, name)
    with torch.no_grad():
        for local, _, pname, param, shard in _own_params(module):
            mod_name = local.rpartition(".")[0]
            value = _full_value(full.get_submodule(mod_name), pname, full.get_parameter(local).shape, shard,
                                seed=seed, name=sources.get(local, f"{name}.{local}"))
            param.copy_(shard.take(value))


def _env(plan: Plan, coords: RankCoords, groups: ParallelGroups, comm_log: CommLog | None) -> ShardEnv:
    check_layout_for_runtime(plan.layout)
    spec, placement = plan.model.spec, tuple(tuple(s) for s in plan.experts.shards)
    if spec.is_moe and len(placement) != plan.layout.expert_shards:
        raise PlanError(f"experts.shards: {len(placement)} shards for ep·tp/etp = {plan.layout.expert_shards} ranks")
    if spec.is_moe and sorted(e for s in placement for e in s) != list(range(spec.num_experts)):
        raise PlanError(f"experts.shards: must hold each of the {spec.num_experts} experts exactly once")
    if plan.experts.load is not None and plan.experts.load.replicas:
        raise PlanError(f"experts.load.replicas={plan.experts.load.replicas}: moeplan's runtime holds each routed "
                        f"expert once (replicas are priced by the planner, not run)")
    return ShardEnv(spec=spec, layout=plan.layout, coords=coords, groups=groups, expert_placement=placement,
                    comm_log=comm_log)


def run_dispatcher(plan: Plan) -> str:
    """The dispatcher the runtime runs: the plan's, except dedup within one node, which is the flat all-to-all (as
    the planner prices it)."""
    dispatcher = plan.comm.dispatcher
    if dispatcher == "dedup" and not spans_nodes(plan.layout, plan.target.devices_per_node):
        return "flat"
    return dispatcher


def node_group_ranks(plan: Plan) -> tuple[Ranks, Ranks] | None:
    """The (inter, intra) expert node groups the runtime creates for ``plan`` (moeplan.runtime.groups
    .expert_node_ranks), or None when its dispatcher needs none."""
    dispatcher = run_dispatcher(plan)
    if not plan.model.spec.is_moe or dispatcher not in ("hierarchical", "dedup"):
        return None
    return expert_node_ranks(plan.layout, plan.target.devices_per_node,
                             min_per_node=1 if dispatcher == "dedup" else 2)


def build_rank_modules(plan: Plan, coords: RankCoords, groups: ParallelGroups, *, seed: int, device: torch.device,
                       dtype: torch.dtype = torch.float32, aux_loss_coeff: float = 0.0, aux_loss_scale: float = 1.0,
                       aux_loss_scope: str = "micro-batch", comm_log: CommLog | None = None) -> dict[int, LayerDict]:
    """Stage id -> LayerDict(layer name -> module) for the PP chunks of ``coords.pp_rank`` (see the module docstring).

    Modules are built on meta, moved to ``device`` in ``dtype`` and initialised from ``seed``; copies whose owner
    is on this rank are tied to it. ``aux_loss_coeff`` is the MoE load-balance loss weight and ``aux_loss_scale``
    its backward scale, ``1/num_microbatches`` under the executor (moeplan.models.Router), ``aux_loss_scope`` the
    tokens its expert shares are taken over (moeplan.runtime.expert_parallel.ParallelRouter). With ``shared-expert`` in
    ``plan.comm.overlap`` the shared experts run beside the dispatch (moeplan.runtime.expert_parallel);
    ``comm_log`` tallies the payload bytes of every TP/EP/CP collective the modules run (by comm class).
    The hierarchical and dedup dispatchers' node groups (moeplan.runtime.groups.make_node_groups) are created here, so this
    is collective over the default group for such a plan. Raises PlanError for a plan the runtime cannot execute.
    """
    dispatcher, per_node = run_dispatcher(plan), plan.target.devices_per_node
    dispatch = dict(dispatcher=dispatcher, devices_per_node=per_node, aux_loss_scale=aux_loss_scale,
                    aux_loss_scope=aux_loss_scope, overlap_shared="shared-expert" in plan.comm.overlap)  # ParallelMoE's
    if plan.model.spec.is_moe and dispatcher in ("hierarchical", "dedup"):
        groups = make_node_groups(plan.layout, per_node, groups, min_per_node=1 if dispatcher == "dedup" else 2)
    env, spec = _env(plan, coords, groups, comm_log), plan.model.spec
    out: dict[int, LayerDict] = {}
    for stage, names in zip(stage_ids(plan, coords.pp_rank), plan.stages.chunks[coords.pp_rank]):
        layers = LayerDict()
        for name in names:
            with torch.device("meta"):
                module = _parallel_layer(env, name, aux_loss_coeff, dispatch, plan).to(dtype)
            module = module.to_empty(device=device)
            materialize_(module, spec, name, seed=seed)
            layers[name] = module
        out[stage] = layers
    _tie_local_copies(out, spec)
    return out


def _layers(modules: dict[int, LayerDict]) -> list[tuple[str, nn.Module]]:
    return [(name, module) for stage in sorted(modules) for name, module in modules[stage].items()]


def _tie_local_copies(modules: dict[int, LayerDict], spec: ModelSpec) -> None:
    by_name = dict(_layers(modules))
    for name, module in by_name.items():
        for local, owner in shared_sources(spec, name).items():
            owner_layer = next((n for n in by_name if owner.startswith(n + ".")), None)
            if owner_layer is None:
                continue
            parent, _, attr = local.rpartition(".")
            shared = by_name[owner_layer].get_parameter(owner[len(owner_layer) + 1:])
            setattr(module.get_submodule(parent), attr, shared)


def rank_parameters(modules: dict[int, LayerDict], spec: ModelSpec) -> list[RankParam]:
    """Every distinct parameter of this rank in stage/layer order, named by the single-process parameter it shards
    (a copy by its owner's name, so a copy and its owner on two PP ranks share a name)."""
    seen: dict[int, RankParam] = {}
    for name, layer in _layers(modules):
        sources = shared_sources(spec, name)
        for local, mod, _, param, shard in _own_params(layer):
            if id(param) not in seen:
                seen[id(param)] = RankParam(name=sources.get(local, f"{name}.{local}"), param=param, shard=shard,
                                            expert=isinstance(mod, LocalExperts))
    return list(seen.values())


def tp_replicated_params(modules: dict[int, LayerDict]) -> list[nn.Parameter]:
    """The parameters of this rank's :class:`~moeplan.runtime.parallel.TPReplicated` modules (norms, MLA down
    projections, routers, MTP projections), each distinct parameter once, in stage/layer order — the same order on
    every rank of a TP group. Their gradients must be summed over TP after the step's last backward."""
    out: dict[int, nn.Parameter] = {}
    for _, layer in _layers(modules):
        for mod in layer.modules():
            if isinstance(mod, TPReplicated):
                for param in mod.parameters():
                    if param.requires_grad:
                        out.setdefault(id(param), param)
    return list(out.values())
