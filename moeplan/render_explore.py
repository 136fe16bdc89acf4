"""What ``moeplan explore`` writes and prints: the CSV, the Pareto PNG, the rich table and the JSON summary (the
core never imports this)."""
from __future__ import annotations

import csv
import io
import statistics
from typing import Iterator

from rich.console import Console
from rich.table import Table
from rich.text import Text

from moeplan.explore import SHORT_NAMES, ExploreResult, Verified, pareto
from moeplan.layout import Layout

GIB = 1024**3


def gaps(result: ExploreResult) -> list[float]:
    """Screened step / full-pipeline step − 1 of each verified architecture (verified order)."""
    screened = {s.index: s for s in result.screened}
    return [screened[v.index].step_s / v.step_s - 1 for v in result.verified if v.status == "ok"]


def explore_summary(result: ExploreResult, top: int) -> dict:
    """What the table shows, as data: counts, timings, the verification gap and the ``top`` best."""
    g = gaps(result)
    verified = {v.index: v for v in result.verified}
    kept = result.archs.kept
    best = []
    for s in result.ranked()[:top]:
        a, v = kept[s.index], verified.get(s.index)
        best.append({"name": a.spec.name, **dict(a.values), "total_params_b": a.total_params / 1e9,
                     "activated_params_b": a.activated_params / 1e9, "layout": s.layout.short(),
                     "strategy": s.strategy.short(), "screen_step_s": s.step_s, "screen_tokens_per_s": s.tokens_per_s,
                     "screen_mfu": s.mfu, "screen_memory_gib": s.memory_bytes / GIB, "screen_fits": s.fits,
                     "full_step_s": v.step_s if v and v.status == "ok" else None,
                     "full_layout": v.layout.short() if v and v.status == "ok" else None})
    return {"combinations": result.archs.combinations, "kept": len(kept),
            "rejected": dict(result.archs.rejected), "screened_ok": sum(s.status == "ok" for s in result.screened),
            "shortlist": len(result.shortlist), "screen_s": result.screen_s, "verify_s": result.verify_s,
            "verified": len(result.verified), "verified_failed": sum(v.status != "ok" for v in result.verified),
            "gap_max_abs": max(map(abs, g), default=None), "gap_median": statistics.median(g) if g else None,
            "pareto": [kept[s.index].spec.name for s in pareto(result)], "best": best}


def verified_line(v: Verified, name: str) -> str:
    """One verification as it finishes (``moeplan explore`` prints it above its progress bar)."""
    if v.status != "ok":
        return f"verified {name}: failed: {v.reason}"
    assert v.layout is not None and v.strategy is not None
    return (f"verified {name}: {v.layout.short()} {v.strategy.short()}, step {v.step_s:.3f} s, "
            f"{v.tokens_per_s:,.0f} tokens/s, MFU {v.mfu:.1%} (compiled in {v.compile_s:.1f} s)")


def render_explore(console: Console, result: ExploreResult, top: int) -> None:
    """The best ``top`` architectures with their layouts and both figures, then one line per phase."""
    kept = result.archs.kept
    verified = {v.index: v for v in result.verified}
    varied = list(result.space.choices.varied())
    t = Table(title=f"{result.space.name} on {result.num_devices} x {result.target.name}: best by screened "
                    f"tokens/s", title_justify="left")
    t.add_column("#", justify="right")
    for name in varied:
        t.add_column(SHORT_NAMES[name], justify="right")
    for col in ("total B", "act B", "layout", "schedule", "step s", "tok/s", "MFU", "GiB", "full s", "gap"):
        t.add_column(col, justify="left" if col in ("layout", "schedule") else "right",
                     no_wrap=col in ("layout", "schedule"))
    for rank, s in enumerate(result.ranked()[:top], 1):
        a, v = kept[s.index], verified.get(s.index)
        values = dict(a.values)
        full = gap = "" if v is None else "failed"
        if v is not None and v.status == "ok":
            full, gap = f"{v.step_s:.3f}", f"{s.step_s / v.step_s - 1:+.1%}"
        t.add_row(str(rank), *(str(values[n]) for n in varied), f"{a.total_params / 1e9:.0f}",
                  f"{a.activated_params / 1e9:.1f}", _short(s.layout), s.strategy.schedule,
                  f"{s.step_s:.3f}", f"{s.tokens_per_s:,.0f}", f"{s.mfu:.1%}",
                  f"{s.memory_bytes / GIB:.1f}" + ("" if s.fits else " !"), full, gap)
    console.print(t)
    console.print(Text(f"{', '.join(f'{SHORT_NAMES[n]}: {n}' for n in varied)}; layout tp-pp-vpp-ep-cp-mb; GiB: "
                       f"the screen's memory estimate (! over the device); gap: screened step / full step - 1",
                       style="dim"))
    rej = ", ".join(f"{n} {r}" for r, n in result.archs.rejected.most_common(3))
    no_layout = sum(s.status != "ok" for s in result.screened)
    console.print(f"{result.archs.combinations:,} combinations, {len(kept):,} meet the constraints"
                  + (f" (left out: {rej})" if rej else "") + f"; screened in {result.screen_s:.1f} s over "
                  f"{len(result.shortlist)} shortlisted layouts" + (f"; {no_layout} with no shortlist layout that fits"
                                                               if no_layout else ""))
    g = gaps(result)
    if result.verified:
        console.print(f"verified {len(result.verified)} with the full pipeline in {result.verify_s:.1f} s: screen vs "
                      f"full median {statistics.median(g):+.1%}, worst {max(g, key=abs):+.1%}" if g else
                      f"verified {len(result.verified)}: every compile failed")


