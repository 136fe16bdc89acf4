"""``moeplan compare``'s per-comm-class table (moeplan.runtime.compare.comm_class_rows): bytes per link tier, exposed
seconds and overlap rate, predicted vs measured — on hand-made step records, and on a real short run through the
command line (``moeplan run --force-balanced-routing``, then ``moeplan compare --json`` and the table)."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from moeplan.compile import compile_model
from moeplan.plan import save_plan
from moeplan.errors import PlanError
from moeplan.runtime.compare import (comm_class_rows, measured_window, read_records, render_comm_classes,
                                     rows_json)
from moeplan.runtime.data import stdlib_tokens
from moeplan.runtime.metrics import RankStep, StepRecord
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.targets import load_target

sys.path.insert(0, str(Path(__file__).parent.parent))
from inprocess import run_moeplan  # noqa: E402


def moeplan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeplan.cli", *args], capture_output=True, text=True, timeout=300)


def hierarchical_plan(seq_len: int = 64):
    """4 ranks as 2 nodes × 2, EP 4 over both nodes, the hierarchical dispatcher (fp32 cpu target)."""
    return compile_model(spec=load_spec("tiny-pangu"), target=load_target("cpu", devices_per_node=2), num_devices=4,
                         fixed=Fixed(global_batch=8, seq_len=seq_len, pp=1, tp=1, cp=1, ep=4, micro_batch=2,
                                     dispatcher="hierarchical", recompute="none"),
                         workers=1, candidates=1).plan


@pytest.fixture(scope="module")
def plan():
    return hierarchical_plan()


def _record(step: int, ranks: list[dict]) -> StepRecord:
    return StepRecord(step=step, loss=1.0, step_time_s=1.0, tokens_per_s=1.0, grad_norm=1.0, host=None,
                      ranks=tuple(RankStep(rank=i, pp_rank=0, action_s={"F": 0.1}, comm_bytes={}, cpu_s=0.1,
                                           peak_saved_bytes=0, **r) for i, r in enumerate(ranks)))


def test_measured_window_names_its_steps_or_refuses_one_past_the_run():
    records = [_record(step, [{"comm_s": {}}]) for step in (1, 2, 3)]
    assert [r.step for r in measured_window(records)] == [2, 3]  # shorter than 5 steps: every step after the first
    assert [r.step for r in measured_window(records, 1)] == [1, 2, 3]
    assert [r.step for r in measured_window([_record(s, [{"comm_s": {}}]) for s in range(1, 9)])] == [5, 6, 7, 8]
    with pytest.raises(PlanError, match=r"first_step=1000: the metrics end at step 3; give a step from 1 to 3"):
        measured_window(records, 1000)


def _rows(plan, records) -> dict[str, object]:
    return {r.quantity: r for r in comm_class_rows(plan, records, first_step=1)}


def test_rows_hold_the_plan_and_the_rank_means(plan):
    """ep: tier bytes are the mean over ranks (median over steps); exposed the mean of comm_s; the overlap rate
    1 − Σ comm_s / Σ comm_busy_s; dp: waited, with its tiers not tallied by the runtime."""
    ranks = [dict(comm_s={"ep": 0.2, "dp": 0.1}, comm_busy_s={"ep": 0.5},
                  comm_tier_bytes={"ep": {"intra": 100, "inter": 1000}}),
             dict(comm_s={"ep": 0.4, "dp": 0.3}, comm_busy_s={"ep": 1.0},
                  comm_tier_bytes={"ep": {"intra": 300, "inter": 1000}})] * 2
    rows = _rows(plan, [_record(1, ranks), _record(2, ranks)])
    pred = plan.prediction.comm["ep"]
    assert rows["comm ep intra-node bytes"].predicted == pred.intra_bytes  # fp32 plan: no scaling
    assert rows["comm ep intra-node bytes"].measured == 200
    assert rows["comm ep inter-node bytes"].measured == 1000
    assert rows["comm ep exposed"].predicted == pred.exposed_s
    assert rows["comm ep exposed"].measured == pytest.approx(0.3)
    assert rows["comm ep overlap rate"].measured == pytest.approx(1 - 0.6 / 1.5)
    assert rows["comm ep overlap rate"].predicted == pred.overlap_rate
    # dp: no busy figure means synchronous (busy = waited): overlap 0; tiers not measured
    assert rows["comm dp overlap rate"].measured == pytest.approx(0.0)
    assert rows["comm dp exposed"].measured == pytest.approx(0.2)
    assert rows["comm dp inter-node bytes"].measured is None
    assert rows["comm dp inter-node bytes"].ratio is None
    assert "comm cp exposed" not in rows  # neither planned nor measured


def test_metrics_without_the_new_fields_still_compare(plan):
    """Metrics written before comm_tier_bytes / comm_busy_s: bytes 0, overlap from comm_s alone (0)."""
    rows = _rows(plan, [_record(1, [dict(comm_s={"ep": 0.2})] * 4)])
    assert rows["comm ep intra-node bytes"].measured == 0
    assert rows["comm ep overlap rate"].measured == pytest.approx(0.0)


def test_a_metrics_line_stating_a_key_twice_is_refused(tmp_path):
    """Issue 34: the last value of a key stated twice used to win in silence."""
    good = _record(1, [dict(comm_s={"ep": 0.2})]).to_json()
    path = tmp_path / "m.jsonl"
    path.write_text(good + "\n" + good.replace('"loss": 1.0', '"loss": 1.0, "loss": 9.0') + "\n")
    with pytest.raises(PlanError, match=r"line 2 is not a moeplan run metrics record \(duplicate key 'loss'\)"):
        read_records(path)
    path.write_text(good + "\n")
    assert read_records(path)[0].loss == 1.0


def test_table_has_a_line_per_class(plan):
    ranks = [dict(comm_s={"ep": 0.2}, comm_tier_bytes={"ep": {"intra": 2**20, "inter": 2**21}})] * 4
    console = Console(file=io.StringIO(), width=200)
    render_comm_classes(console, comm_class_rows(plan, [_record(1, ranks)], first_step=1), title="t")
    lines = [ln.strip("│ ") for ln in console.file.getvalue().splitlines()]
    ep = lines.index(next(ln for ln in lines if ln.startswith("ep ")))
    assert "intra-node bytes" in lines[ep] and "1.000 MiB" in lines[ep]
    assert "inter-node bytes" in lines[ep + 1] and "2.000 MiB" in lines[ep + 1]
    assert "exposed" in lines[ep + 2] and "200.00 ms" in lines[ep + 2]
    assert any(ln.startswith("dp ") for ln in lines)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """3 steps of the hierarchical plan through ``moeplan run --force-balanced-routing``."""
    root = tmp_path_factory.mktemp("compare_comm")
    save_plan(hierarchical_plan(), root / "plan.yaml")
    np.save(root / "tokens.npy", stdlib_tokens("train")[:20_000].numpy())
    proc = moeplan("run", str(root / "plan.yaml"), "--steps", "3", "--data", str(root / "tokens.npy"),
                   "--metrics", str(root / "run.jsonl"), "--force-balanced-routing")
    assert proc.returncode == 0, proc.stderr
    return root


def test_compare_json_has_the_comm_rows_of_a_real_run(short_run, plan):
    proc = run_moeplan("compare", str(short_run / "plan.yaml"), str(short_run / "run.jsonl"), "--json",
                   "--first-step", "2")
    assert proc.returncode == 0, proc.stderr
    rows = {r["quantity"]: r for r in json.loads(proc.stdout)}
    assert rows["comm ep inter-node bytes"]["measured"] == rows["comm ep inter-node bytes"]["predicted"] == (
        plan.prediction.comm["ep"].inter_bytes)  # the gathers over the nodes carry every token: exact
    assert 0.9 < rows["comm ep intra-node bytes"]["ratio"] < 1.1  # 2 steps of random routing
    assert rows["comm ep exposed"]["measured"] > 0
    assert rows["comm ep overlap rate"]["measured"] == pytest.approx(0.0)  # no overlap mechanism on
    assert rows["step time"]["measured"] > 0  # the first table's rows are still there
    assert rows_json([]) == []


def test_compare_prints_the_comm_table(short_run):
    proc = run_moeplan("compare", str(short_run / "plan.yaml"), str(short_run / "run.jsonl"), "--first-step", "2")
    assert proc.returncode == 0, proc.stderr
    lines = [ln.strip("│ ") for ln in proc.stdout.splitlines()]
    assert any(ln.startswith("ep ") and "intra-node bytes" in ln for ln in lines)
    assert any("inter-node bytes" in ln for ln in lines) and any("overlap rate" in ln for ln in lines)
