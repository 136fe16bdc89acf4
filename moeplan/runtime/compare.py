"""Predicted vs measured: a plan's prediction against a run's metrics (``moeplan compare PLAN run.jsonl``).

Predicted figures come from the plan only: ``prediction`` (step time, exposed communication per class),
``sharding.layers`` (per layer kind and micro-batch on one device: forward, backward input/weight seconds, in-layer
collectives with their bytes and seconds, saved bytes), ``sharding.p2p``, ``memory.ranks`` (activation bytes and
recompute mode per PP rank) and the schedule (number of micro-batches and sends). Per PP rank and step:

- per compute action of the rank's action list, over the layers of its stage: ``F`` Σ (fwd_s + forward
  collectives); ``B`` Σ (bwd_input_s + bwd_weight_s + backward collectives), plus the forward under full recompute
  (selective recompute seconds are not in the plan); ``I`` the same without bwd_weight_s, ``W`` Σ bwd_weight_s
  (plus bwd_input_s and the backward collectives on a target whose ``runtime.weight_pass`` is ``whole-backward``);
  summed per kind. An ``OVERLAP_F_B`` pair is the simulated pair's duration (``replay.plan_timeline``: how much of
  each half's communication hides under the other's compute is the simulation's figure);
- ``OPTIMIZER`` = ``prediction.exposed_comm_s["dp"] + prediction.optimizer_s`` (gradient reduce-scatter, parameter
  all-gather, Adam update: the tail after the last backward, as ``cost_models/step.py`` prices it);
- ``comm pp`` = ``prediction.exposed_comm_s["pp"]``, the simulated wait for p2p transfers; the measured figure is the
  time spent in RECV actions, which also holds the wait for the producing stage (pipeline bubble);
- bytes per class: in-layer collectives M · Σ bytes; ``pp`` the p2p message bytes times the rank's SENDs; ``dp``
  (rows named ``grad sync``; predicted when the experts reduce over the same group as the dense parameters, ep = 1)
  the runtime's fp32 reduce-scatter input and all-gather shard of the rank's parameters, ``4·P·(1 + 1/(dp·cp))``;
- peak saved-activation bytes on the device: ``memory.ranks[r].activation_bytes`` plus its backward working set
  (``working_set_bytes``: re-made, fetched back and prefetched tensors, which the meter counts); swapped to host (a
  per-tensor plan): per chunk, its layers' swapped bytes (``memory.ranks[r].decisions``) times the micro-batches
  the action list keeps in flight, at the fullest point (:func:`predicted_host_bytes`).

- model states on the device (rows ``ppN params``, ``ppN grads``, ``ppN optimizer``): ``memory.ranks[r]``'s
  ``params_bytes``, ``grads_bytes`` and ``optimizer_bytes`` against the runtime's meter (``RankStep.params_bytes``
  etc., moeplan.runtime.metrics.model_state_bytes; measured None for metrics written before the fields). The
  runtime keeps fp32 parameters, fp32 ``.grad`` tensors, an fp32 master shard and fp32 moments whatever the plan's
  precision, so each term is scaled by the runtime's bytes per parameter over the plan's
  (:func:`_state_scales`; 1 for an fp32 plan on the ``cpu`` target).

Byte figures of the plan are in its target's training dtype (``Target.training_dtype``: fp32 for a calibrated cpu
target, bf16 for accelerators and plans written before the field existed); the runtime trains in fp32, so predicted
activation and communication bytes are scaled by ``RUNTIME_BYTES / plan.target.dtype_bytes`` (1 for an fp32 plan).

Measured figures: the median over steps ``first_step..N`` (default 5, or every step after the first when the run is
shorter; a given ``first_step`` past the last step is refused) of each step's value; per-PP-rank figures average the
ranks of that PP rank (they are replicas). A run with ``--meter-every K > 1`` has unmetered steps: times (step,
actions, p2p, optimizer) come from those, which the saved-tensor hooks and the collective meter did not slow down,
and the saved-activation peaks and in-layer collectives from the metered ones.

Per comm class (:func:`comm_class_rows`, the second table): bytes one device sends per step over the intra-node and
the inter-node link (``prediction.comm[cls].intra_bytes`` / ``inter_bytes`` against the mean over ranks of
``RankStep.comm_tier_bytes``, which the runtime tallies for its in-layer classes tp, ep and cp), the exposed seconds
(``prediction.comm[cls].exposed_s``, averaged over PP ranks, against the mean over ranks of ``RankStep.comm_s``: the
time the compute stream waited on the class) and the overlap rate (``prediction.comm[cls].overlap_rate`` against
``1 − Σ comm_s / Σ comm_busy_s`` over the ranks and steps, ``comm_busy_s`` being the seconds the class's collectives
were in flight). The in-layer classes' seconds come from the metered steps, the others' from the unmetered ones.

Busy machine (:func:`busy_warning`): over the same steps, the CPU time other processes used on rank 0's machine
(its busy CPU-seconds from /proc/stat minus the CPU seconds of the run's ranks there: global ranks 0 to
``LOCAL_WORLD_SIZE − 1``, as torchrun numbers them, or every rank of a local run) plus the time the hypervisor
stole, beyond the CPUs the run leaves idle (``cpus − min(ranks, cpus)``), as a share of the CPUs the run's ranks
could use. Above ``BUSY_SHARE`` the measured times are not comparable with the prediction, which assumes each rank
has its CPU to itself (each emulated device is one single-threaded process, ``OMP_NUM_THREADS=1``).
"""
from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from moeplan.actions import parse_action
from moeplan.errors import PlanError
from moeplan.files import read_text
from moeplan.ir import kind_of
from moeplan.plan import Plan
from moeplan.render import plural
from moeplan.runtime.metrics import COMM_CLASSES, TIERS, StepRecord

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
    measured: float | None  # None: the run does not measure it

    @property
    def ratio(self) -> float | None:
        return None if not self.predicted or self.measured is None else self.measured / self.predicted


