"""Predicted vs measured: a plan's prediction against a run's metrics (``moeplan compare PLAN run.jsonl``).

Predicted figures come from the plan only: ``prediction`` (step time, exposed communication per class),
``sharding.layers`` (per layer kind and micro-batch on one device: forward, backward input/weight seconds, in-layer
collectives with their bytes and seconds, saved bytes), ``sharding.p2p``, ``memory.ranks`` (activation bytes and
recompute mode per PP rank) and the schedule (number of micro-batches and sends). Per PP rank and step:

- ``F`` = M · Σ over the rank's layers (fwd_s + forward collectives); ``B`` = M · Σ (bwd_input_s + bwd_weight_s +
  backward collectives), plus fwd_s under full recompute (selective recompute seconds are not in the plan);
- ``OPTIMIZER`` = ``prediction.exposed_comm_s["dp"] + prediction.optimizer_s`` (gradient reduce-scatter, parameter
  all-gather, Adam update: the tail after the last backward, as ``passes/simulate.py`` prices it);
- ``comm pp`` = ``prediction.exposed_comm_s["pp"]``, the simulated wait for p2p transfers; the measured figure is the
  time spent in RECV actions, which also holds the wait for the producing stage (pipeline bubble);
- bytes per class: in-layer collectives M · Σ bytes; ``pp`` the p2p message bytes times the rank's SENDs; ``dp``
  (rows named ``grad sync``; predicted when the experts reduce over the same group as the dense parameters, ep = 1)
  the runtime's fp32 reduce-scatter input and all-gather shard of the rank's parameters, ``4·P·(1 + 1/(dp·cp))``;
- peak saved-activation bytes on the device: ``memory.ranks[r].activation_bytes``; swapped to host (a per-tensor
  plan): per chunk, its layers' swapped bytes (``memory.ranks[r].decisions``) times the micro-batches the action
  list keeps in flight, at the fullest point (:func:`predicted_host_bytes`).

Byte figures of the plan are in its target's training dtype (``Target.training_dtype``: fp32 for a calibrated cpu
target, bf16 for accelerators and plans written before the field existed); the runtime trains in fp32, so predicted
activation and communication bytes are scaled by ``RUNTIME_BYTES / plan.target.dtype_bytes`` (1 for an fp32 plan).

Measured figures: the median over steps ``first_step..N`` (default 5, or every step after the first when the run is
shorter) of each step's value; per-PP-rank figures average the ranks of that PP rank (they are replicas). A run with
``--meter-every K > 1`` has unmetered steps: times (step, actions, p2p, optimizer) come from those, which the
saved-tensor hooks and the collective meter did not slow down, and the saved-activation peaks and in-layer
collectives from the metered ones.

Busy machine (:func:`busy_warning`): over the same steps, the CPU time other processes used on rank 0's machine
(its busy CPU-seconds from /proc/stat minus the CPU seconds of the run's ranks there: global ranks 0 to
``LOCAL_WORLD_SIZE − 1``, as torchrun numbers them, or every rank of a local run) plus the time the hypervisor
stole, beyond the CPUs the run leaves idle (``cpus − min(ranks, cpus)``), as a share of the CPUs the run's ranks
could use. Above ``BUSY_SHARE`` the measured times are not comparable with the prediction, which assumes each rank
has its CPU to itself (each emulated device is one single-threaded process, ``OMP_NUM_THREADS=1``).
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from moeplan.cost_models.timeline import parse_action
from moeplan.errors import PlanError
from moeplan.ir import kind_of
from moeplan.plan import Plan
from moeplan.render import plural
from moeplan.runtime.metrics import StepRecord

RUNTIME_BYTES = 4
IN_LAYER = ("tp", "ep", "cp")
ROW_NAMES = {"dp": "grad sync"}
"""Row names of comm classes that differ from the class: the runtime's ``dp`` class is every gradient
synchronisation of the optimizer phase (the DP/CP reduce-scatter and parameter all-gather, and the all-reduce of
tied embedding gradients between PP ranks, which runs with dp = 1 too)."""
BUSY_SHARE = 0.10
"""Share of the run's CPUs taken by other work above which compare warns: a single-threaded rank that loses a share
s of its CPU runs about 1/(1 − s) times slower, so 10% makes measured times about 11% longer, an error as large as
the ones the comparison is read for."""


@dataclass(frozen=True)
class Row:
    """One compared quantity: ``unit`` is ``s`` or ``bytes``; ``predicted`` None when the plan does not say."""

    quantity: str
    unit: str
    predicted: float | None
    measured: float

    @property
    def ratio(self) -> float | None:
        return None if not self.predicted else self.measured / self.predicted


def read_records(path: str | Path) -> list[StepRecord]:
    """The step records of a metrics JSONL file; PlanError (one line) for a missing or malformed file."""
    path = Path(path)
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        records = [StepRecord.from_json(ln) for ln in lines]
    except OSError as e:
        raise PlanError(f"metrics={str(path)!r}: cannot read ({e.strerror})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise PlanError(f"metrics={str(path)!r}: not a moeplan run metrics file ({e})") from None
    if not records:
        raise PlanError(f"metrics={str(path)!r}: holds no steps")
    return records


def _window(records: list[StepRecord], first_step: int) -> list[StepRecord]:
    chosen = [r for r in records if r.step >= first_step]
    return chosen or records[1:] or records


def _byte_scale(plan: Plan) -> float:
    """Runtime bytes per plan byte: the fp32 runtime over the plan target's training dtype."""
    return RUNTIME_BYTES / plan.target.dtype_bytes


