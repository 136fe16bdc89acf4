"""Primitive layers of the model family: RMSNorm with a fused-kernel backward, the SwiGLU FFN and rotary embedding.

Each is a leaf of the tracer (:data:`moeplan.models.TRACER_LEAVES`) or, for SwiGLU, three linears and two
elementwise ops; every class with children declares ``SHARD`` (how each child's work divides over tensor
parallelism; key ``""`` is the hint for the module's own ops).
"""
from __future__ import annotations

from typing import ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from moeplan.ir import ShardHint


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm whose backward keeps only the input and ``rstd`` (fp32, one per row), as fused kernels do (Apex /
    Transformer Engine / MindSpeed fused RMSNorm), instead of the fp32 copies the composite op saves."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.to(rstd.dtype) * rstd
        g = grad.to(rstd.dtype) * weight.to(rstd.dtype)
        dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        dweight = (grad.to(rstd.dtype) * x_hat).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dweight.to(weight.dtype), None


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x²) + eps) · weight`` over the last dim (Zhang & Sennrich, arXiv 1910.07467), computed
    in fp32 (or wider). ``forward(x [..., d]) -> [..., d]``; parameter ``weight [d]`` (initialised to 1)."""

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def extra_repr(self) -> str:
        return f"dim={self.weight.shape[0]}, eps={self.eps}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) · w3 x)`` (Shazeer, arXiv 2002.05202). ``forward(x [..., h]) -> [..., h]``; width ``ffn``."""

    SHARD: ClassVar[Mapping[str, ShardHint]] = {"": ShardHint.TP, "w1": ShardHint.TP, "w3": ShardHint.TP,
                                                "w2": ShardHint.TP}

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Rotary(nn.Module):
    """Rotary position embedding, rotate-half form (RoFormer, arXiv 2104.09864 §3.4; HF Llama / DeepSeek code).

    ``forward(x [b, s, n, d]) -> [b, s, n, d]``, ``d`` even, positions ``0..s-1``. The cos/sin tables are computed
    in fp32 on each call (no buffers), so a module built on the meta device needs no re-initialisation.
    """

    def __init__(self, dim: int, theta: float) -> None:
        super().__init__()
        self.dim = dim
        self.theta = theta

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq, half = x.shape[1], self.dim // 2
        inv_freq = self.theta ** -(torch.arange(half, device=x.device, dtype=torch.float32) * (2.0 / self.dim))
        angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)  # [s, d/2]
        cos = angles.cos().repeat(1, 2)[:, None, :].to(x.dtype)  # [s, 1, d]
        sin = angles.sin().repeat(1, 2)[:, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
