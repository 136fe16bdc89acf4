"""DP overlap on the CPU emulator: the measured exposed DP time with mechanism ``dp`` on and off (issue 12).

For each layout: ``moeplan compile tiny-pangu --target TARGET --global-batch 8 --seq-len 64 ... --overlap dp`` and
the same with ``--overlap none``, ``moeplan run PLAN --steps N --metrics ...``; prints one JSON line per (layout,
overlap): the medians over the steps after ``--warmup`` of the exposed DP seconds (the metrics' ``comm_s["dp"]``:
the seconds the rank waited on DP collectives — the posted reduce-scatters at the optimizer step plus the
synchronous ones and the parameter all-gathers), of the DP busy seconds (``comm_busy_s["dp"]``: the DP
collectives' time in flight), both averaged over the ranks, of the step time, and the final loss; then one summary
line per layout with the ratio on/off of the median exposed DP time.

Layouts: ``dp2-pp2-vpp2`` (4 ranks, DP 2 × PP 2 × VPP 2, interleaved 1F1B): each rank holds 2 chunks, and the
reduce-scatter of the chunk whose backward ends first runs while the other chunk's last backwards do (Megatron-LM
``--overlap-grad-reduce``, at chunk granularity). ``dp2`` (2 ranks, DP 2): one chunk per rank, whose last backward
ends the step's backward, so the reduce-scatter has nothing to hide behind: the control.

Usage::

    python benchmarks/dp_overlap.py [--target cpu] [--steps 30] [--warmup 5] [--only dp2-pp2-vpp2,dp2]

Timings are only meaningful on a quiet machine with a core per rank (each emulated device is one single-threaded
process); the loss is the same with the mechanism on and off (tests/runtime/test_dp_overlap.py).
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
    "dp2-pp2-vpp2": ("--devices", "4", "--tp", "1", "--cp", "1", "--ep", "1", "--pp", "2", "--vpp", "2",
                     "--micro-batch", "1", "--schedule", "interleaved"),
    "dp2": ("--devices", "2", "--tp", "1", "--cp", "1", "--ep", "1", "--pp", "1", "--micro-batch", "1"),
}


def measure(name: str, overlap: str, *, target: str, steps: int, warmup: int, workdir: Path) -> dict:
    """Compile and run one layout with ``--overlap overlap``; the medians of its measured DP and step seconds."""
    plan, metrics = workdir / f"{name}-{overlap}.yaml", workdir / f"{name}-{overlap}.jsonl"
    moeplan_cli("compile", "tiny-pangu", "--target", target, "--global-batch", "8", "--seq-len", "64", *LAYOUTS[name],
         "--overlap", overlap, "-o", str(plan))
    metrics.unlink(missing_ok=True)  # this script's own file: `moeplan run` keeps an earlier run's lines
    moeplan_cli("run", str(plan), "--steps", str(steps), "--metrics", str(metrics))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    kept = records[warmup:]

    def rank_mean(r: dict, field: str) -> float:
        return statistics.fmean(x[field].get("dp", 0.0) for x in r["ranks"])

    return {"layout": name, "overlap": overlap, "steps": len(kept),
            "exposed_dp_s": statistics.median(rank_mean(r, "comm_s") for r in kept),
            "dp_busy_s": statistics.median(rank_mean(r, "comm_busy_s") for r in kept),
            "step_s": statistics.median(r["step_time_s"] for r in kept), "final_loss": records[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="cpu", help="cpu, or a calibrated cpu target YAML (moeplan calibrate)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the medians")
    ap.add_argument("--only", default=",".join(LAYOUTS), help="comma-separated layout names")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    if not 0 <= args.warmup < args.steps:
        sys.exit(f"--warmup={args.warmup}: must be at least 0 and below --steps={args.steps}")
    with tempfile.TemporaryDirectory(prefix="moeplan-dp-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for name in args.only.split(","):
            if name not in LAYOUTS:
                sys.exit(f"--only: unknown layout {name!r}; choose from {', '.join(LAYOUTS)}")
            rows = {}
            for overlap in ("dp", "none"):
                rows[overlap] = measure(name, overlap, target=args.target, steps=args.steps, warmup=args.warmup,
                                        workdir=workdir)
                print(json.dumps(rows[overlap]), flush=True)
            on, off = rows["dp"]["exposed_dp_s"], rows["none"]["exposed_dp_s"]
            print(json.dumps({"layout": name, "exposed_dp_on_over_off": on / off if off else None,
                              "same_final_loss": rows["dp"]["final_loss"] == rows["none"]["final_loss"]}))


if __name__ == "__main__":
    main()
