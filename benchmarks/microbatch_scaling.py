"""How a micro-batch's forward and backward grow with its size, measured against predicted, free of machine drift.

The CPU emulator's speed drifts by up to 1.45× within minutes (benchmarks/cpu_prediction.py), so comparing runs
made minutes apart mixes the model's error with the machine's. This script measures micro-batch sizes 1, 2 and 4
(``--sizes``) interleaved in one process — round after round, each size once per round — so every size sees the
same machine, and compares how the per-micro-batch F and B seconds grow with the size against how the plans
compiled for those sizes on ``--target`` say they grow. What runs is the model's own eager forward and backward
(``moeplan.models.MoEModel``, the single-process reference of the runtime's parity tests; one thread, fp32;
moeplan.runtime.calibrate.measure_model_fb_s, which ``calibrate --fit-model`` fits its rate scale to), not the
executor; the predicted figures are ``moeplan compare``'s per-action F and B (moeplan.runtime.compare) over the
number of micro-batches.

Usage::

    python benchmarks/microbatch_scaling.py --target cal.yaml [--model tiny-pangu] [--rounds 40]

Prints one JSON line per size (measured and predicted F and B milliseconds per micro-batch, the medians over the
rounds after a warm-up) and a summary line: each size's measured and predicted F and B over the smallest size's.
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


def predicted_per_microbatch(model: str, target: str, size: int, workdir: Path) -> tuple[float, float]:
    """Predicted (F, B) seconds per micro-batch of ``size`` sequences on one device (1F1B, no recompute)."""
    from moeplan.plan import load_plan
    from moeplan.runtime.compare import predicted_rank

    path = workdir / f"mb{size}.yaml"
    moeplan_cli("compile", model, "--target", target, "--devices", "1", "--tp", "1", "--pp", "1", "--ep", "1",
                "--micro-batch", str(size), "--recompute", "none", "-o", str(path))
    plan = load_plan(path)
    pred, n = predicted_rank(plan, 0), plan.layout.num_microbatches
    return pred["F"] / n, pred["B"] / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="a calibrated cpu target YAML (moeplan calibrate), or cpu")
    ap.add_argument("--model", default="tiny-pangu")
    ap.add_argument("--sizes", default="1,2,4", help="comma-separated micro-batch sizes, smallest first")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    from moeplan.runtime.calibrate import measure_model_fb_s
    from moeplan.spec import load_spec

    sizes = sorted(int(s) for s in args.sizes.split(","))
    spec = load_spec(args.model)
    if sizes[-1] > spec.global_batch:
        raise SystemExit(f"--sizes: {sizes[-1]} exceeds the model's global batch {spec.global_batch}")
    with tempfile.TemporaryDirectory(prefix="moeplan-mbscale-") as tmp:
        predicted = {s: predicted_per_microbatch(args.model, args.target, s, Path(tmp)) for s in sizes}
    measured = measure_model_fb_s(spec, tuple(sizes), rounds=args.rounds, warmup=args.warmup)
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
