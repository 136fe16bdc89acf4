"""Predicted vs measured on the CPU emulator: tiny-pangu at world size <= 2 (issue 3, "Prediction").

For each layout: ``moeplan compile tiny-pangu --target TARGET ...``, then per round ``moeplan run PLAN --steps N
--meter-every 5 --force-balanced-routing`` and ``moeplan compare PLAN run.jsonl --json``. It prints one JSON line
per run (round, layout, measured/predicted step), then one per layout (the plan's layout, schedule and overlap,
predicted and median measured step, their ratio, each round's ratio, and per PP rank the predicted and measured
peak saved-activation bytes of the first round) and a summary line: the layouts within 15% (step, and step with
10% on activations), the range of step ratios, and the measured step of ``picked`` (the layout ``moeplan compile``
picks on 2 devices) over the fastest measured 2-device layout.

The development VM's speed drifts by up to 1.45× within minutes (the 1-device run measured 150, 222 and 187 ms per
step in one afternoon), so a layout measured once can land in a slow phase that its neighbours missed. The layouts
are therefore run in ``--rounds`` rounds, each round running every layout once in the listed order, and each
layout's measured step is the median over the rounds (``step_ratios`` lists the rounds' ratios, so the spread is
visible). When ``1dev-mb1`` is among the layouts it runs in every round: ``step_ratio_over_fit_point`` is the
median over the rounds of the layout's ratio divided by the fit point's ratio in the same round — the model's
error with the machine's drift since calibration taken out (the fit point is 1.00 on the machine it was fitted
on).

Usage::

    moeplan calibrate --target cpu --fit-model tiny-pangu -o cal.yaml      # once per machine
    python benchmarks/cpu_prediction.py --target cal.yaml [--steps 20] [--rounds 3] [--only pp2,dp2] [--workdir DIR]

By default the runs route tokens to random experts (``--force-balanced-routing``), the balanced routing a plan
without a load trace prices. ``--natural-routing`` measures with the model's own router instead, whose choices
are not balanced: at EP 2 one rank's experts get more tokens and the other rank waits for it at every
all-to-all. Each layout whose routed experts are split over more than one rank (``ep·tp/etp`` > 1) then first
runs once with ``--record-load`` and is compiled again with that trace (``--expert-load TRACE
--expert-load-window 4:STEPS``, the steps the comparison uses), so that its plan prices the load its runs will
see (the same seed and data route the same way in every run; docs/load-balance.md §4).

Timings are only meaningful on a quiet machine: each emulated device is one single-threaded process. With
``--fit-model tiny-pangu`` the calibration's forward and backward launch scales are fitted on ``1dev-mb1`` (a
1-device run of the same model and batch), so that row is the fit point, not a prediction.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
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


def compile_layout(name: str, *, target: str, workdir: Path) -> Path:
    """``moeplan compile`` one layout; the plan's path."""
    plan = workdir / f"{name}.yaml"
    moeplan_cli("compile", "tiny-pangu", "--target", target, "--global-batch", "8", "--seq-len", "64", *LAYOUTS[name],
                "-o", str(plan))
    return plan


def price_load(name: str, plan: Path, *, target: str, workdir: Path, steps: int) -> Path:
    """With natural routing: ``plan`` compiled again with the load trace of one run of it, when its routed experts
    are split over ranks (module docstring); else ``plan``."""
    from moeplan.plan import load_plan

    if load_plan(plan).layout.expert_shards < 2:
        return plan
    trace = workdir / f"{name}-load.json"
    trace.unlink(missing_ok=True)
    moeplan_cli("run", str(plan), "--steps", str(steps), "--meter-every", "5", "--metrics",
                str(workdir / f"{name}-record.jsonl"), "--record-load", str(trace))
    priced = workdir / f"{name}-load.yaml"
    moeplan_cli("compile", "tiny-pangu", "--target", target, "--global-batch", "8", "--seq-len", "64",
                *LAYOUTS[name], "--expert-load", str(trace), "--expert-load-window", f"4:{steps}", "-o", str(priced))
    return priced


