"""What a pipeline stage boundary costs on gloo: a receive posted after the data was sent, against one posted early.

Two processes (run with ``torchrun --nproc-per-node 2 benchmarks/p2p_receive.py [--floats N]``). Rank 0 computes
2 ms and sends N floats (default 8,192: one tiny-pangu micro-batch boundary, 64 × 128); rank 1 computes 6 ms, so the
data was sent 4 ms before it asks for it, and then waits for it. ``late``: rank 1 posts the ``irecv`` only then (what
the runtime does without the ``pp`` overlap mechanism); ``early``: it posted the ``irecv`` before its compute (what
it does with ``pp``, moeplan.runtime.executor). Prints, per mode, the median and 90th percentile of rank 1's wait
over 50 rounds (after 10 warm-up rounds). gloo moves a message only once both sides have posted it, so a late receive
waits for a handshake with a sender that is busy computing. Only meaningful on a quiet machine; run it twice.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--floats", type=int, default=64 * 128)
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, data = dist.get_rank(), torch.randn(args.floats)
    waits: dict[str, list[float]] = {"late": [], "early": []}
    for it in range(args.rounds):
        for i, mode in enumerate(waits):
            tag = 2 * it + i
            dist.barrier()
            if rank == 0:
                _busy(2)
                dist.isend(data, 1, tag=tag).wait()
                continue
            out = torch.empty(args.floats)
            work = dist.irecv(out, 0, tag=tag) if mode == "early" else None
            _busy(6)
            t0 = time.perf_counter()
            (work or dist.irecv(out, 0, tag=tag)).wait()
            if it >= 10:
                waits[mode].append((time.perf_counter() - t0) * 1e6)
    if rank == 1:
        for mode, w in waits.items():
            w.sort()
            print(f"{mode:5s} receive wait: median {statistics.median(w):8.1f} µs, p90 {w[int(0.9 * len(w))]:8.1f} µs")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
