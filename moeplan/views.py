"""``moeplan inspect``'s views of a plan as rich renderables: overview, stages, memory, timeline and comm.

Pure functions of the plan (and, for the timeline, of its simulated step from :func:`moeplan.replay.plan_timeline`):
the textual app (``moeplan/tui.py``) shows them one per tab and ``moeplan inspect --static`` prints them, so both
show the same content. Nothing here imports textual. Units: seconds, bytes (shown in binary units, GiB = 2^30 B).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich import box
from rich.console import Console, Group, RenderableType
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from moeplan.actions import OVERLAP, compute_parts, parse_action
from moeplan.errors import PlanError
from moeplan.flops import count_params
from moeplan.plan import MEMORY_TERMS, Plan
from moeplan.render import compact, expert_load_line

VIEWS = ("overview", "stages", "memory", "timeline", "comm")
COMPUTE_STYLES = {"F": "green", "B": "blue", "I": "cyan", "W": "magenta", "OVERLAP_F_B": "yellow"}
COMPUTE_GLYPHS = {"F": "F", "B": "B", "I": "I", "W": "W", "OVERLAP_F_B": "O"}
CATEGORY_NAMES = {"F": "forward", "B": "backward (dX + dW)", "I": "input grad (dX)", "W": "weight grad (dW)",
                  "OVERLAP_F_B": "F&B pair (OVERLAP_F_B)", "swap": "exposed swap"}
CLASS_STYLES = {"tp": "bright_magenta", "ep": "bright_red", "cp": "bright_yellow", "dp": "bright_blue",
                "pp": "bright_green", "swap": "bright_white"}
LABEL_WIDTH = 13  # columns of the lane names left of the Gantt


class PlainTable(Table):
    """A rich Table whose str cells are plain text, never markup: a plan's names, labels and reasons are the
    user's text (a model named ``[/oops]`` broke ``inspect`` with rich's MarkupError)."""

    def add_row(self, *renderables, **kw) -> None:
        super().add_row(*(Text(r) if isinstance(r, str) else r for r in renderables), **kw)

def fmt_s(x: float) -> str:
    """Seconds as ``1.234 s``, ``12.3 ms`` or ``45 µs``."""
    if x == 0 or abs(x) >= 1:
        return f"{x:.3f} s" if x else "0 s"
    if abs(x) >= 1e-3:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} µs"


def unit_of(x: float) -> tuple[str, float]:
    """The binary unit to show ``x`` bytes in, and its size: GiB, MiB, KiB or B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return unit, scale
    return "B", 1


def fmt_bytes(x: float) -> str:
    """Bytes in binary units: ``47.1 GiB``, ``7.4 MiB``, ``132.0 KiB``, ``512 B``, ``0``."""
    unit, scale = unit_of(x)
    return f"{x / scale:.{0 if unit == 'B' else 1}f} {unit}" if x else "0"


