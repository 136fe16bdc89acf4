"""How a micro-batch's forward and backward grow with its size, measured against predicted, free of machine drift.

The CPU emulator's speed drifts by up to 1.45× within minutes (benchmarks/cpu_prediction.py), so comparing runs
made minutes apart mixes the model's error with the machine's. This script measures micro-batch sizes 1, 2 and 4
(``--sizes``) in turn — round after round, each size once per round — so every size sees the same machine, and
compares how the per-micro-batch F and B seconds grow with the size against how the plans compiled for those sizes
on ``--target`` say they grow. What runs is ``moeplan run`` of each 1-device plan (``--steps`` steps per round,
meters off; moeplan.calibrate.measure_runtime_fb_s, what ``calibrate --fit-model`` fits its rate scale to
with sizes 1 and 4); the predicted figures are ``moeplan compare``'s per-action F and B
(moeplan.runtime.compare); both over the number of micro-batches.

Usage::

    python benchmarks/microbatch_scaling.py --target cal.yaml [--model tiny-pangu] [--rounds 5] [--steps 16]

Prints one JSON line per size (measured and predicted F and B milliseconds per micro-batch, the measured ones the
medians over the steps of all rounds after the first three) and a summary line: each size's measured and predicted
F and B over the smallest size's.
A predicted growth below the measured one means the target prices the per-token work too low and the per-kernel
work too high (the launch fit of ``moeplan calibrate --fit-model`` puts whatever a micro-batch of 1 costs into
the per-kernel costs).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from cli_runs import moeplan_cli
from moeplan.plan import Plan, load_plan


def compiled(model: str, target: str, size: int, workdir: Path) -> Plan:
    """The 1-device plan of micro-batches of ``size`` sequences (1F1B, no recompute)."""
    path = workdir / f"mb{size}.yaml"
    moeplan_cli("compile", model, "--target", target, "--devices", "1", "--tp", "1", "--pp", "1", "--ep", "1",
                "--micro-batch", str(size), "--recompute", "none", "-o", str(path))
    return load_plan(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="a calibrated cpu target YAML (moeplan calibrate), or cpu")
    ap.add_argument("--model", default="tiny-pangu")
    ap.add_argument("--sizes", default="1,2,4", help="comma-separated micro-batch sizes, smallest first")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16, help="steps per plan and round (the first three are warm-up)")
    args = ap.parse_args()
    from moeplan.calibrate import FIT_FIRST_STEP, measure_runtime_fb_s
    from moeplan.runtime.compare import predicted_rank
    from moeplan.spec import load_spec

    sizes = sorted(int(s) for s in args.sizes.split(","))
    spec = load_spec(args.model)
    bad = [s for s in sizes if s < 1 or spec.global_batch % s]
    if bad:
        raise SystemExit(f"--sizes={args.sizes}: {bad[0]} does not divide the model's global batch {spec.global_batch}")
    if args.rounds < 1 or args.steps <= FIT_FIRST_STEP:
        raise SystemExit(f"--rounds={args.rounds} --steps={args.steps}: need at least 1 round of more than "
                         f"{FIT_FIRST_STEP} steps")
    with tempfile.TemporaryDirectory(prefix="moeplan-mbscale-") as tmp:
        plans = {s: compiled(args.model, args.target, s, Path(tmp)) for s in sizes}
    predicted = {s: tuple(predicted_rank(p, 0)[k] / p.layout.num_microbatches for k in ("F", "B"))
                 for s, p in plans.items()}
    measured = {s: tuple(t / plans[s].layout.num_microbatches for t in fb)
                for s, fb in measure_runtime_fb_s(plans, rounds=args.rounds, steps=args.steps).items()}
    for s in sizes:
        print(json.dumps({"micro_batch": s, "F_measured_ms": round(measured[s][0] * 1e3, 3),
                          "F_predicted_ms": round(predicted[s][0] * 1e3, 3),
                          "B_measured_ms": round(measured[s][1] * 1e3, 3),
                          "B_predicted_ms": round(predicted[s][1] * 1e3, 3)}))
    base = sizes[0]
    print(json.dumps({f"mb{s}_over_mb{base}": {
        "F_measured": round(measured[s][0] / measured[base][0], 3),
        "F_predicted": round(predicted[s][0] / predicted[base][0], 3),
        "B_measured": round(measured[s][1] / measured[base][1], 3),
        "B_predicted": round(predicted[s][1] / predicted[base][1], 3)} for s in sizes[1:]}))


if __name__ == "__main__":
    main()
