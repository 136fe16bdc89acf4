"""Planning under expert load: what a measured routing histogram changes in the predicted step, MFU, worst-rank
memory and the searched layout (docs/load-balance.md §6).

Two cases, each searched freely by the default compile: the Pangu Ultra MoE 718B on 6144 ascend-910b (the README's
main job) and DeepSeek-V3 on 2048 H800 (its published global batch 15,360 × 4,096). Each is compiled four times:

- ``balanced``: no trace (every routed expert gets ``T·top_k/E`` tokens, moeplan's assumption without one);
- ``contiguous``, ``greedy``, ``eplb+r``: with the public DeepSeek-V3 routing histogram
  (``benchmarks/data/deepseek-v3-bincounts.json``: 58 MoE layers × 256 experts, measured in inference; its source
  and licence are in ``benchmarks/data/README.md``) mapped onto the model's MoE decoder layers in order (both
  models have 58), placed by that policy; ``eplb+r`` gives every EP rank ``r`` extra expert slots for replicas.

Printed per row: the layout searched (and whether it differs from the balanced one), the expert group size, the
load factor priced (busiest EP rank over the mean, averaged over layers), the predicted step (and the same plan's
step under balanced routing) and MFU, and the worst PP rank's memory. The default compile simulates the best few
estimates, not every option, so a row's plan may be faster than the ``balanced`` row's when the load steered the
search to options it had not simulated; its own balanced step shows the load's cost. The histogram is one snapshot (one "step"), so the imbalance priced is that snapshot's
under each policy's placement, fitted to it: an in-sample figure (benchmarks/planner_quality.py scores placements
on data they were not made from).

Usage: ``python benchmarks/load_ablation.py [--only 718b|deepseek] [--replicas R] [--json]``; several minutes on
a 2-core machine (eight full compiles).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from moeplan.compile import compile_model
from moeplan.compiler import DEFAULT_PIPELINE, Pipeline
from moeplan.expert_load import read_trace
from moeplan.load_model import LoadModel
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.targets import load_target

TRACE = Path(__file__).resolve().parent / "data" / "deepseek-v3-bincounts.json"
CASES = {
    "718b": ("pangu-ultra-moe-718b", "ascend-910b", 6144, {}),
    "deepseek": ("deepseek-v3", "h800", 2048, {"global_batch": 15360, "seq_len": 4096}),
}


def compile_row(name: str, target: str, devices: int, shape: dict, policy: str | None, replicas: int) -> dict:
    spec = load_spec(name)
    spec = spec.with_shape(seq_len=shape.get("seq_len"), global_batch=shape.get("global_batch"))
    tgt = load_target(target)
    load = None
    pipe = Pipeline.parse(DEFAULT_PIPELINE)
    if policy is not None:
        trace = read_trace(TRACE, spec=spec)  # the histogram's 58 MoE layers onto the model's, checked
        load = LoadModel(trace, path=str(TRACE.relative_to(TRACE.parents[2])), groups=spec.num_expert_groups,
                         ranks_per_node=tgt.devices_per_node)
        pipe = pipe.with_option("place-experts", "policy", policy).with_option("place-experts", "replicas", replicas)
    t0 = time.perf_counter()
    plan = compile_model(spec=spec, target=tgt, num_devices=devices, pipeline=pipe,
                         fixed=Fixed(global_batch=spec.global_batch, seq_len=spec.seq_len, load=load)).plan
    lay, pred = plan.layout, plan.prediction
    return {"layout": lay.as_layout().short(), "expert_shards": lay.expert_shards, "expert_load": lay.expert_load,
            "step_s": pred.step_time_s, "mfu": pred.mfu,
            "worst_rank_bytes": max(m.total_bytes for m in plan.memory.ranks),
            "balanced_step_s": plan.experts.load.balanced_step_s if plan.experts.load else pred.step_time_s,
            "compile_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=sorted(CASES))
    ap.add_argument("--replicas", type=int, default=1, help="eplb: extra expert slots per EP rank (default 1)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for case, (name, target, devices, shape) in CASES.items():
        if args.only and case != args.only:
            continue
        base = None
        for label, policy, replicas in (("balanced", None, 0), ("contiguous", "contiguous", 0),
                                        ("greedy", "greedy", 0), (f"eplb+{args.replicas}", "eplb", args.replicas)):
            row = {"case": f"{name} on {devices} {target}", "variant": label,
                   **compile_row(name, target, devices, shape, policy, replicas)}
            base = base or row
            row["layout_changed"] = row["layout"] != base["layout"]
            rows.append(row)
            if not args.json:
                changed = "changed" if row["layout_changed"] else ""
                print(f"{row['case']:<40} {label:<11} {row['layout']:<42} {changed:<8} n={row['expert_shards']:<4}"
                      f" load×{row['expert_load']:.3f}  step {row['step_s']:.3f} s (balanced "
                      f"{row['balanced_step_s']:.3f} s)  "
                      f"MFU {row['mfu']:.1%}  worst rank {row['worst_rank_bytes'] / 2**30:.1f} GiB  "
                      f"({row['compile_s']:.0f} s)", flush=True)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()


if __name__ == "__main__":
    main()