def read_records(path: str | Path) -> list[StepRecord]:
    """The step records of a metrics JSONL file; PlanError (one line) for a missing or malformed file."""
    path = Path(path)
    lines = read_text(path, field="metrics", error=PlanError).splitlines()  # a FIFO or a device is refused
    records = []
    for n, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            records.append(StepRecord.from_json(ln))
        except (ValueError, KeyError, TypeError) as e:
            raise PlanError(f"metrics={str(path)!r}: line {n} is not a moeplan run metrics record ({e})") from None
    if not records:
        raise PlanError(f"metrics={str(path)!r}: holds no steps")
    return records


#: the first compared step when none is given (the steps before it warm up: allocator, gloo connections)
DEFAULT_FIRST_STEP = 5


def measured_window(records: list[StepRecord], first_step: int | None = None) -> list[StepRecord]:
    """The records compared: the steps from ``first_step`` on. ``None``: from :data:`DEFAULT_FIRST_STEP` on, or
    every step after the first in a shorter run (the one step of a 1-step run). Raises PlanError when a given
    ``first_step`` is past the run's last step (its median would be of other steps)."""
    if first_step is None:
        return [r for r in records if r.step >= DEFAULT_FIRST_STEP] or records[1:] or records
    chosen = [r for r in records if r.step >= first_step]
    if not chosen:
        last = max((r.step for r in records), default=0)
        raise PlanError(f"first_step={first_step}: the metrics end at step {last}; give a step from 1 to {last}")
    return chosen


def _split_window(records: list[StepRecord], first_step: int | None
                  ) -> tuple[list[StepRecord], list[StepRecord], list[StepRecord]]:
    """(window, timed, metered): the :func:`measured_window`; its unmetered steps, whose times the meters did not
    slow (the whole window when every step was metered); its metered steps, which hold the saved-activation peaks
    and in-layer collectives (the run's metered steps, or the window, when the window has none)."""
    window = measured_window(records, first_step)
    timed = [r for r in window if not r.metered] or window
    metered = [r for r in window if r.metered] or [r for r in records if r.metered] or window
    return window, timed, metered


