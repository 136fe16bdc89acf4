"""What ``fb`` overlap does to the EP wait, measured against predicted, on the CPU emulator at world size 2.

One layout — tiny-pangu, 2 devices, EP 2 (dp 2), pp 1, micro-batch 1, 1F1B, flat dispatcher, global batch 8 ×
seq 64 unless changed — compiled twice, with ``--overlap fb`` and with ``--overlap none``; then ``--rounds`` rounds,
each running both plans (off, then on) for ``--steps`` steps with every step metered. Per plan and round it takes
the measured EP wait of the compute stream: per step the mean over ranks of ``comm_s["ep"]`` (the seconds the
compute stream waited on EP collectives, moeplan.runtime.overlap inside the OVERLAP_F_B pairs), the median over
the steps after ``--warmup``. It prints one line per round (both waits and the fall from off to on), one per plan
(the predicted EP wait ``prediction.comm["ep"].exposed_s`` and the median measured one over the rounds), and the
fall, predicted and measured (median over the rounds), and their ratio. Running off and on side by side in each
round keeps a drift of the machine's speed (docs/step-model.md §6) from landing on one of them only.

Usage::

    moeplan calibrate --target cpu --fit-model tiny-pangu -o cal.yaml      # once per machine
    python benchmarks/fb_overlap.py --target cal.yaml [--steps 30] [--rounds 3] [--seq-len 64]

The runs route tokens to random experts (``--force-balanced-routing``, as the plan assumes; ``--natural-routing``
uses the model's router, whose imbalance adds waits the plan does not price).

Timings are only meaningful on a quiet machine (each emulated device is one single-threaded process); run it twice.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from cli_runs import moeplan_cli


def compile_plan(overlap: str, *, target: str, seq_len: int, workdir: Path) -> Path:
    """``moeplan compile`` the EP 2 layout with ``--overlap OVERLAP``; the plan's path."""
    plan = workdir / f"{overlap}.yaml"
    moeplan_cli("compile", "tiny-pangu", "--target", target, "--devices", "2", "--tp", "1", "--pp", "1", "--ep", "2",
                "--micro-batch", "1", "--global-batch", "8", "--seq-len", str(seq_len), "--schedule", "1f1b",
                "--dispatcher", "flat", "--overlap", overlap, "-o", str(plan))
    return plan


def measure(plan: Path, metrics: Path, *, steps: int, warmup: int, balanced: bool) -> dict[str, float]:
    """Run a plan once: the median over the steps after ``warmup`` of the EP wait, the EP in-flight time and the
    step (seconds, mean over ranks)."""
    from moeplan.runtime.compare import read_records

    metrics.unlink(missing_ok=True)  # this script's own file: `moeplan run` keeps an earlier run's lines
    moeplan_cli("run", str(plan), "--steps", str(steps), "--meter-every", "1", "--metrics", str(metrics),
                *(("--force-balanced-routing",) if balanced else ()))
    records = [r for r in read_records(metrics) if r.step > warmup]
    return {"ep_wait_s": statistics.median(statistics.mean(k.comm_s.get("ep", 0.0) for k in r.ranks) for r in records),
            "ep_busy_s": statistics.median(statistics.mean(k.busy_s("ep") for k in r.ranks) for r in records),
            "step_s": statistics.median(r.step_time_s for r in records)}


def main() -> None:
    from moeplan.plan import load_plan

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="cpu", help="a calibrated cpu target YAML (moeplan calibrate), or cpu")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each plan, off and on side by side")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--natural-routing", action="store_true", help="route with the model's router, not at random")
    args = ap.parse_args()
    if args.steps <= args.warmup or args.rounds < 1:
        sys.exit(f"--steps must be > --warmup and --rounds >= 1 (got {args.steps}, {args.warmup}, {args.rounds})")
    runs: dict[str, list[dict[str, float]]] = {"none": [], "fb": []}
    with tempfile.TemporaryDirectory(prefix="moeplan-fb-") as tmp:
        plans = {o: compile_plan(o, target=args.target, seq_len=args.seq_len, workdir=Path(tmp)) for o in runs}
        for k in range(args.rounds):
            for o in runs:
                runs[o].append(measure(plans[o], Path(tmp) / f"{o}-round{k + 1}.jsonl", steps=args.steps,
                                       warmup=args.warmup, balanced=not args.natural_routing))
            off, on = runs["none"][-1]["ep_wait_s"], runs["fb"][-1]["ep_wait_s"]
            print(json.dumps({"round": k + 1, "ep_wait_off_s": round(off, 6), "ep_wait_on_s": round(on, 6),
                              "ep_wait_fall_s": round(off - on, 6)}), flush=True)
        predicted = {o: load_plan(plans[o]).prediction for o in runs}
    for o, rs in runs.items():
        pred = predicted[o]
        print(json.dumps({"overlap": o, "ep_wait_predicted_s": round(pred.comm["ep"].exposed_s, 6),
                          "ep_wait_measured_s": round(statistics.median(r["ep_wait_s"] for r in rs), 6),
                          "ep_busy_measured_s": round(statistics.median(r["ep_busy_s"] for r in rs), 6),
                          "ep_total_predicted_s": round(pred.comm["ep"].total_s, 6),
                          "step_predicted_s": round(pred.step_time_s, 6),
                          "step_measured_s": round(statistics.median(r["step_s"] for r in rs), 6)}))
    fall_predicted = predicted["none"].comm["ep"].exposed_s - predicted["fb"].comm["ep"].exposed_s
    fall_measured = statistics.median(off["ep_wait_s"] - on["ep_wait_s"] for off, on in zip(runs["none"], runs["fb"]))
    print(json.dumps({"ep_wait_fall_predicted_s": round(fall_predicted, 6),
                      "ep_wait_fall_measured_s": round(fall_measured, 6),
                      "same_direction": (fall_predicted > 0) == (fall_measured > 0),
                      "measured_over_predicted": round(fall_measured / fall_predicted, 3) if fall_predicted else None}))


if __name__ == "__main__":
    main()
