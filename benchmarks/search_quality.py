"""How close the default layout search comes to the optimum of the whole space (target: within 1% on every case).

Per (model, target, devices) case, two searches over the same space (every layout, schedule, dispatcher and
overlap set the target's runtime runs):

- the default ``moeplan compile`` search (``--candidates 4``): its step, its compile time (trace + search, in this
  process: the CLI adds about 1.5 s of imports and plan writing), and the bound it reports (how far from the
  optimum its plan can be);
- the exact search (``--exact``): every option whose lower bound (moeplan/bounds.py) is below the best step found
  goes through the full pipeline, so its best is the optimum of every valid layout under the cost model. It may
  run for a long time on the large cases (minutes to hours on a 2-core machine).

Prints a table and, with ``--json``, one JSON line per case: the steps, regret = default / optimum − 1, both
compile times and the exact search's counts (options, evaluated, pruned).

    python benchmarks/search_quality.py [--only SUBSTRING] [--json] [--default-only]
"""
from __future__ import annotations

import argparse
import json
import time

from moeplan.compile import compile_model
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.targets import load_target

CASES: tuple[tuple[str, str, int], ...] = (
    ("pangu-ultra-moe-718b", "ascend-910b", 6144),
    ("pangu-pro-moe-72b", "ascend-910b:313t", 512),
    ("deepseek-v3", "h800", 2048),
    ("qwen3-235b-a22b", "h100", 1024),
    ("mixtral-8x22b", "h100", 256),
    ("qwen2-57b-a14b", "h100", 64),
    ("qwen3-30b-a3b", "h100", 64),
    ("llama3-70b", "a100", 1024),
    ("llama3-70b", "h100", 64),
)


def run_case(model: str, target: str, devices: int, *, exact: bool) -> dict:
    spec, tgt = load_spec(model), load_target(target)
    fixed = Fixed(global_batch=spec.global_batch, seq_len=spec.seq_len)
    row: dict = {"case": f"{model} on {devices} {target}"}
    for name, candidates in (("default", 4), ("exact", None))[:2 if exact else 1]:
        t0 = time.perf_counter()
        res = compile_model(spec=spec, target=tgt, num_devices=devices, fixed=fixed, candidates=candidates).result
        best = res.ranked[0].state
        row[name] = {"step_s": best.prediction.step_time_s, "layout": best.layout.short(),
                     "strategy": best.strategy.short(), "compile_s": round(time.perf_counter() - t0, 2),
                     "options": res.num_options, "evaluated": res.num_evaluated, "pruned": res.num_pruned,
                     "gap_bound": max(0.0, res.gap)}
    if exact:
        row["regret"] = row["default"]["step_s"] / row["exact"]["step_s"] - 1
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the cases whose name contains this")
    ap.add_argument("--json", action="store_true", help="one JSON line per case")
    ap.add_argument("--default-only", action="store_true", help="skip the exact search")
    args = ap.parse_args()
    for model, target, devices in CASES:
        if args.only and args.only not in f"{model} {target} {devices}":
            continue
        row = run_case(model, target, devices, exact=not args.default_only)
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        d = row["default"]
        line = (f"{row['case']:<40} default {d['step_s']:8.3f} s in {d['compile_s']:6.1f} s "
                f"({d['layout']}; bound gap {d['gap_bound']:.1%})")
        if "exact" in row:
            e = row["exact"]
            line += (f" | optimum {e['step_s']:8.3f} s in {e['compile_s']:7.1f} s ({e['layout']}; {e['evaluated']} "
                     f"of {e['options']} evaluated, {e['pruned']} pruned) | regret {row['regret']:+.2%}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
