"""``moeplan inspect``: the views (moeplan/views.py), the textual app (moeplan/tui.py) driven by textual's pilot, the
``--static`` output and the one-line errors on bad plan files."""
import asyncio
import html
import re
from importlib import resources
from collections import Counter

import numpy as np
import pytest
from inprocess import run_moeplan
import yaml
from typer.testing import CliRunner

from moeplan import views
from moeplan.actions import compute_parts
from moeplan.cli import app as cli_app
from moeplan.compile import compile_model
from moeplan.errors import PlanError
from moeplan.plan import save_plan
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.targets import load_target
from moeplan.tui import GanttView, HelpScreen, InspectApp

UNIQUE = {"overview": "predicted step", "stages": "bottleneck (highlighted)", "memory": "memory per device",
          "timeline": "per column", "comm": "communication per step"}


@pytest.fixture(scope="module")
def plan():
    # dualpipev with fb overlap: F, B, I, W and OVERLAP_F_B actions, ep collectives; ilp: per-op recompute decisions
    # and a solver status for the memory view
    return compile_model(spec=load_spec("tiny-pangu"), target=load_target("ascend-910b"), num_devices=4,
                         fixed=Fixed(global_batch=8, seq_len=64, pp=2, vpp=2, ep=2, micro_batch=1,
                                     schedule="dualpipev", overlap=frozenset({"fb"}), recompute="ilp"),
                         workers=1).plan


@pytest.fixture(scope="module")
def plan_file(plan, tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "tiny.yaml"
    save_plan(plan, path)
    return path


def slow_rank(plan, rank):
    """The plan with ``rank``'s chunks 10x slower (its chunk 0 the slowest) than every other chunk."""
    top = max(map(max, plan.stages.chunk_time_s))
    times = [[top * (20 if c == 0 else 10) if r == rank else t for c, t in enumerate(row)]
             for r, row in enumerate(plan.stages.chunk_time_s)]
    return plan.model_copy(update={"stages": plan.stages.model_copy(update={"chunk_time_s": times})})


def screen_text(app):
    """What the terminal shows, from textual's SVG screenshot."""
    return html.unescape(re.sub(r"<[^>]+>", "", app.export_screenshot())).replace("\xa0", " ")


def drive(plan, script, size=(120, 40)):
    """Run the app at ``size`` (columns, rows) and ``await script(app, pilot)`` in it."""
    async def main():
        app = InspectApp(plan)
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await script(app, pilot)
    asyncio.run(main())


async def show(app, pilot, key):
    await pilot.press(key)
    await app.workers.wait_for_complete()
    await pilot.pause()
    return app.query_one("TabbedContent").active, screen_text(app)


def test_every_view_opens_by_number_and_tab(plan):
    async def script(app, pilot):
        assert UNIQUE["overview"] in screen_text(app)
        for i, name in enumerate(views.VIEWS):
            active, text = await show(app, pilot, str(i + 1))
            assert active == name and UNIQUE[name] in text, (name, text[-2000:])
            assert all(UNIQUE[other] not in text for other in views.VIEWS if other != name), name
        assert (await show(app, pilot, "tab"))[0] == "overview"  # wraps around after comm
        assert (await show(app, pilot, "tab"))[0] == "stages"
        assert (await show(app, pilot, "shift+tab"))[0] == "overview"
        await pilot.press("q")
        await pilot.pause()
        assert app.return_code == 0 and not app.is_running
    drive(plan, script)


def test_help_opens_and_closes(plan):
    async def script(app, pilot):
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen) and "zoom in" in screen_text(app)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen) and app.is_running
    drive(plan, script)


def test_timeline_zoom_and_pan_change_the_window(plan):
    async def script(app, pilot):
        _, text = await show(app, pilot, "4")
        view = app.query_one(GanttView)
        step = view.gantt.step_s
        assert view.start_s == 0 and view.span_s == pytest.approx(step)
        assert views.scale_line(0, step, view.columns) in text and "r1 compute" in text
        assert "F&B pair (OVERLAP_F_B)" in text  # the legend lists what the window shows
        _, text = await show(app, pilot, "plus")
        assert view.span_s == pytest.approx(step / 2) and view.start_s == pytest.approx(step / 4)
        assert views.scale_line(step / 4, 3 * step / 4, view.columns) in text
        _, text = await show(app, pilot, "right")
        assert view.start_s == pytest.approx(step / 4 + step / 8)
        _, text = await show(app, pilot, "minus")
        _, text = await show(app, pilot, "minus")  # never wider than the step
        assert view.start_s == 0 and view.span_s == pytest.approx(step)
    drive(plan, script)


