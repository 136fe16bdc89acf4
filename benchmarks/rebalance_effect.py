"""Dynamic expert placement on the CPU emulator: step time with rebalancing against without, measured and predicted.

1. Compiles tiny-pangu for EP 2 on 2 cpu devices (``moeplan compile tiny-pangu --target TARGET --devices 2 --ep 2
   --tp 1 --pp 1 --cp 1``) and runs it once for ``--steps`` steps with ``--record-load``: the router's own choices
   (natural routing, no ``--force-balanced-routing``), which every later run repeats (same seed, same data; the
   losses with and without rebalancing are the same, tests/runtime/test_rebalance.py).
2. Compiles two plans priced with that trace over the steps after the first rebalance (``--expert-load TRACE
   --expert-load-window EVERY:STEPS``): ``off``, the contiguous placement all run long, and ``on``, the same with
   ``--rebalance-every EVERY`` (the trace replayed as the runtime rebalances; docs/load-balance.md §7), which
   ``moeplan run`` takes from the plan.
3. Runs both ``--rounds`` times, interleaved (off, on, off, on, ...), ``--meter-every 5``: the step times are those
   of the unmetered steps after the first rebalance (the first ``--every`` steps of both are the same: nothing has
   moved yet).

Prints one JSON line per run (median step time of the kept steps, the rebalances' median seconds and moved bytes,
per rebalance the predicted device imbalance of the window, max/mean − 1 of the tokens per expert rank, averaged
over the MoE layers, under the placement it had and the one it left, and the median 1-minute load average of the
machine), then a summary line: per way the predicted and the median measured step and their ratio, the measured
ratio on/off, and the rebalances' predicted and measured median seconds (whole, and migration alone).

``step_time_s`` does not include a rebalance (it runs after the step's record is measured); its cost is its
``seconds`` (all of it: count all-reduce, planning, migration) and ``migrate_s`` (moving the weights and AdamW
state), both the slowest rank's.

Usage::

    moeplan calibrate --target cpu --fit-model tiny-pangu -o cal.yaml      # once per machine
    python benchmarks/rebalance_effect.py --target cal.yaml [--rounds 3] [--steps 40] [--every 10] [--workdir DIR]

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

COMPILE = ("compile", "tiny-pangu", "--devices", "2", "--ep", "2", "--tp", "1", "--pp", "1", "--cp", "1",
           "--global-batch", "8", "--seq-len", "64")
METER_EVERY = 5


def run(plan: Path, metrics: Path, *, steps: int, extra: tuple[str, ...] = ()) -> list[dict]:
    """One ``moeplan run`` of ``plan`` (on the default data, the standard library's sources); its metrics records."""
    metrics.unlink(missing_ok=True)  # this script's own file: `moeplan run` refuses to delete an earlier run's lines
    moeplan_cli("run", str(plan), "--steps", str(steps), "--metrics", str(metrics), "--meter-every",
                str(METER_EVERY), *extra)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def kept(records: list[dict], every: int) -> list[dict]:
    """The unmetered steps after the first rebalance."""
    return [r for r in records if r["step"] > every and r["step"] % METER_EVERY]


def summary(records: list[dict], every: int) -> dict:
    """The figures of one run (see the module docstring)."""
    kept_steps = kept(records, every)
    moves = [r["rebalance"] for r in records if "rebalance" in r]
    out = {"kept_steps": len(kept_steps), "step_s": statistics.median(r["step_time_s"] for r in kept_steps),
           "load_1m": statistics.median(r["host"]["load_1m"] for r in kept_steps if r.get("host"))}
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
    from moeplan.plan import load_plan

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="cpu", help="a calibrated cpu target YAML (moeplan calibrate) for the "
                                                   "predictions to mean something")
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
        base, trace = workdir / "ep2.yaml", workdir / "trace.json"
        moeplan_cli(*COMPILE, "--target", args.target, "-o", str(base))
        trace.unlink(missing_ok=True)
        run(base, workdir / "record.jsonl", steps=args.steps, extra=("--record-load", str(trace)))
        plans = {}
        for on in (False, True):
            plans[on] = workdir / f"{'on' if on else 'off'}.yaml"
            moeplan_cli(*COMPILE, "--target", args.target, "--expert-load", str(trace), "--expert-load-window",
                        f"{args.every}:{args.steps}", *(("--rebalance-every", str(args.every)) if on else ()),
                        "-o", str(plans[on]))
        predicted = {on: load_plan(p) for on, p in plans.items()}
        steps: dict[bool, list[float]] = {False: [], True: []}
        moves: list[dict] = []
        for i in range(args.rounds):
            for on in (False, True):
                records = run(plans[on], workdir / f"run-{i}-{'on' if on else 'off'}.jsonl", steps=args.steps)
                steps[on] += [r["step_time_s"] for r in kept(records, args.every)]
                moves += [r["rebalance"] for r in records if "rebalance" in r and r["step"] < args.steps]
                print(json.dumps({"round": i, "rebalance": on, **summary(records, args.every)}), flush=True)
    out: dict = {"summary": True, "steps_each_way": len(steps[False])}
    for on in (False, True):
        way = "on" if on else "off"
        pred, meas = predicted[on].prediction.step_time_s, statistics.median(steps[on])
        out |= {f"step_s_{way}_predicted": round(pred, 4), f"step_s_{way}_measured": round(meas, 4),
                f"ratio_{way}_measured_predicted": round(meas / pred, 3)}
    out["ratio_on_off_measured"] = round(out["step_s_on_measured"] / out["step_s_off_measured"], 3)
    out["ratio_on_off_predicted"] = round(out["step_s_on_predicted"] / out["step_s_off_predicted"], 3)
    r = predicted[True].experts.load.rebalance  # type: ignore[union-attr]
    if r is not None and moves:
        out |= {"rebalance_s_predicted": round(r.seconds, 5),
                "rebalance_s_measured": round(statistics.median(m["seconds"] for m in moves), 5),
                "migrate_s_predicted": round(r.migrate_s, 5),
                "migrate_s_measured": round(statistics.median(m["migrate_s"] for m in moves), 5),
                "moved_experts_predicted": r.moved_experts,
                "moved_experts_measured": statistics.median(m["moved_experts"] for m in moves)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
