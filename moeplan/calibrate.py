"""``moeplan calibrate --target cpu``: measure this machine and write a calibrated CPU target (docs/architecture.md §5, §7).

Measured with one thread (each emulated device is one process with ``OMP_NUM_THREADS=1``), fp32, best of a few
repeats after a warm-up (the median is used for the gloo figures). The 2 gloo ranks are bound one to a core each,
as ``moeplan run`` binds its ranks (moeplan.runtime.launch.pin_to_cpu), so each rank's gloo transport threads run
on its own core:

- ``cube_flops``: ``2·n³ / t`` of an ``n×n×n`` matmul (the largest of ``MATMUL_SIZES``), an achieved rate;
- ``vector_flops``: ``N / t`` of an ``N``-element add; ``hbm_bandwidth_bytes_per_s`` (and the host copy rate):
  ``3·4·N / t`` of that add (two reads, one write);
- ``launch.matmul_s`` / ``launch.other_s``: the time per kernel of a chain of ``CHAIN`` tiny (8×8) matmuls / 8-element
  multiplies run forward and backward (eager dispatch, autograd recording and the autograd engine: what a training
  step pays per kernel; a matmul with a weight is 3 kernels: Y, dX, dW; a multiply by a constant 2: Y, dX);
- ``launch.forward_kernel_s`` / ``launch.backward_kernel_s`` (the cpu target's ``"kernel"`` launch granularity,
  cost_models/compute.py): the same multiply chain timed in two parts — the forward with autograd recording, per
  multiply (one aten kernel plus one autograd node), and the backward, per node (one kernel plus the engine's
  bookkeeping). An eager training step pays these per aten op: the trace counts the ops of each node.
  ``training_dtype`` is ``fp32``, the runtime's dtype on CPU;
- gloo α–β between 2 local ranks: ``t_p2p(S)`` (half a ping-pong) and ``t_ar(S)`` (all-reduce) for message sizes
  up to 16 MiB. The comm model (cost_models/comm.py) has ``p2p = S/B + α + L`` and 2-rank ``all_reduce = S/B + 2α
  + L`` (L = ``launch.collective_s``), so from the smallest message ``α = t_ar − t_p2p`` and ``L = 2·t_p2p −
  t_ar`` (each at least 0), and ``B`` is the slope of ``t_ar`` over the message sizes ≥ 1 MiB (least squares).
  Only ``B`` is used from these idle figures (the rest is kept in the file's header): α and L come from the
  loaded measurement below.
- gloo latency UNDER LOAD (what training sees): each of the 2 ranks alternates a compute burst (``BURST_OPS`` eager
  kernels of tiny-pangu's size, a 64×64 by 64×128 matmul and an add per pair, ≈0.9 ms here: about the compute
  between two in-layer collectives of a tiny-pangu training step, the bulk of its collectives) with one comm op of
  ``LOADED_BYTES`` (a tiny-pangu PP handoff: seq 64 × hidden 64 × fp32): p2p (a send and a recv per iteration),
  ``all_to_all_single``, ``all_reduce``, and the runtime's ``all_gather_into_tensor`` / ``reduce_scatter_tensor``.
  The effective cost per message is the loop's period minus the period of the same bursts with no comm (both ranks
  busy, measured right before it so drifts of the machine cancel), the median of ``LOADED_REPEATS`` such pairs of
  ``LOADED_ITERS`` iterations. Why: with 2 ranks on 2 cores no core is idle, so gloo's transport threads are
  scheduled against the ranks' compute (and a message waits for its peer to leave its burst); an idle ping-pong,
  each rank asleep in recv, misses that — 110–180 µs per message where training paid ≈0.85 ms per EP all-to-all.
  The cost grows with the burst (the ranks drift apart more over longer compute; measured here for an all-to-all:
  ≈0.75 ms after 0.34 ms bursts, ≈0.85 ms after 0.9 ms, ≈1.0–1.3 ms after 2.5 ms, ≈1.8 ms after 7.6 ms), hence a
  burst of the in-layer collectives' spacing. Each kind's cost less its transfer time (``volume·S/B``) is written as
  that kind's ``launch.collective_latency_s``, which the comm model uses instead of its α step counts: gloo's kinds
  do not follow them (its reduce-scatter costs about what an all-reduce does: ≈1.6 ms, against ≈1.05 ms for an
  all-gather and ≈0.85 ms for an all-to-all of 16 KiB here). α and L are still fitted (least squares of
  ``t_op − volume·S/B = steps·α + L``, each at least 0, :func:`fit_alpha_launch`) for the link fields. It is a
  property of the machine, measured once and used for every layout (no per-layout factor).
- ``comm_compute_slowdown_by_kind`` (what a collective in flight costs the compute beside it): the same loop with
  the collective posted asynchronously (``async_op=True``) before each burst and waited after it — the runtime's
  asynchronous collectives (the shared experts beside the dispatch, the DP reduce-scatters) — and its extra period
  over the bare bursts, E, measured in the same rounds, for each of ``ASYNC_KINDS``. The simulator charges a compute
  segment σ × the time it overlaps a collective in flight (cost_models/timeline.py): with the collective priced at
  its loaded cost L and the burst longer than L, that is ``σ·L``, so ``σ = E / L``, per kind. On 2 ranks over 2
  cores gloo's threads take their CPU time from the ranks' compute, and the kinds differ: an all-to-all hides
  about two thirds of its cost (σ 0.28–0.37 in three calibrations here), while the all-gather, reduce-scatter and
  all-reduce hide a fifth to a third of theirs (σ 0.61–0.67, 0.77–0.88 and 0.72–0.87). The simulator uses the
  kind's σ for the collectives of an ``OVERLAP_F_B`` pair's halves too, which block on two threads
  (docs/step-model.md §6 compares the ways of measuring it). ``comm_compute_slowdown`` is the all-to-all's (the
  kinds not listed use it).
- ``launch.p2p_host_s`` (what a pipeline p2p message costs the compute thread of each side): the same loop with
  each rank posting an ``isend`` and an ``irecv`` to the other before each burst and waiting for both after it —
  what the runtime's SEND and early-posted RECV do (moeplan.runtime.executor) — its extra period over the bare
  bursts per message. Measured here 300, 305 and 405 µs per message in three runs with the ranks bound (340–380 µs
  unbound, about the blocking p2p's 330–420 µs): posting a gloo p2p asynchronously hides little of it when no core
  is idle, because the transport thread's work shares the rank's core. The simulator charges it on the compute
  stream at every SEND and RECV (cost_models/timeline.py).

Optionally (``fit_model``) three factors are then fitted to that model run on this machine by ``moeplan run``
(the runtime's executor, parallel layers and ZeRO-1 AdamW, one device, meters off): two plans of ``global_batch``
sequences, in micro-batches of 1 and of ``GROWTH_SIZE`` sequences, run in turn for ``FIT_ROUNDS`` rounds of
``FIT_STEPS`` steps, and each plan's F and B seconds per step are the medians over the steps from
``FIT_FIRST_STEP`` on of all its rounds (:func:`measure_runtime_fb_s`). Both figures come from the code the
predictions are for, in the same phases of the machine (whose speed drifts by up to 1.45× within minutes on the
development VM). Before, the growth was measured on the model's single-process eager step and the 1-device step by
one 40-step run a minute later: the eager step grew by 11.1 and 11.8 ms from 1 to 4 sequences in two back-to-back
calibrations where the runtime grew by 9.0, 9.7 and 8.5 ms in the next three, so the rate scale came out 2.3–3.0
instead of 2.1–2.3. The launch factors vary from one calibration to the next with the tiny chains' timing of the
bare per-kernel cost above (forward × 2.38, 1.64, 2.83 in those three): what the fit sets is their product.
First the rate scale ``u`` (every op's roofline time × ``u``: the compute and memory efficiencies ÷ ``u``, at
least 1): how much a micro-batch's F + B grows from 1 to ``GROWTH_SIZE`` sequences; the predicted growth is
linear in ``u`` (the launch costs cancel: a micro-batch of any size launches the same kernels), and ``u`` makes it
equal the measured one. Why: the peak rates above come from a 512³ matmul and a 4M-element add, while the model's
ops are small (64-wide) and many are neither (softmax, index ops, concatenations); on tiny-pangu a micro-batch's
F + B grew by 9.7 ms from 1 to 4 sequences where the peak rates priced 3.6 ms (u ≈ 2.7), so with a fit of the launch
costs alone every layout with micro-batches above 1 was predicted too fast (F × 1.13 and B × 1.25 from 1 to 4
sequences predicted, × 1.48 and × 1.60 measured; benchmarks/microbatch_scaling.py). Then, with ``u`` in place, the
launch costs are scaled by two factors fitted to the micro-batch-1 plan's F and B: ``k_f`` on the forward costs
(``forward_kernel_s``, and the per-op ``matmul_s`` / ``other_s`` of the ``"op"`` granularity) so that the
predicted F seconds equal the measured ones, then, with ``k_f`` in place, ``k_b`` on ``backward_kernel_s`` so
that the predicted B seconds do. Each prediction is linear in its factor (``T(k) = T(0) + k·(T(1) − T(0))``, so
``k = (T_measured − T(0)) / (T(1) − T(0))``). Rationale: the chain measures the bare cost per aten kernel, while a
training step also runs the runtime's Python code between kernels (module calls, reshapes, routing, the executor's
per-layer dispatch) in the forward and its autograd nodes (views, reshapes, the custom autograd functions of the
parallel layers) in the backward. Fitting the forward alone puts the whole overhead into F: on tiny-pangu it
predicted F 224 ms and B 91 ms per step where the run measured F 172 ms and B 165 ms, so every schedule that
overlaps or reorders F and B (1F1B's steady state, interleaving, zero-bubble's I/W split, fb pairs) was priced with
the wrong shape. The fit is one calibration of the machine with that model family's runtime code, used for every
layout; its layout is reported as the fit point, not as a prediction.

The file keeps the base target's other fields (node size, memory), sets every efficiency to 1 (the figures are
achieved rates; the fitted rate scale then divides the compute and memory ones) and is written atomically;
``moeplan compile ... --target FILE`` loads it.
"""
from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import yaml