def _byte_scale(plan: Plan) -> float:
    """Runtime bytes per plan byte: the fp32 runtime over the plan target's training dtype."""
    return RUNTIME_BYTES / plan.target.dtype_bytes


STATE_ROWS = (("params", "params_bytes"), ("grads", "grads_bytes"), ("optimizer", "optimizer_bytes"))
"""The model-state rows per PP rank: (row name, field of PlanRankMemory and of RankStep)."""


def _state_scales(plan: Plan) -> tuple[float, float, float]:
    """Runtime bytes per plan byte of (params, grads, optimizer): the runtime's bytes per parameter (fp32
    weights and ``.grad``, an fp32 master clone and fp32 moments: ``state_bytes_per_param(4, fp32, always_master)``)
    over the plan's (its target's training dtype, ``memory.precision``, ``target.runtime.master_copy``). Sharding
    is the plan's."""
    from moeplan.cost_models.memory import state_bytes_per_param
    from moeplan.state import Precision

    pr = plan.memory.precision
    planned = state_bytes_per_param(plan.target.dtype_bytes, Precision(
        grad_dtype=pr.grad_dtype, main_params_dtype=pr.main_params_dtype, moments_dtype=pr.moments_dtype,
        distributed_optimizer=pr.distributed_optimizer), plan.target.runtime.master_copy == "always")
    runtime = state_bytes_per_param(RUNTIME_BYTES, Precision(), True)
    return tuple(r / p if p else 1.0 for r, p in zip(runtime, planned))


def _rank_layers(plan: Plan, pp_rank: int) -> list[str]:
    return [n for chunk in plan.stages.chunks[pp_rank] for n in chunk]


def predicted_rank(plan: Plan, pp_rank: int) -> dict[str, float]:
    """Predicted per-step seconds (F, B, OPTIMIZER, comm:<class>) and bytes (bytes:<class>) of one PP rank."""
    from moeplan.replay import plan_timeline
    from moeplan.runtime.build import stage_ids
    from moeplan.runtime.executor import stage_layers

    spec, m = plan.model.spec, plan.layout.num_microbatches
    full = plan.memory.ranks[pp_rank].recompute == "full"
    whole = plan.target.runtime.weight_pass == "whole-backward"
    scale = _byte_scale(plan)
    out: dict[str, float] = defaultdict(float)
    per_action: dict[tuple[str, int], float] = defaultdict(float)  # (F/B/I/W, stage) -> seconds of one action
    for stage in stage_ids(plan, pp_rank):
        for name in stage_layers(plan, stage):
            cost = plan.sharding.layers[kind_of(spec, name).value]
            fwd_c = sum(c.time_s for c in cost.collectives if c.phase == "fwd")
            bwd_c = sum(c.time_s for c in cost.collectives if c.phase != "fwd")
            recompute = cost.fwd_s + fwd_c if full else 0.0
            per_action[("F", stage)] += cost.fwd_s + fwd_c
            per_action[("B", stage)] += cost.bwd_input_s + cost.bwd_weight_s + bwd_c + recompute
            per_action[("I", stage)] += cost.bwd_input_s + bwd_c + recompute
            per_action[("W", stage)] += cost.bwd_weight_s + (cost.bwd_input_s + bwd_c if whole else 0.0)
            for c in cost.collectives:
                out[f"comm:{c.comm_class}"] += m * c.time_s
                out[f"bytes:{c.comm_class}"] += m * c.bytes * scale
    pairs = []
    for a in map(parse_action, plan.schedule.actions[pp_rank]):
        if a.parts:
            pairs.append([str(p) for p in a.parts])
        elif (a.kind, a.stage) in per_action:
            out[a.kind] += per_action[(a.kind, a.stage)]
    if pairs:  # only the simulation knows how much of a pair's communication hides under the other half
        spans = {e.action: (e.start_s, e.end_s) for e in plan_timeline(plan).timeline.events
                 if e.rank == pp_rank and e.stream == "compute"}
        out["OVERLAP_F_B"] = sum(max(spans[t][1] for t in texts) - min(spans[t][0] for t in texts)
                                 for texts in pairs)
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
    for _, key in STATE_ROWS:  # measured at every step (after its optimizer step); absent in older metrics
        values = []
        for rec in timed + metered:
            ranks = [r for r in rec.ranks if r.pp_rank == pp_rank]
            if ranks and all(getattr(r, key) >= 0 for r in ranks):
                values.append(sum(getattr(r, key) for r in ranks) / len(ranks))
        if values:
            out[key] = statistics.median(values)
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


