"""Predicted vs measured on the CPU emulator: tiny-pangu at world size <= 2 (issue 3, "Prediction").

For each layout: ``moeplan compile tiny-pangu --target TARGET ...``, ``moeplan run PLAN --steps N --meter-every 5
--force-balanced-routing``,
``moeplan compare PLAN run.jsonl --json``; prints one JSON line per layout (the plan's layout, schedule and overlap,
predicted and measured step seconds, their ratio, and per PP rank the predicted and measured peak saved-activation
bytes) and a summary line: the layouts within 15% (step) and 10% (activations), the range of step ratios, and the
measured step of ``picked`` (the layout ``moeplan compile`` picks on 2 devices) over the fastest measured 2-device
layout.

The development VM's speed drifts by up to 1.45× within minutes (the fit point measured 150, 222 and 187 ms per
step in one afternoon), so after each layout the fit point (``1dev-mb1``) is run again: ``fit_point_ratio`` is its
measured/predicted step then, and ``step_ratio_over_fit_point`` the layout's ratio divided by it — the model's
error with the machine's drift since calibration taken out (the fit point is 1.00 on the machine it was fitted
on). Both are printed; ``--no-fit-point`` skips the re-runs.

Usage::

    moeplan calibrate --target cpu --fit-model tiny-pangu -o cal.yaml      # once per machine
    python benchmarks/cpu_prediction.py --target cal.yaml [--steps 40] [--only pp2,dp2] [--workdir DIR]

The runs route tokens to random experts (``--force-balanced-routing``) because the plan prices balanced routing:
the routing of an untrained tiny-pangu is not balanced, so at EP 2 one rank's experts get more tokens and the
other rank waits for it at every all-to-all, which the plan does not model. ``--natural-routing`` measures with
the model's own router instead.

Timings are only meaningful on a quiet machine: each emulated device is one single-threaded process. With
``--fit-model tiny-pangu`` the calibration's forward and backward launch scales are fitted on ``1dev-mb1`` (a
1-device run of the same model and batch), so that row is the fit point, not a prediction.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from cli_runs import moeplan_cli

LAYOUTS: dict[str, tuple[str, ...]] = {
    "1dev-mb1": ("--devices", "1", "--tp", "1", "--pp", "1", "--ep", "1", "--micro-batch", "1"),
    "1dev-mb2": ("--devices", "1", "--tp", "1", "--pp", "1", "--ep", "1", "--micro-batch", "2"),
    "pp2": ("--devices", "2", "--tp", "1", "--pp", "2", "--vpp", "1", "--ep", "1", "--micro-batch", "1"),
    "pp2-vpp2": ("--devices", "2", "--tp", "1", "--pp", "2", "--vpp", "2", "--ep", "1", "--micro-batch", "1"),
    "dp2": ("--devices", "2", "--tp", "1", "--pp", "1", "--ep", "1", "--micro-batch", "1"),
    "ep2": ("--devices", "2", "--tp", "1", "--pp", "1", "--ep", "2", "--micro-batch", "1"),
    "tp2": ("--devices", "2", "--tp", "2", "--pp", "1", "--ep", "1", "--micro-batch", "1"),
    "tp2-etp2": ("--devices", "2", "--tp", "2", "--etp", "2", "--pp", "1", "--ep", "1", "--micro-batch", "1"),
    "cp2": ("--devices", "2", "--tp", "1", "--cp", "2", "--pp", "1", "--ep", "1", "--micro-batch", "1"),
    "picked": ("--devices", "2"),  # whatever `moeplan compile` picks on 2 devices
}


def measure(name: str, *, target: str, steps: int, workdir: Path, balanced: bool = True) -> dict:
    """Compile, run and compare one layout; the comparison's step time and peak saved activations."""
    plan, metrics = workdir / f"{name}.yaml", workdir / f"{name}.jsonl"
    moeplan_cli("compile", "tiny-pangu", "--target", target, "--global-batch", "8", "--seq-len", "64", *LAYOUTS[name],
         "-o", str(plan))
    moeplan_cli("run", str(plan), "--steps", str(steps), "--meter-every", "5", "--metrics", str(metrics),
                *(("--force-balanced-routing",) if balanced else ()))
    rows = {r["quantity"]: r for r in json.loads(moeplan_cli("compare", str(plan), str(metrics), "--json"))}
    from moeplan.plan import load_plan

    p = load_plan(plan)
    lay = p.layout
    layout = (f"tp{lay.tp} pp{lay.pp} vpp{lay.vpp} ep{lay.ep} etp{lay.etp} cp{lay.cp} dp{lay.dp} mb{lay.micro_batch} "
              f"{p.schedule.kind} {p.comm.dispatcher} overlap={','.join(p.comm.overlap) or 'none'}")
    step = rows["step time"]
    peaks = {q.split()[0]: (r["predicted"], r["measured"], r["ratio"]) for q, r in rows.items()
             if q.endswith("peak saved activations")}
    return {"layout": name, "schedule": layout, "step_predicted_ms": round(step["predicted"] * 1e3, 2),
            "step_measured_ms": round(step["measured"] * 1e3, 2), "step_ratio": round(step["ratio"], 3),
            "peak_saved_bytes": {r: {"predicted": int(p), "measured": int(m), "ratio": round(x, 3)}
                                 for r, (p, m, x) in peaks.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="a calibrated cpu target YAML (moeplan calibrate)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--only", default=",".join(LAYOUTS), help="comma-separated layout names")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--no-fit-point", action="store_true", help="do not run the fit point again after each layout")
    ap.add_argument("--natural-routing", action="store_true", help="route with the model's router, not at random")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="moeplan-pred-") as tmp:
        workdir = Path(args.workdir or tmp)
        (workdir / "fit-point").mkdir(parents=True, exist_ok=True)
        results, balanced = [], not args.natural_routing
        for name in args.only.split(","):
            row = measure(name, target=args.target, steps=args.steps, workdir=workdir, balanced=balanced)
            if not args.no_fit_point and name != "1dev-mb1":
                fit = measure("1dev-mb1", target=args.target, steps=args.steps, workdir=workdir / "fit-point",
                              balanced=balanced)
                row["fit_point_ratio"] = fit["step_ratio"]
                row["step_ratio_over_fit_point"] = round(row["step_ratio"] / fit["step_ratio"], 3)
            results.append(row)
            print(json.dumps(row), flush=True)
    within = [r["layout"] for r in results if abs(r["step_ratio"] - 1) <= 0.15
              and all(abs(p["ratio"] - 1) <= 0.10 for p in r["peak_saved_bytes"].values())]
    summary = {"layouts": len(results), "within_15pct_step_and_10pct_activations": within,
               "step_ratio_range": [min(r["step_ratio"] for r in results), max(r["step_ratio"] for r in results)]}
    adjusted = [r for r in results if "step_ratio_over_fit_point" in r]
    if adjusted:
        summary.update(
            step_ratio_over_fit_point_range=[min(r["step_ratio_over_fit_point"] for r in adjusted),
                                             max(r["step_ratio_over_fit_point"] for r in adjusted)],
            within_15pct_over_fit_point=[r["layout"] for r in adjusted
                                         if abs(r["step_ratio_over_fit_point"] - 1) <= 0.15])
    two = [r for r in results if not r["layout"].startswith("1dev")]
    picked = next((r for r in results if r["layout"] == "picked"), None)
    if picked is not None and two:
        fastest = min(two, key=lambda r: r["step_measured_ms"])
        summary.update(picked=picked["schedule"], fastest_measured=fastest["layout"],
                       picked_over_fastest=round(picked["step_measured_ms"] / fastest["step_measured_ms"], 3))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
