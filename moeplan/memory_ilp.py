"""The keep / recompute / swap ILP of one PP rank (docs/memory.md §2), solved with OR-Tools math_opt.

Data: the rank's layers grouped by (VPP chunk, layer kind) — layers of a kind in a chunk are identical, so they
share one decision per saved tensor (:class:`Group`, with cost_models/saved_tensors.py's per-layer data) — the
vectors of in-flight micro-batches per chunk that the rank's action list passes through (read from the
``schedule`` pass), the bytes left for activations once model states and op workspace are counted, and the host
link.

Variables per group ``g``: ``keep[g,u]``, ``swap[g,u]`` per storage ``u`` and ``redo[g,o]`` per op ``o`` (binary).

- a needed storage is held or its op re-runs: ``keep + swap + redo[maker(u)] ≥ 1`` (the layer input has no maker);
- a re-run op finds its inputs: ``keep[u] + swap[u] + redo[maker(u)] ≥ redo[o]`` for each storage ``u`` it reads;
- ``keep + swap ≤ 1``;
- memory, for each in-flight vector ``n``: ``Σ_g n[chunk g] · count_g · Σ_u bytes_u keep[g,u] + W + P ≤
  budget``, where ``W ≥ Σ_{u needed} bytes_u redo[g, maker(u)] + Σ_u bytes_u swap[g,u]`` for every group (the
  backward working set of one layer: the saved tensors it re-makes in backward, a re-made tensor no backward reads
  being freed as soon as its consumer has run, plus its swapped tensors back on the device) and
  ``P ≥ Σ_u bytes_u swap[g,u]`` for every group (the next layer's, prefetched meanwhile, which the runtime takes
  from the same stage: any layer);
- swap time the host link cannot hide: per chunk ``c`` and micro-batch, ``out_c ≥ B_c / bw − F_c`` and
  ``in_c ≥ B_c / bw − Bw_c`` (``B_c`` swapped bytes, ``F_c`` / ``Bw_c`` the chunk's forward / backward compute
  seconds: the copy out runs under the forward, the prefetch under the backward), ``≥ 0``.

Objective: the seconds added to the rank's step, ``m · Σ_c (Σ_{g in c} count_g Σ_o seconds_o redo[g,o] + out_c +
in_c)`` for ``m`` micro-batches, plus 1e-13 s per swapped byte so that a free choice keeps rather than swaps.

Solved with HiGHS (math_opt) to a relative gap of 1%. Small problems take milliseconds. On the 718B at 30 GiB,
``ilp-no-swap`` proves every rank in 0.07–0.60 s, but ``ilp`` proves only 7 of 16 ranks within 2 s
(docs/memory.md §3). Each solve has a time limit. When it hits without a proof, HiGHS's best solution answers,
flagged ``status="heuristic"`` with its gap in the reason. Without any solution, the greedy :func:`heuristic`
answers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Sequence

from moeplan.cost_models.saved_tensors import LayerTensors, closure, flag_of
from moeplan.state import GroupChoice, OpDecision

SWAP_TIE_S_PER_BYTE = 1e-13
GIB = 2**30  # the model counts bytes in GiB: coefficients near 1 keep HiGHS's numerics sound
FEASIBILITY_MARGIN_GIB = 1e-5
"""Taken off the budget: HiGHS accepts a row violated by up to its feasibility tolerance (1e-6 GiB is about 1 KiB),
which once put a plan 587 bytes over its budget."""
SolveStatus = Literal["optimal", "heuristic", "infeasible"]


@dataclass(frozen=True)
class Group:
    """``count`` identical layers of one kind in VPP chunk ``chunk`` of the rank."""

    chunk: int
    count: int
    layer: LayerTensors


@dataclass(frozen=True)
class RankProblem:
    """One PP rank's problem (module docstring): ``in_flight`` vectors (micro-batches in flight per chunk),
    ``budget_bytes`` for activations, the recompute working set and swap buffers, ``microbatches`` per step, and
    the host link's bytes/s (None: no swap)."""

    groups: tuple[Group, ...]
    in_flight: tuple[tuple[int, ...], ...]
    budget_bytes: float
    microbatches: int
    host_bandwidth: float | None


