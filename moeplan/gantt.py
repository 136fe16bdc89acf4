"""``moeplan timeline``: a plan's simulated step as a Chrome / Perfetto trace and as a Gantt + memory PNG.

Source of every bar: :func:`moeplan.replay.plan_timeline`, the discrete-event simulation of one PP group's step
(cost_models/timeline.py; docs/step-model.md §2): an ``Event`` per executed action, a ``SegmentEvent`` per compute
segment and collective. After the pipeline, per rank, the DP collectives the compute did not hide, the first
forward's wait for parameters and the optimizer step, as cost_models/step.py prices them (``dp_collectives``,
``dp_exposure``, ``optimizer_s``): the last bar ends at the plan's predicted step time.

Trace: the JSON Object Format of the Trace Event Format
(https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU), read by Perfetto
(https://ui.perfetto.dev) and chrome://tracing. One process per PP rank, one thread (track) per stream: the compute
stream, each link-tier stream the simulator reports (``comm intra``, ``comm inter``, ``comm intra+inter`` for an
all-to-all that holds both), ``p2p send``, ``swap (exposed)`` when the plan has swap the host link does not hide,
and ``dp + optimizer``. Complete events (``ph: "X"``), microseconds.

Slices on one track must nest (the format's B/E rule, which X events inherit). Compute segments run one at a time,
but the simulator lets an ``OVERLAP_F_B`` pair finish under the next pair (DualPipe's unaligned chunk boundaries),
so the spans of two actions can cross. An action's slice therefore runs from its first compute segment to the last
compute segment that starts before the next action's first: one slice per computing action, in execution order,
whose children are the compute segments run meanwhile, each named ``{part} {segment}`` (``48B0 attn_core``), so a
carried tail shows under the next action with its own part's name. ``args.part_end_ms`` gives when each part ended.

Memory: every term of the plan's memory that does not move during the step (model states, workspace,
communication buffers, the runtime's bytes) plus the saved activations of the micro-batches in flight
(``StageProgram.activation_bytes`` per stage and micro-batch, added when a forward starts and freed when its B, or
W when split, ends: the simulator's rule) plus the backward working set the plan reserves on top, the transient
bytes grown by the allocator's share (cost_models/memory.py). Its peak equals the plan's ``total_bytes`` when the
timed order of forwards and frees matches the action order that ``peak_live_bytes`` walks.
"""
from __future__ import annotations

import io
import json
from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from moeplan.actions import OVERLAP, action_kind, compute_parts, parse_action
from moeplan.cost_models.step import dp_collectives, dp_exposure, optimizer_s
from moeplan.cost_models.timeline_types import TIERS, Event, SegmentEvent, StageProgram, Timeline
from moeplan.files import write_atomic
from moeplan.plan import Plan
from moeplan.replay import plan_timeline
from moeplan.state import PlanState, Segment

COMPUTE, SEND, SWAP, DP = "compute", "p2p send", "swap (exposed)", "dp + optimizer"
KIND_COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868", OVERLAP: "#8172b3"}
CLASS_COLORS = {"tp": "#937860", "ep": "#da8bc3", "cp": "#8c8c8c", "pp": "#ccb974", "dp": "#64b5cd",
                "swap": "#2f4f4f", "optimizer": "#404040"}
FIGSIZE_IN, DPI = (14.0, 9.0), 100  # the PNG is 1400 x 900 pixels
_US = 1e6


class Slice(NamedTuple):
    """One bar of the step: PP ``rank``, ``track`` (a stream, module docstring), ``name``, category ``cat``
    (``action``, ``segment``, ``collective``, ``p2p``, ``swap``, ``dp``, ``optimizer``), seconds from the step
    start, and the trace event's ``args``."""

    rank: int
    track: str
    name: str
    cat: str
    start_s: float
    end_s: float
    args: dict


