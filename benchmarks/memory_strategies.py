"""Recompute and swap strategies side by side, over a sweep of memory budgets (docs/memory.md §3).

For each case — a model on a target at a fixed layout and strategy — the passes up to ``schedule`` run once, then
``plan-memory{budget_gib=B}`` and ``simulate`` run per recompute mode (none, full, selective, mindspeed,
ilp-no-swap, ilp) and budget B. Prints per (budget, mode) the predicted step time, the largest and the
per-PP-rank peak device memory (GiB), or why the mode does not fit; and for the ILP modes the slowest per-rank
solve and the solver statuses. With ``--json``, one JSON line per (case, budget, mode).

    python benchmarks/memory_strategies.py [--only SUBSTRING] [--budgets 40,50,60] [--json]
"""
from __future__ import annotations

import argparse
import json
import time

from moeplan.compiler import Pipeline, run_pipeline
from moeplan.errors import InfeasibleError
from moeplan.layout import Layout
from moeplan.passes.plan_memory import PlanMemoryPass
from moeplan.passes.simulate import SimulatePass
from moeplan.spec import load_spec
from moeplan.state import PlanState, Strategy
from moeplan.targets import load_target
from moeplan.trace import trace_model

MODES = ("none", "full", "selective", "mindspeed", "ilp-no-swap", "ilp")
GIB = 2**30
# (model, target, devices, layout degrees, strategy): the 718B at the layout moeplan compiles it to, DeepSeek-V3 at
# its published degrees (PP 16, EP 64, no TP; arXiv 2412.19437 §3.2)
CASES = (
    ("pangu-ultra-moe-718b", "ascend-910b", 6144, dict(tp=2, pp=16, vpp=4, ep=8, etp=1, cp=4, micro_batch=1),
     Strategy(schedule="interleaved", dispatcher="dedup", overlap=frozenset({"shared-expert", "fb", "dp", "pp"}))),
    ("deepseek-v3", "h800", 2048, dict(tp=1, pp=16, vpp=1, ep=64, etp=1, cp=1, micro_batch=1),
     Strategy(schedule="1f1b", dispatcher="dedup", overlap=frozenset({"shared-expert", "dp", "pp"}))),
)


def run_case(model: str, target: str, devices: int, degrees: dict, strategy: Strategy, budgets: list[float]
             ) -> list[dict]:
    spec, tgt = load_spec(model), load_target(target)
    dp = devices // (degrees["tp"] * degrees["pp"] * degrees["cp"])
    layout = Layout(**degrees, dp=dp, global_batch=spec.global_batch, seq_len=spec.seq_len)
    graph = trace_model(spec, seq_len=spec.seq_len)
    rows = []
    for mode in MODES:
        state = PlanState(graph=graph, target=tgt, layout=layout, strategy=Strategy(
            schedule=strategy.schedule, dispatcher=strategy.dispatcher, overlap=strategy.overlap, recompute=mode))
        state, _ = run_pipeline(state, Pipeline.parse("shard,partition-stages,place-experts,schedule").passes)
        for budget in budgets:
            row = {"case": f"{model} on {devices} {target}", "layout": layout.short(), "budget_gib": budget,
                   "mode": mode}
            t0 = time.perf_counter()
            try:
                planned = PlanMemoryPass(budget_gib=budget).run(state)
            except InfeasibleError as e:
                rows.append({**row, "fits": False, "needs_gib": round(e.needs_bytes / GIB, 2)})
                continue
            plan_s = time.perf_counter() - t0
            pred = SimulatePass().run(planned).prediction
            ranks = planned.memory.stages
            rows.append({**row, "fits": True, "step_s": round(pred.step_time_s, 4),
                         "peak_gib": [round(m.total_bytes / GIB, 2) for m in ranks],
                         "plan_memory_s": round(plan_s, 3),
                         "statuses": sorted({m.solve_status for m in ranks if m.solve_status}),
                         "max_gap": max((m.solve_gap for m in ranks), default=0.0)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the cases whose name contains this")
    ap.add_argument("--budgets", default="30,40,50,60", help="comma-separated budgets, GiB per device")
    ap.add_argument("--json", action="store_true", help="one JSON line per (case, budget, mode)")
    args = ap.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    for model, target, devices, degrees, strategy in CASES:
        if args.only and args.only not in f"{model} {target} {devices}":
            continue
        rows = run_case(model, target, devices, degrees, strategy, budgets)
        for r in sorted(rows, key=lambda r: (r["budget_gib"], MODES.index(r["mode"]))):
            if args.json:
                print(json.dumps(r), flush=True)
            elif r["fits"]:
                print(f"{r['case']:<36} {r['layout']:<34} {r['budget_gib']:5.0f} GiB {r['mode']:<12} "
                      f"step {r['step_s']:8.3f} s  peak {max(r['peak_gib']):6.2f} GiB  plan-memory "
                      f"{r['plan_memory_s']:6.3f} s {','.join(r['statuses'])}")
            else:
                print(f"{r['case']:<36} {r['layout']:<34} {r['budget_gib']:5.0f} GiB {r['mode']:<12} "
                      f"does not fit (needs {r['needs_gib']:.2f} GiB)")


if __name__ == "__main__":
    main()