@dataclass(frozen=True)
class RankSolution:
    """A solved :class:`RankProblem`: ``status`` ``optimal`` (proved, within ``gap``), ``heuristic`` (the solver's
    limit hit: its best solution and ``gap``, or the greedy answer with gap inf; ``reason`` says which) or
    ``infeasible`` (``reason`` names the bytes needed against the budget); ``added_s`` the seconds added to the
    step; ``peak_bytes`` the activations and the backward working set at the fullest in-flight vector; per chunk
    the swap seconds not hidden per micro-batch."""

    status: SolveStatus
    reason: str
    gap: float
    added_s: float
    peak_bytes: float
    choices: tuple[GroupChoice, ...]
    exposed_swap_s: tuple[tuple[float, float], ...] = ()
    solve_s: float = 0.0


def _windows(problem: RankProblem) -> tuple[list[float], list[float]]:
    """Per chunk, the forward and the backward compute seconds of one micro-batch (what a swap hides under)."""
    chunks = len(problem.in_flight[0]) if problem.in_flight else 1 + max(g.chunk for g in problem.groups)
    fwd, bwd = [0.0] * chunks, [0.0] * chunks
    for g in problem.groups:
        fwd[g.chunk] += g.count * g.layer.fwd_s
        bwd[g.chunk] += g.count * g.layer.bwd_s
    return fwd, bwd


def working_set(choices: Sequence[GroupChoice]) -> float:
    """The backward working set of ``choices`` (module docstring): the most one layer re-makes and fetches back,
    plus the most one layer has prefetched."""
    return (max((ch.remade_bytes + ch.swapped_bytes for ch in choices), default=0.0)
            + max((ch.swapped_bytes for ch in choices), default=0.0))


def evaluate(problem: RankProblem, choices: Sequence[GroupChoice]) -> tuple[float, float, tuple]:
    """(seconds added to the step, peak bytes, per-chunk (out, in) exposed swap seconds per micro-batch) of
    ``choices`` under ``problem``'s model (module docstring)."""
    fwd, bwd = _windows(problem)
    kept, swapped, redo = [0.0] * len(fwd), [0.0] * len(fwd), [0.0] * len(fwd)
    for g, ch in zip(problem.groups, choices):
        kept[g.chunk] += g.count * ch.kept_bytes
        swapped[g.chunk] += g.count * ch.swapped_bytes
        redo[g.chunk] += g.count * ch.recompute_s
    bw = problem.host_bandwidth
    exposed = tuple((max(0.0, s / bw - f), max(0.0, s / bw - b)) if bw else (0.0, 0.0)
                    for s, f, b in zip(swapped, fwd, bwd))
    peak = max((sum(n * k for n, k in zip(v, kept)) for v in problem.in_flight), default=0.0) + working_set(choices)
    added = problem.microbatches * sum(r + o + i for r, (o, i) in zip(redo, exposed))
    return added, peak, exposed


def choice_of(group: Group, rerun: set[str], swapped: set[str]) -> GroupChoice:
    """The :class:`GroupChoice` of re-running ``rerun`` (closed over what it needs) and swapping ``swapped``:
    every other needed storage, and every input a re-run op reads that is not re-made, is kept."""
    lt = group.layer
    made = {m for o in lt.ops if o.name in rerun for m in o.makes}
    held = {t.name for t in lt.tensors if t.needed and t.name not in made} | swapped
    rerun = closure(lt, rerun, held | {r for o in lt.ops if o.name in rerun for r in o.reads if r not in made})
    made = {m for o in lt.ops if o.name in rerun for m in o.makes}
    reads = {r for o in lt.ops if o.name in rerun for r in o.reads}
    keep = {t.name for t in lt.tensors if (t.needed or t.name in reads) and t.name not in made} - swapped
    by = {t.name: t.bytes for t in lt.tensors}
    needed = {t.name for t in lt.tensors if t.needed}
    ops = []
    for o in lt.ops:
        if o.name in rerun:
            ops.append(OpDecision(o.name, o.label, "recompute", sum(by[m] for m in o.makes if m in needed),
                                  flag_of(o.label, "recompute", lt.mla)))
        elif set(o.makes) & swapped:
            ops.append(OpDecision(o.name, o.label, "swap", sum(by[m] for m in o.makes if m in swapped),
                                  flag_of(o.label, "swap", lt.mla)))
    ops += [OpDecision(u, "layer input", "swap", by[u], None) for u in sorted(swapped) if u not in
            {m for o in lt.ops for m in o.makes}]
    return GroupChoice(group.chunk, lt.kind.value, tuple(sorted(rerun)), tuple(sorted(swapped)),
                       sum(by[u] for u in keep), sum(by[u] for u in swapped),
                       sum(o.seconds for o in lt.ops if o.name in rerun),
                       sum(by[m] for m in made if m in needed), sum(o.flops for o in lt.ops if o.name in rerun),
                       tuple(ops))