def _rank_layers(plan: Plan, pp_rank: int) -> list[str]:
    return [n for chunk in plan.stages.chunks[pp_rank] for n in chunk]


def predicted_rank(plan: Plan, pp_rank: int) -> dict[str, float]:
    """Predicted per-step seconds (F, B, OPTIMIZER, comm:<class>) and bytes (bytes:<class>) of one PP rank."""
    spec, m = plan.model.spec, plan.layout.num_microbatches
    full = plan.memory.ranks[pp_rank].recompute == "full"
    scale = _byte_scale(plan)
    out: dict[str, float] = defaultdict(float)
    for name in _rank_layers(plan, pp_rank):
        cost = plan.sharding.layers[kind_of(spec, name).value]
        out["F"] += m * cost.fwd_s
        out["B"] += m * (cost.bwd_input_s + cost.bwd_weight_s + (cost.fwd_s if full else 0.0))
        for c in cost.collectives:
            out["F" if c.phase == "fwd" else "B"] += m * c.time_s
            out[f"comm:{c.comm_class}"] += m * c.time_s
            out[f"bytes:{c.comm_class}"] += m * c.bytes * scale
    sends = sum(1 for a in plan.schedule.actions[pp_rank] if parse_action(a).kind.startswith("SEND"))
    out["bytes:pp"] += sends * plan.sharding.p2p.bytes * scale
    if plan.layout.pp > 1:
        out["comm:pp"] = plan.prediction.exposed_comm_s.get("pp", 0.0)
    group = plan.layout.dp * plan.layout.cp
    if group > 1 and plan.layout.ep == 1:
        params = sum(plan.sharding.layers[kind_of(spec, n).value].params for n in _rank_layers(plan, pp_rank))
        out["bytes:dp"] = RUNTIME_BYTES * params * (1 + 1 / group)
    out["OPTIMIZER"] = plan.prediction.exposed_comm_s.get("dp", 0.0) + plan.prediction.optimizer_s
    return dict(out)


