"""How much device imbalance the load-aware placements remove, scored honestly (docs/load-balance.md §5).

For each window position ``t`` (every ``--horizon`` steps): the load of each MoE layer is predicted from steps
``[t − w, t)`` (sliding mean or EMA, moeplan.expert_load.predict), each policy places the experts from that
prediction (moeplan.placement), and the placement is scored on the next ``--horizon`` steps ``[t, t + h)`` only:
device imbalance ``max/mean − 1`` of the routed tokens per EP rank, averaged over those steps. Per layer, the
reduction against contiguous placement is ``1 − imbalance(policy)/imbalance(contiguous)`` (averaged over the window
positions); the table prints its median over layers, and the replicas' memory as extra expert slots per rank.

Two sources:

- ``--trace FILE``: a multi-step trace (``moeplan run --record-load``), on ``--ep`` ranks;
- ``--deepseek``: the public DeepSeek-V3 routing histogram (benchmarks/data/deepseek-v3-bincounts.json, one
  snapshot of 58 MoE layers × 256 experts measured in inference). One snapshot has no time axis, so it is taken as
  the routing distribution of a stationary run: each "step" draws one micro-batch of the EP group from it
  (``ep × --tokens`` tokens, ``top_k = 8`` copies each, multinomial per layer; ``--tokens`` 4096: one 4K sequence
  per rank), on EP 32 and EP 64. This scores how well a placement made from past draws fits future ones; it does
  not test drift, which the recorded traces do.

Usage: ``python benchmarks/planner_quality.py --deepseek`` or ``python benchmarks/planner_quality.py --trace
load.json --ep 2 [--window 20 --horizon 10 --method mean|ema --replicas 1]``.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from moeplan.expert_load import LoadTrace, imbalance, predict, rank_tokens, read_trace
from moeplan.placement import place

DEEPSEEK = Path(__file__).resolve().parent / "data" / "deepseek-v3-bincounts.json"


def sampled(snapshot: LoadTrace, *, steps: int, tokens: int, top_k: int, seed: int) -> LoadTrace:
    """``steps`` draws of ``tokens·top_k`` routed copies per layer from each layer's share in ``snapshot``."""
    rng = np.random.default_rng(seed)
    share = snapshot.counts.sum(axis=0) / snapshot.counts.sum(axis=(0, 2))[:, None]  # [layers, experts]
    counts = np.stack([[rng.multinomial(tokens * top_k, p) for p in share] for _ in range(steps)])
    return LoadTrace(snapshot.model, snapshot.num_experts, snapshot.layers, tuple(range(1, steps + 1)), counts,
                     f"{steps} multinomial draws of {tokens} tokens × {top_k} from {snapshot.source}")


def score(trace: LoadTrace, ep: int, *, window: int, horizon: int, method: str, replicas: int,
          groups: int = 1, nodes: int = 1) -> dict[str, tuple[float, float, int]]:
    """Per policy: (median over layers of the reduction against contiguous, median imbalance, extra slots)."""
    e, per_layer = trace.num_experts, {}
    policies = {"contiguous": {}, "greedy": {}, f"eplb+{replicas}": {"num_replicas": e + ep * replicas,
                                                                       "num_groups": groups, "num_nodes": nodes}}
    imb: dict[str, list[np.ndarray]] = {p: [] for p in policies}
    slots = {}
    for t in range(window, len(trace.steps) - horizon + 1, horizon):
        load = predict(trace, t, window, method)
        future = trace.counts[t:t + horizon]  # [h, layers, experts]
        for name, kw in policies.items():
            placed = place(name.split("+")[0], load, ep, **kw)  # type: ignore[arg-type]
            if placed.status != "ok":
                raise SystemExit(f"{name} on ep {ep}: {placed.reason}")
            slots[name] = placed.extra_slots
            tokens = rank_tokens(future, [x.shards for x in placed.layers])  # [h, layers, ranks]
            imb[name].append(imbalance(tokens).mean(axis=0))  # [layers]
    base = np.mean(imb["contiguous"], axis=0)
    for name in policies:
        mean = np.mean(imb[name], axis=0)
        cut = [1 - m / b for m, b in zip(mean, base) if b > 0]
        per_layer[name] = (statistics.median(cut) if cut else 0.0, float(np.median(mean)), slots[name])
    return per_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace")
    ap.add_argument("--ep", type=int, nargs="*", default=None)
    ap.add_argument("--deepseek", action="store_true")
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--horizon", type=int, default=10)
    ap.add_argument("--method", choices=("mean", "ema"), default="mean")
    ap.add_argument("--replicas", type=int, default=1, help="eplb: extra expert slots per EP rank")
    ap.add_argument("--tokens", type=int, default=4096, help="--deepseek: tokens per rank and step")
    ap.add_argument("--steps", type=int, default=60, help="--deepseek: steps drawn")
    args = ap.parse_args()
    runs = []
    if args.trace:
        runs += [(args.trace, read_trace(args.trace), ep) for ep in args.ep or [2]]
    if args.deepseek:
        snapshot = read_trace(DEEPSEEK, first_moe_layer=3)
        for ep in args.ep or [32, 64]:
            runs.append((f"DeepSeek-V3 histogram, ep {ep}", sampled(snapshot, steps=args.steps, tokens=ep * args.tokens,
                                                                     top_k=8, seed=ep), ep))
    print(f"predict: {args.method} of the previous {args.window} steps; score: the next {args.horizon} steps")
    print(f"{'source':<44} {'ep':>3} {'policy':<11} {'median cut':>10} {'median imbalance':>17} {'extra slots':>11}")
    for label, trace, ep in runs:
        for name, (cut, imb, slots) in score(trace, ep, window=args.window, horizon=args.horizon, method=args.method,
                                             replicas=args.replicas).items():
            print(f"{label[-44:]:<44} {ep:>3} {name:<11} {cut:>10.1%} {imb:>17.1%} {slots:>11}", flush=True)


if __name__ == "__main__":
    main()
