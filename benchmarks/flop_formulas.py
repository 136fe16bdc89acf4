"""FLOP-per-token definitions behind the published figures in ``benchmarks/published_runs.yaml``.

Each function is ``name(spec, *, seq_len, ...) -> float``: training FLOPs per TOKEN (forward + backward) of a
:class:`moeplan.spec.ModelSpec`, written to reproduce one source's own count, so that a published TFLOPS or MFU
figure can be turned back into seconds per step with the SAME definition the source used (the definitions cancel):

    step_time_s = FLOPs_per_token(formula) * global_batch * seq_len / (TFLOPS_per_gpu * 1e12 * devices)
    step_time_s = FLOPs_per_token(formula) * global_batch * seq_len / (MFU * peak_flops * devices)

Extra keyword arguments (``tp``, ``make_vocab_size_divisible_by``, ``expert_ffn_size``) have defaults; a run's
``assumptions`` say which values were used. ``FORMULAS`` maps the names used in ``measured.flop_formula`` to the
functions.

Run ``python benchmarks/flop_formulas.py`` to print each formula for the models of the published runs.
"""
from __future__ import annotations

import math

from moeplan.flops import flops_per_token as _moeplan_causal
from moeplan.spec import ModelSpec

SWIGLU = 3 / 2  # Megatron's gated_linear_multiplier for SwiGLU