def _rate(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def _params(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


# --- overview ---------------------------------------------------------------------------------------------------

def overview(plan: Plan) -> Group:
    """Model, target, layout, strategy and the predicted step (step time, tokens/s, MFU with the plan's definition,
    HFU, bubble, peak memory per PP rank against the budget, exposed communication per class)."""
    lay, pred, tgt = plan.layout, plan.prediction, plan.target
    params = count_params(plan.model.spec)
    t = PlainTable(title="plan", show_header=False, title_justify="left", expand=True)
    t.add_column(style="bold", no_wrap=True)
    t.add_column()
    t.add_row("model", f"{plan.model.name} · {_params(params.total)} parameters, {_params(params.activated)} "
                       f"activated per token (MTP excluded; + {_params(params.mtp)} MTP)")
    t.add_row("target", f"{tgt.name}{':' + tgt.variant if tgt.variant else ''} ({tgt.backend}) · "
                        f"{lay.num_devices} devices, {tgt.devices_per_node} per node · "
                        f"{fmt_bytes(tgt.memory_bytes)} and {tgt.cube_flops / 1e12:.0f} TFLOP/s bf16 each")
    t.add_row("layout", f"tp {lay.tp} · pp {lay.pp} · vpp {lay.vpp} · ep {lay.ep} · etp {lay.etp} · cp {lay.cp} · "
                        f"dp {lay.dp} · micro_batch {lay.micro_batch}"
                        f"{' · sequence parallel' if lay.sequence_parallel else ''}")
    t.add_row("batch", f"global batch {lay.global_batch} sequences × seq len {lay.seq_len} = "
                       f"{lay.global_batch * lay.seq_len:,} tokens per step · {lay.num_microbatches} micro-batches "
                       f"per PP group")
    t.add_row("schedule", plan.schedule.kind)
    t.add_row("dispatcher", plan.comm.dispatcher)
    t.add_row("overlap", ", ".join(plan.comm.overlap) or "none")
    if plan.model.spec.is_moe:
        t.add_row("routing", expert_load_line(plan))
    p = PlainTable(title="predicted step", show_header=False, title_justify="left", expand=True)
    p.add_column(style="bold", no_wrap=True)
    p.add_column()
    p.add_row("step time", fmt_s(pred.step_time_s))
    p.add_row("tokens/s", f"{pred.tokens_per_s:,.0f}")
    p.add_row("MFU", Text(f"{pred.mfu:.1%}  ") + Text(pred.mfu_definition, style="dim"))
    p.add_row("HFU", Text(f"{pred.hfu:.1%}  ") + Text("executed FLOPs, recompute and MTP included", style="dim"))
    p.add_row("bubble", f"{pred.bubble:.2%} of the step the compute stream idles for the pipeline")
    budget = plan.memory.budget_bytes
    unit, scale = unit_of(max(pred.peak_memory_bytes))
    peak = Text(f"budget {fmt_bytes(budget)}; per pp rank (rank:{unit}) ")
    for r, b in enumerate(pred.peak_memory_bytes):
        peak.append(f"{r}:{b / scale:.1f}", style="bold red" if b > budget else "")
        peak.append("  ")
    p.add_row("peak memory", peak)
    p.add_row("exposed comm", " · ".join(f"{k} {fmt_s(v)}" for k, v in pred.exposed_comm_s.items() if v) or "none")
    if pred.host_wait_s:
        p.add_row("host wait", fmt_s(pred.host_wait_s))
    if pred.optimizer_s:
        p.add_row("optimizer", fmt_s(pred.optimizer_s))
    return Group(t, p, *([expert_load_table(plan)] if plan.experts.load is not None else []))


def expert_load_table(plan: Plan) -> Table:
    """Each traced MoE layer's device imbalance under the plan's placement (docs/load-balance.md): max/mean − 1,
    vLLM's balancedness mean/max and the coefficient of variation of the routed tokens per EP rank, over the
    trace window."""
    load = plan.experts.load
    assert load is not None
    t = compact_table("expert load per MoE layer", f"{load.policy} placement over {len(load.layers[0].shards)} "
                                                   f"EP ranks; means over the trace window")
    for col in ("layer", "imbalance", "balancedness", "cv"):
        t.add_column(col, justify="right")
    for x in load.layers:
        t.add_row(str(x.layer), f"{x.imbalance:.1%}", f"{x.balancedness:.3f}", f"{x.cv:.3f}")
    return t


# --- stages -----------------------------------------------------------------------------------------------------

def bottleneck(plan: Plan) -> tuple[int, int]:
    """``(pp_rank, chunk)``: the PP rank whose chunks take the most time per micro-batch (the sum of its
    ``stages.chunk_time_s``), and within it the slowest chunk. Every micro-batch passes every rank, so in steady
    state the pipeline runs no faster than this rank."""
    times = plan.stages.chunk_time_s
    rank = max(range(len(times)), key=lambda r: sum(times[r]))
    return rank, max(range(len(times[rank])), key=lambda c: times[rank][c])


class ByWidth:
    """A renderable that is ``wide`` on a console of at least ``min_width`` columns, else ``narrow``."""

    def __init__(self, wide: RenderableType, narrow: RenderableType, min_width: int) -> None:
        self.wide, self.narrow, self.min_width = wide, narrow, min_width

    def __rich_console__(self, console: Console, options):  # noqa: ANN201 - rich's protocol
        yield self.wide if options.max_width >= self.min_width else self.narrow


def compact_table(title: str, caption: str | None = None) -> PlainTable:
    """A table for narrow terminals: a rule under the header, no borders, two spaces between columns."""
    return PlainTable(title=title, caption=caption, box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), show_edge=False)


def _layers(names: list[str]) -> Text:
    items = compact([n for n in names if not n.startswith("empty.")]).split(", ") if len(names) else []
    out = Text(", ").join(Text(i, style="magenta" if i.startswith("mtp") else "") for i in items if i)
    empty = sum(n.startswith("empty.") for n in names)
    if empty:
        out.append(f"{', ' if out else ''}{empty} empty", style="italic dim")
    return out


def stages(plan: Plan, narrow: bool = False) -> Table:
    """PP ranks × VPP chunks: each chunk's pipeline stage, layers (MTP in magenta, empty layers counted in italics)
    and forward + backward seconds per micro-batch; per rank the total and the peak memory. The bottleneck
    (:func:`bottleneck`) is highlighted: its row in bold on red, its slowest chunk marked ▶. ``narrow``: the same
    cells in a borderless table (:func:`compact_table`), stage and time on lines of their own."""
    lay, times = plan.layout, plan.stages.chunk_time_s
    worst_rank, worst_chunk = bottleneck(plan)
    title = f"stages ({plan.stages.placement} placement; slowest chunk {plan.stages.imbalance:+.1%} over the mean)"
    caption = (f"bottleneck (highlighted): pp rank {worst_rank}, the rank whose chunks take the most time per "
               f"micro-batch ({fmt_s(sum(times[worst_rank]))}); ▶ marks its slowest chunk, {worst_chunk} "
               f"({fmt_s(times[worst_rank][worst_chunk])}). Times are forward + backward per micro-batch.")
    t = compact_table(title, caption) if narrow else PlainTable(title=title, caption=caption, expand=True)
    t.add_column("pp" if narrow else "pp rank", no_wrap=True)
    for c in range(lay.vpp):
        t.add_column(f"chunk {c}")
    t.add_column("Σ time", no_wrap=True)
    t.add_column("peak" if narrow else "peak mem", no_wrap=True)
    for r, chunks in enumerate(plan.stages.chunks):
        cells = []
        for c, names in enumerate(chunks):
            cell = Text(f"{'▶ ' if (r, c) == (worst_rank, worst_chunk) else ''}stage {plan.stages.stage_of(r, c)}"
                        f"{chr(10) if narrow else ' · '}{fmt_s(times[r][c])}\n",
                        style="bold" if (r, c) == (worst_rank, worst_chunk) else "")
            cells.append(cell + _layers(names))
        t.add_row(str(r), *cells, fmt_s(sum(times[r])), fmt_bytes(plan.prediction.peak_memory_bytes[r]),
                  style="bold on dark_red" if r == worst_rank else None, end_section=not narrow)
    return t


def stages_width(plan: Plan) -> int:
    """Columns from which the stages view shows the bordered table: each chunk's cell wants about 18 columns
    (``stage 16 · 10.1 ms``) beside about 40 for the rank, the total, the peak and the borders; below, the
    borderless one (the 718B's four chunks collapsed to cells of "layers.…" at 80 columns)."""
    return 40 + 18 * plan.layout.vpp


def stages_view(plan: Plan) -> Group:
    """The stages table (:func:`stages`, narrow below :func:`stages_width`) and the partition pass's reason."""
    return Group(ByWidth(stages(plan), stages(plan, narrow=True), stages_width(plan)),
                 Text(plan.stages.reason, style="dim"))


# --- memory -----------------------------------------------------------------------------------------------------

def _bar(parts: list[tuple[float, str]], budget: float, width: int = 16) -> Text:
    """A bar of ``width`` cells for ``budget`` bytes, one colored run per (bytes, style); red past the budget."""
    out, used = Text(), 0
    for b, style in parts:
        n = round(b / budget * width)
        out.append("█" * n, style=style)
        used += n
    if used < width:
        out.append("·" * (width - used), style="dim")
    return out


WIDE_MEMORY_COLUMNS = 150
"""Columns from which the memory view lists every term (docs/memory.md); below, the compact table of three sums
(what fits 80 columns: the 718B's memory view collapsed to columns of "2…" there)."""


def memory(plan: Plan) -> Group:
    """Per PP rank: model states (params, grads, optimizer) vs activations vs workspace against the budget, the
    recompute mode and in-flight micro-batches; the memory solver's status per rank; for the per-tensor modes
    every recompute / swap decision with the bytes it frees per layer and micro-batch and its Megatron-LM /
    MindSpeed-LLM flag (docs/memory.md §4)."""
    mem = plan.memory
    budget = mem.budget_bytes
    unit, scale = unit_of(max(m.total_bytes for m in mem.ranks))
    t = PlainTable(title=f"memory per device in {unit} (budget {budget / scale:.2f} {unit}; recompute asked: "
                    f"{mem.recompute}; {mem.precision.short()})", expand=True,
              caption="bar: model states (params + grads + optimizer) █ blue, activations and working set █ green, "
                      "workspace, buffers, runtime and allocator █ yellow, · free, against the budget; (N mb): "
                      "micro-batches whose activations are held at the peak")
    for col in ("pp rank", "recompute", *(label for label, _ in MEMORY_TERMS), "total", "budget", ""):
        t.add_column(col, no_wrap=True, justify="left" if col in ("recompute", "") else "right")
    for m in mem.ranks:
        states = m.params_bytes + m.grads_bytes + m.optimizer_bytes
        acts = m.activation_bytes + m.working_set_bytes
        cells = [f"{getattr(m, f) / scale:.2f}" + (f" ({m.in_flight_microbatches} mb)" if f == "activation_bytes"
                                                     else "") for _, f in MEMORY_TERMS]
        t.add_row(str(m.pp_rank), m.recompute, *cells, f"{m.total_bytes / scale:.2f}",
                  Text(f"{m.total_bytes / budget:.0%}", style="bold red" if m.total_bytes > budget else ""),
                  _bar([(states, "blue"), (acts, "green"), (m.total_bytes - states - acts, "yellow")], budget))
    n = compact_table(f"memory per device in {unit} (budget {budget / scale:.2f} {unit}; recompute asked: "
                      f"{mem.recompute})",
                      "states: params + grads + optimizer █ blue; activations and working set █ green; other: "
                      "workspace, buffers, runtime, allocator █ yellow; a wider terminal shows every term")
    for col in ("pp", "recompute", "states", "activations", "other", "total", "budget", ""):
        n.add_column(col, no_wrap=True, justify="left" if col in ("recompute", "") else "right")
    for m in mem.ranks:
        states = m.params_bytes + m.grads_bytes + m.optimizer_bytes
        acts = m.activation_bytes + m.working_set_bytes
        other = m.total_bytes - states - acts
        n.add_row(str(m.pp_rank), m.recompute, f"{states / scale:.2f}",
                  f"{acts / scale:.2f} ({m.in_flight_microbatches} mb)", f"{other / scale:.2f}",
                  f"{m.total_bytes / scale:.2f}",
                  Text(f"{m.total_bytes / budget:.0%}", style="bold red" if m.total_bytes > budget else ""),
                  _bar([(states, "blue"), (acts, "green"), (other, "yellow")], budget, width=10))
    parts: list[RenderableType] = [ByWidth(t, n, WIDE_MEMORY_COLUMNS)]
    solved = [m for m in mem.ranks if m.solve_status]
    if solved:
        s = PlainTable(title="memory solver (per-tensor modes, moeplan/memory_ilp.py)")
        for col in ("pp rank", "status", "gap", "exposed swap / mb", "note"):
            s.add_column(col)
        for m in solved:
            swap = sum(a + b for a, b in m.exposed_swap_s)
            s.add_row(str(m.pp_rank), m.solve_status, "unknown" if m.solve_gap < 0 else f"{m.solve_gap:.2%}",
                      fmt_s(swap), m.solve_reason)
        parts.append(s)
    decided = [(m.pp_rank, d) for m in mem.ranks for d in m.decisions if d.ops]
    if decided:
        d = PlainTable(title="recompute / swap decisions (bytes freed per layer and micro-batch)")
        for col in ("pp rank", "chunk", "layer kind", "op", "decision", "frees", "flag"):
            d.add_column(col)
        for r, dec in decided:
            for op in dec.ops:
                d.add_row(str(r), str(dec.chunk), dec.kind, op.label or op.op,
                          Text(op.decision, style="cyan" if op.decision == "recompute" else "bright_white"),
                          fmt_bytes(op.saved_bytes), op.flag or Text("none", style="dim"))
        parts.append(d)
    return Group(*parts)


# --- comm -------------------------------------------------------------------------------------------------------

WIDE_COMM_COLUMNS = 120
"""Columns from which the comm view is one table (its nine columns want about 118); below, two borderless tables,
the whole step and its steady state (at 80 columns every cell of the one table collapsed to "…")."""


def comm(plan: Plan) -> ByWidth:
    """Per comm class (``prediction.comm``): bytes one device sends per link tier, total and exposed seconds over
    the step and the overlap rate ``1 − exposed / total`` (docs/references.md §4.4), and the same in the steady
    state (docs/step-model.md §2); one table from :data:`WIDE_COMM_COLUMNS` columns, else two."""
    title = (f"communication per step (dispatcher {plan.comm.dispatcher}; overlap "
             f"{', '.join(plan.comm.overlap) or 'none'})")
    caption = ("bytes one device sends per step; steady state: the schedule's middle (its overlapped F&B pairs, or "
               "first backward to last forward); exposed = the compute stream waited on it")
    comm = plan.prediction.comm
    step = [(fmt_bytes(c.intra_bytes), fmt_bytes(c.inter_bytes), fmt_s(c.total_s), fmt_s(c.exposed_s),
             _rate(c.overlap_rate)) for c in comm.values()]
    steady = [(fmt_s(c.steady_total_s), fmt_s(c.steady_exposed_s), _rate(c.steady_overlap_rate))
              for c in comm.values()]
    classes = [Text(cls, style=CLASS_STYLES.get(cls, "")) for cls in comm]
    step_columns = ("intra-node", "inter-node", "total", "exposed", "overlap")

    def table(t: PlainTable, columns: tuple[str, ...], rows) -> PlainTable:
        for col in ("class", *columns):
            t.add_column(col, no_wrap=True)
        for cls, row in zip(classes, rows):
            t.add_row(cls, *row)
        return t

    wide = table(PlainTable(title=title, caption=caption, expand=True),
                 (*step_columns, "steady total", "steady exposed", "steady overlap"),
                 [a + b for a, b in zip(step, steady)])
    narrow = Group(table(compact_table(title), step_columns, step),
                   table(compact_table("steady state"), ("total", "exposed", "overlap"), steady),
                   Text(caption, style="dim"))
    return ByWidth(wide, narrow, WIDE_COMM_COLUMNS)


# --- timeline ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Intervals:
    """Busy intervals of one category in one lane, as sorted starts and sorted ends (seconds) with their prefix
    sums, so the busy time before any instant is two binary searches (:meth:`busy_before`)."""

    starts: np.ndarray
    ends: np.ndarray
    cum_starts: np.ndarray
    cum_ends: np.ndarray

    @staticmethod
    def of(spans: list[tuple[float, float]]) -> "Intervals":
        s = np.sort(np.array([a for a, _ in spans], dtype=float))
        e = np.sort(np.array([b for _, b in spans], dtype=float))
        return Intervals(s, e, np.concatenate(([0.0], np.cumsum(s))), np.concatenate(([0.0], np.cumsum(e))))

    def busy_before(self, t: np.ndarray) -> np.ndarray:
        """Σ over intervals of their length before each instant of ``t``: Σ min(end, t) − Σ min(start, t)."""
        def sum_min(x: np.ndarray, cum: np.ndarray) -> np.ndarray:
            k = np.searchsorted(x, t, side="right")
            return cum[k] + (len(x) - k) * t
        return sum_min(self.ends, self.cum_ends) - sum_min(self.starts, self.cum_starts)


@dataclass(frozen=True)
class Lane:
    """One row of the Gantt: a PP rank's compute stream, one of its link tiers (``intra``/``inter``) or its
    exposed swap; busy intervals per category (F, B, I, W, OVERLAP_F_B; or a comm class; or ``swap``)."""

    rank: int
    stream: str
    cats: dict[str, Intervals]


@dataclass(frozen=True)
class Gantt:
    """A plan's simulated step as lanes (:func:`gantt_of`); ``step_s``: the simulated step's length in seconds
    (the pipeline only: the DP collectives and optimizer step after it are not simulated here)."""

    step_s: float
    lanes: tuple[Lane, ...]


def gantt_of(plan: Plan) -> Gantt:
    """Simulate ``plan``'s step (:func:`moeplan.replay.plan_timeline`; seconds for a 718B plan) and bucket it into
    lanes: per PP rank, its compute stream (F/B/I/W actions; both parts of an OVERLAP_F_B pair as OVERLAP_F_B), each link tier its collectives and
    p2p SENDs hold, colored by comm class (read from the stage programs, :func:`moeplan.cost_models.step.
    stage_programs`), and — when the plan has any — the exposed swap: ``memory.ranks[r].exposed_swap_s[chunk]``
    (copy out, prefetch) seconds at the end of each forward and the start of each backward of that chunk, where
    the simulator places them (cost_models/step.py ``stage_program``)."""
    from moeplan.replay import plan_timeline

    _, programs, tl = plan_timeline(plan)
    pp = plan.layout.pp
    spans: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
    p2p_tiers = plan.sharding.p2p.tier.split("+")
    paired = {(r, str(p)) for r, acts in enumerate(plan.schedule.actions)
              for a in acts if parse_action(a).kind == OVERLAP for p in compute_parts(a)}  # parts of OVERLAP_F_B pairs
    for e in tl.events:  # a pair's parts are two events that overlap in time
        if e.stream == "compute":
            kind = "OVERLAP_F_B" if (e.rank, e.action) in paired else parse_action(e.action).kind
            spans.setdefault((e.rank, "compute", kind), []).append((e.start_s, e.end_s))
        elif e.stream == "comm" and e.end_s > e.start_s:
            for tier in p2p_tiers:
                spans.setdefault((e.rank, tier, "pp"), []).append((e.start_s, e.end_s))
    parts: dict[tuple[int, str], tuple[float, float]] = {}
    for s in tl.segment_events:
        if s.stream == "compute":
            a, b = parts.get((s.rank, s.part), (s.start_s, s.end_s))
            parts[(s.rank, s.part)] = (min(a, s.start_s), max(b, s.end_s))
            continue
        action = parse_action(s.part)
        cls = programs[action.stage].phase(action.kind)[s.index].comm.comm_class
        for tier in s.stream.split("+"):
            spans.setdefault((s.rank, tier, cls), []).append((s.start_s, s.end_s))
    chunk_of = {plan.stages.stage_of(r, c): c for r in range(pp) for c in range(plan.layout.vpp)}
    swapping = {m.pp_rank: m.exposed_swap_s for m in plan.memory.ranks if any(map(any, m.exposed_swap_s))}
    for (rank, part), (start, end) in parts.items():
        if rank not in swapping:
            continue
        (action,) = compute_parts(part)
        out_s, fetch_s = swapping[rank][chunk_of[action.stage]]
        span = (end - out_s, end) if action.kind == "F" else (start, start + fetch_s) if action.kind != "W" else None
        if span and span[1] > span[0]:
            spans.setdefault((rank, "swap", "swap"), []).append(span)
    lanes = []
    for r in range(pp):
        for stream in ("compute", "intra", "inter", "swap"):
            cats = {k[2]: Intervals.of(v) for k, v in sorted(spans.items()) if k[:2] == (r, stream)}
            if cats or stream == "compute":
                lanes.append(Lane(rank=r, stream=stream, cats=cats))
    return Gantt(step_s=tl.step_time_s, lanes=tuple(lanes))


def _glyph(cat: str) -> str:
    return COMPUTE_GLYPHS.get(cat, cat[0])


def _style(cat: str) -> str:
    return COMPUTE_STYLES.get(cat) or CLASS_STYLES.get(cat, "white")


def scale_line(start_s: float, end_s: float, width: int) -> str:
    """The visible window and its scale, e.g. ``0 s – 7.507 s · 62.6 ms per column``."""
    return f"{fmt_s(start_s)} – {fmt_s(end_s)} · {fmt_s((end_s - start_s) / width)} per column"


def _axis(start_s: float, end_s: float, width: int) -> Text:
    step = max(12, width // 8)
    line = [" "] * width
    for col in range(0, width - 6, step):
        label = "|" + fmt_s(start_s + (end_s - start_s) * col / width).replace(" ", "")
        line[col:col + len(label)] = label
    return Text(" " * LABEL_WIDTH + "".join(line)[:width], style="dim")


def gantt_text(g: Gantt, start_s: float, end_s: float, width: int) -> Text:
    """Draw lanes over ``[start_s, end_s]`` in ``width`` columns: each cell shows the category that is busy longest
    in it — its glyph on its color when busy at least half the cell, the glyph alone when less, ``·`` when idle.
    Lines: the scale, a time axis, one line per lane, the legend. Raises PlanError on an empty window."""
    if not end_s > start_s or width < 1:
        raise PlanError(f"window=({start_s}, {end_s}) x {width} columns: needs end > start and width >= 1")
    edges = np.linspace(start_s, end_s, width + 1)
    cell = (end_s - start_s) / width
    out = Text(scale_line(start_s, end_s, width) + "\n", style="bold")
    out.append_text(_axis(start_s, end_s, width))
    seen: set[str] = set()
    for lane in g.lanes:
        out.append("\n")
        out.append(f"r{lane.rank} {lane.stream}".ljust(LABEL_WIDTH)[:LABEL_WIDTH],
                   style="bold" if lane.stream == "compute" else "dim")
        if not lane.cats:
            out.append("·" * width, style="dim")
            continue
        names = list(lane.cats)
        busy = np.stack([np.diff(lane.cats[n].busy_before(edges)) for n in names])
        best, amount = busy.argmax(axis=0), busy.max(axis=0)
        for col in range(width):
            if amount[col] <= 0:
                out.append("·", style="dim")
                continue
            cat = names[best[col]]
            seen.add(cat)
            full = amount[col] >= cell / 2
            out.append(_glyph(cat), style=f"bold black on {_style(cat)}" if full else _style(cat))
    out.append("\n")
    legend = [c for c in (*COMPUTE_STYLES, *CLASS_STYLES) if c in seen]
    for c in legend:
        out.append(f" {_glyph(c)} ", style=f"bold black on {_style(c)}")
        out.append(f" {CATEGORY_NAMES.get(c, c + ' comm')}  ")
    return out


def timeline_caption(plan: Plan) -> Text:
    """What the Gantt shows and leaves out."""
    return Text(f"One PP group's simulated step ({plan.schedule.kind}); lanes per pp rank: compute stream, link "
                f"tiers (collectives and p2p SENDs by comm class), exposed swap. The DP collectives and the "
                f"optimizer step that follow the pipeline are not drawn (exposed dp "
                f"{fmt_s(plan.prediction.exposed_comm_s.get('dp', 0.0))}, optimizer "
                f"{fmt_s(plan.prediction.optimizer_s)}).", style="dim")


# --- static output ----------------------------------------------------------------------------------------------

def print_static(console: Console, plan: Plan) -> None:
    """Every view, one after the other, as ``moeplan inspect --static`` prints it (the timeline over the whole
    step at the console's width; simulating it takes seconds on a 718B plan)."""
    console.print(Rule("overview"))
    console.print(overview(plan))
    console.print(Rule("stages"))
    console.print(stages_view(plan))
    console.print(Rule("memory"))
    console.print(memory(plan))
    console.print(Rule("timeline"))
    g = gantt_of(plan)
    console.print(gantt_text(g, 0.0, g.step_s, max(20, console.width - LABEL_WIDTH)), crop=False, soft_wrap=True)
    console.print(timeline_caption(plan))
    console.print(Rule("comm"))
    console.print(comm(plan))