def measured_rank(timed: list[StepRecord], metered: list[StepRecord], pp_rank: int) -> dict[str, float]:
    """Median of the mean over the ranks of ``pp_rank`` of each per-step figure: times over ``timed``, the
    saved-activation peak and the in-layer collective seconds over ``metered``."""
    out = _median_rank(timed, pp_rank)
    for key, value in _median_rank(metered, pp_rank).items():
        if key in ("peak_saved_bytes", "peak_host_bytes") or (key.startswith("comm:") and key[5:] in IN_LAYER):
            out[key] = value
    return out


def _median_rank(records: list[StepRecord], pp_rank: int) -> dict[str, float]:
    series: dict[str, list[float]] = defaultdict(list)
    for rec in records:
        ranks = [r for r in rec.ranks if r.pp_rank == pp_rank]
        keys = {k for r in ranks for k in r.action_s} | {f"comm:{k}" for r in ranks for k in r.comm_s} \
            | {f"bytes:{k}" for r in ranks for k in r.comm_bytes} | {"peak_saved_bytes", "peak_host_bytes"}
        for key in keys:
            values = [_value(r, key) for r in ranks]
            series[key].append(sum(values) / len(values))
    return {k: statistics.median(v) for k, v in series.items()}


def _value(rank, key: str) -> float:
    if key in ("peak_saved_bytes", "peak_host_bytes"):
        return float(getattr(rank, key))
    if key.startswith("comm:"):
        return rank.comm_s.get(key[5:], 0.0)
    if key.startswith("bytes:"):
        return float(rank.comm_bytes.get(key[6:], 0))
    return rank.action_s.get(key, 0.0)


def compare(plan: Plan, records: list[StepRecord], *, first_step: int = 5) -> list[Row]:
    """All compared rows: step time and tokens/s, then per PP rank actions, comm seconds and bytes, peak saved
    activation bytes. Raises PlanError when the records come from another layout (rank count differs)."""
    if any(len(r.ranks) != plan.layout.num_devices for r in records):
        raise PlanError(f"metrics: the run has {len(records[0].ranks)} ranks, the plan {plan.layout.num_devices}")
    window = _window(records, first_step)
    timed = [r for r in window if not r.metered] or window
    metered = [r for r in window if r.metered] or [r for r in records if r.metered] or window
    rows = [Row("step time", "s", plan.prediction.step_time_s, statistics.median(r.step_time_s for r in timed)),
            Row("tokens/s", "tokens/s", plan.prediction.tokens_per_s,
                statistics.median(r.tokens_per_s for r in timed))]
    for pp_rank in range(plan.layout.pp):
        pred, meas = predicted_rank(plan, pp_rank), measured_rank(timed, metered, pp_rank)
        tag = f"pp{pp_rank}"
        for kind in ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "SEND_WAIT", "OPTIMIZER"):
            if kind in pred or kind in meas:
                rows.append(Row(f"{tag} {kind}", "s", pred.get(kind), meas.get(kind, 0.0)))
        for cls in (*IN_LAYER, "pp", "dp"):
            if f"comm:{cls}" in pred or f"comm:{cls}" in meas:
                rows.append(Row(f"{tag} comm {ROW_NAMES.get(cls, cls)}", "s", pred.get(f"comm:{cls}"),
                                meas.get(f"comm:{cls}", 0.0)))
        for cls in (*IN_LAYER, "pp", "dp"):
            if f"bytes:{cls}" in pred or f"bytes:{cls}" in meas:
                rows.append(Row(f"{tag} bytes {ROW_NAMES.get(cls, cls)}", "bytes", pred.get(f"bytes:{cls}"),
                                meas.get(f"bytes:{cls}", 0.0)))
        rows.append(Row(f"{tag} peak saved activations", "bytes",
                        plan.memory.ranks[pp_rank].activation_bytes * _byte_scale(plan),
                        meas.get("peak_saved_bytes", 0.0)))
        rows.append(Row(f"{tag} peak swapped activations (host)", "bytes",
                        predicted_host_bytes(plan, pp_rank) * _byte_scale(plan), meas.get("peak_host_bytes", 0.0)))
    return [r for r in rows if r.measured or r.predicted]