def padded_vocab(vocab_size: int, *, tp: int = 1, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron-LM / Megatron-Bridge vocabulary padding: round up to a multiple of ``divisible_by * tp``
    (megatron/training/tokenizer ``_vocab_size_with_padding``; Megatron-Bridge ``calculate_padded_vocab_size``)."""
    multiple = make_vocab_size_divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


# ---- DeepSeek (ISCA'25, arXiv 2505.09343) ------------------------------------------------------------------------
def deepseek_causal(spec: ModelSpec, *, seq_len: int) -> float:
    """DeepSeek's "causal" count of arXiv 2505.09343 (Insights into DeepSeek-V3, ISCA'25) §5.1.2 / Table 4:
    "Causal MFU only takes into account the flops of the lower triangle of the attention matrix (in line with
    FlashAttention)". Its Table 2 gives 250 GFLOPS/token for DeepSeek-V3 at sequence length 4096.

    Reproduced as moeplan's Megatron causal count without MTP (``moeplan.flops.flops_per_token``): 249.8 GFLOP
    per token for deepseek-v3 at 4096, and with Table 4's 19.926 s step of 15360 x 4096 tokens on 2048 GPUs it
    gives 385.1 TFLOPS (the table prints 385) = 38.94 % of a 989 TFLOPS peak (printed: 38.94 %; with 989.5 it would
    be 38.92 %). The paper does not publish the formula itself; the match of the printed numbers is the evidence.
    """
    return _moeplan_causal(spec, seq_len=seq_len)


def deepseek_noncausal(spec: ModelSpec, *, seq_len: int) -> float:
    """DeepSeek's "non-causal" count of arXiv 2505.09343 §5.1.2 / Table 4: "non-causal MFU includes the flops of
    the whole attention matrix (in line with Megatron)". Reproduced as :func:`deepseek_causal` with the core
    attention term (scores and score x V) doubled; for deepseek-v3 at 4096 this gives 432 TFLOPS at the 19.926 s
    step = 43.73 % of 989 TFLOPS (Table 4 prints 432 TFLOPS, 43.73 %).
    """
    if spec.attention == "mla":
        core = 6 * seq_len * spec.num_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim) / 2
    else:
        core = 6 * seq_len * spec.num_heads * spec.head_dim
    return _moeplan_causal(spec, seq_len=seq_len) + spec.num_layers * core


# ---- Megatron-LM core_v0.10.0 / core_v0.11.0 (arXiv 2504.14960, MoE Parallel Folding) -------------------------------
def megatron_core_v0_10(spec: ModelSpec, *, seq_len: int, tp: int = 1, make_vocab_size_divisible_by: int = 128,
                        expert_ffn_size: int | None = None) -> float:
    """``num_floating_point_operations(args, batch_size)`` of NVIDIA/Megatron-LM megatron/training/training.py at
    tag core_v0.10.0 (commit 7ee599a25ca15f042c1087176b73ebddb0566d02; byte-identical at core_v0.11.0,
    aa6207e2da6bca789375f591c9124aa408d2509a), divided by batch_size * seq_length:

        12 * L * h^2 * [ (1 + g/n + s/h) * (n*d/h)            # attention, NON-causal (full s x s)
                         + (ffn_hidden_size/h) * topk * 3/2     # routed experts (every layer), SwiGLU
                         + (shared_expert_ffn/h) * 3/2          # shared experts
                         + padded_vocab / (2*L*h) ]             # logits

    Quirks reproduced: every layer is counted with the expert MLP (no dense-prefix branch, no MLA branch, no
    MTP) and the routed width is ``args.ffn_hidden_size``, NOT ``--moe-ffn-hidden-size``: ``expert_ffn_size``
    (default ``spec.moe_ffn_size``) is that value, an assumption for models whose dense and expert widths differ
    (Qwen2-57B-A14B). The vocabulary is padded to a multiple of ``128 * tp``. This is the count behind the MFU
    figures of arXiv 2504.14960 (experiments on Megatron-Core with MoE Parallel Folding, merged 2024-11 and first
    released in core_v0.10.0; the paper compares with "MCore v0.9"; the exact commit is not stated).
    GQA/MHA models only (raises ValueError for MLA).
    """
    if spec.attention != "gqa":
        raise ValueError("megatron_core_v0_10 has no MLA branch")
    h, L, n = spec.hidden_size, spec.num_layers, spec.num_heads
    q_ratio = n * spec.head_dim / h
    ffn = spec.moe_ffn_size if expert_ffn_size is None else expert_ffn_size
    topk = spec.top_k if spec.num_experts else 1
    if not spec.num_experts:
        ffn = spec.dense_ffn_size
    vocab = padded_vocab(spec.vocab_size, tp=tp, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    per_layer = ((1 + spec.num_kv_heads / n + seq_len / h) * q_ratio
                 + ffn / h * topk * SWIGLU
                 + spec.shared_ffn_size / h * SWIGLU
                 + vocab / (2 * L * h))
    return 12 * L * h * h * per_layer


# ---- Megatron-Bridge (NVIDIA-NeMo/Megatron-Bridge, performance summary TFLOP/s/GPU) ---------------------------------
def megatron_bridge_v0(spec: ModelSpec, *, seq_len: int, tp: int = 1, make_vocab_size_divisible_by: int = 128,
                       mtp: bool = True) -> float:
    """``transformer_flops()`` in ``num_floating_point_operations(cfg, batch_size)`` of NVIDIA-NeMo/Megatron-Bridge
    src/megatron/bridge/training/utils/flop_utils.py, identical for standard (non-hybrid, non-GDN, non-LoRA)
    transformers from tag v0.1.0rc4 (6725f7049504c3bcf9a65c5aee40aa118bc7a869) through v0.4.1
    (f9b6319e58494b9a655b4789724df715aebabaef), i.e. the NeMo containers 25.09 .. 26.04.01, divided by
    batch_size * seq_length. Terms per token (3 x 2 x GEMM):

      * dense-prefix MLP ``ffn_hidden_size * 3/2``, routed ``moe_ffn * topk * 3/2`` and shared ``shared * 3/2`` per
        layer, times 12 h; the MTP modules count as extra layers of the last layer's kind;
      * attention CAUSAL: GQA ``12 h^2 (1 + g/n + s/(2h)) (n d / h)``; MLA the same projection/core terms as
        moeplan's count (``6 (q_term + kv term + h*rope + n*v*h + s*n*(qk+rope)/2 + s*n*v/2)``);
      * MTP norms and eh-projection ``6 * mtp * (3h + 2h^2)``; logits ``6 h V_padded (mtp + 1)``, V padded to
        a multiple of 128 * TP.

    Differs from moeplan's ``flops_per_token_with_mtp`` only by the vocabulary padding.
    """
    h = spec.hidden_size
    n_mtp = spec.num_mtp_layers if mtp else 0
    num_layers = spec.num_layers + n_mtp
    moe_layers = spec.num_moe_layers + (n_mtp if spec.num_moe_layers else 0)
    dense_layers = spec.num_dense_layers + (0 if spec.num_moe_layers else n_mtp)
    mlp = 12 * h * (spec.dense_ffn_size * SWIGLU * dense_layers
                    + (spec.moe_ffn_size * spec.top_k + spec.shared_ffn_size) * SWIGLU * moe_layers)
    if spec.attention == "gqa":
        q = spec.num_heads * spec.head_dim
        attn = 12 * num_layers * h * h * (1 + spec.num_kv_heads / spec.num_heads + seq_len / h / 2) * (q / h)
    else:
        n = spec.num_heads
        qk, rope, v = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        q_term = spec.q_lora_rank * (h + n * (qk + rope) + 1) if spec.q_lora_rank else h * n * (qk + rope)
        attn = 6 * num_layers * (q_term + spec.kv_lora_rank * (h + n * (qk + v) + 1) + h * rope + n * v * h
                                 + seq_len * n * (qk + rope) / 2 + seq_len * n * v / 2)
    vocab = padded_vocab(spec.vocab_size, tp=tp, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    return mlp + attn + 6 * n_mtp * (3 * h + 2 * h * h) + 6 * h * vocab * (n_mtp + 1)


def moeplan_megatron_causal(spec: ModelSpec, *, seq_len: int) -> float:
    """moeplan's own Megatron causal count without MTP (``moeplan.flops.flops_per_token``), for reference."""
    return _moeplan_causal(spec, seq_len=seq_len)


FORMULAS = {
    "deepseek_causal": deepseek_causal,
    "deepseek_noncausal": deepseek_noncausal,
    "megatron_core_v0_10": megatron_core_v0_10,
    "megatron_bridge_v0": megatron_bridge_v0,
    "moeplan_megatron_causal": moeplan_megatron_causal,
}


if __name__ == "__main__":  # pragma: no cover - a table for the reader
    from moeplan.spec import load_spec

    for model in ("deepseek-v3", "mixtral-8x22b", "mixtral-8x22b-g8t8", "qwen2-57b-a14b", "qwen3-30b-a3b",
                  "qwen3-235b-a22b"):
        spec = load_spec(model)
        row = []
        for name, fn in FORMULAS.items():
            try:
                row.append(f"{name}={fn(spec, seq_len=4096) / 1e9:.2f}")
            except ValueError:
                row.append(f"{name}=n/a")
        print(f"{model:20s} GFLOP/token @4096: " + "  ".join(row))