@pytest.mark.parametrize("rank", [0, 1])
def test_bottleneck_is_the_slow_rank(plan, rank):
    slow = slow_rank(plan, rank)
    assert views.bottleneck(slow) == (rank, 0)
    table = views.stages(slow)
    assert [row.style is not None for row in table.rows] == [r == rank for r in range(2)]
    marked = [(r, c) for c, col in enumerate(table.columns[1:3]) for r, cell in enumerate(col._cells)
              if str(cell).startswith("▶")]
    assert marked == [(rank, 0)]

    async def script(app, pilot):
        _, text = await show(app, pilot, "2")
        assert f"bottleneck (highlighted): pp rank {rank}," in text
        stage = slow.stages.stage_of(rank, 0)
        assert f"▶ stage {stage} ·" in text and text.count("▶") == 2  # the cell and the caption
    drive(slow, script)


def test_gantt_cells_show_the_longest_busy_category():
    lane = views.Lane(rank=0, stream="compute", cats={"F": views.Intervals.of([(0.0, 1.0), (4.0, 4.2)]),
                                                       "B": views.Intervals.of([(2.0, 3.0)])})
    busy = lane.cats["F"].busy_before(np.array([0.0, 0.5, 1.0, 4.1, 10.0]))
    assert busy == pytest.approx([0.0, 0.5, 1.0, 1.1, 1.2])
    text = views.gantt_text(views.Gantt(step_s=5.0, lanes=(lane,)), 0.0, 5.0, 5).plain.splitlines()
    assert text[0] == views.scale_line(0.0, 5.0, 5) and text[2] == "r0 compute".ljust(views.LABEL_WIDTH) + "F·B·F"
    with pytest.raises(PlanError, match="window"):
        views.gantt_text(views.Gantt(step_s=5.0, lanes=(lane,)), 2.0, 2.0, 5)


def test_gantt_lanes_cover_the_simulated_actions(plan):
    g = views.gantt_of(plan)
    compute = {lane.rank: lane for lane in g.lanes if lane.stream == "compute"}
    assert sorted(compute) == [0, 1]
    for r, lane in compute.items():
        n = Counter()
        for a in plan.schedule.actions[r]:
            parts = compute_parts(a)
            n.update({"OVERLAP_F_B": 2} if len(parts) == 2 else {p.kind: 1 for p in parts})
        assert {k: len(v.starts) for k, v in lane.cats.items()} == n and {"F", "I", "W", "OVERLAP_F_B"} <= set(n)
    assert {c for lane in g.lanes if lane.stream != "compute" for c in lane.cats} == {"ep", "pp"}
    # an exposed swap on rank 1, chunk 1 (the simulator holds the compute stream for it after each forward and
    # before each backward): the swap lane shows it there
    out_s, fetch_s = 1e-4, 2e-4
    ranks = [m.model_copy(update={"exposed_swap_s": [[0, 0], [out_s, fetch_s]]}) if m.pp_rank == 1 else m
             for m in plan.memory.ranks]
    swapped = plan.model_copy(update={"memory": plan.memory.model_copy(update={"ranks": ranks})})
    g = views.gantt_of(swapped)
    (swap,) = [lane for lane in g.lanes if lane.stream == "swap"]
    n = plan.layout.num_microbatches
    assert swap.rank == 1 and len(swap.cats["swap"].starts) == 2 * n
    assert swap.cats["swap"].busy_before(np.array([g.step_s]))[0] == pytest.approx(n * (out_s + fetch_s))


def test_memory_and_comm_views_show_the_plan(plan):
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(views.memory(plan), views.comm(plan), views.overview(plan))
    text = console.export_text()
    ops = [op for m in plan.memory.ranks for d in m.decisions for op in d.ops]
    assert ops and all((op.flag or "none") in text for op in ops)
    assert "optimal" in text and plan.prediction.mfu_definition.split(";")[0] in text
    assert all(cls in text for cls in plan.prediction.comm)


@pytest.mark.parametrize("args", [[], ["--static"]])
def test_static_output_has_every_section(plan_file, args):
    res = CliRunner().invoke(cli_app, ["inspect", str(plan_file), *args])  # not a terminal: static implied
    assert res.exit_code == 0, res.output
    for name in views.VIEWS:
        assert f"─ {name} ─" in res.output and UNIQUE[name] in res.output, name


