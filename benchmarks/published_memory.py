"""Memory against published runs: every published run fits at its recipe, and published peaks are matched.

1. **Runs** (``published_runs.yaml``, every run not excluded): the run's layout, schedule and recipe compiled with
   memory enforced, as ``moeplan compile`` runs it (the budget: the device's whole memory). A run that trained must
   not be refused. Per run: the fullest device's total, its headroom to the budget and its terms.
2. **Peaks** (``published_memory.yaml``): each measured figure's layout and recipe priced the same way (not enforced:
   the figure is compared, not the fit), the statistic the source measured read off the plan's terms of the fullest
   device — ``max_allocated``: model states, activations, working set, workspace and FSDP's gathered copies (what
   PyTorch's caching allocator hands out); ``max_reserved``: that plus the allocator's share; ``nvidia_smi`` and
   ``unknown``: the total — against the published figure (``measured_peak_gib`` in the entry's ``unit``, GiB or
   GB).
3. **CPU emulator**: ``benchmarks/cpu_memory.py`` measures the runtime's own meters against the plan.

Usage: ``python benchmarks/published_memory.py [--only ID_SUBSTRING] [--json] [--runs-only | --peaks-only]``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_runs import compile_run  # noqa: E402

from moeplan.errors import InfeasibleError  # noqa: E402
from moeplan.plan import MEMORY_TERMS  # noqa: E402
from moeplan.state import StageMemory  # noqa: E402

HERE = Path(__file__).resolve().parent
GIB = 2**30
PRICED = "shard,partition-stages,place-experts,schedule,plan-memory{enforce=false}"
ENFORCED = "shard,partition-stages,place-experts,schedule,plan-memory"
ALLOCATED = ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "working_set_bytes",
             "workspace_bytes", "gathered_bytes")


def statistic(m: StageMemory, metric: str) -> float:
    """The plan's figure for what a source's statistic measures (module docstring), bytes."""
    allocated = sum(getattr(m, f) for f in ALLOCATED)
    if metric == "max_allocated":
        return allocated
    if metric == "max_reserved":
        return allocated + m.allocator_bytes
    return m.total_bytes


def check_runs(only: str) -> list[dict]:
    """Part 1 of the module docstring."""
    runs = yaml.safe_load((HERE / "published_runs.yaml").read_text())["runs"]
    out = []
    for run in runs:
        if run.get("exclude") or only not in run["id"]:
            continue
        notes: list[str] = []
        try:
            state = compile_run(run, ENFORCED, notes)
        except InfeasibleError as e:
            out.append({"id": run["id"], "fits": False, "why": str(e)})
            continue
        mem = state.memory
        assert mem is not None
        top = max(mem.stages, key=lambda m: m.total_bytes)
        out.append({"id": run["id"], "fits": True, "layout": state.layout.short(),
                    "recompute": sorted({m.recompute for m in mem.stages}),
                    "peak_gib": top.total_bytes / GIB, "budget_gib": mem.budget_bytes / GIB,
                    "pp_rank": top.pp_rank, "terms_gib": {f: getattr(top, f) / GIB for _, f in MEMORY_TERMS}})
    return out


def check_peaks(only: str) -> list[dict]:
    """Part 2 of the module docstring."""
    peaks = yaml.safe_load((HERE / "published_memory.yaml").read_text())["peaks"]
    out = []
    for peak in peaks:
        if only not in peak["id"]:
            continue
        notes: list[str] = []
        run = {**peak, "layout": {**peak["layout"]}}
        if not peak.get("devices") or not peak["layout"].get("global_batch"):
            out.append({"id": peak["id"], "error": "the source states no device count or global batch"})
            continue
        if (peak.get("recipe") or {}).get("fsdp") and (peak["layout"].get("dp_shard") or 1) == 1:
            out.append({"id": peak["id"], "error": "FSDP over the CP ranks alone (torchtitan's dp_shard_cp mesh with "
                                                   "dp_shard 1): moeplan's dp_shard 1 means no FSDP"})
            continue
        try:
            state = compile_run(run, PRICED, notes)
        except Exception as e:  # a layout moeplan cannot express: reported, not hidden
            out.append({"id": peak["id"], "error": f"{type(e).__name__}: {e}"})
            continue
        assert state.memory is not None
        top = max(state.memory.stages, key=lambda m: statistic(m, peak["metric"]))
        unit = GIB if peak.get("unit", "GiB") == "GiB" else 1e9
        predicted = statistic(top, peak["metric"]) / unit
        out.append({"id": peak["id"], "metric": peak["metric"], "measured": peak["measured_peak_gib"],
                    "predicted": predicted, "ratio": predicted / peak["measured_peak_gib"],
                    "layout": state.layout.short(), "notes": notes})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--runs-only", action="store_true")
    ap.add_argument("--peaks-only", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    runs = [] if args.peaks_only else check_runs(args.only)
    peaks = [] if args.runs_only else check_peaks(args.only)
    ratios = [p["ratio"] for p in peaks if "ratio" in p]
    summary = {"runs": len(runs), "refused": [r["id"] for r in runs if not r["fits"]],
               "peaks": len(ratios), "within_10pct": sum(abs(r - 1) <= 0.10 for r in ratios),
               "median_abs_error": statistics.median(abs(r - 1) for r in ratios) if ratios else None,
               "seconds": time.perf_counter() - t0}
    if args.json:
        print(json.dumps({"runs": runs, "peaks": peaks, "summary": summary}, indent=1, default=str))
        return
    for r in runs:
        if not r["fits"]:
            print(f"REFUSED {r['id']}: {r['why']}")
            continue
        terms = " ".join(f"{f.removesuffix('_bytes')} {v:.1f}" for f, v in r["terms_gib"].items() if v >= 0.05)
        print(f"{r['id']:55s} {r['peak_gib']:5.1f} of {r['budget_gib']:.1f} GiB (headroom "
              f"{r['budget_gib'] - r['peak_gib']:+5.1f}) pp{r['pp_rank']} {','.join(r['recompute'])}: {terms}")
    for p in peaks:
        if "error" in p:
            print(f"{p['id']:62s} not priced: {p['error']}")
            continue
        print(f"{p['id']:62s} {p['metric']:13s} measured {p['measured']:6.1f} predicted {p['predicted']:6.1f} "
              f"ratio {p['ratio']:.3f}")
    print(f"{summary['runs']} runs, {len(summary['refused'])} refused; {summary['peaks']} peaks, "
          f"{summary['within_10pct']} within 10%" + (f", median |error| {summary['median_abs_error']:.1%}"
                                                   if ratios else "") + f"; {summary['seconds']:.0f} s")


if __name__ == "__main__":
    main()