@dataclass(frozen=True)
class MemoryCurve:
    """One PP rank's device memory over the step, a step function: ``bytes_at[i]`` bytes from ``times_s[i]`` on.
    ``static_bytes``: the terms that do not move during the step (model states, workspace, FSDP's gathered copies,
    communication buffers, runtime; with the allocator's share); ``working_set_bytes``: the backward working set
    reserved on top (with the allocator's share); ``plan_total_bytes``: the plan's predicted peak of the rank
    (``memory.ranks[r].total_bytes``)."""

    times_s: tuple[float, ...]
    bytes_at: tuple[float, ...]
    static_bytes: float
    working_set_bytes: float
    plan_total_bytes: float

    @property
    def activation_peak_bytes(self) -> float:
        """The curve's peak less its static bytes: comparable to the plan's ``activation_bytes`` plus
        ``working_set_bytes`` (with the allocator's share)."""
        return max(self.bytes_at) - self.static_bytes


@dataclass(frozen=True)
class StepTimeline:
    """A plan's simulated step, ready to draw: every slice, per rank its tracks in display order, per rank its
    memory curve, the pipeline's end and the step's end (seconds)."""

    plan: Plan
    slices: tuple[Slice, ...]
    tracks: tuple[tuple[str, ...], ...]
    memory: tuple[MemoryCurve, ...]
    pipeline_s: float
    step_s: float


def step_timeline(plan: Plan) -> StepTimeline:
    """Simulate ``plan``'s step (:func:`moeplan.replay.plan_timeline`) and lay it out per rank and track (module
    docstring). Raises PlanError when the schedule does not simulate."""
    state, programs, tl = plan_timeline(plan)  # the state and programs give segment metadata and the DP tail
    phases = {(s, k): p.phase(k) for s, p in enumerate(programs) for k in ("F", "B", "I", "W")}
    segs: dict[int, list[SegmentEvent]] = defaultdict(list)
    for s in tl.segment_events:
        segs[s.rank].append(s)
    events: dict[int, list[Event]] = defaultdict(list)
    for e in tl.events:
        events[e.rank].append(e)
    slices: list[Slice] = []
    for r, actions in enumerate(plan.schedule.actions):
        compute = sorted((s for s in segs[r] if s.stream == "compute"), key=lambda s: s.start_s)
        slices += _compute_slices(r, actions, compute, events[r])
        slices += _swap_slices(r, compute, state)
        slices += [_collective(s, phases) for s in segs[r] if s.stream != "compute"]
        slices += [_send(e, plan) for e in events[r] if e.stream == "comm"]
        slices += _dp_tail(r, state, tl)
    step = max(s.end_s for s in slices)
    tracks = tuple(_track_order({s.track for s in slices if s.rank == r}) for r in range(plan.layout.pp))
    memory = tuple(_memory(r, state, programs, events[r], step) for r in range(plan.layout.pp))
    return StepTimeline(plan=plan, slices=tuple(slices), tracks=tracks, memory=memory, pipeline_s=tl.step_time_s,
                        step_s=step)


def _compute_slices(r: int, actions: Sequence[str], segs: Sequence[SegmentEvent],
                    events: Sequence[Event]) -> list[Slice]:
    """One ``action`` slice per computing action of rank ``r`` (the window rule of the module docstring) and one
    ``segment`` child per compute segment; ``segs`` sorted by start (the compute stream runs one at a time)."""
    owner = {str(p): text for text in actions for p in compute_parts(text)}
    ends = {e.action: e for e in events if e.stream == "compute"}
    first: dict[str, float] = {}
    for s in segs:
        first.setdefault(owner[s.part], s.start_s)
    out: list[Slice] = []
    for text in actions:  # an action without compute segments (a W with no weights): a zero-length slice
        parts = compute_parts(text)
        if parts and text not in first:
            at = ends[str(parts[0])].start_s
            out.append(Slice(r, COMPUTE, text, "action", at, at, _action_args(text, ends)))
    starts = sorted((t, text) for text, t in first.items())
    j = 0
    for k, (start, text) in enumerate(starts):
        nxt = starts[k + 1][0] if k + 1 < len(starts) else float("inf")
        end = start
        while j < len(segs) and segs[j].start_s < nxt:
            end = max(end, segs[j].end_s)
            j += 1
        out.append(Slice(r, COMPUTE, text, "action", start, end, _action_args(text, ends)))
    for s in segs:
        a = parse_action(s.part)
        out.append(Slice(r, COMPUTE, f"{s.part} {s.name}", "segment", s.start_s, s.end_s,
                         {"action": owner[s.part], "part": s.part, "stage": a.stage, "micro_batch": a.microbatch,
                          "kind": a.kind, "segment": s.name}))
    return out


