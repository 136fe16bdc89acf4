"""Rich rendering of compile, describe and simulate results and of the models and targets lists, for the CLI (the core
never imports this)."""
from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:  # imported where used: `moeplan models` and `targets` need neither
    from moeplan.plan import Plan
    from moeplan.search import SearchResult

GIB = 1024**3


def compact(names: list[str]) -> str:
    """``['embedding', 'layers.0', 'layers.1', 'layers.2', 'mtp.0']`` → ``'embedding, layers.0-2, mtp.0'``."""
    out: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            out.append(f"layers.{run[0]}" if len(run) == 1 else f"layers.{run[0]}-{run[-1]}")
            run.clear()

    for n in names:
        if n.startswith("layers.") and (not run or int(n.split(".")[1]) == run[-1] + 1):
            run.append(int(n.split(".")[1]))
            continue
        flush()
        if n.startswith("layers."):
            run.append(int(n.split(".")[1]))
        else:
            out.append(n)
    flush()
    return ", ".join(out)


def layout_dict(plan: Plan) -> dict:
    p = plan.layout
    return {k: getattr(p, k) for k in ("tp", "pp", "vpp", "ep", "etp", "cp", "dp", "micro_batch", "global_batch",
                                       "seq_len")}


def predicted_dict(plan: Plan) -> dict:
    from moeplan.plan import MFU_DEFINITION

    p = plan.prediction
    return {"step_time_s": p.step_time_s, "tokens_per_s": p.tokens_per_s, "mfu": p.mfu, "hfu": p.hfu,
            "bubble": p.bubble, "peak_memory_bytes": p.peak_memory_bytes, "exposed_comm_s": p.exposed_comm_s,
            "comm": {k: v.model_dump() for k, v in p.comm.items()}, "host_wait_s": p.host_wait_s,
            "optimizer_s": p.optimizer_s, "schedule": plan.schedule.kind, "dispatcher": plan.comm.dispatcher,
            "overlap": plan.comm.overlap, "mfu_definition": MFU_DEFINITION}