from moeplan.files import write_atomic
from moeplan.plan import Plan
from moeplan.runtime.launch import pin_to_cpu
from moeplan.runtime.parallel import all_gather_flat, reduce_scatter_flat
from moeplan.spec import ModelSpec
from moeplan.targets import Efficiency, LaunchCost, Link, Target, load_target

MATMUL_SIZES = (128, 256, 512)
ADD_ELEMENTS = 1 << 22
MESSAGE_BYTES = (4, 1 << 20, 1 << 22, 1 << 24)
CHAIN = 400
LOADED_BYTES = 64 * 64 * 4
BURST_OPS = 100
LOADED_ITERS = 40
LOADED_REPEATS = 15
FIT_ROUNDS = 3
FIT_STEPS = 16
FIT_FIRST_STEP = 3
GROWTH_SIZE = 4
MAX_RATE_SCALE = 10.0
ASYNC_KINDS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")  # σ per kind (module docstring)
ASYNC_OPS = (*(f"async_{kind}" for kind in ASYNC_KINDS), "async_p2p")  # posted before the burst, waited after it
LOADED_OPS: dict[str, tuple[float, int]] = {  # op -> (multiple of S/B, α steps) at 2 ranks (cost_models/comm.py)
    "p2p": (1.0, 1), "all_gather": (1.0, 1), "all_to_all": (0.5, 1), "all_reduce": (1.0, 2),
    "reduce_scatter": (0.5, 1)}