def _action_args(text: str, ends: dict[str, Event]) -> dict:
    """Trace args of an action: its kind, stage(s), micro-batch(es), and when each part ended (ms)."""
    parts = compute_parts(text)
    one = len(parts) == 1
    return {"kind": parts[0].kind if one else OVERLAP,
            "stage": parts[0].stage if one else [p.stage for p in parts],
            "micro_batch": parts[0].microbatch if one else [p.microbatch for p in parts],
            "part_end_ms": {str(p): ends[str(p)].end_s * 1e3 for p in parts}}


def _collective(s: SegmentEvent, phases: dict[tuple[int, str], tuple[Segment, ...]]) -> Slice:
    """A collective on the track of the link-tier stream(s) it held, with its CommOp's class and bytes
    (``phases[(stage, kind)]``: the stage program's segments of that pass)."""
    a = parse_action(s.part)
    c = phases[(a.stage, a.kind)][s.index].comm
    assert c is not None  # a segment off the compute stream is a collective
    return Slice(s.rank, f"comm {s.stream or 'none'}", f"{s.part} {s.name}", "collective", s.start_s, s.end_s,
                 {"part": s.part, "stage": a.stage, "micro_batch": a.microbatch, "kind": a.kind, "segment": s.name,
                  "comm_class": c.comm_class, "collective": c.kind, "bytes": c.bytes, "group_size": c.group_size,
                  "wire_intra_bytes": c.wire_intra_bytes, "wire_inter_bytes": c.wire_inter_bytes})


def _send(e: Event, plan: Plan) -> Slice:
    """A PP SEND on the p2p link (the plan's ``sharding.p2p`` transfer)."""
    a, p2p = parse_action(e.action), plan.sharding.p2p
    return Slice(e.rank, SEND, e.action, "p2p", e.start_s, e.end_s,
                 {"stage": a.stage, "micro_batch": a.microbatch, "kind": a.kind, "comm_class": "pp",
                  "bytes": p2p.bytes, "tier": p2p.tier})


def _swap_slices(r: int, segs: Sequence[SegmentEvent], state: PlanState) -> list[Slice]:
    """The swap a per-tensor memory plan leaves exposed (``exposed_swap_s`` per chunk: copy out, prefetch, seconds
    per micro-batch): cost_models/step.py puts the copy out at the end of each forward and the prefetch at the start
    of each backward, inside the compute segments named ``swap_out`` / ``prefetch`` (or merged with them)."""
    assert state.memory is not None and state.stages is not None
    exposed = state.memory.stages[r].exposed_swap_s
    if not any(x > 0 for pair in exposed for x in pair):
        return []
    chunk = {state.stages.stage_of(r, c): c for c in range(len(exposed))}
    out = []
    for s in segs:
        names = s.name.split("+")
        a = parse_action(s.part)
        copy_out, prefetch = exposed[chunk[a.stage]]
        args = {"part": s.part, "stage": a.stage, "micro_batch": a.microbatch, "kind": a.kind}
        if "swap_out" in names:
            out.append(Slice(r, SWAP, f"{s.part} swap out", "swap", s.end_s - copy_out, s.end_s, args))
        if "prefetch" in names:
            out.append(Slice(r, SWAP, f"{s.part} prefetch", "swap", s.start_s, s.start_s + prefetch, args))
    return out