def _rate(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def render_comm(console: Console, plan: Plan) -> None:
    """Per comm class: total, exposed, overlap rate (step and steady state), bytes per link tier."""
    t = Table(title=f"communication per step (dispatcher {plan.comm.dispatcher}; overlap "
                    f"{', '.join(plan.comm.overlap) or 'none'})")
    for col in ("class", "total", "exposed", "overlap", "steady overlap", "intra-node", "inter-node"):
        t.add_column(col)
    for cls, c in plan.prediction.comm.items():
        if not c.total_s:
            continue
        t.add_row(cls, f"{c.total_s:.3f} s", f"{c.exposed_s:.3f} s", _rate(c.overlap_rate),
                  _rate(c.steady_overlap_rate), f"{c.intra_bytes / GIB:.2f} GiB", f"{c.inter_bytes / GIB:.2f} GiB")
    console.print(t)


def plural(n: int, noun: str) -> str:
    """``1 micro-batch``, ``2 micro-batches`` (English plural: ``-es`` after s, x, ch, sh; else ``-s``)."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun}{'es' if noun.endswith(('s', 'x', 'ch', 'sh')) else 's'}"


SHAPE_FLAGS = {"seq_len": "--seq-len", "global_batch": "--global-batch"}


def shape_sources(model: str, *, seq_len: int | None = None, global_batch: int | None = None) -> dict[str, str]:
    """Where ``compile MODEL`` took each field of its training shape from, as moeplan.spec.load_spec reads MODEL:
    the ``command line`` (a value given here), the ``registry entry`` (a registry name whose file is a config.json),
    the ``model YAML`` (a moeplan YAML, by registry name or path) or the ``config.json default`` (a config.json given
    by path carries no training shape; when it is a registry entry's file, the entry's value is named). Keys
    ``seq_len`` and ``global_batch``."""
    from pathlib import Path

    from moeplan.spec import _registry

    root = resources.files("moeplan.examples") / "models"
    registry = _registry()
    entry = registry.get(model)
    twins = {} if entry is not None or not model.endswith(".json") else {
        n: e for n, e in registry.items() if Path(str(root / e["file"])).resolve() == Path(model).resolve()}
    out = {}
    for field, value in (("seq_len", seq_len), ("global_batch", global_batch)):
        if value is not None:
            out[field] = f"command line ({SHAPE_FLAGS[field]})"
        elif entry is not None and not entry["file"].endswith(".json"):
            out[field] = f"model YAML {entry['file']} of the registry"
        elif entry is not None and field in entry:
            out[field] = f"registry entry {model}"
        elif entry is None and not model.endswith(".json"):
            out[field] = f"model YAML {model}"
        else:
            notes = [f"the registry entry {n} uses {e[field]}" for n, e in twins.items() if field in e]
            out[field] = "; ".join(["config.json default (a config.json has no training shape", *notes,
                                    f"{SHAPE_FLAGS[field]} sets it)"])
    return out


def expert_load_line(plan: Plan) -> str:
    """What the plan assumes of expert routing, in one line: balanced, or the load trace, its window and policy,
    the mean and worst device imbalance over its layers, the step against the same plan under balanced routing,
    and the rebalances' price (docs/load-balance.md)."""
    load = plan.experts.load
    if load is None:
        return "balanced (no load trace: every routed expert gets T·top_k/E tokens)"
    imb = [x.imbalance for x in load.layers]
    worst = max(load.layers, key=lambda x: x.imbalance)
    step, base = plan.prediction.step_time_s, load.balanced_step_s
    replicas = f" + {load.replicas} replica slot(s) per rank" if load.replicas else ""
    cost = f"{step:.3f} s vs {base:.3f} s balanced ({step / base - 1:+.1%})" if base > 0 else f"{step:.3f} s"
    line = (f"trace {load.trace} (steps {load.window[0]}–{load.window[1]}), {load.policy}{replicas}: device "
            f"imbalance mean {sum(imb) / len(imb):.1%}, worst {worst.imbalance:.1%} (layer {worst.layer}); busiest "
            f"EP rank priced at ×{plan.layout.expert_load:.3f}; step {cost}")
    r = load.rebalance
    if r is not None:
        line += (f"; rebalanced every {r.every} steps: {r.moved_experts:.1f} experts moved, "
                 f"{r.sent_bytes / 2**20:.2f} MiB from the busiest rank, {r.seconds * 1e3:.2f} ms per rebalance "
                 f"(+{r.per_step_s * 1e3:.2f} ms per step)")
    return line


def render_plan(console: Console, plan: Plan, sources: dict[str, str] | None = None) -> None:
    """Layout, prediction, stages and memory of a plan; ``sources`` (:func:`shape_sources`) adds where the training
    shape came from."""
    from moeplan.plan import MEMORY_TERMS, MFU_DEFINITION

    lay, pred = plan.layout, plan.prediction
    console.print(Text.assemble((plan.model.name, "bold"), f" on {lay.num_devices} × {plan.target.name}"
                  f"{':' + plan.target.variant if plan.target.variant else ''} — "
                  f"tp {lay.tp} · pp {lay.pp} · vpp {lay.vpp} · ep {lay.ep} · etp {lay.etp} · cp {lay.cp} · "
                  f"dp {lay.dp} · micro-batch {lay.micro_batch} · {plural(lay.num_microbatches, 'micro-batch')} of "
                  f"{lay.global_batch} × {lay.seq_len}"))
    if sources:
        console.print(f"global batch {lay.global_batch} sequences from the {sources['global_batch']}; seq_len "
                      f"{lay.seq_len} tokens from the {sources['seq_len']}", markup=False)
    t = Table(title="predicted step", show_header=False)
    t.add_row("step time", f"{pred.step_time_s:.3f} s")
    t.add_row("tokens/s", f"{pred.tokens_per_s:,.0f}")
    t.add_row("MFU", f"{pred.mfu:.1%}  ({MFU_DEFINITION})")
    t.add_row("HFU", f"{pred.hfu:.1%}  (executed FLOPs incl. recompute and MTP)")
    t.add_row("bubble", f"{pred.bubble:.2%}  ({plan.schedule.kind})")
    t.add_row("exposed comm", ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in pred.exposed_comm_s.items() if v))
    if pred.host_wait_s:
        t.add_row("host-bound wait", f"{pred.host_wait_s * 1e3:.1f} ms (kernel launches after host syncs)")
    console.print(t)
    if plan.experts.load is not None:
        console.print(f"expert load: {expert_load_line(plan)}", markup=False)
    render_comm(console, plan)
    st = Table(title=f"stages (slowest chunk {plan.stages.imbalance:+.1%} over the mean)")
    for col in ("pp rank", "chunk", "stage", "layers", "time/mb"):
        st.add_column(col)
    for r, chunks in enumerate(plan.stages.chunks):
        for c, names in enumerate(chunks):
            st.add_row(str(r), str(c), str(plan.stages.stage_of(r, c)), compact(names),
                       f"{plan.stages.chunk_time_s[r][c] * 1e3:.1f} ms")
    console.print(st)
    console.print(Text(plan.stages.reason, style="dim"))
    budget = plan.memory.budget_bytes
    unit, scale = ("GiB", GIB) if budget >= GIB else ("MiB", 2**20)  # the cpu emulator's budgets are MiB
    mt = Table(title=f"memory per device, {unit} (budget {budget / scale:.1f} {unit}; "
                     f"{plan.memory.precision.short()})")
    for col in ("pp rank", "recompute", *(label for label, _ in MEMORY_TERMS), "total", "headroom"):
        mt.add_column(col)
    for m in plan.memory.ranks:
        mt.add_row(str(m.pp_rank), m.recompute, *(f"{getattr(m, f) / scale:.2f}" for _, f in MEMORY_TERMS),
                   f"{m.total_bytes / scale:.2f}", f"{(budget - m.total_bytes) / scale:+.2f}")
    console.print(mt)


