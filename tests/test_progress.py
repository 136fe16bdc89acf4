"""What a running search reports (moeplan.search_eval.SearchProgress) and how moeplan compile shows it on stderr
(moeplan.cli_progress): a rich bar on a terminal, a status line every few seconds otherwise."""
from __future__ import annotations

import io
import time

from rich.console import Console

from moeplan.cli_progress import SearchStatus, status_line
from moeplan.compile import compile_model
from moeplan.search import Fixed
from moeplan.search_eval import SearchProgress
from moeplan.spec import load_spec
from moeplan.targets import load_target


def test_the_search_reports_each_result_and_ends_with_its_own_counts():
    seen: list[SearchProgress] = []
    res = compile_model(spec=load_spec("tiny-pangu"), target=load_target("cpu"), num_devices=2,
                        fixed=Fixed(global_batch=8, seq_len=64), progress=seen.append, workers=1).result
    assert seen[0] == SearchProgress("estimate", res.num_options)
    sims = [p for p in seen if p.phase == "simulate"]
    assert [p.simulated for p in sims] == sorted(p.simulated for p in sims)  # results arrive one by one
    last = sims[-1]
    assert (last.options, last.simulated, last.pruned) == (res.num_options, res.num_evaluated, res.num_pruned)
    assert last.best_s == res.ranked[0].state.prediction.step_time_s
    assert all(p.simulated + p.pruned <= p.to_simulate for p in sims[:-1])


def test_off_a_terminal_a_status_line_comes_every_period_and_nothing_for_a_short_search():
    out = io.StringIO()
    with SearchStatus(Console(file=out, force_terminal=False, width=200), every_s=0.05) as status:
        status(SearchProgress("simulate", 30110, simulated=4, pruned=15390, to_simulate=8, best_s=8.105))
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert lines and all(line.startswith("search: 30,110 options · 4 simulated of 8 chosen · 15,390 pruned by a "
                                         "bound · best 8.105 s · ") for line in lines)
    quiet = io.StringIO()
    with SearchStatus(Console(file=quiet, force_terminal=False), every_s=10) as status:
        status(SearchProgress("estimate", 44))
    assert quiet.getvalue() == ""
    assert status_line(SearchProgress("estimate", 30110), 12.3) == ("search: estimating 30,110 options in closed "
                                                                     "form · 12 s")


def test_on_a_terminal_a_bar_shows_after_the_delay_and_is_gone_at_the_end():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with SearchStatus(console, after_s=0.01) as status:
        status(SearchProgress("estimate", 30110))
        time.sleep(0.6)
        assert status._bar is not None  # up after the delay
        status(SearchProgress("simulate", 30110, simulated=2, to_simulate=4, best_s=8.105))
        time.sleep(0.6)
    shown = out.getvalue()
    assert "estimating 30,110 options" in shown and "simulating · 0 pruned · best 8.105 s" in shown and "2/4" in shown
    assert status._bar is not None and status._bar.live.is_started is False
