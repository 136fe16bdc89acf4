"""How close the default layout search comes to the optimum of the whole space (target: within 1% on every case).

Per (model, target, devices) case, two searches over the same space (every layout, schedule, dispatcher and
overlap set the target's runtime runs):

- the default ``moeplan compile`` search (``--candidates 4``): its step, its wall time (trace + search, in this
  process: the CLI adds about 2.5 s of imports and plan writing), and the bound it reports (how far from the
  optimum its plan can be);
- the exact search (``--exact``): every option whose lower bound (moeplan/bounds.py) is below the best step found
  goes through the full pipeline, so its best is the optimum of every valid layout under the cost model. It runs
  for minutes to half an hour per case on a 2-core machine, so its results are stored: ``--store`` runs it and
  writes each case's optimum to ``benchmarks/data/search_quality.json`` as it finishes, with the commit and the
  command that computed it; a plain run compares the default search against the stored optimum without
  recomputing it. A commit that changes a prediction (a golden file) changes the optima: run ``--store`` again.

Prints one line per case and, with ``--json``, one JSON line per case: the default step and wall time, the stored
optimum, regret = default / optimum − 1.

    python benchmarks/search_quality.py [--only SUBSTRING] [--json] [--store]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
STORED = Path(__file__).parent / "data" / "search_quality.json"


def case_name(model: str, target: str, devices: int) -> str:
    return f"{model} on {devices} {target}"


def search(model: str, target: str, devices: int, *, exact: bool) -> dict:
    """One search of a case: its best plan's step, layout and strategy, its wall time and counts."""
    spec, tgt = load_spec(model), load_target(target)
    fixed = Fixed(global_batch=spec.global_batch, seq_len=spec.seq_len)
    t0 = time.perf_counter()
    res = compile_model(spec=spec, target=tgt, num_devices=devices, fixed=fixed,
                        candidates=None if exact else 4).result
    best = res.ranked[0].state
    return {"step_s": best.prediction.step_time_s, "layout": best.layout.short(), "strategy": best.strategy.short(),
            "wall_s": round(time.perf_counter() - t0, 2), "options": res.num_options,
            "evaluated": res.num_evaluated, "pruned": res.num_pruned, "gap_bound": max(0.0, res.gap)}


def _commit() -> str:
    """The checkout's commit, ``+changes`` when its tracked files differ from it."""
    root = Path(__file__).parent.parent
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                           text=True).stdout.strip()
    return (head or "unknown") + ("+changes" if dirty else "")


def load_stored(path: Path = STORED) -> dict:
    """The stored optima: ``{"cases": {case name: {...}}}`` (empty when there is no file)."""
    return json.loads(path.read_text()) if path.exists() else {"cases": {}}


def store(case: str, optimum: dict, path: Path = STORED) -> None:
    """Add ``case``'s optimum to the file, with the commit and command that computed it (written whole, then
    renamed: an interrupted run leaves the previous file)."""
    data = load_stored(path)
    data["cases"][case] = {**optimum, "commit": _commit(), "command": " ".join(["python", *sys.argv]),
                           "date": time.strftime("%Y-%m-%d")}
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the cases whose name contains this")
    ap.add_argument("--json", action="store_true", help="one JSON line per case")
    ap.add_argument("--store", action="store_true",
                    help="run the exact search and store its optimum (benchmarks/data/search_quality.json)")
    args = ap.parse_args()
    for model, target, devices in CASES:
        case = case_name(model, target, devices)
        if args.only and args.only not in f"{model} {target} {devices}":
            continue
        if args.store:
            store(case, search(model, target, devices, exact=True))
        row = {"case": case, "default": search(model, target, devices, exact=False)}
        optimum = load_stored()["cases"].get(case)
        if optimum is not None:
            row["optimum"] = optimum
            row["regret"] = row["default"]["step_s"] / optimum["step_s"] - 1
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        d = row["default"]
        line = (f"{case:<40} default {d['step_s']:8.3f} s in {d['wall_s']:5.1f} s ({d['layout']}; bound gap "
                f"{d['gap_bound']:.1%})")
        if optimum is None:
            line += " | optimum not stored (--store computes it)"
        else:
            line += (f" | optimum {optimum['step_s']:8.3f} s ({optimum['layout']}; exact search {optimum['wall_s']:.0f} s,"
                     f" {optimum['evaluated']} of {optimum['options']} evaluated, at {optimum['commit'][:10]}) "
                     f"| regret {row['regret']:+.2%}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
