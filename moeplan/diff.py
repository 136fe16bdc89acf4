"""The differences between two plans (``moeplan diff A B``), for an engineer choosing between them.

:func:`diff_plans` builds a typed value, :class:`PlanDiff`: sections (model and target, layout, stages, memory,
schedule, communication, prediction) of :class:`Row` s, each holding a field, A's value, B's value and the change
from A to B. A section is present only when one of its rows differs. Only the plans are read (``moeplan.plan.Plan``):
the values are the plans' own, converted to the unit in ``Row.unit`` (bytes to GiB, fractions to %).
:func:`diff_json` and :func:`render_diff` only format that value.

Floats are equal when within a relative tolerance of ``REL_TOL`` (1e-6; ``ABS_TOL`` near zero), so the last-digit
noise of a re-simulation (``moeplan simulate``) is not reported. Not compared: ``sharding`` and ``experts`` (derived
from the model, target and layout, which are), ``provenance`` (compile times) and the free-text ``stages.reason``.
"""
from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Literal, Union

from rich.console import Console
from rich.table import Table
from rich.text import Text

from moeplan.errors import PlanError
from moeplan.plan import MEMORY_TERMS, Plan, PlanLayout, load_plan
from moeplan.render import compact

REL_TOL = 1e-6
ABS_TOL = 1e-12
GIB = 1024**3
CONTEXT = (2, 3)  # actions shown before and from the first differing position of an action list

Value = Union[None, bool, int, float, str, list]
Better = Literal["lower", "higher"]


@dataclass(frozen=True)
class Row:
    """One differing field. ``a``/``b``: the value in plan A / B in ``unit`` (None: the plan has no such field,
    e.g. a PP rank the other plan lacks); ``change``: B vs A in words (``+0.0123 (+4.1%)``, ``+layers.3 (from pp 1
    chunk 0)``, ``changed``); ``delta`` = b − a and ``rel`` = (b − a) / |a| for numbers (None otherwise or when a
    is 0); ``better``: ``A`` or ``B`` for a figure with a preferred direction (prediction), else None."""

    field: str
    a: Value
    b: Value
    change: str
    unit: str = ""
    delta: float | None = None
    rel: float | None = None
    better: Literal["A", "B"] | None = None


@dataclass(frozen=True)
class Section:
    """A titled group of differing rows."""

    name: str
    rows: tuple[Row, ...]


@dataclass(frozen=True)
class PlanDiff:
    """B vs A: ``a``/``b`` label the plans (their paths), ``warnings`` say when they are for different models or
    targets, ``sections`` hold only the sections where something differs (none: the plans are equal)."""

    a: str
    b: str
    warnings: tuple[str, ...]
    sections: tuple[Section, ...]

    @property
    def equal(self) -> bool:
        return not self.sections


def load_side(path: str, side: str) -> Plan:
    """Load plan ``side`` (``A`` or ``B``) with :func:`moeplan.plan.load_plan`. Raises PlanError with one line
    prefixed ``plan A:`` / ``plan B:``."""
    try:
        return load_plan(path)
    except PlanError as e:
        raise PlanError(f"plan {side}: {e}") from None


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)
        return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def fmt(x: Value) -> str:
    """A value as the tables show it: numbers to 4 significant digits (thousands grouped from 1,000 on), lists
    comma-separated with runs of decoder layers compacted (``layers.0-3``), None as ``–``."""
    if x is None:
        return "–"
    if isinstance(x, bool) or isinstance(x, str):
        return str(x)
    if isinstance(x, (int, float)):
        return f"{x:,.0f}" if abs(x) >= 1000 or isinstance(x, int) else f"{x:.4g}"
    return compact([str(v) for v in x]) if x else "(none)"


def _row(field: str, a: Value, b: Value, *, unit: str = "", better: Better | None = None) -> Row | None:
    """The row of ``field`` when A's and B's values differ, else None."""
    if _same(a, b):
        return None
    if a is None or b is None:
        return Row(field, a, b, "only in B" if a is None else "only in A", unit)
    if isinstance(a, list) and isinstance(b, list):
        change = [f"+{v}" for v in b if v not in a] + [f"-{v}" for v in a if v not in b]
        return Row(field, a, b, ", ".join(change) or "reordered", unit)
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
        return Row(field, a, b, "changed", unit)
    delta = b - a
    rel = delta / abs(a) if a else None
    step = {"": "", "%": " pt"}.get(unit, f" {unit}")  # a change of a percentage is in percentage points
    change = f"{'+' if delta > 0 else '-'}{fmt(abs(delta))}{step}" + (f" ({rel:+.1%})" if rel is not None else "")
    won = None if better is None else ("B" if (delta < 0) == (better == "lower") else "A")
    return Row(field, a, b, change, unit, delta, rel, won)