def measure(plan: Path, metrics: Path, *, steps: int, balanced: bool) -> dict[str, dict]:
    """Run a plan once and compare: the rows of ``moeplan compare --json`` by quantity."""
    metrics.unlink(missing_ok=True)  # this script's own file: `moeplan run` keeps an earlier run's lines
    moeplan_cli("run", str(plan), "--steps", str(steps), "--meter-every", "5", "--metrics", str(metrics),
                *(("--force-balanced-routing",) if balanced else ()))
    return {r["quantity"]: r for r in json.loads(moeplan_cli("compare", str(plan), str(metrics), "--json"))}


def summarize(name: str, plan: Path, runs: list[dict[str, dict]], fit: list[float] | None) -> dict:
    """One layout's row over its rounds: the median measured step and its ratio, each round's ratio, the peak saved
    activations of the first round, and (``fit``: the fit point's ratio in each round) the median ratio over the
    fit point's."""
    from moeplan.plan import load_plan

    p = load_plan(plan)
    lay = p.layout
    layout = (f"tp{lay.tp} pp{lay.pp} vpp{lay.vpp} ep{lay.ep} etp{lay.etp} cp{lay.cp} dp{lay.dp} mb{lay.micro_batch} "
              f"{p.schedule.kind} {p.comm.dispatcher} overlap={','.join(p.comm.overlap) or 'none'}")
    predicted = runs[0]["step time"]["predicted"]
    measured = statistics.median(r["step time"]["measured"] for r in runs)
    ratios = [r["step time"]["ratio"] for r in runs]
    peaks = {q.split()[0]: r for q, r in runs[0].items() if q.endswith("peak saved activations")}
    row = {"layout": name, "schedule": layout, "step_predicted_ms": round(predicted * 1e3, 2),
           "step_measured_ms": round(measured * 1e3, 2), "step_ratio": round(measured / predicted, 3),
           "step_ratios": [round(x, 3) for x in ratios],
           "peak_saved_bytes": {rank: {"predicted": int(r["predicted"]), "measured": int(r["measured"]),
                                       "ratio": round(r["ratio"], 3)} for rank, r in peaks.items()}}
    if fit is not None and name != "1dev-mb1":
        row["step_ratio_over_fit_point"] = round(statistics.median(x / f for x, f in zip(ratios, fit)), 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="a calibrated cpu target YAML (moeplan calibrate)")
    ap.add_argument("--steps", type=int, default=20,
                    help="steps per run (the comparison takes the median of steps >= 5)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every layout, interleaved")
    ap.add_argument("--only", default=",".join(LAYOUTS), help="comma-separated layout names")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--natural-routing", action="store_true", help="route with the model's router, not at random")
    args = ap.parse_args()
    names = args.only.split(",")
    if unknown := [n for n in names if n not in LAYOUTS]:
        sys.exit(f"--only: unknown layout {unknown[0]!r} (one of {', '.join(LAYOUTS)})")
    if args.steps <= 5 or args.rounds < 1:
        sys.exit(f"--steps must be > 5 and --rounds >= 1 (got {args.steps}, {args.rounds})")
    with tempfile.TemporaryDirectory(prefix="moeplan-pred-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        plans = {n: compile_layout(n, target=args.target, workdir=workdir) for n in names}
        if args.natural_routing:
            plans = {n: price_load(n, p, target=args.target, workdir=workdir, steps=args.steps)
                     for n, p in plans.items()}
        runs: dict[str, list[dict[str, dict]]] = {n: [] for n in names}
        for k in range(args.rounds):
            for name in names:
                rows = measure(plans[name], workdir / f"{name}-round{k + 1}.jsonl", steps=args.steps,
                               balanced=not args.natural_routing)
                runs[name].append(rows)
                print(json.dumps({"round": k + 1, "layout": name, "step_ratio": round(rows["step time"]["ratio"], 3)}),
                      flush=True)
        fit = [r["step time"]["ratio"] for r in runs["1dev-mb1"]] if "1dev-mb1" in runs else None
        results = [summarize(n, plans[n], runs[n], fit) for n in names]
    for row in results:
        print(json.dumps(row), flush=True)
    step_ok = [r for r in results if abs(r["step_ratio"] - 1) <= 0.15]
    within = [r["layout"] for r in step_ok if all(abs(p["ratio"] - 1) <= 0.10 for p in r["peak_saved_bytes"].values())]
    summary = {"layouts": len(results), "rounds": args.rounds, "within_15pct_step_and_10pct_activations": within,
               "within_15pct_step": [r["layout"] for r in step_ok],
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
