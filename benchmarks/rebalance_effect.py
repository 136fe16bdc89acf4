"""Dynamic expert placement on the CPU emulator: step time with ``moeplan run --rebalance-every 10`` against without.

Compiles tiny-pangu for EP 2 on 2 cpu devices (``moeplan compile tiny-pangu --target cpu --devices 2 --ep 2 --tp 1
--pp 1 --cp 1``), then runs it ``--rounds`` times each way, interleaved (off, on, off, on, ...), ``--steps`` steps
per run, under natural routing (no ``--force-balanced-routing``: the router's own, imbalanced choices). The first
``--every`` steps of both runs are the same (nothing has moved yet), so only the steps after the first rebalance
are kept. Prints one JSON line per run (median step time of the kept steps, the rebalances' median seconds and
moved bytes, per rebalance the predicted device imbalance of the window, max/mean − 1 of the tokens per expert
rank, averaged over the MoE layers, under the placement it had and the one it left, and the median 1-minute load
average of the machine), then a summary line: the median step time of every kept step of
every run each way, the ratio on/off, and the step time with the migrations spread over the kept steps.

``step_time_s`` does not include a rebalance (it runs after the step's record is measured); its cost is its
``seconds`` (all of it: count all-reduce, planning, migration) and ``migrate_s`` (moving the weights and AdamW
state), both the slowest rank's.

Usage::

    python benchmarks/rebalance_effect.py [--rounds 3] [--steps 40] [--every 10] [--workdir DIR]

Timings mean something only on a quiet machine with a core per rank: check the ``load_1m`` figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from cli_runs import moeplan_cli

COMPILE = ("compile", "tiny-pangu", "--target", "cpu", "--devices", "2", "--ep", "2", "--tp", "1", "--pp", "1",
           "--cp", "1", "--global-batch", "8", "--seq-len", "64")


def run(plan: Path, metrics: Path, *, steps: int, every: int, rebalance: bool) -> list[dict]:
    """One ``moeplan run`` of ``plan`` (on the default data, the standard library's sources); its metrics records."""
    metrics.unlink(missing_ok=True)  # this script's own file: `moeplan run` refuses to delete an earlier run's lines
    extra = ("--rebalance-every", str(every)) if rebalance else ()
    moeplan_cli("run", str(plan), "--steps", str(steps), "--metrics", str(metrics), *extra)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def summary(records: list[dict], every: int) -> dict:
    """The figures of one run (see the module docstring)."""
    kept = [r for r in records if r["step"] > every]
    moves = [r["rebalance"] for r in records if "rebalance" in r]
    out = {"kept_steps": len(kept), "step_s": statistics.median(r["step_time_s"] for r in kept),
           "load_1m": statistics.median(r["host"]["load_1m"] for r in kept if r.get("host"))}
    if moves:
        out |= {"rebalances": len(moves), "moved_experts": [m["moved_experts"] for m in moves],
                "rebalance_s": statistics.median(m["seconds"] for m in moves),
                "migrate_s": statistics.median(m["migrate_s"] for m in moves),
                "moved_bytes": statistics.median(m["moved_bytes"] for m in moves),
                "imbalance": [[round(statistics.fmean(x["imbalance_before"] for x in m["layers"].values()), 4),
                               round(statistics.fmean(x["imbalance_after"] if x["applied"] else x["imbalance_before"]
                                                      for x in m["layers"].values()), 4)] for m in moves]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="runs each way, interleaved")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10, help="--rebalance-every of the runs that rebalance")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    if not 0 < args.every < args.steps:
        sys.exit(f"--every={args.every}: must be at least 1 and below --steps={args.steps}")
    with tempfile.TemporaryDirectory(prefix="moeplan-rebalance-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        plan = workdir / "ep2.yaml"
        moeplan_cli(*COMPILE, "-o", str(plan))
        steps: dict[bool, list[float]] = {False: [], True: []}
        costs: list[float] = []
        for i in range(args.rounds):
            for rebalance in (False, True):
                records = run(plan, workdir / f"run-{i}-{'on' if rebalance else 'off'}.jsonl",
                              steps=args.steps, every=args.every, rebalance=rebalance)
                steps[rebalance] += [r["step_time_s"] for r in records if r["step"] > args.every]
                costs += [r["rebalance"]["seconds"] for r in records if rebalance and "rebalance" in r]
                print(json.dumps({"round": i, "rebalance": rebalance, **summary(records, args.every)}), flush=True)
        off, on = statistics.median(steps[False]), statistics.median(steps[True])
        spread = statistics.fmean(steps[True]) + sum(costs) / len(steps[True])
        print(json.dumps({"summary": True, "steps_each_way": len(steps[False]), "median_step_s_off": off,
                          "median_step_s_on": on, "ratio_on_off": on / off,
                          "mean_step_s_off": statistics.fmean(steps[False]),
                          "mean_step_s_on_with_migrations": spread}))


if __name__ == "__main__":
    main()
