"""Predicted vs measured device memory per PP rank on the CPU emulator: tiny-pangu (issue 32, item 4c).

For each layout: ``moeplan compile tiny-pangu --target cpu ...``, ``moeplan run PLAN --steps N --metrics FILE``
and ``moeplan compare PLAN FILE --json``; then per layout and PP rank, predicted and measured bytes of the model
states (``params``, ``grads``, ``optimizer``: the plan's ``memory.ranks[r]`` terms against the runtime's meter,
moeplan.runtime.metrics.model_state_bytes) and of the saved activations (the plan's ``activation_bytes +
working_set_bytes`` against the peak ``SavedActivationMeter`` measured; the host-swapped bytes too where a plan
swaps), with their ratios, and a summary: per term the worst ratio and the layouts outside ``--tolerance``.

The runs route tokens to random experts (``--force-balanced-routing``), the balanced routing a plan without a load
trace prices: the rows an EP rank holds follow the routing (docs/memory.md §5). ``--natural-routing`` runs the
model's own router instead; a layout whose routed experts are split over ranks (``ep·tp/etp`` > 1) then first runs
once with ``--record-load`` and is compiled again with that trace (``--expert-load TRACE``), so that its plan
prices the busiest rank's rows (docs/load-balance.md §4; the same seed and data route the same way in every run). Memory does not depend on the machine's speed, so
one short run per layout is enough (the model states are the same from the first step on; the activation peak is
the median over the steps after the first, as compare takes it). Results: docs/memory.md §8.

Usage::

    python benchmarks/cpu_memory.py [--steps 3] [--only 1dev,pp2] [--workdir DIR] [--json] [--natural-routing]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from cli_runs import moeplan_cli

BASE = ("--global-batch", "8", "--seq-len", "64")
ONE = ("--devices", "1", "--tp", "1", "--pp", "1", "--ep", "1")
LAYOUTS: dict[str, tuple[str, ...]] = {
    "1dev": (*ONE, "--micro-batch", "1", "--recompute", "none"),
    "dp2": ("--devices", "2", "--tp", "1", "--pp", "1", "--ep", "1", "--micro-batch", "1", "--recompute", "none"),
    "pp2": ("--devices", "2", "--tp", "1", "--pp", "2", "--vpp", "1", "--ep", "1", "--micro-batch", "1",
            "--recompute", "none"),
    "pp2-vpp2": ("--devices", "2", "--tp", "1", "--pp", "2", "--vpp", "2", "--ep", "1", "--micro-batch", "1",
                 "--schedule", "interleaved", "--recompute", "none"),
    "tp2": ("--devices", "2", "--tp", "2", "--pp", "1", "--ep", "1", "--micro-batch", "1", "--recompute", "none",
            "--overlap", "none"),
    "ep2": ("--devices", "2", "--tp", "1", "--pp", "1", "--ep", "2", "--micro-batch", "1", "--recompute", "none",
            "--overlap", "none"),
    # what the compiler picks for ep2: fb pairs, where the plan holds both halves' micro-batches whole (§8)
    "ep2-fb": ("--devices", "2", "--tp", "1", "--pp", "1", "--ep", "2", "--micro-batch", "1", "--recompute", "none"),
    "cp2": ("--devices", "2", "--tp", "1", "--cp", "2", "--pp", "1", "--ep", "1", "--micro-batch", "1",
            "--recompute", "none", "--overlap", "none"),
    "full": (*ONE, "--micro-batch", "2", "--recompute", "full"),
    "selective": (*ONE, "--micro-batch", "2", "--recompute", "selective"),
    "modules": (*ONE, "--micro-batch", "2", "--recompute", "modules:core_attn,layernorm"),
    # a budget that binds both per-tensor modes (11.5 MiB; recompute none needs 14.1 MiB at micro-batch 2)
    "ilp-no-swap": (*ONE, "--micro-batch", "2", "--recompute", "ilp-no-swap", "--memory-budget", "0.0115"),
    "ilp": (*ONE, "--micro-batch", "2", "--recompute", "ilp", "--memory-budget", "0.0115"),
    "dp2-pp2-ep2": ("--devices", "4", "--tp", "1", "--pp", "2", "--vpp", "1", "--ep", "2", "--micro-batch", "1",
                    "--recompute", "none", "--overlap", "none"),
}
TERMS = ("params", "grads", "optimizer", "peak saved activations", "peak swapped activations (host)")
SHORT = {"peak saved activations": "saved", "peak swapped activations (host)": "host"}


def run_layout(name: str, *, workdir: Path, steps: int, natural: bool = False) -> dict:
    """Compile, run and compare one layout: its plan's layout line and, per PP rank, term -> (predicted, measured).
    ``natural``: route with the model's router, the plan priced with the run's load (module docstring). The plan
    is read as YAML here (the commands are the ones that parse it)."""
    import yaml

    plan_path, metrics = workdir / f"{name}.yaml", workdir / f"{name}.jsonl"
    moeplan_cli("compile", "tiny-pangu", "--target", "cpu", *BASE, *LAYOUTS[name], "-o", str(plan_path))
    routing = () if natural else ("--force-balanced-routing",)
    if natural and yaml.safe_load(plan_path.read_text())["sharding"]["expert_shards"] > 1:
        trace = workdir / f"{name}-load.json"
        trace.unlink(missing_ok=True)
        moeplan_cli("run", str(plan_path), "--steps", str(steps), "--record-load", str(trace), "--metrics",
                    str(workdir / f"{name}-record.jsonl"))
        moeplan_cli("compile", "tiny-pangu", "--target", "cpu", *BASE, *LAYOUTS[name], "--expert-load", str(trace),
                    "-o", str(plan_path))
    metrics.unlink(missing_ok=True)  # this script's own file: `moeplan run` keeps an earlier run's lines
    moeplan_cli("run", str(plan_path), "--steps", str(steps), "--metrics", str(metrics), *routing)
    rows = {r["quantity"]: r for r in json.loads(moeplan_cli("compare", str(plan_path), str(metrics), "--json"))}
    plan = yaml.safe_load(plan_path.read_text())
    lay = plan["layout"]
    ranks = []
    for r in range(lay["pp"]):
        mem = plan["memory"]["ranks"][r]
        terms = {}
        for term in TERMS:
            row = rows.get(f"pp{r} {term}")
            if row is not None and (row["predicted"] or row["measured"]):
                terms[SHORT.get(term, term)] = (row["predicted"], row["measured"])
        ranks.append({"pp_rank": r, "recompute": mem["recompute"], "activation_bytes": mem["activation_bytes"],
                      "working_set_bytes": mem.get("working_set_bytes", 0), "terms": terms})
    shape = " ".join(f"{k}{lay[k]}" for k in ("tp", "pp", "vpp", "ep", "cp", "dp", "micro_batch") if k in lay)
    shape += " " + plan["schedule"]["kind"]
    return {"layout": name, "shape": shape, "ranks": ranks}


def _ratio(pred: float | None, meas: float | None) -> float | None:
    return None if not pred or meas is None else meas / pred


def render(results: list[dict], tolerance: float) -> list[str]:
    """The table (one line per layout and PP rank; ``—`` where a term is 0 on both sides) and the summary: per term,
    the worst ratio and the layouts outside ``tolerance``."""
    cols = ("params", "grads", "optimizer", "saved", "host")
    lines = [f"{'layout':<12} {'pp':>2} {'recompute':<11}" + "".join(
        f" {c + ' pred':>11} {c + ' meas':>11} {'ratio':>6}" for c in cols)]
    worst: dict[str, tuple[float, str]] = {}
    off: dict[str, list[str]] = {c: [] for c in cols}
    seen: dict[str, int] = {c: 0 for c in cols}
    for res in results:
        for rank in res["ranks"]:
            where = f"{res['layout']}/pp{rank['pp_rank']}"
            line = f"{res['layout']:<12} {rank['pp_rank']:>2} {rank['recompute']:<11}"
            for c in cols:
                pred, meas = rank["terms"].get(c, (None, None))
                q = _ratio(pred, meas)
                line += "".join(f" {'—' if v is None else f'{v:,.0f}':>11}" for v in (pred, meas))
                line += f" {'—' if q is None else f'{q:.3f}':>6}"
                if q is None:
                    continue
                seen[c] += 1
                if c not in worst or abs(q - 1) > abs(worst[c][0] - 1):
                    worst[c] = (q, where)
                if abs(q - 1) > tolerance:
                    off[c].append(f"{where} {q:.2f}")
            lines.append(line)
    lines.append(f"summary (outside ±{tolerance:.0%}):")
    for c in cols:
        if c in worst:
            listed = off[c] if len(off[c]) <= 6 else off[c][:6] + [f"... {len(off[c]) - 6} more"]
            lines.append(f"  {c}: worst {worst[c][0]:.3f} ({worst[c][1]}); {len(off[c])} of {seen[c]} outside"
                         + (": " + ", ".join(listed) if listed else ""))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", default="", help="comma list of layouts (default: all): " + ",".join(LAYOUTS))
    ap.add_argument("--workdir", type=Path, help="keep plans and metrics here (default: a temporary directory)")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--json", action="store_true", help="one JSON line per layout instead of the table")
    ap.add_argument("--natural-routing", action="store_true", help="route with the model's router, each EP "
                                                                   "layout priced with its recorded load")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        sys.exit(f"unknown layout(s) {', '.join(unknown)}; known: {', '.join(LAYOUTS)}")
    with tempfile.TemporaryDirectory(prefix="moeplan-mem-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results = []
        for name in names:
            res = run_layout(name, workdir=workdir, steps=args.steps, natural=args.natural_routing)
            results.append(res)
            if args.json:
                print(json.dumps(res), flush=True)
            else:
                print(f"# {name}: {res['shape']}", file=sys.stderr, flush=True)
    if not args.json:
        print("\n".join(render(results, args.tolerance)))


if __name__ == "__main__":
    main()