def _dp_tail(r: int, state: PlanState, tl: Timeline) -> list[Slice]:
    """After rank ``r``'s pipeline: the DP collectives not hidden, the first forward's wait for parameters (which
    passes/simulate.py adds to the step) and the optimizer step; ends at the rank's predicted step."""
    ops = dp_collectives(state, r)
    after, wait = dp_exposure(ops, tl=tl, rank=r, overlap="dp" in state.strategy.overlap)
    t, out = tl.rank_end_s[r], []
    dp_args = {"collectives": len(ops), "total_ms": sum(o.time_s for o in ops) * 1e3,
               "wire_bytes": sum(o.wire_bytes for o in ops), "overlap_dp": "dp" in state.strategy.overlap}
    for name, cat, secs, args in (("dp collectives (exposed)", "dp", after, dp_args),
                                  ("parameter all-gather wait", "dp", wait, {}),
                                  ("optimizer step", "optimizer", optimizer_s(state, r), {})):
        if secs > 0:
            out.append(Slice(r, DP, name, cat, t, t + secs, args))
            t += secs
    return out


def _track_order(names: set[str]) -> tuple[str, ...]:
    comm = [f"comm {t}" for t in (*TIERS, "+".join(TIERS))]
    order = [COMPUTE, *comm, SEND, SWAP, DP]
    return tuple(sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n)))


def _memory(r: int, state: PlanState, programs: Sequence[StageProgram], events: Sequence[Event],
            end_s: float) -> MemoryCurve:
    """Rank ``r``'s memory curve (module docstring)."""
    assert state.memory is not None and state.sharding is not None and state.stages is not None
    mem = state.memory.stages[r]
    grow = 1 + state.target.memory_overheads.allocator_fraction  # the allocator's share of the transient bytes
    stage_bytes = {s: programs[s].activation_bytes * grow for s in range(len(programs))}
    working = mem.working_set_bytes * grow
    static = (mem.runtime_bytes + mem.model_state_bytes + mem.comm_buffer_bytes
              + grow * (mem.workspace_bytes + mem.gathered_bytes))
    deltas = []
    for e in events:
        if e.stream != "compute":
            continue
        a = parse_action(e.action)
        if a.kind == "F":
            deltas.append((e.start_s, stage_bytes[a.stage]))
        elif a.kind in ("B", "W"):
            deltas.append((e.end_s, -stage_bytes[a.stage]))
    times, values, live = [0.0], [static + working], 0.0
    for t, d in sorted(deltas):  # frees first at equal times, as the simulator's peak
        live += d
        times.append(t)
        values.append(static + working + live)
    times.append(end_s)
    values.append(values[-1])
    return MemoryCurve(tuple(times), tuple(values), static, working, mem.total_bytes)


# ---- the trace -------------------------------------------------------------------------------------------------------
def trace_document(st: StepTimeline) -> dict:
    """The Trace Event Format document (JSON Object Format) of ``st``: metadata events naming and ordering each
    process (PP rank) and thread (track), then one complete event per slice; ``ts`` / ``dur`` in microseconds,
    rounded to the nanosecond (start and end rounded each, so nested slices stay nested)."""
    plan, events = st.plan, []
    tids = [{name: i + 1 for i, name in enumerate(tracks)} for tracks in st.tracks]
    for r, tracks in enumerate(st.tracks):
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"pp rank {r}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for name in tracks:
            tid = tids[r][name]
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": r, "tid": tid, "args": {"sort_index": tid}})
    for s in st.slices:
        ts, end = round(s.start_s * _US, 3), round(s.end_s * _US, 3)
        events.append({"name": s.name, "cat": s.cat, "ph": "X", "pid": s.rank, "tid": tids[s.rank][s.track],
                       "ts": ts, "dur": round(end - ts, 3), "args": s.args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": "moeplan timeline", "model": plan.model.name,
                          "layout": plan.layout.as_layout().short(), "schedule": plan.schedule.kind,
                          "predicted_step_s": plan.prediction.step_time_s, "simulated_step_s": st.step_s,
                          "pipeline_s": st.pipeline_s}}


def trace_json(st: StepTimeline) -> str:
    """:func:`trace_document` as compact JSON text."""
    return json.dumps(trace_document(st), separators=(",", ":"))


# ---- the figure ------------------------------------------------------------------------------------------------------
def _unit(max_bytes: float) -> tuple[float, str]:
    return (2**30, "GiB") if max_bytes >= 2**30 else (2**20, "MiB")