def compare(plan: Plan, records: list[StepRecord], *, first_step: int | None = None) -> list[Row]:
    """All compared rows: step time and tokens/s, then per PP rank actions, comm seconds and bytes, peak saved
    activation bytes, over :func:`measured_window`. Raises PlanError when the records come from another layout (rank
    count, or the ranks per PP rank, differ) or ``first_step`` is past the run."""
    if any(len(r.ranks) != plan.layout.num_devices for r in records):
        raise PlanError(f"metrics: the run has {len(records[0].ranks)} ranks, the plan {plan.layout.num_devices}")
    per_pp = plan.layout.num_devices // plan.layout.pp
    for rec in records:  # same rank count, another layout: the ranks' pp ranks differ (dp 2 against pp 2)
        found = sorted(Counter(r.pp_rank for r in rec.ranks).items())
        if found != [(p, per_pp) for p in range(plan.layout.pp)]:
            raise PlanError(f"metrics: step {rec.step} has ranks on pp ranks "
                            f"{', '.join(f'{p} ×{n}' for p, n in found)}; the plan has pp={plan.layout.pp}, {per_pp} "
                            f"rank(s) each: the metrics are of another layout")
    _, timed, metered = _split_window(records, first_step)
    rows = [Row("step time", "s", plan.prediction.step_time_s, statistics.median(r.step_time_s for r in timed)),
            Row("tokens/s", "tokens/s", plan.prediction.tokens_per_s,
                statistics.median(r.tokens_per_s for r in timed))]
    for pp_rank in range(plan.layout.pp):
        pred, meas = predicted_rank(plan, pp_rank), measured_rank(timed, metered, pp_rank)
        tag = f"pp{pp_rank}"
        for kind in ("F", "B", "I", "W", "OVERLAP_F_B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "SEND_WAIT",
                     "OPTIMIZER"):
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
                        (plan.memory.ranks[pp_rank].activation_bytes + plan.memory.ranks[pp_rank].working_set_bytes)
                        * _byte_scale(plan),
                        meas.get("peak_saved_bytes", 0.0)))
        rows.append(Row(f"{tag} peak swapped activations (host)", "bytes",
                        predicted_host_bytes(plan, pp_rank) * _byte_scale(plan), meas.get("peak_host_bytes", 0.0)))
        for (name, key), scale in zip(STATE_ROWS, _state_scales(plan)):
            rows.append(Row(f"{tag} {name}", "bytes", getattr(plan.memory.ranks[pp_rank], key) * scale,
                            meas.get(key)))
    return [r for r in rows if r.measured or r.predicted]


COMM_FIGURES = (("intra-node bytes", "bytes"), ("inter-node bytes", "bytes"), ("exposed", "s"),
                ("overlap rate", "rate"))
"""The figures of :func:`comm_class_rows` per comm class, with their units."""