def solve(problem: RankProblem, *, time_limit_s: float = 2.0) -> RankSolution:
    """The optimal decisions of ``problem`` (module docstring) within 1%; flagged ``heuristic`` when HiGHS does
    not prove it within ``time_limit_s`` (its best solution, or the greedy :func:`heuristic` without one)."""
    from ortools.math_opt.python import mathopt

    t0 = time.perf_counter()
    model = mathopt.Model(name="plan-memory")
    fwd, bwd = _windows(problem)
    kept, swapped, redo_s = [0.0] * len(fwd), [0.0] * len(fwd), [0.0] * len(fwd)
    work = model.add_variable(lb=0.0, name="working_set")
    prefetch = model.add_variable(lb=0.0, name="prefetch")
    keep, swap, redo = {}, {}, {}
    for gi, g in enumerate(problem.groups):
        lt = g.layer
        maker = {m: o.name for o in lt.ops for m in o.makes}
        for o in lt.ops:
            redo[gi, o.name] = model.add_binary_variable(name=f"redo[{gi},{o.name}]")
        for t in lt.tensors:
            keep[gi, t.name] = model.add_binary_variable(name=f"keep[{gi},{t.name}]")
            swap[gi, t.name] = model.add_binary_variable(name=f"swap[{gi},{t.name}]")
            if problem.host_bandwidth is None:
                model.add_linear_constraint(swap[gi, t.name] == 0)
            model.add_linear_constraint(keep[gi, t.name] + swap[gi, t.name] <= 1)

        def held(u: str):  # noqa: ANN202 (a math_opt expression)
            made = redo[gi, maker[u]] if u in maker else 0
            return keep[gi, u] + swap[gi, u] + made

        for t in lt.tensors:
            if t.needed:
                model.add_linear_constraint(held(t.name) >= 1)
        for o in lt.ops:
            for u in o.reads:
                model.add_linear_constraint(held(u) >= redo[gi, o.name])
        kept[g.chunk] += g.count * sum(t.bytes / GIB * keep[gi, t.name] for t in lt.tensors)
        sw = sum(t.bytes / GIB * swap[gi, t.name] for t in lt.tensors)
        swapped[g.chunk] += g.count * sw
        redo_s[g.chunk] += g.count * sum(o.seconds * redo[gi, o.name] for o in lt.ops)
        model.add_linear_constraint(work >= sum(t.bytes / GIB * redo[gi, maker[t.name]] for t in lt.tensors
                                                if t.name in maker and t.needed) + sw)
        model.add_linear_constraint(prefetch >= sw)
    for v in problem.in_flight:
        model.add_linear_constraint(sum(n * k for n, k in zip(v, kept) if n) + work + prefetch
                                    <= problem.budget_bytes / GIB - FEASIBILITY_MARGIN_GIB)
    exposed = []
    for c in range(len(fwd)):
        out, back = model.add_variable(lb=0.0, name=f"out[{c}]"), model.add_variable(lb=0.0, name=f"in[{c}]")
        if problem.host_bandwidth:
            model.add_linear_constraint(out >= swapped[c] * (GIB / problem.host_bandwidth) - fwd[c])
            model.add_linear_constraint(back >= swapped[c] * (GIB / problem.host_bandwidth) - bwd[c])
        exposed.append(out + back)
    model.minimize(problem.microbatches * sum(r + e for r, e in zip(redo_s, exposed))
                   + SWAP_TIE_S_PER_BYTE * GIB * sum(swapped))
    params = mathopt.SolveParameters(time_limit=timedelta(seconds=time_limit_s), relative_gap_tolerance=1e-2,
                                     absolute_gap_tolerance=1e-9)
    result = mathopt.solve(model, mathopt.SolverType.HIGHS, params=params)
    reason = result.termination.reason
    if reason in (mathopt.TerminationReason.INFEASIBLE, mathopt.TerminationReason.INFEASIBLE_OR_UNBOUNDED):
        return _infeasible(problem, time.perf_counter() - t0)
    proved = reason == mathopt.TerminationReason.OPTIMAL
    if not proved and not result.has_primal_feasible_solution():
        sol = heuristic(problem)
        why = f"HiGHS stopped ({reason.name.lower()}) within {time_limit_s:g} s without a solution: greedy answer"
        return RankSolution(sol.status, why if sol.status != "infeasible" else sol.reason, float("inf"),
                            sol.added_s, sol.peak_bytes, sol.choices, sol.exposed_swap_s, time.perf_counter() - t0)
    values = result.variable_values()
    choices = []
    for gi, g in enumerate(problem.groups):
        lt = g.layer
        rerun = {o.name for o in lt.ops if values[redo[gi, o.name]] > 0.5}
        swapped_set = {t.name for t in lt.tensors if values[swap[gi, t.name]] > 0.5}
        choices.append(choice_of(g, rerun, swapped_set))
    added, peak, exp = evaluate(problem, choices)
    bounds = result.termination.objective_bounds
    gap = abs(bounds.primal_bound - bounds.dual_bound) / max(abs(bounds.primal_bound), 1e-12)
    why = "" if proved else (f"HiGHS stopped ({reason.name.lower()}) within {time_limit_s:g} s: its best solution, "
                             f"{gap:.1%} from the bound")
    return RankSolution("optimal" if proved else "heuristic", why, gap, added, peak, tuple(choices), exp,
                        time.perf_counter() - t0)