def render_search(console: Console, result: SearchResult, top: int) -> None:
    """The best ``top`` layouts and the rejection counts."""
    t = Table(title=f"best {min(top, len(result.ranked))} of {result.num_evaluated} simulated "
                    f"({result.num_enumerated} enumerated)")
    for col in ("#", "layout", "strategy", "step", "tokens/s", "MFU", "bubble", "peak mem"):
        t.add_column(col)
    for i, ev in enumerate(result.ranked[:top]):
        p = ev.state.prediction
        t.add_row(str(i + 1), ev.state.layout.short(), ev.state.strategy.short(), f"{p.step_time_s:.3f} s",
                  f"{p.tokens_per_s:,.0f}",
                  f"{p.mfu:.1%}", f"{p.bubble:.2%}", f"{max(p.peak_memory_bytes) / GIB:.1f} GiB")
    console.print(t)
    if result.rejected:
        from moeplan.layout import REASONS

        console.print("rejected: " + "; ".join(f"{n} × {REASONS[r]}" for r, n in result.rejected.most_common()))


def search_summary(result: SearchResult) -> str:
    """One line: options simulated and pruned, and how far from the optimum the best can be (moeplan/bounds.py)."""
    head = (f"search: {result.num_options} options, {result.num_evaluated} through the full pipeline, "
            f"{result.num_pruned} pruned by a lower bound; ")
    if result.gap <= 0:
        return head + "the plan is the optimum under the cost model (no option left can beat it)"
    line = head + (f"{result.num_open} options left unsimulated have a lower bound below this plan's step (the "
                   f"least {result.bound_s:.3f} s), so one of them could be up to {result.gap:.1%} faster")
    if result.simulation_s > 0:
        cost = result.num_open * result.simulation_s / result.workers
        line += (f"; --exact settles it by simulating at most those, about {duration_text(cost)} at "
                 f"{result.simulation_s:.2g} s each on {result.workers} worker{'s' if result.workers > 1 else ''}")
    else:
        line += "; --exact settles it by simulating them"
    return line


def duration_text(seconds: float) -> str:
    """A duration for a person: ``45 s`` (at least ``1 s``), ``12 min``, ``3.2 h``."""
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def search_dict(result: SearchResult) -> dict:
    """The search's counts and bound for ``--json``."""
    return {"options": result.num_options, "evaluated": result.num_evaluated, "pruned": result.num_pruned,
            "bound_s": None if result.bound_s == float("inf") else result.bound_s, "gap": max(0.0, result.gap),
            "open": result.num_open, "simulation_s": result.simulation_s}