def _rows(*rows: Row | None) -> list[Row]:
    return [r for r in rows if r is not None]


def _flat(d: dict, prefix: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def target_fingerprint(plan: Plan) -> str:
    """sha256 of the canonical JSON of the plan's target, first 16 hex digits (as ``ModelSpec.fingerprint``)."""
    return hashlib.sha256(plan.target.model_dump_json().encode()).hexdigest()[:16]


def _model_target(a: Plan, b: Plan) -> tuple[list[Row], list[str]]:
    shape = {"name", "seq_len", "global_batch"}  # the name has its own row; the training shape is in the layout
    spec_a = {k: v for k, v in a.model.spec.model_dump(mode="json").items() if k not in shape}
    spec_b = {k: v for k, v in b.model.spec.model_dump(mode="json").items() if k not in shape}
    ta, tb = _flat(a.target.model_dump(mode="json"), "target."), _flat(b.target.model_dump(mode="json"), "target.")
    rows = _rows(_row("model", a.model.name, b.model.name), _row("model fingerprint", a.model.fingerprint,
                                                                 b.model.fingerprint),
                 *(_row(f"spec.{k}", spec_a.get(k), spec_b.get(k)) for k in spec_a | spec_b),
                 _row("target fingerprint", target_fingerprint(a), target_fingerprint(b)),
                 *(_row(k, ta.get(k), tb.get(k)) for k in ta | tb))
    warnings = []
    if spec_a != spec_b or a.model.name != b.model.name:
        warnings.append(f"the plans are for different models: A {a.model.name} ({a.model.fingerprint}), "
                        f"B {b.model.name} ({b.model.fingerprint}); they are diffed anyway")
    if ta != tb:
        warnings.append(f"the plans are for different targets: A {a.target.name} ({target_fingerprint(a)}), "
                        f"B {b.target.name} ({target_fingerprint(b)}); they are diffed anyway")
    return rows, warnings


def _layout(a: Plan, b: Plan) -> list[Row]:
    return _rows(*(_row(f, getattr(a.layout, f), getattr(b.layout, f)) for f in PlanLayout.model_fields))


def _where(plan: Plan) -> dict[str, tuple[int, int]]:
    return {n: (r, c) for r, chunks in enumerate(plan.stages.chunks) for c, names in enumerate(chunks) for n in names}


def _moves(names: list[str], sign: str, word: str, other: dict[str, tuple[int, int]]) -> list[str]:
    groups: dict[tuple[int, int] | None, list[str]] = defaultdict(list)
    for n in names:
        groups[other.get(n)].append(n)
    return [f"{sign}{compact(ns)}" + (f" ({word} pp {k[0]} chunk {k[1]})" if k else "") for k, ns in groups.items()]


def _stages(a: Plan, b: Plan) -> list[Row]:
    sa, sb, wa, wb = a.stages, b.stages, _where(a), _where(b)
    ca = {(r, c): names for r, chunks in enumerate(sa.chunks) for c, names in enumerate(chunks)}
    cb = {(r, c): names for r, chunks in enumerate(sb.chunks) for c, names in enumerate(chunks)}
    rows = _rows(_row("placement", sa.placement, sb.placement))
    for r, c in sorted(ca | cb):
        la, lb = ca.get((r, c)), cb.get((r, c))
        if la is not None and lb is not None and la != lb:
            change = _moves([n for n in lb if n not in la], "+", "from", wa) + \
                _moves([n for n in la if n not in lb], "-", "to", wb)
            rows.append(Row(f"pp {r} chunk {c} · layers", la, lb, "; ".join(change) or "reordered"))
        else:
            rows += _rows(_row(f"pp {r} chunk {c} · layers", la, lb))
        if la is not None and lb is not None:
            rows += _rows(_row(f"pp {r} chunk {c} · time per micro-batch", sa.chunk_time_s[r][c],
                               sb.chunk_time_s[r][c], unit="s"))
    return rows + _rows(_row("imbalance (slowest chunk over the mean)", 100 * sa.imbalance, 100 * sb.imbalance,
                             unit="%"),
                        _row("empty layers", sa.empty_layers, sb.empty_layers))


def _memory(a: Plan, b: Plan) -> list[Row]:
    rows = _rows(_row("budget", a.memory.budget_bytes / GIB, b.memory.budget_bytes / GIB, unit="GiB"),
                 _row("recompute asked", a.memory.recompute, b.memory.recompute),
                 _row("precision", a.memory.precision.short(), b.memory.precision.short()))
    ma, mb = {m.pp_rank: m for m in a.memory.ranks}, {m.pp_rank: m for m in b.memory.ranks}
    for r in sorted(ma | mb):
        x, y = ma.get(r), mb.get(r)
        if x is None or y is None:  # a PP rank of one plan only: its total
            rows += _rows(_row(f"pp {r} · total", x and x.total_bytes / GIB, y and y.total_bytes / GIB, unit="GiB"))
            continue
        rows += _rows(_row(f"pp {r} · recompute", x.recompute, y.recompute),
                      *(_row(f"pp {r} · {label}", getattr(x, f) / GIB, getattr(y, f) / GIB, unit="GiB")
                        for label, f in (*MEMORY_TERMS, ("total", "total_bytes"))),
                      _row(f"pp {r} · in-flight micro-batches", x.in_flight_microbatches, y.in_flight_microbatches))
        da = {(d.chunk, d.kind): (d.recomputed, d.swapped) for d in x.decisions}
        db = {(d.chunk, d.kind): (d.recomputed, d.swapped) for d in y.decisions}
        for c, kind in sorted(da | db):
            (rec_a, swap_a), (rec_b, swap_b) = da.get((c, kind), ([], [])), db.get((c, kind), ([], []))
            rows += _rows(_row(f"pp {r} chunk {c} {kind} · ops recomputed", sorted(rec_a), sorted(rec_b)),
                          _row(f"pp {r} chunk {c} {kind} · ops swapped", sorted(swap_a), sorted(swap_b)))
    return rows


def _schedule(a: Plan, b: Plan) -> list[Row]:
    rows = _rows(_row("kind", a.schedule.kind, b.schedule.kind))
    aa, ab = a.schedule.actions, b.schedule.actions
    for r in range(max(len(aa), len(ab))):
        xa = list(aa[r]) if r < len(aa) else None
        xb = list(ab[r]) if r < len(ab) else None
        rows += _rows(_row(f"pp {r} · actions", None if xa is None else len(xa), None if xb is None else len(xb)))
        if xa is not None and xb is not None and xa != xb:
            i = next((k for k, (p, q) in enumerate(zip(xa, xb)) if p != q), min(len(xa), len(xb)))
            lo, hi = max(0, i - CONTEXT[0]), i + CONTEXT[1]
            rows.append(Row(f"pp {r} · first difference", xa[lo:hi], xb[lo:hi],
                            f"at action {i} (from 0); actions {lo}..{hi - 1} shown"))
    return rows


def _comm(a: Plan, b: Plan) -> list[Row]:
    rows = _rows(_row("dispatcher", a.comm.dispatcher, b.comm.dispatcher),
                 _row("overlap", sorted(a.comm.overlap), sorted(b.comm.overlap)))
    ca, cb = a.prediction.comm, b.prediction.comm
    for k in dict.fromkeys([*ca, *cb]):
        x, y = ca.get(k), cb.get(k)
        pct = [None if v is None or v.overlap_rate is None else 100 * v.overlap_rate for v in (x, y)]
        rows += _rows(_row(f"{k} · total", x and x.total_s, y and y.total_s, unit="s"),
                      _row(f"{k} · exposed", x and x.exposed_s, y and y.exposed_s, unit="s", better="lower"),
                      _row(f"{k} · overlap rate", *pct, unit="%", better="higher" if None not in pct else None))
    return rows


def _prediction(a: Plan, b: Plan) -> list[Row]:
    pa, pb = a.prediction, b.prediction
    rows = _rows(_row("step time", pa.step_time_s, pb.step_time_s, unit="s", better="lower"),
                 _row("tokens/s", pa.tokens_per_s, pb.tokens_per_s, better="higher"),
                 _row("MFU", 100 * pa.mfu, 100 * pb.mfu, unit="%", better="higher"),
                 _row("HFU (counts recompute)", 100 * pa.hfu, 100 * pb.hfu, unit="%"),
                 _row("bubble", 100 * pa.bubble, 100 * pb.bubble, unit="%", better="lower"))
    ka, kb = pa.peak_memory_bytes, pb.peak_memory_bytes
    rows += _rows(_row("peak memory, max over PP ranks", max(ka) / GIB, max(kb) / GIB, unit="GiB", better="lower"))
    for r in range(max(len(ka), len(kb))):
        rows += _rows(_row(f"pp {r} · peak memory", ka[r] / GIB if r < len(ka) else None,
                           kb[r] / GIB if r < len(kb) else None, unit="GiB", better="lower"))
    return rows


def diff_plans(a: Plan, b: Plan, *, label_a: str = "A", label_b: str = "B") -> PlanDiff:
    """The differences of plan B from plan A, section by section (see the module docstring): model and target
    (name, fingerprint, differing spec and target fields; a warning when the models or targets differ), layout
    (``PlanLayout``'s fields), stages (per (pp rank, vpp chunk): layers added, removed or moved, chunk seconds per
    micro-batch; imbalance %; empty layers), memory (GiB per device; per PP rank recompute mode and, for the
    per-tensor modes, ops recomputed / swapped per (chunk, layer kind)), schedule (kind; per PP rank the number of
    actions and the first differing position with ``CONTEXT`` actions around it, in torch.distributed.pipelining
    notation, https://pytorch.org/docs/stable/distributed.pipelining.html), communication (dispatcher, overlap
    mechanisms, per comm class total / exposed seconds and overlap rate = 1 − exposed / total, as
    ``PlanCommClass``) and prediction (step time s, tokens/s, MFU / HFU / bubble %, peak memory GiB, the maximum
    and per PP rank; with the better plan; MFU as ``moeplan.plan.MFU_DEFINITION``). Raises nothing on valid plans."""
    model_rows, warnings = _model_target(a, b)
    parts = (("model and target", model_rows), ("layout", _layout(a, b)), ("stages", _stages(a, b)),
             ("memory per device", _memory(a, b)), ("schedule", _schedule(a, b)),
             ("communication per step", _comm(a, b)), ("prediction", _prediction(a, b)))
    return PlanDiff(label_a, label_b, tuple(warnings), tuple(Section(n, tuple(rows)) for n, rows in parts if rows))


def diff_json(d: PlanDiff) -> dict:
    """``d`` as a JSON-ready dict: ``a``, ``b``, ``equal``, ``rel_tol``, ``warnings`` and ``sections``, each
    ``{"name", "rows": [{"field", "a", "b", "change", "unit", "delta", "rel", "better"}]}``."""
    return {"a": d.a, "b": d.b, "equal": d.equal, "rel_tol": REL_TOL, "warnings": list(d.warnings),
            "sections": [{"name": s.name, "rows": [asdict(r) for r in s.rows]} for s in d.sections]}


def render_diff(console: Console, d: PlanDiff, *, summary: bool = False) -> None:
    """Print ``d``: the warnings, the prediction section first (what a reader wants to know: which plan is faster,
    by how much, in how much memory), then one rich table per other section (field with its unit, A, B, change,
    better), or one line when the plans are equal. ``summary``: the prediction, then one line per other section
    with the number of its rows that differ (a 718B stage split moves hundreds of layers)."""
    console.print(Text(f"A: {d.a}\nB: {d.b}"))
    for w in d.warnings:
        console.print(Text(f"warning: {w}", style="yellow"))
    if d.equal:
        console.print(f"plans are equal (floats within a relative tolerance of {REL_TOL:g})")
        return
    first = sorted(d.sections, key=lambda s: s.name != "prediction")
    for s in first:
        if summary and s.name != "prediction":
            console.print(Text(f"{s.name}: {len(s.rows)} row{'s' * (len(s.rows) != 1)} differ"), soft_wrap=True)
            continue
        t = Table(title=s.name)
        for col in ("field", "A", "B", "change (B vs A)"):
            t.add_column(col)
        ranked = any(r.better for r in s.rows)
        if ranked:
            t.add_column("better")
        for r in s.rows:
            cells = [f"{r.field} ({r.unit})" if r.unit else r.field, fmt(r.a), fmt(r.b), r.change]
            t.add_row(*map(Text, cells + ([r.better or ""] if ranked else [])))
        console.print(t)
    if summary and any(s.name != "prediction" for s in first):
        console.print("(`moeplan diff` without --summary lists the rows)", soft_wrap=True)