def _infeasible(problem: RankProblem, solve_s: float) -> RankSolution:
    """The least bytes any choice needs (every op re-run, only the layer inputs held), as the reason."""
    least = [choice_of(g, {o.name for o in g.layer.ops}, set()) for g in problem.groups]
    _, peak, _ = evaluate(problem, least)
    return RankSolution("infeasible", f"activations need at least {peak / 2**30:.2f} GiB with every op recomputed; "
                        f"{max(problem.budget_bytes, 0) / 2**30:.2f} GiB are left after model states, workspace and overheads",
                        0.0, float("inf"), peak, tuple(least), solve_s=solve_s)


def heuristic(problem: RankProblem) -> RankSolution:
    """Greedy: start from keeping everything; while over budget, take the move that frees the most bytes of the
    fullest in-flight vector per second added — re-run one more op (with what it needs) or swap one more storage
    of one group — until it fits (status ``optimal`` is never claimed: ``heuristic``), or ``infeasible``."""
    state = [(set(), set()) for _ in problem.groups]
    choices = [choice_of(g, *s) for g, s in zip(problem.groups, state)]
    added, peak, _ = evaluate(problem, choices)
    while peak > problem.budget_bytes:
        best = None
        for gi, g in enumerate(problem.groups):
            rerun, swapped = state[gi]
            moves = [({*rerun, o.name}, swapped) for o in g.layer.ops if o.name not in rerun]
            if problem.host_bandwidth:
                moves += [(rerun, {*swapped, t.name}) for t in g.layer.tensors if t.needed and t.name not in swapped]
            for mv in moves:
                trial = list(choices)
                try:
                    trial[gi] = choice_of(g, *mv)
                except ValueError:
                    continue
                a, p, _ = evaluate(problem, trial)
                if p >= peak:
                    continue
                score = (peak - p) / max(a - added, 1e-12)
                if best is None or score > best[0]:
                    best = (score, gi, mv, trial, a, p)
        if best is None:
            return _infeasible(problem, 0.0)
        _, gi, mv, choices, added, peak = best
        state[gi] = mv
    _, _, exp = evaluate(problem, choices)
    return RankSolution("heuristic", "greedy", float("inf"), added, peak, tuple(choices), exp)