def comm_class_rows(plan: Plan, records: list[StepRecord], *, first_step: int | None = None) -> list[Row]:
    """Per comm class (metrics.COMM_CLASSES order; a class the plan names or the run measured), the rows
    ``comm <class> <figure>`` of :data:`COMM_FIGURES`, predicted vs measured (module docstring). Bytes are per
    device and step, the plan's scaled to the fp32 runtime; a tier's measured bytes are None for a class whose
    tiers the runtime does not tally (pp, dp), an overlap rate None for a class that moved nothing."""
    window, timed, metered = _split_window(records, first_step)
    scale = _byte_scale(plan)
    rows: list[Row] = []
    for cls in COMM_CLASSES:
        pred = plan.prediction.comm.get(cls)
        steps = metered if cls in IN_LAYER else timed
        waited = [sum(r.comm_s.get(cls, 0.0) for r in rec.ranks) / len(rec.ranks) for rec in steps]
        busy = sum(r.busy_s(cls) for rec in steps for r in rec.ranks)
        tiers = {t: [sum(r.comm_tier_bytes.get(cls, {}).get(t, 0) for r in rec.ranks) / len(rec.ranks)
                     for rec in window] for t in TIERS}
        moved = pred is not None and (pred.total_s or pred.intra_bytes or pred.inter_bytes)
        if not moved and not busy and not any(any(v) for v in tiers.values()):
            continue
        tallied = cls in IN_LAYER
        rows += [
            Row(f"comm {cls} intra-node bytes", "bytes", pred and pred.intra_bytes * scale,
                statistics.median(tiers["intra"]) if tallied else None),
            Row(f"comm {cls} inter-node bytes", "bytes", pred and pred.inter_bytes * scale,
                statistics.median(tiers["inter"]) if tallied else None),
            Row(f"comm {cls} exposed", "s", pred and pred.exposed_s, statistics.median(waited)),
            Row(f"comm {cls} overlap rate", "rate", pred and pred.overlap_rate,
                1 - sum(r.comm_s.get(cls, 0.0) for rec in steps for r in rec.ranks) / busy if busy else None)]
    return rows


UNCALIBRATED_RATIO = 2.0
"""Measured / predicted step time (or its inverse) above which ``compare`` of a plan compiled for a shipped cpu target
points at ``moeplan calibrate``: the shipped figures are one machine's, and another machine may differ several-fold."""


def uncalibrated_warning(plan: Plan, rows: list[Row]) -> str | None:
    """One line when the measured step is off the prediction by more than :data:`UNCALIBRATED_RATIO` either way and
    the plan's target is a shipped cpu target as shipped (not a ``moeplan calibrate`` output): the likely cause and
    the fix; None otherwise."""
    from moeplan.targets import load_target, target_names

    step = next(r for r in rows if r.quantity == "step time")
    if plan.target.backend != "cpu" or plan.target.name not in target_names() or not step.predicted \
            or step.measured is None:
        return None
    if plan.target != load_target(plan.target.name, variant=plan.target.variant,
                                  devices_per_node=plan.target.devices_per_node,
                                  training_dtype=plan.target.training_dtype):
        return None  # a calibrated target, saved under a shipped name
    ratio = step.measured / step.predicted
    if 1 / UNCALIBRATED_RATIO <= ratio <= UNCALIBRATED_RATIO:
        return None
    return (f"the measured step is {ratio:.1f}x the predicted one, and the plan's target {plan.target.name!r} holds "
            f"the shipped figures, not this machine's: run `moeplan calibrate -o mine.yaml`, then compile with "
            f"`--target mine.yaml` (docs/runtime.md)")


def busy_warning(records: list[StepRecord], *, first_step: int | None = None) -> str | None:
    """One line when rank 0's machine was busy with other work during the compared steps (see the module docstring
    for the measure and ``BUSY_SHARE`` for the threshold), or when the run had more ranks than CPUs there; None when
    neither, or when the metrics do not say (files written before the host figures, or not on Linux)."""
    window = [r for r in measured_window(records, first_step) if r.host is not None]
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
    from moeplan.cost_models.memory import in_flight_vectors
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
    if unit == "rate":
        return f"{value:.0%}"
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


def render_comm_classes(console, rows: list[Row], *, title: str) -> None:
    """The rows of :func:`comm_class_rows` as a rich table: per comm class (named on its first line) each figure's
    predicted and measured value and their ratio (``—`` where not known)."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("class", "figure", "predicted", "measured", "measured/predicted"):
        table.add_column(col, justify="left" if col in ("class", "figure") else "right")
    shown = None
    for r in rows:
        _, cls, figure = r.quantity.split(" ", 2)
        table.add_row(cls if cls != shown else "", figure, _fmt(r.predicted, r.unit), _fmt(r.measured, r.unit),
                      "—" if r.ratio is None else f"{r.ratio:.2f}", end_section=figure == COMM_FIGURES[-1][0])
        shown = cls
    console.print(table)
