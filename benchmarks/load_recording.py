"""Expert load of real training under each auxiliary-loss scope, recorded by ``moeplan run --record-load``.

tiny-pangu on the CPU emulator, 4 ranks (DP 4 × EP 2: expert groups of 2 ranks, placement [[0-3], [4-7]]), global
batch 8 of 64 tokens (micro-batch 2, one micro-batch per DP rank), natural routing (no --force-balanced-routing),
the default data (the Python standard library's sources, byte-level), ``--steps`` steps (default 200). One run per
configuration, one at a time: no auxiliary loss, then ``--aux-loss-coeff`` (default 0.01) at the scopes
micro-batch, sequence, ep-group and dp-group. (With one micro-batch per DP rank, global-batch is dp-group, so it
is not run; on 2 ranks, DP 2 × EP 2, the expert group would be the DP group and ep-group the same loss as
dp-group, hence 4 ranks.)

From each trace it prints the device imbalance per MoE layer — ``max_r T_r / mean_r T_r − 1`` of the tokens
``T_r`` each EP rank computes in one step under the run's placement (moeplan.expert_load.rank_tokens and
imbalance), averaged over the steps of a window — for the windows 1–20, 91–110 and 181–200 (scaled to
``--steps``), as one table: configuration × layer × window, with the mean LM loss of the last window. Then the
recording's cost per step (the line ``moeplan run`` prints at the end) against the median step time.

Usage::

    python benchmarks/load_recording.py --run --out DIR [--steps 200] [--coeff 0.01]   # compile, run, print
    python benchmarks/load_recording.py --out DIR   # print the table from the traces already in DIR

``--run`` takes minutes per run on a 2-core machine (each run's wall time is printed); the runs write
``OUT/<config>.json`` (trace), ``.jsonl`` (metrics) and ``.log`` (stderr) and ``OUT/plan.yaml``.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from moeplan.expert_load import imbalance, rank_tokens, read_trace

CONFIGS = {"none": None, "micro-batch": "micro-batch", "sequence": "sequence", "ep-group": "ep-group",
           "dp-group": "dp-group"}
"""Configuration name -> its --aux-loss-scope (None: no auxiliary loss)."""
COMPILE = [str(Path(__file__).resolve().parent.parent / "examples/models/tiny-pangu.yaml"), "--target", "cpu",
           "--devices", "4", "--ep", "2", "--tp", "1", "--pp", "1", "--cp", "1", "--micro-batch", "2",
           "--recompute", "none"]
COST = re.compile(r"recording took ([\d.]+) ms per step, ([\d.]+) of them in (\d+) rewrites")


def moeplan(*args: str, log: Path | None = None) -> float:
    """Run ``moeplan ARGS`` (stderr to ``log``); its wall seconds. Exits on failure."""
    t0 = time.perf_counter()
    with open(log or "/dev/null", "w") as err:
        proc = subprocess.run([sys.executable, "-m", "moeplan.cli", *args], stdout=subprocess.DEVNULL, stderr=err)
    if proc.returncode:
        sys.exit(f"moeplan {' '.join(args)}: exit {proc.returncode} (see {log})")
    return time.perf_counter() - t0


def run_all(out: Path, steps: int, coeff: float) -> None:
    """Compile the plan (once) and run every configuration, one after the other."""
    out.mkdir(parents=True, exist_ok=True)
    plan = out / "plan.yaml"
    if not plan.exists():
        moeplan("compile", *COMPILE, "-o", str(plan))
    for name, scope in CONFIGS.items():
        for suffix in (".json", ".jsonl"):
            (out / f"{name}{suffix}").unlink(missing_ok=True)
        aux = [] if scope is None else ["--aux-loss-coeff", str(coeff), "--aux-loss-scope", scope]
        seconds = moeplan("run", str(plan), "--steps", str(steps), "--record-load", str(out / f"{name}.json"),
                          "--metrics", str(out / f"{name}.jsonl"), "--meter-every", str(steps + 1), *aux,
                          log=out / f"{name}.log")
        print(f"# {name}: {steps} steps in {seconds:.0f} s", flush=True)


def windows(steps: int) -> list[tuple[int, int]]:
    """1-based inclusive step windows: the first, middle and last 10 % (20 of 200)."""
    w = max(1, steps // 10)
    mid = (steps - w) // 2
    return [(1, w), (mid + 1, mid + w), (steps - w + 1, steps)]


def table(out: Path, steps: int) -> None:
    """Print the imbalance table and the recording cost from the traces, metrics and logs in ``out`` (runs of
    ``steps`` steps)."""
    rows, costs, spans = [], [], windows(steps)
    for name in CONFIGS:
        path = out / f"{name}.json"
        if not path.exists():
            continue
        trace = read_trace(path)
        if len(trace.steps) != steps:
            print(f"# {name}: {len(trace.steps)} steps recorded, not {steps}; left out")
            continue
        done = np.array(trace.steps)
        per_step = imbalance(rank_tokens(trace.counts, trace.placement))  # [steps, layers]
        metrics = [json.loads(ln) for ln in (out / f"{name}.jsonl").read_text().splitlines() if ln.strip()]
        loss = {m["step"]: m["loss"] for m in metrics}
        last = statistics.mean(loss[s] for s in range(spans[-1][0], spans[-1][1] + 1))
        for j, layer in enumerate(trace.layers):
            cells = [per_step[(done >= a) & (done <= b), j].mean() for a, b in spans]
            rows.append((name, layer, cells, last))
        cost = COST.search((out / f"{name}.log").read_text())
        step_ms = 1e3 * statistics.median(m["step_time_s"] for m in metrics[1:])
        if cost:
            costs.append((name, float(cost[1]), float(cost[2]), int(cost[3]), step_ms))
    if not rows:
        sys.exit(f"no traces under {out}; run with --run first")
    heads = [f"steps {a}-{b}" for a, b in spans]
    print("device imbalance (max/mean - 1 of tokens per EP rank, mean over the window's steps); layer 4 = mtp.0")
    print(f"| aux loss | layer | {' | '.join(heads)} | LM loss, last window |")
    print("|---|---|" + "---|" * len(heads) + "---|")
    for name, layer, cells, last in rows:
        print(f"| {name} | {layer} | {' | '.join(f'{c:.3f}' for c in cells)} | {last:.3f} |")
    print("\n| aux loss | recording ms/step | of it rewrites | rewrites | median step ms |\n|---|---|---|---|---|")
    for name, total, writes, count, step_ms in costs:
        print(f"| {name} | {total:.2f} | {writes:.2f} | {count} | {step_ms:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="store_true", help="compile and run every configuration first")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--coeff", type=float, default=0.01, help="--aux-loss-coeff of the runs with a scope")
    parser.add_argument("--out", type=Path, required=True, help="folder of the plan, traces, metrics and logs")
    args = parser.parse_args()
    if args.run:
        run_all(args.out, args.steps, args.coeff)
    table(args.out, args.steps)


if __name__ == "__main__":
    main()