@dataclass(frozen=True)
class Calibration:
    """Measured rates and overheads of this machine (units in the names)."""

    matmul_flops: dict[int, float]
    vector_flops: float
    memory_bytes_per_s: float
    launch_matmul_s: float
    launch_other_s: float
    forward_kernel_s: float
    backward_kernel_s: float
    p2p_s: dict[int, float]
    all_reduce_s: dict[int, float]
    loaded_s: dict[str, float]
    async_s: dict[str, float]
    async_p2p_s: float
    rounds: int = LOADED_REPEATS
    """Rounds of the loaded gloo measurement whose median ``loaded_s``, ``async_s`` and ``async_p2p_s`` are."""

    @property
    def cube_flops(self) -> float:
        return self.matmul_flops[max(self.matmul_flops)]

    @property
    def comm_compute_slowdown_by_kind(self) -> dict[str, float]:
        """Per collective kind, σ = E / L (module docstring): the extra period of the collective posted
        asynchronously beside a compute burst over its loaded blocking cost, capped at the target's bound of 10."""
        return {kind: min(10.0, self.async_s[kind] / self.loaded_s[kind]) if self.loaded_s[kind] > 0 else 0.0
                for kind in self.async_s}

    @property
    def comm_compute_slowdown(self) -> float:
        """The all-to-all's σ: the target's ``comm_compute_slowdown``, for the kinds without their own."""
        return self.comm_compute_slowdown_by_kind["all_to_all"]

    def comm_link(self) -> tuple[Link, float]:
        """(α–β link, launch.collective_s): B from the idle large messages, α and L fitted to the loaded small
        messages (module docstring)."""
        big = [(s, t) for s, t in self.all_reduce_s.items() if s >= 1 << 20]
        mean_s = statistics.fmean(s for s, _ in big)
        mean_t = statistics.fmean(t for _, t in big)
        slope = sum((s - mean_s) * (t - mean_t) for s, t in big) / sum((s - mean_s) ** 2 for s, _ in big)
        bandwidth = 1.0 / max(slope, 1e-12)
        alpha, launch = fit_alpha_launch({op: t - LOADED_OPS[op][0] * LOADED_BYTES / bandwidth
                                          for op, t in self.loaded_s.items()})
        return Link(bandwidth_bytes_per_s=bandwidth, latency_s=alpha), launch

    def collective_latency_s(self) -> dict[str, float]:
        """Per kind, the loaded cost of one 2-rank collective less its transfer time at the idle bandwidth: the
        target's ``launch.collective_latency_s`` (each kind as measured, not through the α–L fit)."""
        bandwidth = self.comm_link()[0].bandwidth_bytes_per_s
        return {op: max(0.0, t - LOADED_OPS[op][0] * LOADED_BYTES / bandwidth) for op, t in self.loaded_s.items()}


