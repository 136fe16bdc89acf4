"""What each overlap mechanism buys on a MoE step: the dispatcher and the mechanisms added one at a time.

For Pangu Ultra MoE 718B on 6144 Ascend 910B at its reported layout (TP 8, PP 16, VPP 2, EP 4 with TP-extend-EP,
micro-batch 2; docs/references.md §1.1) and DeepSeek-V3 on 2048 H800 at its published layout (PP 16, EP 64, no TP, FP8 GEMMs;
15360 × 4096 tokens; DeepSeek recomputes its norms and MLA up-projections, which no whole-layer mode expresses, so
moeplan's ``selective`` — norms, activations, core attention — stands in), with the layout fixed, each row adds one
step:

1. flat all-to-all dispatch, the baseline schedule — the 718B's interleaved 1F1B over its two chunks per rank;
   DeepSeek-V3's 1F1B with one chunk per rank (its 120 micro-batches per step do not divide by PP 16, which
   interleaving needs) — with only the PP sends and receives posted early (``pp``);
2. the node-aware dispatcher: hierarchical (MindSpeed ``--moe-hierarchical-alltoallv``) for the 718B, the
   node-deduplicating one (DeepEP) for DeepSeek-V3;
3. + ``shared-expert`` (the shared experts beside the dispatch and combine);
4. + ``fb`` (a forward paired with a backward so each one's all-to-all hides under the other's compute);
5. the V schedule DualPipeV (two chunks per rank placed in a V, I/W split, its own F&B pairs) in place of the
   baseline schedule;
6. + ``dp`` (gradient reduce-scatter and parameter all-gather beside the pipeline).

Per row: predicted step, MFU (Megatron-LM's causal model FLOPs over devices × bf16 peak), the EP overlap rate
``1 − exposed / total`` in the steady state and over the step, and the inter-node EP bytes one device sends per
step. The last line compares the inter-node EP bytes of rows 1 and 2 with docs/references.md §3.2's volume sketch for the
hierarchical all-to-all, ``k·(1 − 1/N) / (N − 1)`` for top-k over N nodes (only the 718B's hierarchical dispatcher is
that scheme; the deduplicating one sends each token once to each node its experts are on).

The memory plan is reported, not enforced (``plan-memory{enforce=false}``): the 718B ran with swapping and
fine-grained recompute moeplan's memory pass does not model yet; a row whose plan does not fit is marked ``(!)``.

The rows are independent: they are predicted in ``--jobs`` processes (default: one per CPU), printed in order.

Usage: ``python benchmarks/overlap_ablation.py [--json] [--only NAME] [--jobs N]``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from moeplan.compiler import Pipeline, run_pipeline
from moeplan.layout import Layout
from moeplan.spec import load_spec
from moeplan.state import PlanState, Strategy
from moeplan.targets import load_target
from moeplan.trace import trace_model

PIPELINE = "shard,partition-stages,place-experts,schedule,plan-memory{enforce=false},simulate"

CASES = {
    "pangu-ultra-moe-718b": dict(
        target="ascend-910b", dtype=None, devices=6144, node_dispatcher="hierarchical", recompute="auto",
        base_schedule="interleaved",
        layout=dict(tp=8, pp=16, vpp=2, ep=4, etp=1, cp=1, micro_batch=2, global_batch=6144, seq_len=4096)),
    "deepseek-v3": dict(
        target="h800", dtype="fp8", devices=2048, node_dispatcher="dedup", recompute="selective",
        base_schedule="1f1b", layout=dict(tp=1, pp=16, vpp=2, ep=64, etp=1, cp=1, micro_batch=1, global_batch=15360, seq_len=4096)),
}


def rows(node_dispatcher: str, base: str) -> list[tuple[str, str, str, frozenset[str]]]:
    """(label, dispatcher, schedule, overlap) of each row (module docstring)."""
    out, mechs = [], {"pp"}
    out.append(("flat", "flat", base, frozenset(mechs)))
    out.append((node_dispatcher, node_dispatcher, base, frozenset(mechs)))
    for added in ("shared-expert", "fb"):
        mechs.add(added)
        out.append((f"+ {added}", node_dispatcher, base, frozenset(mechs)))
    out.append(("DualPipeV", node_dispatcher, "dualpipev", frozenset(mechs)))
    mechs.add("dp")
    out.append(("+ dp", node_dispatcher, "dualpipev", frozenset(mechs)))
    return out


def run_row(name: str, label: str, dispatcher: str, schedule: str, overlap: frozenset[str]) -> dict:
    """One row of case ``name``: its layout with ``dispatcher``, ``schedule`` and ``overlap`` through PIPELINE."""
    case = CASES[name]
    spec = load_spec(name)
    target = load_target(case["target"], training_dtype=case["dtype"])
    lay = case["layout"]
    dp = case["devices"] // (lay["tp"] * lay["cp"] * lay["pp"])
    graph = trace_model(spec, seq_len=lay["seq_len"])
    layout = Layout(dp=dp, **{**lay, "vpp": 1 if schedule == "1f1b" else lay["vpp"]})
    strategy = Strategy(schedule=schedule, dispatcher=dispatcher, overlap=overlap,  # type: ignore[arg-type]
                        recompute=case["recompute"])
    state, _ = run_pipeline(PlanState(graph=graph, target=target, layout=layout, strategy=strategy),
                            Pipeline.parse(PIPELINE).passes)
    p, mem = state.prediction, state.memory
    assert p is not None and mem is not None
    ep = p.comm.get("ep", {})
    return {"row": label, "dispatcher": dispatcher, "schedule": schedule, "overlap": sorted(overlap),
            "step_s": p.step_time_s, "mfu": p.mfu, "ep_total_s": ep.get("total_s"),
            "ep_overlap_steady": ep.get("steady_overlap_rate"), "ep_overlap_step": ep.get("overlap_rate"),
            "ep_inter_bytes": ep.get("inter_bytes"), "ep_intra_bytes": ep.get("intra_bytes"),
            "recompute": sorted({m.recompute for m in mem.stages}),
            "memory_fits": all(m.total_bytes <= mem.budget_bytes for m in mem.stages)}


def run_cases(names: list[str], jobs: int) -> dict[str, list[dict]]:
    """Every row of each case in ``names``, predicted in ``jobs`` processes (the rows are independent)."""
    tasks = [(name, *row) for name in names for row in rows(CASES[name]["node_dispatcher"],
                                                            CASES[name]["base_schedule"])]
    if jobs == 1:
        done = [run_row(*t) for t in tasks]
    else:
        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
            done = list(pool.map(run_row, *zip(*tasks)))
    out: dict[str, list[dict]] = {name: [] for name in names}
    for t, row in zip(tasks, done):
        out[t[0]].append(row)
    return out


def sketch_factor(spec_name: str, case: dict) -> float:
    """docs/references.md §3.2's flat / hierarchical inter-node volume for top-k over the expert group's N nodes."""
    spec = load_spec(spec_name)
    lay = case["layout"]
    group = lay["ep"] * lay["tp"]  # moeplan's expert group (TP-extend-EP: tp·ep; no TP: ep)
    n = max(1, group // load_target(case["target"]).devices_per_node)
    k = spec.top_k
    return k * (1 - 1 / n) / (n - 1) if n > 1 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes predicting rows (default: CPUs)")
    args = ap.parse_args()
    if args.jobs < 1:
        sys.exit(f"--jobs={args.jobs}: must be at least 1")
    t0 = time.perf_counter()
    results = run_cases([name for name in CASES if args.only in name], args.jobs)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for name, rs in results.items():
        case = CASES[name]
        print(f"{name} on {case['devices']} {case['target']}, {case['layout']}")
        print(f"  {'row':16s} {'step s':>8s} {'MFU':>6s} {'EP s':>7s} {'EP ovl steady':>14s} {'EP ovl step':>12s} "
              f"{'EP inter GB/dev':>16s}  recompute")
        for r in rs:
            steady = "-" if r["ep_overlap_steady"] is None else f"{r['ep_overlap_steady']:.1%}"
            step = "-" if r["ep_overlap_step"] is None else f"{r['ep_overlap_step']:.1%}"
            print(f"  {r['row']:16s} {r['step_s']:8.3f} {r['mfu']:6.1%} {r['ep_total_s'] or 0:7.3f} {steady:>14s} "
                  f"{step:>12s} {(r['ep_inter_bytes'] or 0) / 1e9:16.2f}  {','.join(r['recompute'])}"
                  f"{'' if r['memory_fits'] else ' (!)'}")
        flat, node = rs[0]["ep_inter_bytes"], rs[1]["ep_inter_bytes"]
        if flat and node:
            print(f"  inter-node EP bytes {rs[0]['row']} / {rs[1]['row']}: {flat / node:.2f}x"
                  f" (docs/references.md §3.2 hierarchical sketch k(1-1/N)/(N-1): {sketch_factor(name, case):.2f}x)")
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
