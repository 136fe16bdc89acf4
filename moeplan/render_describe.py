"""Rich rendering and JSON of ``moeplan describe`` (CLI only; the core never imports this)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from moeplan.describe import ModelDescription
from moeplan.spec import ModelSpec

FLOPS_NOTE = "Megatron-LM causal count, forward + backward, without MTP (docs/references.md §4.1)"


def human(x: float, unit: str = "") -> str:
    """``1.23e9`` → ``'1.23 B'`` (K, M, B, T steps of 1000)."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.2f} {suffix}{unit}"
    return f"{x:.2f} {unit}".rstrip()


def describe_json(d: ModelDescription) -> dict:
    """The JSON of ``describe --json``: the four contract keys first, then the detail."""
    return {"params_total": d.params_total, "params_activated": d.params_activated, "params_mtp": d.params_mtp,
            "flops_per_token": d.flops_per_token, "name": d.name, "seq_len": d.seq_len,
            "params_activated_one_vocab": d.params_activated_one_vocab,
            "flops_per_token_with_mtp": d.flops_per_token_with_mtp,
            "traced_flops_per_token": d.traced_flops_per_token, "flops_definition": FLOPS_NOTE,
            "layer_kinds": [{"kind": r.kind.value, "count": r.count, "params": r.params,
                             "activated_params": r.activated_params, "fwd_gflop_per_token": r.fwd_gflop_per_token,
                             "fwd_bwd_gflop_per_token": r.fwd_bwd_gflop_per_token,
                             "saved_bytes_per_token": r.saved_bytes_per_token} for r in d.rows]}


def render_describe(console: Console, spec: ModelSpec, d: ModelDescription) -> None:
    """Totals and one row per layer kind."""
    console.print(f"[bold]{d.name}[/] — {spec.attention.upper()} attention, {spec.num_layers} layers "
                  f"({spec.num_dense_layers} dense), {spec.num_experts} routed experts top-{spec.top_k}, "
                  f"{spec.num_mtp_layers} MTP, seq {d.seq_len}")
    console.print(f"parameters: {human(d.params_total)} total, {human(d.params_activated)} activated "
                  f"({human(d.params_activated_one_vocab)} counting one vocab matrix), MTP {human(d.params_mtp)} "
                  f"apart")
    console.print(f"FLOPs per token: {human(d.flops_per_token, 'FLOP')} ({FLOPS_NOTE}); traced graph "
                  f"{human(d.traced_flops_per_token, 'FLOP')}; with MTP {human(d.flops_per_token_with_mtp, 'FLOP')}")
    t = Table(title="per layer kind")
    for col in ("kind", "count", "params/layer", "activated/layer", "fwd GFLOP/token", "fwd+bwd GFLOP/token",
                "saved bytes/token"):
        t.add_column(col)
    for r in d.rows:
        t.add_row(r.kind.value, str(r.count), human(r.params), human(r.activated_params),
                  f"{r.fwd_gflop_per_token:.4g}", f"{r.fwd_bwd_gflop_per_token:.4g}", f"{r.saved_bytes_per_token:,.0f}")
    console.print(t)
