"""Rich rendering and JSON of ``moeplan describe`` (CLI only; the core never imports this)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from moeplan.describe import ModelDescription
from moeplan.render import plural
from moeplan.spec import ModelSpec

FLOPS_NOTE = "Megatron-LM causal count, forward + backward, without MTP (docs/references.md §4.1)"


def human(x: float, unit: str = "") -> str:
    """``1.23e9`` → ``'1.23 B'``: steps of 1000 with K, M, B, T for counts, SI prefixes (k, M, G, T) before a unit
    (``human(4.5e11, 'FLOP')`` → ``'450.00 GFLOP'``); below 1000 the value as an integer."""
    for div, count, si in ((1e12, "T", "T"), (1e9, "B", "G"), (1e6, "M", "M"), (1e3, "K", "k")):
        if abs(x) >= div:
            return f"{x / div:.2f} {si + unit if unit else count}"
    return f"{x:.0f} {unit}".rstrip()


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
    ffn = (f"{spec.num_experts} routed experts top-{spec.top_k}"
           + (f" + {plural(spec.num_shared_experts, 'shared expert')}" if spec.num_shared_experts else "")
           if spec.num_experts else "dense FFN, no experts")
    mtp = plural(spec.num_mtp_layers, "MTP module") if spec.num_mtp_layers else "no MTP"
    console.print(Text.assemble((d.name, "bold"), f" — {spec.attention.upper()} attention, {spec.num_layers} layers "
                                f"({spec.num_dense_layers} dense), {ffn}, {mtp}, seq_len {d.seq_len} tokens"))
    console.print(f"parameters: {human(d.params_total)} total, {human(d.params_activated)} activated "
                  f"({human(d.params_activated_one_vocab)} counting one vocab matrix)"
                  + (f", MTP {human(d.params_mtp)} more" if spec.num_mtp_layers else ""))
    console.print(f"FLOPs per token: {human(d.flops_per_token, 'FLOP')} ({FLOPS_NOTE}); traced graph "
                  f"{human(d.traced_flops_per_token, 'FLOP')}" + (
                      f"; with MTP {human(d.flops_per_token_with_mtp, 'FLOP')}" if spec.num_mtp_layers else ""))
    t = Table(title="per layer kind")
    for col in ("kind", "count", "params/layer", "activated/layer", "fwd GFLOP/token", "fwd+bwd GFLOP/token",
                "saved bytes/token"):
        t.add_column(col)
    for r in d.rows:
        t.add_row(r.kind.value, str(r.count), human(r.params), human(r.activated_params),
                  f"{r.fwd_gflop_per_token:.4g}", f"{r.fwd_bwd_gflop_per_token:.4g}", f"{r.saved_bytes_per_token:,.0f}")
    console.print(t)