def models_rows() -> list[dict]:
    """One row per registry model (examples/models/registry.yaml): its file, architecture and default training
    shape (``seq_len`` tokens, ``global_batch`` sequences). Raises SpecError when an entry does not load."""
    from moeplan.spec import _registry, load_spec

    rows = []
    for name, entry in sorted(_registry().items()):
        s = load_spec(name)
        rows.append({"name": name, "file": entry["file"], "attention": s.attention, "layers": s.num_layers,
                     "dense_layers": s.num_dense_layers, "hidden_size": s.hidden_size, "experts": s.num_experts,
                     "top_k": s.top_k, "shared_experts": s.num_shared_experts, "mtp_layers": s.num_mtp_layers,
                     "seq_len": s.seq_len, "global_batch": s.global_batch})
    return rows


def render_models(console: Console, rows: list[dict]) -> None:
    """The table of :func:`models_rows`; below 120 columns without the file column (``--json`` has it), with short
    headers and no box, so that the rows fit 80 columns with every name whole."""
    from rich import box

    wide = console.width >= 120
    t = Table(title="models (registry names; a moeplan YAML or an HF config.json path works too)",
              box=box.HEAVY_HEAD if wide else None, pad_edge=wide, padding=(0, 1))
    t.add_column("name", no_wrap=True, min_width=max((len(r["name"]) for r in rows), default=4))  # what one types
    if wide:
        t.add_column("file", overflow="fold")
    heads = (("attention", "layers (dense)", "hidden", "experts", "MTP", "seq_len", "global batch") if wide else
             ("attn", "layers", "hidden", "experts", "MTP", "seq", "batch"))
    for col in heads:
        t.add_column(col, justify="left" if col in ("attention", "attn") else "right", no_wrap=not wide)
    for r in rows:
        experts = f"{r['experts']} top-{r['top_k']}" + (f" +{r['shared_experts']}" + " shared" * wide
                                                        if r["shared_experts"] else "") if r["experts"] else "dense"
        t.add_row(r["name"], *([r["file"]] if wide else []), r["attention"], f"{r['layers']} ({r['dense_layers']})",
                  str(r["hidden_size"]), experts, str(r["mtp_layers"]), str(r["seq_len"]), str(r["global_batch"]))
    console.print(t)
    if not wide:
        console.print("layers: decoder layers (dense ones); experts: routed, top-k, +shared; seq: tokens; batch: "
                      "sequences")


def targets_rows() -> list[dict]:
    """One row per shipped target and variant (targets/*.yaml; ``NAME:VARIANT`` selects a variant): backend, devices
    per node, memory (bytes), bf16 peak (FLOP/s) and link bandwidths (bytes/s per device). Raises TargetError when a
    file does not load."""
    import yaml

    from moeplan.targets import load_target, target_names

    rows = []
    for name in target_names():
        raw = yaml.safe_load((resources.files("moeplan.targets") / f"{name}.yaml").read_text())
        default = raw.get("default_variant")
        for variant in sorted(raw.get("variants") or {}, key=lambda v: v != default) or [None]:
            t = load_target(name, variant=variant)
            rows.append({"name": f"{name}:{variant}" if variant else name, "default": bool(variant) and variant == default,
                         "backend": t.backend, "devices_per_node": t.devices_per_node,
                         "memory_bytes": t.memory_bytes, "bf16_flops": t.cube_flops,
                         "intra_node_bytes_per_s": t.intra_node.bandwidth_bytes_per_s,
                         "inter_node_bytes_per_s": t.inter_node.bandwidth_bytes_per_s})
    return rows


def render_targets(console: Console, rows: list[dict]) -> None:
    """The table of :func:`targets_rows` (GiB = 2^30 bytes, TFLOP/s and GB/s = 10^12 and 10^9)."""
    t = Table(title="targets (--target NAME or NAME:VARIANT; * the default variant; or a target YAML path)")
    for col in ("name", "backend", "devices/node", "memory", "bf16 peak", "intra-node", "inter-node"):
        t.add_column(col, justify="left" if col in ("name", "backend") else "right")
    for r in rows:
        t.add_row(r["name"] + (" *" if r["default"] else ""), r["backend"], str(r["devices_per_node"]),
                  f"{r['memory_bytes'] / GIB:.0f} GiB", f"{r['bf16_flops'] / 1e12:,.1f} TFLOP/s",
                  f"{r['intra_node_bytes_per_s'] / 1e9:,.1f} GB/s", f"{r['inter_node_bytes_per_s'] / 1e9:,.1f} GB/s")
    console.print(t)
