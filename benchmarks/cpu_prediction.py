"""Predicted vs measured on the CPU emulator: tiny-pangu at world size <= 2 (issue 3, "Prediction").

For each layout: ``moeplan compile tiny-pangu --target TARGET ...``, ``moeplan run PLAN --steps N --meter-every 5``,
``moeplan compare PLAN run.jsonl --json``; prints one JSON line per layout (the plan's layout, schedule and overlap,
predicted and measured step seconds, their ratio, and per PP rank the predicted and measured peak saved-activation
bytes) and a summary line: the layouts within 15% (step) and 10% (activations), the range of step ratios, and the
measured step of ``picked`` (the layout ``moeplan compile`` picks on 2 devices) over the fastest measured 2-device
layout. When ``1dev-mb1`` (the fit point) is among the layouts it is measured again at the end:
``fit_point_end_over_start`` is its second step time over its first. This machine's speed drifts (by up to 1.35×
within minutes on the development VM), so a sweep whose fit point moved by more than about 5% measured a machine
that was not the calibrated one: re-run it.

Usage::

    moeplan calibrate --target cpu --fit-model tiny-pangu -o cal.yaml      # once per machine
    python benchmarks/cpu_prediction.py --target cal.yaml [--steps 40] [--only pp2,dp2] [--workdir DIR]

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


def measure(name: str, *, target: str, steps: int, workdir: Path) -> dict:
    """Compile, run and compare one layout; the comparison's step time and peak saved activations."""
    plan, metrics = workdir / f"{name}.yaml", workdir / f"{name}.jsonl"
    moeplan_cli("compile", "tiny-pangu", "--target", target, "--global-batch", "8", "--seq-len", "64", *LAYOUTS[name],
         "-o", str(plan))
    moeplan_cli("run", str(plan), "--steps", str(steps), "--meter-every", "5", "--metrics", str(metrics))
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
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="moeplan-pred-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results, names = [], args.only.split(",")
        for name in names:
            results.append(measure(name, target=args.target, steps=args.steps, workdir=workdir))
            print(json.dumps(results[-1]), flush=True)
        drift = None
        if "1dev-mb1" in names and len(names) > 1:  # the fit point again: did the machine change speed meanwhile?
            again = measure("1dev-mb1", target=args.target, steps=args.steps, workdir=workdir)
            first = next(r for r in results if r["layout"] == "1dev-mb1")
            drift = round(again["step_measured_ms"] / first["step_measured_ms"], 3)
    within = [r["layout"] for r in results if abs(r["step_ratio"] - 1) <= 0.15
              and all(abs(p["ratio"] - 1) <= 0.10 for p in r["peak_saved_bytes"].values())]
    summary = {"layouts": len(results), "within_15pct_step_and_10pct_activations": within,
               "step_ratio_range": [min(r["step_ratio"] for r in results), max(r["step_ratio"] for r in results)]}
    if drift is not None:
        summary["fit_point_end_over_start"] = drift
    two = [r for r in results if not r["layout"].startswith("1dev")]
    picked = next((r for r in results if r["layout"] == "picked"), None)
    if picked is not None and two:
        fastest = min(two, key=lambda r: r["step_measured_ms"])
        summary.update(picked=picked["schedule"], fastest_measured=fastest["layout"],
                       picked_over_fastest=round(picked["step_measured_ms"] / fastest["step_measured_ms"], 3))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
