"""Does the layout search's memory estimate agree with the ``plan-memory`` pass? (issue: one memory model)

For each (model, target, devices) case of benchmarks/search_quality.py, the options the default search would send
through the full pipeline (the best ``--per-case`` estimates, those whose memory estimate fits first), each run
through ``shard, partition-stages, place-experts, schedule, plan-memory{enforce=false}``: per option, the
estimate's fullest rank (moeplan/estimate.py ``estimate_memory``) against the pass's, and whether both pick the
same recompute mode per rank. Prints the worst relative difference per case.

    python benchmarks/memory_agreement.py [--only SUBSTRING] [--per-case N] [--fsdp]
"""
from __future__ import annotations

import argparse
import time
from collections import Counter

from search_quality import CASES

from moeplan.compiler import Pipeline, run_pipeline
from moeplan.cost_models.memory import budget_bytes
from moeplan.estimate import estimate_memory, model_cost
from moeplan.ir import named_layers
from moeplan.search import Fixed, build_options, rank_by_estimate
from moeplan.spec import load_spec
from moeplan.state import PlanState
from moeplan.targets import load_target
from moeplan.trace import trace_model

PIPELINE = "shard,partition-stages,place-experts,schedule,plan-memory{enforce=false}"


def run_case(model: str, target: str, devices: int, per_case: int, fsdp: bool = False) -> dict:
    spec, tgt = load_spec(model), load_target(target)
    graph = trace_model(spec, seq_len=spec.seq_len)
    fixed = Fixed(global_batch=spec.global_batch, seq_len=spec.seq_len, search_fsdp=fsdp)
    budget = budget_bytes(tgt)
    built = build_options(graph=graph, target=tgt, num_devices=devices, fixed=fixed, budget=budget)
    ranked = rank_by_estimate(graph=graph, target=tgt, options=built.options, budget=budget, workers=1)
    kinds = tuple(k for _, k in named_layers(spec))
    worst, modes_same, n, sharded = 0.0, 0, 0, 0
    for _, _, lay, st in ranked[:per_case]:
        cost = model_cost(graph, lay, tgt, st.dispatcher, st.overlap, Counter(kinds), {}, st.precision)
        est = estimate_memory(lay, st, cost, kinds=kinds, target=tgt, budget=budget, hidden_size=spec.hidden_size)
        state, _ = run_pipeline(PlanState(graph=graph, target=tgt, layout=lay, strategy=st), Pipeline.parse(PIPELINE).passes)
        passed = state.memory.stages
        diff = max(abs(e.total_bytes / p.total_bytes - 1) for e, p in zip(est.ranks(), passed))
        worst = max(worst, diff)
        modes_same += all(e.recompute == p.recompute for e, p in zip(est.ranks(), passed))
        n += 1
        sharded += lay.dp_shard > 1
    return {"case": f"{model} on {devices} {target}", "options": n, "fsdp_options": sharded,
            "worst_rel_diff": worst, "same_modes": modes_same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="")
    ap.add_argument("--per-case", type=int, default=8)
    ap.add_argument("--fsdp", action="store_true", help="search FSDP layouts too (moeplan compile --dp-shard auto)")
    args = ap.parse_args()
    for model, target, devices in CASES:
        if args.only not in f"{model} {target} {devices}":
            continue
        t0 = time.perf_counter()
        row = run_case(model, target, devices, args.per_case, args.fsdp)
        print(f"{row['case']:45s} {row['options']:3d} options ({row['fsdp_options']} FSDP): "
              f"worst |estimate/pass - 1| {row['worst_rel_diff']:.3%}, "
              f"same recompute modes on every rank in {row['same_modes']}/{row['options']}  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