@pytest.mark.parametrize("case", ["schema_version", "truncated", "binary"])
def test_bad_plan_exits_2_with_one_line(plan_file, tmp_path, case):
    bad = tmp_path / "bad.yaml"
    text = plan_file.read_text()
    if case == "schema_version":
        data = yaml.safe_load(text)
        data["schema_version"] = 1
        bad.write_text(yaml.safe_dump(data))
    elif case == "truncated":
        bad.write_text(text[: len(text) // 2])
    else:
        bad.write_bytes(bytes(range(256)) * 8)
    proc = run_moeplan("inspect", bad, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: ") and proc.stdout == ""
    assert {"schema_version": "schema_version=1", "truncated": "bad.yaml", "binary": "not a text file"}[case] in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_plan_text_is_printed_as_it_is_never_as_markup(plan, tmp_path):
    """Names and reasons come from the user's files: ``[/oops]`` raised rich's MarkupError in ``inspect``,
    ``describe``, ``compile`` and ``compare``; ``[bold]`` would have vanished into a style."""
    odd = "[/oops] [bold]x"
    p = plan.model_copy(update={"model": plan.model.model_copy(update={"name": odd}),
                                "target": plan.target.model_copy(update={"name": odd}),
                                "stages": plan.stages.model_copy(update={"reason": odd})})
    save_plan(p, tmp_path / "odd.yaml")
    proc = run_moeplan("inspect", tmp_path / "odd.yaml", "--static")
    assert proc.returncode == 0 and proc.stdout.count(odd) >= 3, proc.stderr

    async def script(app, pilot):
        for i, name in enumerate(views.VIEWS):
            active, text = await show(app, pilot, str(i + 1))
            assert active == name, name
            if name in ("overview", "stages"):
                assert odd in text, name
    drive(p, script)
    model = tmp_path / "odd-model.yaml"
    model.write_text(f"name: {odd!r}\n" + "".join(
        line for line in (resources.files("moeplan.examples") / "models" / "tiny-pangu.yaml").read_text()
        .splitlines(keepends=True) if not line.startswith("name:")))
    for args in (("describe", model), ("compile", model, "--target", "cpu", "--devices", "2")):
        proc = run_moeplan(*args)
        assert proc.returncode == 0 and proc.stdout.startswith(odd), proc.stderr


@pytest.mark.parametrize("which", ["tiny", "718b"])
def test_every_view_fits_the_terminal(plan, plan_718b, which):
    """At 80 columns the memory view collapsed to cells of "2…", the 718B's comm view to "…" in every cell and its
    stages to "layers.…"; the TUI leaves the tables 78 columns (80 less its scroll bar). Each table view fits 78
    columns without cutting a cell, and a wide console gets the full tables: every memory term, the steady-state
    columns beside the step's, the bordered stages (from :func:`moeplan.views.stages_width`)."""
    import io

    from rich.console import Console

    p = plan if which == "tiny" else plan_718b
    for width, wide in ((78, False), (200, True)):
        for view in (views.overview, views.stages_view, views.memory, views.comm):
            buf = io.StringIO()
            Console(file=buf, width=width, color_system=None).print(view(p))
            text = buf.getvalue()
            assert max(map(len, text.splitlines())) <= width and "…" not in text, (view.__name__, width, text)
            if view is views.memory:
                rows = [line for line in text.splitlines() if re.search(r"\(\d+ mb\)", line)]  # one per PP rank
                assert len(rows) == len(p.memory.ranks) and ("gathered" in text) == wide, text  # a wide-only term
                unit, scale = views.unit_of(max(m.total_bytes for m in p.memory.ranks))
                assert all(f"{m.total_bytes / scale:.2f}" in text for m in p.memory.ranks), width
            if view is views.comm:
                assert ("steady exposed" in text) == wide and all(cls in text for cls in p.prediction.comm), text
            if view is views.stages_view:
                assert ("┃ pp rank" in text) == (width >= views.stages_width(p)) and all(f"stage {s} " in text or f"stage {s}\n" in text
                                                             for s in range(p.layout.pp * p.layout.vpp)), text


def screen_lines(app) -> list[str]:
    """The terminal's lines as characters at their columns (the SVG screenshot's text loses the cells' spaces)."""
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=app.size.width, height=app.size.height, color_system=None,
                      record=True)
    console.print(app.screen._compositor.render_update(full=True))
    return console.export_text().splitlines()


def test_no_table_runs_under_the_scroll_bar_at_80_columns(plan_718b):
    """At 80×24 the scroll bar takes the last two columns of a view; a table drawn 80 wide had its border and last
    cells under the bar's glyphs. On every table view of the 718B plan, top and one page down, no line is wider than
    the terminal and no table's border or rule reaches those two columns (a view that fits today scrolls on a
    shorter terminal: the comm table, 80 wide, failed this before the narrow views)."""
    box = set("│┃┐┓┘┛┤┫┼╋╇┩┏┗└┌─━┬┳┴┻")

    async def script(app, pilot):
        for key in ("1", "2", "3", "5"):
            await pilot.press(key)
            await pilot.pause()
            for _ in range(2):
                lines = screen_lines(app)[3:-1]  # between the tabs and the footer
                assert all(len(line) <= 80 and not set(line[78:80]) & box for line in lines), (key, "\n".join(lines))
                await pilot.press("pagedown")
                await pilot.pause()
    drive(plan_718b, script, size=(80, 24))
