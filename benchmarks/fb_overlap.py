"""What ``fb`` overlap does to the EP wait, measured against predicted, on the CPU emulator at world size 2.

One layout — tiny-pangu, 2 devices, EP 2 (dp 2), pp 1, micro-batch 1, 1F1B, flat dispatcher, global batch 8 ×
seq 64 unless changed — compiled twice, with ``--overlap fb`` and with ``--overlap none``, each run for ``--steps``
steps with every step metered. Per plan it prints the predicted EP wait of the compute stream
(``prediction.comm["ep"].exposed_s``) and the measured one: per step the mean over ranks of ``comm_s["ep"]`` (the
seconds the compute stream waited on EP collectives, moeplan.runtime.overlap inside the OVERLAP_F_B pairs), the
median over the steps after ``--warmup``; then the change from off to on, predicted and measured, and their ratio.

Usage::

    moeplan calibrate --target cpu --fit-model tiny-pangu -o cal.yaml      # once per machine
    python benchmarks/fb_overlap.py --target cal.yaml [--steps 30] [--seq-len 64]

The runs route tokens to random experts (``--force-balanced-routing``, as the plan assumes; ``--natural-routing``
uses the model's router, whose imbalance adds waits the plan does not price).

Timings are only meaningful on a quiet machine (each emulated device is one single-threaded process); run it twice.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from cli_runs import moeplan_cli


def measure(overlap: str, *, target: str, steps: int, warmup: int, seq_len: int, workdir: Path,
            balanced: bool = True) -> dict:
    """Compile and run one plan; predicted and measured EP wait and step time (seconds)."""
    from moeplan.plan import load_plan
    from moeplan.runtime.compare import read_records

    plan_path, metrics = workdir / f"{overlap}.yaml", workdir / f"{overlap}.jsonl"
    moeplan_cli("compile", "tiny-pangu", "--target", target, "--devices", "2", "--tp", "1", "--pp", "1", "--ep", "2",
         "--micro-batch", "1", "--global-batch", "8", "--seq-len", str(seq_len), "--schedule", "1f1b",
         "--dispatcher", "flat", "--overlap", overlap, "-o", str(plan_path))
    moeplan_cli("run", str(plan_path), "--steps", str(steps), "--meter-every", "1", "--metrics", str(metrics),
                *(("--force-balanced-routing",) if balanced else ()))
    plan = load_plan(plan_path)
    records = [r for r in read_records(metrics) if r.step > warmup]
    ep = statistics.median(statistics.mean(rank.comm_s.get("ep", 0.0) for rank in r.ranks) for r in records)
    busy = statistics.median(statistics.mean(rank.busy_s("ep") for rank in r.ranks) for r in records)
    return {"overlap": overlap, "ep_wait_predicted_s": plan.prediction.comm["ep"].exposed_s,
            "ep_wait_measured_s": ep, "ep_busy_measured_s": busy,
            "ep_total_predicted_s": plan.prediction.comm["ep"].total_s,
            "step_predicted_s": plan.prediction.step_time_s,
            "step_measured_s": statistics.median(r.step_time_s for r in records)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="cpu", help="a calibrated cpu target YAML (moeplan calibrate), or cpu")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--natural-routing", action="store_true", help="route with the model's router, not at random")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="moeplan-fb-") as tmp:
        rows = {o: measure(o, target=args.target, steps=args.steps, warmup=args.warmup, seq_len=args.seq_len,
                           workdir=Path(tmp), balanced=not args.natural_routing) for o in ("none", "fb")}
    for row in rows.values():
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}))
    predicted = rows["none"]["ep_wait_predicted_s"] - rows["fb"]["ep_wait_predicted_s"]
    measured = rows["none"]["ep_wait_measured_s"] - rows["fb"]["ep_wait_measured_s"]
    print(json.dumps({"ep_wait_fall_predicted_s": round(predicted, 6), "ep_wait_fall_measured_s": round(measured, 6),
                      "same_direction": (predicted > 0) == (measured > 0),
                      "measured_over_predicted": round(measured / predicted, 3) if predicted else None}))


if __name__ == "__main__":
    main()
