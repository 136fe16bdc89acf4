"""Rich rendering of compile, describe and simulate results for the CLI (the core never imports this)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from moeplan.plan import MFU_DEFINITION, Plan
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


def render_plan(console: Console, plan: Plan) -> None:
    """Layout, prediction, stages and memory of a plan."""
    lay, pred = plan.layout, plan.prediction
    console.print(f"[bold]{plan.model.name}[/] on {lay.num_devices} × {plan.target.name}"
                  f"{':' + plan.target.variant if plan.target.variant else ''} — "
                  f"tp {lay.tp} · pp {lay.pp} · vpp {lay.vpp} · ep {lay.ep} · etp {lay.etp} · cp {lay.cp} · "
                  f"dp {lay.dp} · micro-batch {lay.micro_batch} · {lay.num_microbatches} micro-batches of "
                  f"{lay.global_batch} × {lay.seq_len}")
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
    render_comm(console, plan)
    st = Table(title=f"stages (slowest chunk {plan.stages.imbalance:+.1%} over the mean)")
    for col in ("pp rank", "chunk", "stage", "layers", "time/mb"):
        st.add_column(col)
    for r, chunks in enumerate(plan.stages.chunks):
        for c, names in enumerate(chunks):
            stage = c * lay.pp + r if plan.stages.placement == "loop" else (r if c == 0 else 2 * lay.pp - 1 - r)
            st.add_row(str(r), str(c), str(stage), compact(names),
                       f"{plan.stages.chunk_time_s[r][c] * 1e3:.1f} ms")
    console.print(st)
    console.print(f"[dim]{plan.stages.reason}[/]")
    mt = Table(title=f"memory per device (budget {plan.memory.budget_bytes / GIB:.1f} GiB)")
    for col in ("pp rank", "recompute", "params", "grads", "optimizer", "activations", "workspace", "total"):
        mt.add_column(col)
    for m in plan.memory.ranks:
        mt.add_row(str(m.pp_rank), m.recompute, *(f"{x / GIB:.2f} GiB" for x in (
            m.params_bytes, m.grads_bytes, m.optimizer_bytes, m.activation_bytes, m.workspace_bytes,
            m.total_bytes)))
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
        console.print("rejected: " + "; ".join(f"{n} × {r}" for r, n in result.rejected.most_common()))


def search_summary(result: SearchResult) -> str:
    """One line: options simulated and pruned, and how far from the optimum the best can be (moeplan/bounds.py)."""
    head = (f"search: {result.num_options} options, {result.num_evaluated} through the full pipeline, "
            f"{result.num_pruned} pruned by a lower bound; ")
    if result.gap <= 0:
        return head + "the plan is the optimum under the cost model (no option left can beat it)"
    return head + (f"the options left are bounded below by {result.bound_s:.3f} s: the plan is within "
                   f"{result.gap:.1%} of the optimum (--exact proves it)")


def search_dict(result: SearchResult) -> dict:
    """The search's counts and bound for ``--json``."""
    return {"options": result.num_options, "evaluated": result.num_evaluated, "pruned": result.num_pruned,
            "bound_s": None if result.bound_s == float("inf") else result.bound_s, "gap": max(0.0, result.gap)}