def _short(lay: Layout) -> str:
    return f"{lay.tp}-{lay.pp}-{lay.vpp}-{lay.ep}-{lay.cp}-{lay.micro_batch}"


CSV_COLUMNS = ("rank", "name", "total_params", "activated_params", "status", "reason", "layout", "schedule",
               "screen_step_s", "screen_tokens_per_s", "screen_mfu", "screen_memory_gib", "screen_fits",
               "full_layout", "full_step_s", "full_tokens_per_s", "full_mfu", "full_peak_memory_gib",
               "screen_vs_full")


def rows(result: ExploreResult) -> Iterator[dict]:
    """One CSV row per kept architecture, best screened first (then those without a layout); the varied fields
    first."""
    verified = {v.index: v for v in result.verified}
    order = result.ranked() + [s for s in result.screened if s.status != "ok"]
    for rank, s in enumerate(order, 1):
        a = result.archs.kept[s.index]
        v = verified.get(s.index)
        row = {k: val for k, val in a.values}
        row.update(rank=rank if s.status == "ok" else "", name=a.spec.name, total_params=a.total_params,
                   activated_params=a.activated_params, status=s.status, reason=s.reason)
        if s.status == "ok":
            row.update(layout=s.layout.short(), schedule=s.strategy.short(), screen_step_s=f"{s.step_s:.6g}",
                       screen_tokens_per_s=f"{s.tokens_per_s:.6g}", screen_mfu=f"{s.mfu:.4g}",
                       screen_memory_gib=f"{s.memory_bytes / GIB:.4g}", screen_fits=s.fits)
        if v is not None and v.status == "ok":
            row.update(full_layout=v.layout.short(), full_step_s=f"{v.step_s:.6g}",
                       full_tokens_per_s=f"{v.tokens_per_s:.6g}", full_mfu=f"{v.mfu:.4g}",
                       full_peak_memory_gib=f"{v.peak_memory_bytes / GIB:.4g}",
                       screen_vs_full=f"{s.step_s / v.step_s - 1:.4f}")
        elif v is not None:
            row.update(reason=v.reason)
        yield row


def to_csv(result: ExploreResult) -> str:
    varied = list(result.space.choices.varied())
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=varied + list(CSV_COLUMNS), extrasaction="raise", lineterminator="\n")
    w.writeheader()
    for row in rows(result):
        w.writerow(row)
    return buf.getvalue()


def pareto_png(result: ExploreResult) -> bytes:
    """PNG of every screened architecture (activated parameters against tokens/s, total parameters as colour) with
    the Pareto front drawn over it and the verified figures as open markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [s for s in result.screened if s.status == "ok" and s.fits]
    kept = result.archs.kept
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    sc = ax.scatter([kept[s.index].activated_params / 1e9 for s in ok], [s.tokens_per_s for s in ok],
                    c=[kept[s.index].total_params / 1e9 for s in ok], s=6, cmap="viridis", alpha=0.6,
                    linewidths=0)
    fig.colorbar(sc, ax=ax, label="total parameters (B)")
    front = pareto(result)
    ax.plot([kept[s.index].activated_params / 1e9 for s in front], [s.tokens_per_s for s in front], "-o",
            color="crimson", markersize=3, linewidth=1, label="Pareto front (screen)")
    done = [v for v in result.verified if v.status == "ok"]
    if done:
        ax.scatter([kept[v.index].activated_params / 1e9 for v in done], [v.tokens_per_s for v in done],
                   facecolors="none", edgecolors="black", s=30, label="full pipeline (verified)")
    ax.set_xlabel("activated parameters (B)")
    ax.set_ylabel("tokens/s (whole cluster)")
    ax.set_title(f"{result.space.name}: {len(ok):,} architectures on {result.num_devices} x {result.target.name}")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()