def busy_warning(records: list[StepRecord], *, first_step: int = 5) -> str | None:
    """One line when rank 0's machine was busy with other work during the compared steps (see the module docstring
    for the measure and ``BUSY_SHARE`` for the threshold), or when the run had more ranks than CPUs there; None when
    neither, or when the metrics do not say (files written before the host figures, or not on Linux)."""
    window = [r for r in _window(records, first_step) if r.host is not None]
    if not window or any(rank.cpu_s < 0 for r in window for rank in r.ranks):
        return None
    cpus = max(r.host.cpus for r in window)
    local = window[0].host.local_ranks or len(window[0].ranks)
    wall = sum(r.host.wall_s for r in window)
    run_cpu = sum(rank.cpu_s for r in window for rank in r.ranks[:local])
    others = max(0.0, sum(r.host.busy_cpu_s for r in window) - run_cpu) / wall
    stolen = sum(r.host.steal_cpu_s for r in window) / wall
    usable = min(local, cpus)
    share = max(0.0, others + stolen - (cpus - usable)) / usable
    notes = []
    if share > BUSY_SHARE:
        notes.append(f"other processes used {others:.2f} and the hypervisor stole {stolen:.2f} of the "
                     f"{plural(cpus, 'CPU')}, "
                     f"{share:.0%} of the CPU time the run's {local} ranks could use (warning above "
                     f"{BUSY_SHARE:.0%})")
    if local > cpus:
        notes.append(f"the run's {local} ranks shared {plural(cpus, 'CPU')}")
    if not notes:
        return None
    return (f"the machine was busy during steps {window[0].step}-{window[-1].step}: " + "; ".join(notes) +
            f"; 1-minute load average up to {max(r.host.load_1m for r in window):.1f}. Measured times are longer than "
            f"on an idle machine and not comparable with the prediction")


def predicted_host_bytes(plan: Plan, pp_rank: int) -> float:
    """Bytes a per-tensor plan keeps swapped to host on one device of PP rank ``pp_rank`` at the fullest in-flight
    point of its action list (0 for a plan without swaps): per chunk, its layers' swapped bytes times the
    micro-batches in flight."""
    from moeplan.passes.plan_memory import in_flight_vectors
    from moeplan.runtime.build import stage_ids

    rank, chunks = plan.memory.ranks[pp_rank], plan.stages.chunks[pp_rank]
    per_chunk = [0.0] * len(chunks)
    for d in rank.decisions:
        per_chunk[d.chunk] += d.swapped_bytes * sum(1 for n in chunks[d.chunk] if kind_of(plan.model.spec, n).value
                                                    == d.kind)
    if not any(per_chunk):
        return 0.0
    vectors = in_flight_vectors(tuple(plan.schedule.actions[pp_rank]), stage_ids(plan, pp_rank))
    return max(sum(n * b for n, b in zip(v, per_chunk)) for v in vectors)


def rows_json(rows: list[Row]) -> list[dict]:
    return [{"quantity": r.quantity, "unit": r.unit, "predicted": r.predicted, "measured": r.measured,
             "ratio": r.ratio} for r in rows]


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "s":
        return f"{value * 1e3:,.2f} ms"
    if unit == "bytes":
        return f"{value / 2**20:,.3f} MiB"
    return f"{value:,.0f}"


def render_rows(console, rows: list[Row], *, title: str) -> None:
    """A rich table: quantity, predicted, measured, measured / predicted."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("quantity", "predicted", "measured", "measured/predicted"):
        table.add_column(col, justify="left" if col == "quantity" else "right")
    for r in rows:
        table.add_row(r.quantity, _fmt(r.predicted, r.unit), _fmt(r.measured, r.unit),
                      "—" if r.ratio is None else f"{r.ratio:.2f}")
    console.print(table)
