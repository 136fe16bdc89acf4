"""Deterministic per-parameter initialisation (docs/architecture.md §7: every layout starts from the same global weights).

Each parameter is drawn from its own ``torch.Generator`` seeded by ``(global seed, full parameter name)``, e.g.
``"layers.5.attn.q_b.weight"``, so building any subset of layers — or one rank's slice of experts — yields exactly
the weights of the full model. Stacked routed-expert tensors are drawn expert by expert, seeded by
``"{name}.{global expert index}"`` (``layers.5.mlp.experts.w1.17``), so a slice of experts needs no other expert.
Values: RMSNorm gains 1; every other weight ``N(0, 0.02²)`` (GPT-2 / Megatron-LM ``init_method_std``), drawn in fp32
on the CPU and cast to the parameter's dtype and device.
"""
from __future__ import annotations

import hashlib
from typing import Mapping

import torch
from torch import nn

from moeplan.models.layers import RMSNorm
from moeplan.models.moe import GroupedExperts

INIT_STD = 0.02


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from the global seed and a full parameter name (sha256, stable across runs)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_normal(shape: torch.Size | tuple[int, ...], *, seed: int, name: str, std: float = INIT_STD) -> torch.Tensor:
    """``N(0, std²)`` values of ``shape`` (fp32, CPU) from the generator of ``(seed, name)``."""
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.randn(shape, generator=gen) * std


def initial_value(module: nn.Module, param_name: str, shape: torch.Size, *, seed: int, name: str) -> torch.Tensor:
    """The initial fp32 CPU value of ``module.<param_name>`` whose full model name is ``name``."""
    if isinstance(module, RMSNorm):
        return torch.ones(shape)
    if isinstance(module, GroupedExperts):
        first = module.first_expert
        return torch.stack([seeded_normal(shape[1:], seed=seed, name=f"{name}.{first + e}") for e in range(shape[0])])
    return seeded_normal(shape, seed=seed, name=name)


def init_weights_(module: nn.Module, *, prefix: str, seed: int, sources: Mapping[str, str] | None = None) -> None:
    """Initialise every parameter of ``module`` in place; its full name is ``f"{prefix}.{local name}"``.

    ``sources`` maps a local parameter name to the full name of the parameter it copies (the MTP block's embedding
    is ``embedding.word.weight``), so a copy starts equal to its owner. Parameters on meta are skipped.
    """
    sources = sources or {}
    with torch.no_grad():
        for mod_name, mod in module.named_modules():
            for pname, param in mod.named_parameters(recurse=False):
                if param.is_meta:
                    continue
                local = f"{mod_name}.{pname}" if mod_name else pname
                full = sources.get(local, f"{prefix}.{local}")
                param.copy_(initial_value(mod, pname, param.shape, seed=seed, name=full))