def fit_alpha_launch(latency_s: dict[str, float]) -> tuple[float, float]:
    """(α, L) seconds, each ≥ 0: least squares of ``latency_s[op] = steps(op)·α + L`` over the ops given (keys of
    ``LOADED_OPS``, whose 2-rank α step counts are cost_models/comm.py's). Raises ValueError: an op not in
    LOADED_OPS, or fewer than two distinct step counts."""
    unknown = set(latency_s) - set(LOADED_OPS)
    if unknown:
        raise ValueError(f"latency_s ops={sorted(unknown)}: must be among {sorted(LOADED_OPS)}")
    points = [(LOADED_OPS[op][1], t) for op, t in latency_s.items()]
    mean_x, mean_y = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        raise ValueError(f"latency_s ops={sorted(latency_s)}: need ops with different α step counts")
    alpha = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / var)
    launch = mean_y - alpha * mean_x
    if launch < 0:  # L would be negative: α alone, through the origin
        return max(0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)), 0.0
    return alpha, launch


def _best_s(fn: Callable[[], object], *, repeats: int, inner: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def measure_compute() -> tuple[dict[int, float], float, float, float, float]:
    """(matmul FLOP/s by size, vector FLOP/s, memory bytes/s, launch matmul s, launch other s), one thread.
    The per-kernel forward/backward split is :func:`measure_kernel_launch`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        matmul = {}
        for n in MATMUL_SIZES:
            a, b = torch.randn(n, n), torch.randn(n, n)
            matmul[n] = 2 * n ** 3 / _best_s(lambda: a @ b, repeats=5, inner=max(1, 2 ** 24 // n ** 3))
        x, y = torch.randn(ADD_ELEMENTS), torch.randn(ADD_ELEMENTS)
        add_s = _best_s(lambda: x + y, repeats=5, inner=3)
        mm_s = _best_s(_matmul_chain, repeats=5, inner=1) / (3 * CHAIN)
        mul_s = _best_s(_mul_chain, repeats=5, inner=1) / (2 * CHAIN)
    finally:
        torch.set_num_threads(threads)
    return matmul, ADD_ELEMENTS / add_s, 3 * 4 * ADD_ELEMENTS / add_s, mm_s, mul_s


def _matmul_chain() -> None:
    weight, y = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    for _ in range(CHAIN):
        y = y @ weight
    y.sum().backward()


def _mul_chain() -> None:
    y = torch.randn(8, requires_grad=True)
    for _ in range(CHAIN):
        y = y * 1.0001
    y.sum().backward()


def measure_kernel_launch(*, repeats: int = 7) -> tuple[float, float]:
    """(forward, backward) seconds per tiny eager kernel, one thread: the best of ``repeats`` timings of a chain
    of ``CHAIN`` 8-element multiplies recorded by autograd (forward), then of its backward (one mul per node)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fwd, bwd = float("inf"), float("inf")
    try:
        for _ in range(repeats + 1):
            x = torch.randn(8, requires_grad=True)
            t0 = time.perf_counter()
            y = x
            for _ in range(CHAIN):
                y = y * 1.0001
            loss = y.sum()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            fwd, bwd = min(fwd, (t1 - t0) / CHAIN), min(bwd, (t2 - t1) / CHAIN)
    finally:
        torch.set_num_threads(threads)
    return fwd, bwd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, port: int, out: str, rounds: int = LOADED_REPEATS) -> None:
    """One of the 2 benchmark ranks: median p2p (half ping-pong) and all-reduce seconds per message size, then
    :func:`measure_loaded_gloo` over ``rounds`` rounds."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    pin_to_cpu(rank, 2)  # as `moeplan run` binds its ranks, before gloo starts its threads
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    result: dict[str, dict[int, float]] = {"p2p": {}, "all_reduce": {}}
    for size in MESSAGE_BYTES:
        buf = torch.zeros(max(1, size // 4))
        pings, reduces = [], []
        for _ in range(7 if size < 1 << 22 else 3):
            dist.barrier()
            t0 = time.perf_counter()
            _comm_op("p2p", rank, buf, buf)
            pings.append((time.perf_counter() - t0) / 2)
            dist.barrier()
            t0 = time.perf_counter()
            _comm_op("all_reduce", rank, buf, buf)
            reduces.append(time.perf_counter() - t0)
        result["p2p"][size] = statistics.median(pings)
        result["all_reduce"][size] = statistics.median(reduces)
    loaded = measure_loaded_gloo(rank, rounds=rounds)
    if rank == 0:
        Path(out).write_text(yaml.safe_dump({**result, "loaded": loaded}))
    dist.destroy_process_group()


def _burst(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``BURST_OPS`` eager kernels of tiny-pangu's size: a matmul (64×64 · 64×128) and an add per pair."""
    y = x
    for _ in range(BURST_OPS // 2):
        y = (y @ w)[:, :64] + x
    return y


def _collective(kind: str, buf: torch.Tensor, out: torch.Tensor, gathered: torch.Tensor, *,
                async_op: bool) -> object:
    """Issue one 2-rank collective of ``kind`` (one of ``ASYNC_KINDS``) with the runtime's calls
    (moeplan.runtime.parallel) on ``buf``: into ``out`` (``buf``'s size), ``gathered`` (twice it, the all-gather) or
    in place (the all-reduce). Returns the work handle when ``async_op``, else None once it completed."""
    import torch.distributed as dist

    if kind == "all_to_all":
        return dist.all_to_all_single(out, buf, async_op=async_op)
    if kind == "all_reduce":
        return dist.all_reduce(buf, async_op=async_op)
    if kind == "all_gather":
        return all_gather_flat(gathered, buf, async_op=async_op)
    if kind == "reduce_scatter":
        return reduce_scatter_flat(out[:out.numel() // 2], buf, async_op=async_op)
    raise ValueError(f"kind={kind!r}: must be one of {list(ASYNC_KINDS)}")


def _comm_op(op: str, rank: int, buf: torch.Tensor, out: torch.Tensor) -> None:
    import torch.distributed as dist

    if op == "p2p":  # a send and a recv each: two messages per iteration
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(out, 1)
        else:
            dist.recv(out, 0)
            dist.send(buf, 0)
    elif op in ASYNC_KINDS:
        _collective(op, buf, out, torch.cat((out, out)), async_op=False)
    else:
        raise ValueError(f"op={op!r}: must be one of {sorted(LOADED_OPS)}")


def _loaded_period_s(op: str | None, rank: int) -> float:
    """Seconds per iteration of ``LOADED_ITERS`` iterations of a burst (+ one ``op``), both ranks in step. ``op``
    ``"async_<kind>"`` (``ASYNC_KINDS``): that collective posted (``async_op=True``) before the burst and waited
    after it; ``"async_p2p"``: an ``isend`` and an ``irecv`` to the other rank posted before it and waited after it."""
    import torch.distributed as dist

    x, w = torch.randn(64, 64), torch.randn(64, 128)
    buf, out = torch.zeros(LOADED_BYTES // 4), torch.zeros(LOADED_BYTES // 4)
    gathered = torch.zeros(LOADED_BYTES // 2)  # 2 ranks' buf
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(LOADED_ITERS):
        if op == "async_p2p":  # each rank posts a send and a receive, as a pipeline rank does (two messages)
            works = [dist.isend(buf, 1 - rank), dist.irecv(out, 1 - rank)]
        elif op is not None and op.startswith("async_"):
            works = [_collective(op.removeprefix("async_"), buf, out, gathered, async_op=True)]
        else:
            works = []
        _burst(x, w)
        for work in works:
            work.wait()
        if op is not None and not works:
            _comm_op(op, rank, buf, out)
    return (time.perf_counter() - t0) / LOADED_ITERS


def measure_loaded_gloo(rank: int, *, rounds: int = LOADED_REPEATS) -> dict[str, float]:
    """Effective seconds per message of each op of ``LOADED_OPS`` (``LOADED_BYTES`` per rank) while both ranks
    compute, and of ``ASYNC_OPS`` (posted before the burst, waited after; module docstring): the median over
    ``rounds`` (default ``LOADED_REPEATS``) rounds of (period with the op − period without it, measured right
    before), so slow drifts of the machine cancel. Call on both ranks of an initialised 2-rank gloo group, one thread
    each."""
    _loaded_period_s(None, rank)  # warm-up
    diffs: dict[str, list[float]] = {op: [] for op in (*LOADED_OPS, *ASYNC_OPS)}
    for _ in range(rounds):
        for op in diffs:
            base = _loaded_period_s(None, rank)
            diffs[op].append(_loaded_period_s(op, rank) - base)
    per_iter = {"p2p": 2, "async_p2p": 2}
    return {op: max(0.0, statistics.median(d) / per_iter.get(op, 1)) for op, d in diffs.items()}


def measure_gloo(rounds: int = LOADED_REPEATS) -> tuple[dict[int, float], dict[int, float], dict[str, float]]:
    """(p2p seconds, all-reduce seconds) by message bytes between 2 idle local gloo ranks, and the seconds per
    message by op between compute bursts (:func:`measure_loaded_gloo` over ``rounds``, the asynchronous ops
    included)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="moeplan-calibrate-") as tmp:
        out = os.path.join(tmp, "gloo.yaml")
        mp.spawn(_gloo_rank, args=(_free_port(), out, rounds), nprocs=2, join=True)
        data = yaml.safe_load(Path(out).read_text())
    return data["p2p"], data["all_reduce"], data["loaded"]


def calibrate(*, rounds: int = LOADED_REPEATS) -> Calibration:
    """Every measurement of the module docstring; the loaded gloo figures are the median of ``rounds`` rounds (most
    of the minute calibrate takes: fewer rounds are quicker and noisier)."""
    matmul, vector, memory, mm_s, mul_s = measure_compute()
    fwd_s, bwd_s = measure_kernel_launch()
    p2p, reduce, loaded = measure_gloo(rounds)
    async_s = {kind: loaded.pop(f"async_{kind}") for kind in ASYNC_KINDS}
    p2p_post_s = loaded.pop("async_p2p")
    return Calibration(matmul_flops=matmul, vector_flops=vector, memory_bytes_per_s=memory, launch_matmul_s=mm_s,
                       launch_other_s=mul_s, forward_kernel_s=fwd_s, backward_kernel_s=bwd_s, p2p_s=p2p,
                       all_reduce_s=reduce, loaded_s=loaded, async_s=async_s, async_p2p_s=p2p_post_s,
                       rounds=rounds)


def calibrated_target(base: Target, cal: Calibration, *, name: str) -> Target:
    """``base`` with the measured figures (every efficiency 1: they are achieved rates), ``"kernel"`` launch
    granularity, ``fp32`` training and the measured compute slow-downs (``comm_compute_slowdown`` and per kind)."""
    link, collective_s = cal.comm_link()
    return base.model_copy(update=dict(
        name=name, cube_flops=cal.cube_flops, vector_flops=cal.vector_flops,
        hbm_bandwidth_bytes_per_s=cal.memory_bytes_per_s, host_bandwidth_bytes_per_s=cal.memory_bytes_per_s,
        intra_node=link, inter_node=link, efficiency=Efficiency(compute=1.0, memory=1.0, comm=1.0),
        launch=LaunchCost(matmul_s=cal.launch_matmul_s, other_s=cal.launch_other_s,
                          collective_s=collective_s, collective_latency_s=cal.collective_latency_s(),
                          p2p_host_s=cal.async_p2p_s,
                          granularity="kernel",
                          forward_kernel_s=cal.forward_kernel_s,
                          backward_kernel_s=cal.backward_kernel_s),
        training_dtype="fp32", comm_compute_slowdown=cal.comm_compute_slowdown,
        comm_compute_slowdown_by_kind=cal.comm_compute_slowdown_by_kind, variant=None))


@dataclass(frozen=True)
class LaunchFit:
    """The fitted scales and their inputs: ``rate_scale`` (compute and memory time × it: efficiencies ÷ it) from the
    measured growth of a micro-batch's F + B seconds from ``sizes[0]`` to ``sizes[1]`` sequences against the
    predicted growth at rate 1; then the forward and backward launch scales from the measured F and B seconds per
    step of the fit run and the predicted ones with each scale at 0 and at 1."""

    forward_scale: float
    backward_scale: float
    measured_f_s: float
    measured_b_s: float
    predicted_f_s: tuple[float, float]
    predicted_b_s: tuple[float, float]
    rate_scale: float
    sizes: tuple[int, int]
    measured_growth_s: float
    predicted_growth_s: float


def measure_runtime_fb_s(plans: dict[int, Plan], *, rounds: int = FIT_ROUNDS, steps: int = FIT_STEPS,
                         first_step: int = FIT_FIRST_STEP) -> dict[int, tuple[float, float]]:
    """Per key of ``plans`` (1-device plans), the F and B seconds per step of ``moeplan run`` executing it on this
    machine (the runtime's own process, executor and optimizer, meters off): the plans run one after the other,
    ``rounds`` times, ``steps`` steps each, so that every plan sees the same phases of the machine (its speed drifts
    by up to 1.45× within minutes on the development VM); each figure is the median over the steps
    ``first_step..steps-1`` of all rounds of the per-step sums the metrics record (``action_s``), as ``moeplan
    compare`` takes them."""
    from moeplan.plan import save_plan
    from moeplan.runtime.compare import read_records
    from moeplan.runtime.launch import launch_local
    from moeplan.runtime.request import RunRequest

    samples: dict[int, list[tuple[float, float]]] = {key: [] for key in plans}
    with tempfile.TemporaryDirectory(prefix="moeplan-calibrate-") as tmp:
        paths = {key: os.path.join(tmp, f"{key}.yaml") for key in plans}
        for key, plan in plans.items():
            save_plan(plan, paths[key])
        for round_ in range(rounds):
            for key, plan in plans.items():
                metrics = os.path.join(tmp, f"{key}-{round_}.jsonl")
                launch_local(plan, RunRequest(plan=paths[key], steps=steps, metrics=metrics, meter_every=steps + 1))
                samples[key] += [(r.ranks[0].action_s.get("F", 0.0), r.ranks[0].action_s.get("B", 0.0))
                                 for r in read_records(metrics) if r.step >= first_step]
    return {key: (statistics.median(f for f, _ in ts), statistics.median(b for _, b in ts))
            for key, ts in samples.items()}


def predicted_actions_s(plan: Plan) -> tuple[float, float]:
    """The F and B seconds per step a 1-device ``plan`` predicts (moeplan.runtime.compare.predicted_rank)."""
    from moeplan.runtime.compare import predicted_rank

    pred = predicted_rank(plan, 0)
    return pred.get("F", 0.0), pred.get("B", 0.0)


def fit_launch_scale(spec: ModelSpec, target: Target) -> LaunchFit:
    """Fit ``target``'s rate scale and forward and backward launch-cost scales to ``spec`` run on this machine
    (module docstring). Two 1-device plans of the spec's global batch and sequence length, micro-batches of 1 and
    of ``GROWTH_SIZE`` sequences, run in turn for ``FIT_ROUNDS`` rounds (:func:`measure_runtime_fb_s`); the rate
    scale is fitted to how a micro-batch's F + B seconds grow from the one to the other, then the forward scale to
    the F seconds per step of the micro-batch-1 plan and, with it, the backward scale to its B seconds."""
    from moeplan.compile import compile_model
    from moeplan.search import Fixed

    def compiled(forward: float, backward: float, rate: float, size: int = 1) -> Plan:
        fixed = Fixed(global_batch=spec.global_batch, seq_len=spec.seq_len, tp=1, pp=1, vpp=1, ep=1, etp=1, cp=1,
                      micro_batch=size, recompute="none")
        return compile_model(spec=spec, target=scaled_target(target, forward, backward, rate), num_devices=1,
                             fixed=fixed, workers=1, candidates=1).plan

    def linear(measured: float, at0: float, at1: float) -> float:
        return max(0.0, (measured - at0) / (at1 - at0)) if at1 > at0 else 1.0

    def per_microbatch_fb(plan: Plan) -> float:
        return sum(predicted_actions_s(plan)) / plan.layout.num_microbatches

    sizes = (1, min(GROWTH_SIZE, spec.global_batch))
    runs = {size: compiled(1.0, 1.0, 1.0, size) for size in dict.fromkeys(sizes)}
    fb = measure_runtime_fb_s(runs)
    rate, grown, priced = 1.0, 0.0, 0.0
    if sizes[1] > sizes[0]:
        grown = (sum(fb[sizes[1]]) / runs[sizes[1]].layout.num_microbatches
                 - sum(fb[sizes[0]]) / runs[sizes[0]].layout.num_microbatches)
        by_rate = {1.0: runs, 2.0: {size: compiled(1.0, 1.0, 2.0, size) for size in sizes}}
        at = {u: per_microbatch_fb(p[sizes[1]]) - per_microbatch_fb(p[sizes[0]]) for u, p in by_rate.items()}
        priced = at[1.0]
        rate = min(MAX_RATE_SCALE, max(1.0, 1.0 + (grown - at[1.0]) / (at[2.0] - at[1.0]))) \
            if at[2.0] > at[1.0] else 1.0
    f_meas, b_meas = fb[sizes[0]]
    f0, f1 = (predicted_actions_s(compiled(k, 1.0, rate))[0] for k in (0.0, 1.0))
    kf = linear(f_meas, f0, f1)
    b0, b1 = predicted_actions_s(compiled(kf, 0.0, rate))[1], predicted_actions_s(compiled(kf, 1.0, rate))[1]
    return LaunchFit(forward_scale=kf, backward_scale=linear(b_meas, b0, b1), measured_f_s=f_meas,
                     measured_b_s=b_meas, predicted_f_s=(f0, f1), predicted_b_s=(b0, b1), rate_scale=rate,
                     sizes=sizes, measured_growth_s=grown, predicted_growth_s=priced)


def scaled_target(target: Target, forward: float, backward: float, rate: float = 1.0) -> Target:
    """``target`` with its forward launch costs (``forward_kernel_s`` and the ``"op"`` granularity's ``matmul_s`` /
    ``other_s``) times ``forward``, ``backward_kernel_s`` times ``backward``, and its compute and memory
    efficiencies divided by ``rate`` (≥ 1: every op's roofline time × ``rate``, cost_models/compute.py)."""
    launch = target.launch.model_copy(update=dict(
        matmul_s=target.launch.matmul_s * forward, other_s=target.launch.other_s * forward,
        forward_kernel_s=target.launch.forward_kernel_s * forward,
        backward_kernel_s=target.launch.backward_kernel_s * backward))
    eff = target.efficiency.model_copy(update=dict(compute=target.efficiency.compute / rate,
                                                   memory=target.efficiency.memory / rate))
    return target.model_copy(update=dict(launch=launch, efficiency=eff))


def fit_summary(fit: LaunchFit, model: str) -> str:
    """One line: the fitted scales and what they were fitted to (milliseconds per step)."""
    ms = 1e3
    return (f"rate x {fit.rate_scale:.2f}: a micro-batch's F + B grows by {fit.measured_growth_s * ms:.2f} ms from "
            f"{fit.sizes[0]} to {fit.sizes[1]} sequences (predicted {fit.predicted_growth_s * ms:.2f} ms at the "
            f"measured rates); launch costs: forward x {fit.forward_scale:.2f}, backward x {fit.backward_scale:.2f}, "
            f"fitted to a measured 1-device {model} step's F {fit.measured_f_s * ms:.1f} ms and B "
            f"{fit.measured_b_s * ms:.1f} ms (predicted F {fit.predicted_f_s[0] * ms:.1f} / "
            f"{fit.predicted_f_s[1] * ms:.1f} ms and B {fit.predicted_b_s[0] * ms:.1f} / "
            f"{fit.predicted_b_s[1] * ms:.1f} ms without / with the measured launch costs)")


def write_target(target: Target, cal: Calibration, path: str | Path, *, fit: LaunchFit | None = None,
                 fit_model: str = "") -> None:
    """Write ``target`` as YAML atomically, with the raw measurements (and the launch fit) as a comment header."""
    path = Path(path)
    lines = ["# Calibrated by `moeplan calibrate` on this machine (one thread per rank, fp32). Raw figures:",
             *(f"#   matmul {n}x{n}x{n}: {f / 1e9:.2f} GFLOP/s" for n, f in sorted(cal.matmul_flops.items())),
             f"#   add of {ADD_ELEMENTS} fp32: {cal.vector_flops / 1e9:.2f} GFLOP/s, "
             f"{cal.memory_bytes_per_s / 1e9:.2f} GB/s",
             f"#   tiny op with autograd: matmul {cal.launch_matmul_s * 1e6:.2f} us, mul {cal.launch_other_s * 1e6:.2f} us",
             f"#   per eager kernel: forward {cal.forward_kernel_s * 1e6:.2f} us, "
             f"backward {cal.backward_kernel_s * 1e6:.2f} us",
             *(f"#   gloo 2 ranks {s} B: p2p {cal.p2p_s[s] * 1e6:.1f} us, all-reduce {cal.all_reduce_s[s] * 1e6:.1f} us"
               for s in sorted(cal.p2p_s)),
             f"#   gloo 2 ranks, {LOADED_BYTES} B between compute bursts, median of {cal.rounds} rounds "
             "(launch.collective_latency_s, less the transfer time): "
             + ", ".join(f"{op} {t * 1e6:.1f} us" for op, t in sorted(cal.loaded_s.items())),
             f"#   gloo 2 ranks, {LOADED_BYTES} B posted before a compute burst, waited after: "
             + ", ".join(f"{kind} {t * 1e6:.1f} us" for kind, t in cal.async_s.items())
             + " (comm_compute_slowdown_by_kind = each / its blocking cost; comm_compute_slowdown: all_to_all's)",
             f"#   gloo 2 ranks, a send and a receive of {LOADED_BYTES} B each posted before a compute burst, waited "
             f"after: {cal.async_p2p_s * 1e6:.1f} us per message (launch.p2p_host_s)"]
    if fit is not None:
        lines.append(f"# {fit_summary(fit, fit_model)}")
    data = target.model_dump(mode="json", exclude={"variant"})
    text = "\n".join(lines) + "\n" + yaml.safe_dump(data, sort_keys=False)
    write_atomic(path, text)
    load_target(str(path))  # the compiler must be able to read it back
