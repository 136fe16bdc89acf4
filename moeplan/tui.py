"""``moeplan inspect``: a textual app that shows a plan's views (moeplan/views.py) one per tab.

Keys: ``1``–``5`` or tab / shift+tab switch views, ``?`` opens the help, ``q`` quits; on the timeline ``+`` / ``-``
zoom, ←/→ (or ``h``/``l``) pan, ``home`` shows the whole step, ↑/↓ scroll the lanes. The timeline is simulated the
first time its tab opens, in a worker thread (about 20 s on the 718B plan, docs/inspect.md). Imported only by the
CLI command.
"""
from __future__ import annotations

from rich.table import Table
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Header, Static, TabbedContent, TabPane
from textual.worker import Worker, WorkerState

from moeplan import views
from moeplan.plan import Plan

KEYS = (("1 … 5", "overview, stages, memory, timeline, comm"), ("tab / shift+tab", "next / previous view"),
        ("+ / -", "timeline: zoom in / out (×2)"), ("← → or h l", "timeline: pan by a quarter of the window"),
        ("home", "timeline: the whole step"), ("↑ ↓ pgup pgdn", "scroll"), ("?", "this help"), ("q", "quit"))


class HelpScreen(ModalScreen[None]):
    """The keys, over the current view; ``escape``, ``?`` or ``q`` closes it."""

    DEFAULT_CSS = "HelpScreen { align: center middle; } #help { width: auto; border: round $accent; }"
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        t = Table(title="moeplan inspect — keys", show_header=False)
        for key, what in KEYS:
            t.add_row(key, what)
        yield Static(t, id="help")


class GanttView(VerticalScroll):
    """The timeline tab: the Gantt of :func:`moeplan.views.gantt_text` over a zoomable, pannable window."""

    BINDINGS = [Binding("plus,equals_sign", "zoom(0.5)", "zoom in"), Binding("minus", "zoom(2)", "zoom out"),
                Binding("left,h", "pan(-0.25)", "pan left"), Binding("right,l", "pan(0.25)", "pan right"),
                Binding("home", "whole", "whole step")]

    def __init__(self, plan: Plan, **kw) -> None:
        super().__init__(**kw)
        self.plan = plan
        self.gantt: views.Gantt | None = None
        self.start_s = 0.0
        self.span_s = 0.0

    def compose(self) -> ComposeResult:
        yield Static("simulating the step …", id="gantt")
        yield Static(views.timeline_caption(self.plan))

    def show(self, gantt: views.Gantt) -> None:
        """Show ``gantt`` over the whole step."""
        self.gantt = gantt
        self.action_whole()

    @property
    def columns(self) -> int:
        """Columns of the time axis (the width left of the lane names and the scroll bar)."""
        return max(10, self.size.width - views.LABEL_WIDTH - 2)

    def redraw(self) -> None:
        if self.gantt is not None:
            self.query_one("#gantt", Static).update(
                views.gantt_text(self.gantt, self.start_s, self.start_s + self.span_s, self.columns))

    def on_resize(self) -> None:
        self.redraw()

    def _move(self, start_s: float, span_s: float) -> None:
        if self.gantt is None:
            return
        self.span_s = min(max(span_s, self.gantt.step_s * 1e-6), self.gantt.step_s)
        self.start_s = min(max(start_s, 0.0), self.gantt.step_s - self.span_s)
        self.redraw()

    def action_zoom(self, factor: float) -> None:
        """Scale the window by ``factor`` around its middle."""
        self._move(self.start_s + self.span_s * (1 - factor) / 2, self.span_s * factor)

    def action_pan(self, fraction: float) -> None:
        """Move the window by ``fraction`` of its width."""
        self._move(self.start_s + self.span_s * fraction, self.span_s)

    def action_whole(self) -> None:
        if self.gantt is not None:
            self._move(0.0, self.gantt.step_s)


class InspectApp(App[None]):
    """Tabs over a plan's views; the same content ``moeplan inspect --static`` prints."""

    TITLE = "moeplan inspect"
    BINDINGS = [*(Binding(str(i + 1), f"view('{v}')", v, show=False) for i, v in enumerate(views.VIEWS)),
                Binding("tab", "step(1)", "next view", show=False, priority=True),
                Binding("shift+tab", "step(-1)", "previous view", show=False, priority=True),
                Binding("question_mark", "help", "help"), Binding("q", "quit", "quit")]

    def __init__(self, plan: Plan) -> None:
        super().__init__()
        self.plan = plan
        self.simulating = False  # the timeline's worker has been started
        self.sub_title = f"{plan.model.name} on {plan.layout.num_devices} × {plan.target.name}"

    def compose(self) -> ComposeResult:
        yield Header()
        content = {"overview": views.overview, "stages": views.stages_view, "memory": views.memory,
                   "comm": views.comm}
        with TabbedContent(initial="overview"):
            for i, name in enumerate(views.VIEWS):
                with TabPane(f"{i + 1} {name}", id=name):
                    if name == "timeline":
                        yield GanttView(self.plan, id="gantt-view")
                    else:
                        with VerticalScroll():
                            yield Static(content[name](self.plan), id=f"{name}-view")
        yield Footer()

    def action_view(self, name: str) -> None:
        self.query_one(TabbedContent).active = name

    def action_step(self, delta: int) -> None:
        tabs = self.query_one(TabbedContent)
        self.action_view(views.VIEWS[(views.VIEWS.index(tabs.active) + delta) % len(views.VIEWS)])

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        if event.pane.id == "timeline":
            gantt = self.query_one(GanttView)
            gantt.focus()
            if not self.simulating:
                self.simulating = True
                self.run_worker(lambda: views.gantt_of(self.plan), thread=True, name="simulate",
                                exit_on_error=False)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.name != "simulate":
            return
        if event.state == WorkerState.SUCCESS:
            self.query_one(GanttView).show(event.worker.result)
        elif event.state == WorkerState.ERROR:
            self.query_one("#gantt", Static).update(f"simulation failed: {event.worker.error}")