def _bars(slices: Sequence[Slice]) -> list[tuple[float, float]]:
    """(start ms, width ms) of ``slices`` sorted by start, touching ones merged (fewer patches to draw)."""
    out: list[list[float]] = []
    for s in sorted(slices, key=lambda s: s.start_s):
        a, b = s.start_s * 1e3, s.end_s * 1e3
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b - a) for a, b in out]


def figure_png(st: StepTimeline) -> bytes:
    """The PNG (``FIGSIZE_IN`` at ``DPI``, Agg backend): above, the per-rank Gantt (compute segments coloured by
    their action's kind F / B / I / W / OVERLAP_F_B; below each rank, one thin sub-row per other track, collectives
    coloured by comm class); below, each rank's memory over the step (MemoryCurve), with the plan's highest
    predicted peak dashed. Time in ms from the step start."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    plan = st.plan
    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI)
    FigureCanvasAgg(fig)
    gantt, mem_ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    groups: dict[tuple[int, str, str], list[Slice]] = defaultdict(list)
    for s in st.slices:
        if s.cat == "segment":
            groups[(s.rank, COMPUTE, KIND_COLORS[action_kind(s.args["action"])])].append(s)
        elif s.cat != "action":
            groups[(s.rank, s.track, CLASS_COLORS[s.args.get("comm_class", s.cat)])].append(s)
    kinds, classes = set(), set()
    for (r, track, color), group in groups.items():
        others = [t for t in st.tracks[r] if t != COMPUTE]
        if track == COMPUTE:
            y, h = r + 0.05, 0.5
            kinds.add(color)
        else:
            h = 0.38 / len(others)
            y = r + 0.58 + others.index(track) * h
            classes.add(color)
        gantt.broken_barh(_bars(group), (y, h * 0.85), facecolors=color, edgecolors="none")
    gantt.set_ylim(plan.layout.pp, 0)
    gantt.set_yticks([r + 0.3 for r in range(plan.layout.pp)], [f"pp {r}" for r in range(plan.layout.pp)])
    thin = _track_order({t for tracks in st.tracks for t in tracks if t != COMPUTE})
    gantt.set_ylabel("PP rank (thin rows: " + ", ".join(thin) + ")", fontsize=8)
    legend = [Patch(color=c, label=k) for k, c in KIND_COLORS.items() if c in kinds]
    legend += [Patch(color=c, label=k) for k, c in CLASS_COLORS.items() if c in classes]
    gantt.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    peak = max(m.plan_total_bytes for m in st.memory)
    scale, unit = _unit(max(peak, *(max(m.bytes_at) for m in st.memory)))
    for r, m in enumerate(st.memory):
        mem_ax.step([t * 1e3 for t in m.times_s], [b / scale for b in m.bytes_at], where="post", lw=1,
                    label=f"pp {r}")
    mem_ax.axhline(peak / scale, ls="--", lw=1, color="black", label="plan peak")
    mem_ax.set_ylabel(f"device memory ({unit})")
    mem_ax.set_xlabel("time from step start (ms)")
    mem_ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=1 + plan.layout.pp // 12)
    mem_ax.set_xlim(0, st.step_s * 1e3)
    gantt.set_title(f"{plan.model.name} · {plan.layout.as_layout().short()} · {plan.schedule.kind} · predicted step "
                    f"{plan.prediction.step_time_s * 1e3:,.1f} ms", fontsize=11)
    fig.subplots_adjust(left=0.07, right=0.86, top=0.95, bottom=0.07, hspace=0.08)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def write_timeline(plan: Plan, trace_path: str, png_path: str | None = None) -> StepTimeline:
    """Write ``plan``'s trace JSON to ``trace_path`` and, when given, the PNG to ``png_path``; both are built before
    either is written (``moeplan.files.write_atomic``: nothing half-written, nothing written on an error). Raises
    PlanError for a schedule that does not simulate, OutputError (moeplan.errors) when a file cannot be written."""
    st = step_timeline(plan)
    text = trace_json(st)
    png = figure_png(st) if png_path else None
    write_atomic(trace_path, text)
    if png_path and png is not None:
        write_atomic(png_path, png)
    return st
