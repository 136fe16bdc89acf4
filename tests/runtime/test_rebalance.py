"""Dynamic expert placement (``moeplan run --rebalance-every``, moeplan.runtime.rebalance).

tiny-pangu routes dropless (no ``capacity_factor``), so an expert computes the same rows wherever it sits and a run
that moves experts must train exactly as one that does not: the losses of every step agree to 1e-6 (relative) on
EP 2, EP 2 × PP 2, TP 2 × EP 2 (expert-TP, etp 2) and EP 2 × expert-DP 2 (the ZeRO shards of the expert buckets
are re-sliced), and the metrics show experts that moved. A run killed after a rebalance resumes from its checkpoint
with the moved experts where the rebalance put them and the load window it had counted: the rest of its losses
and its next rebalance are the uninterrupted run's. EP 2 rebalances every 10 steps over 22 steps (two rebalances,
the second from a placement the first made, each followed by two steps: the first checks the moved weights, the
second the moved AdamW moments); the 4-rank layouts, four processes on two cores, every 3 over 8 steps (the same
checks in a third of the steps).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moeplan.plan import PlanExpertLoad, PlanLayerLoad, save_plan
from moeplan.runtime.build import layer_placement
from moeplan.runtime.checkpoint import newest_checkpoint
from moeplan.runtime.data import stdlib_tokens
from moeplan.placement import arrange, rebalance_layer

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from inprocess import run_moeplan  # noqa: E402
from test_checkpoint_faults import signal_a_rank  # noqa: E402
from test_executor import make_plan  # noqa: E402

#: layout -> (devices, fixed degrees, --rebalance-every, steps)
LAYOUTS = {"ep2": (2, dict(ep=2, tp=1, pp=1, cp=1), 10, 22),
           "ep2_pp2": (4, dict(ep=2, pp=2, tp=1, cp=1), 3, 8),
           "tp2_ep2": (4, dict(tp=2, ep=2, etp=2, pp=1, cp=1), 3, 8),
           "ep2_edp2": (4, dict(ep=2, tp=1, pp=1, cp=1, micro_batch=2), 3, 8)}  # dp 4
CHECKPOINT_EVERY = 4  # the EP 2 run's checkpoints: 12 and 16 lie between its rebalances after steps 10 and 20


def records(path: Path) -> dict[int, dict]:
    return {d["step"]: d for d in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rebalance")
    np.save(root / "tokens.npy", stdlib_tokens("train")[:20_000].numpy())
    return root


def run(root: Path, layout: str, tag: str, *extra: str, steps: int | None = None) -> subprocess.CompletedProcess:
    """``moeplan run`` of ``layout``'s plan (compiled once) writing ``{tag}.jsonl``."""
    devices, fixed, _, default_steps = LAYOUTS[layout]
    plan = root / f"{layout}.yaml"
    if not plan.exists():
        save_plan(make_plan(devices, fixed), plan)
    return subprocess.run([sys.executable, "-m", "moeplan.cli", "run", str(plan), "--steps",
                           str(steps or default_steps), "--data", str(root / "tokens.npy"), "--metrics",
                           str(root / f"{tag}.jsonl"), *extra], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def rebalanced(root):
    """layout -> (records without rebalancing, records with it); EP 2's rebalancing run also checkpoints."""
    done: dict[str, tuple[dict[int, dict], dict[int, dict]]] = {}

    def get(layout: str) -> tuple[dict[int, dict], dict[int, dict]]:
        if layout not in done:
            every = LAYOUTS[layout][2]
            extra = ("--checkpoint-every", str(CHECKPOINT_EVERY), "--checkpoint-dir", str(root / "ck_full"))
            for tag, args in ((f"{layout}-off", ()), (f"{layout}-on", ("--rebalance-every", str(every),
                                                                        *(extra if layout == "ep2" else ())))):
                proc = run(root, layout, tag, *args)
                assert proc.returncode == 0, f"{tag}: {proc.stderr}"
            done[layout] = records(root / f"{layout}-off.jsonl"), records(root / f"{layout}-on.jsonl")
        return done[layout]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moving_experts_keeps_the_losses(rebalanced, layout):
    off, on = rebalanced(layout)
    every, steps = LAYOUTS[layout][2:]
    assert sorted(on) == sorted(off) == list(range(1, steps + 1))
    for step in off:
        assert abs(on[step]["loss"] - off[step]["loss"]) <= 1e-6 * abs(off[step]["loss"]), step
    assert [s for s in on if "rebalance" in on[s]] == list(range(every, steps + 1, every))
    assert not any("rebalance" in r for r in off.values())
    first = on[every]["rebalance"]
    assert first["moved_experts"] > 0 and first["moved_bytes"] > 0 and first["migrate_s"] > 0
    for name, layer in first["layers"].items():  # applied exactly where the gain beats the default 0.05
        assert layer["applied"] == (layer["imbalance_before"] - layer["imbalance_after"] > 0.05), name
        assert sorted(e for s in layer["placement"] for e in s) == list(range(8))
        assert all(len(s) == 4 for s in layer["placement"])


def test_a_run_killed_after_a_rebalance_resumes_exactly(root, rebalanced):
    """Kill rank 1 after step 13; resume from the checkpoint after step 12 (or 16): the manifest holds the placements
    of the rebalance after step 10, and the resumed run's losses and its rebalance after step 20 are the
    uninterrupted run's (that rebalance plans from the window the checkpoint restored)."""
    _, full = rebalanced("ep2")
    ck, metrics, every = root / "ck", root / "killed.jsonl", str(LAYOUTS["ep2"][2])
    args = [sys.executable, "-m", "moeplan.cli", "run", str(root / "ep2.yaml"), "--data", str(root / "tokens.npy"),
            "--metrics", str(metrics), "--rebalance-every", every, "--checkpoint-every", str(CHECKPOINT_EVERY),
            "--checkpoint-dir", str(ck)]
    launcher = subprocess.Popen([*args, "--steps", "1000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    signal_a_rank(launcher, metrics, ranks=(0, 1), steps=13, sig=signal.SIGKILL)
    assert launcher.returncode != 0
    ref = newest_checkpoint(ck)
    assert ref is not None and 10 < ref.step < 20
    placed = json.loads((ref.path / "moeplan.json").read_text())["experts"]["placement"]
    assert placed == {n: x["placement"] for n, x in full[10]["rebalance"]["layers"].items()}
    assert placed != {n: [[0, 1, 2, 3], [4, 5, 6, 7]] for n in placed}  # experts did move
    resumed = subprocess.run([*args, "--steps", "22", "--resume"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    got = records(metrics)
    assert sorted(got) == list(range(1, 23))
    assert [got[s]["loss"] for s in range(ref.step + 1, 23)] == [full[s]["loss"] for s in range(ref.step + 1, 23)]
    assert {n: (x["moved"], x["placement"]) for n, x in got[20]["rebalance"]["layers"].items()} == {
        n: (x["moved"], x["placement"]) for n, x in full[20]["rebalance"]["layers"].items()}


def test_a_forged_placement_is_refused_before_launch(root, rebalanced, tmp_path):
    import shutil

    rebalanced("ep2")
    ck = tmp_path / "ck"
    shutil.copytree(root / "ck_full", ck)
    manifest = ck / "step-00000020" / "moeplan.json"
    info = json.loads(manifest.read_text())
    info["experts"]["placement"]["layers.2"] = [[0, 1, 2, 3], [4, 5, 6, 6]]
    manifest.write_text(json.dumps(info))
    proc = run_moeplan("run", root / "ep2.yaml", "--steps", "30", "--data", root / "tokens.npy", "--resume",
                       "--checkpoint-dir", ck)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "step-00000020" in lines[0] and "experts: placement['layers.2']=[[0, 1, 2, 3], [4, 5, 6, 6]]" in lines[0]


@pytest.mark.parametrize("args, says", [
    (("--rebalance-every", "10"), "rebalance_every=10: needs routed experts over more than one expert rank"),
    (("--rebalance-every", "-1"), "rebalance_every=-1: must be >= 0"),
    (("--rebalance-threshold", "0.1"), "rebalance_threshold=0.1: applies to --rebalance-every, which is off"),
    (("--rebalance-every", "2", "--rebalance-threshold", "nan"), "rebalance_threshold=nan: must be a finite")])
def test_bad_rebalance_options_are_refused_in_one_line(root, args, says):
    plan = root / "no_ep.yaml"  # tiny-pangu without EP: every expert on each rank
    if not plan.exists():
        save_plan(make_plan(2, dict(pp=2, vpp=1, tp=1, cp=1, ep=1, micro_batch=4)), plan)
    proc = run_moeplan("run", plan, "--steps", "3", *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert says in lines[0]


def test_greedy_plan_keeps_staying_experts_in_their_slots_and_respects_the_threshold():
    before = ((0, 1, 2, 3), (4, 5, 6, 7))
    assert arrange(before, [[0, 2, 5, 7], [1, 3, 4, 6]]) == ((0, 5, 2, 7), (4, 1, 6, 3))
    load = [40, 30, 20, 10, 1, 1, 1, 1]  # rank 0 has 100 of 104 tokens: imbalance 100/52 − 1
    d = rebalance_layer(load, before, threshold=0.05)
    assert d.applied and abs(d.imbalance_before - (100 / 52 - 1)) < 1e-12 and d.imbalance_after < 0.1
    assert d.moved and sorted(e for s in d.placement for e in s) == list(range(8))
    kept = rebalance_layer(load, before, threshold=d.imbalance_before - d.imbalance_after)  # the gain must exceed it
    assert not kept.applied and kept.moved == () and kept.placement == before


def test_a_plan_placed_by_its_load_trains_as_the_contiguous_plan(root, rebalanced):
    # a plan compiled with a load trace places each MoE layer's experts its own way (experts.load.layers): the run
    # holds each layer's experts where the plan says from the first step and trains exactly as the contiguous plan,
    # also after a rebalance, which moves the experts from where the plan put them (had the layers been built
    # contiguous, the rebalance would move the wrong weights)
    off, _ = rebalanced("ep2")
    devices, fixed, _, _ = LAYOUTS["ep2"]
    plain = make_plan(devices, fixed)
    own = {1: [[0, 2, 4, 6], [1, 3, 5, 7]], 2: [[7, 6, 5, 4], [3, 2, 1, 0]], 4: [[1, 6, 0, 7], [2, 5, 3, 4]]}
    load = PlanExpertLoad(trace="hand.json", source="test", window=[1, 1], policy="greedy", replicas=0,
                          balanced_step_s=plain.prediction.step_time_s,
                          layers=[PlanLayerLoad(layer=i, shards=s, imbalance=0.0, balancedness=1.0, cv=0.0)
                                  for i, s in own.items()])
    placed = plain.model_copy(update={"experts": plain.experts.model_copy(update={"load": load})})
    save_plan(placed, root / "placed.yaml")
    steps = 4
    proc = subprocess.run([sys.executable, "-m", "moeplan.cli", "run", str(root / "placed.yaml"), "--steps",
                           str(steps), "--data", str(root / "tokens.npy"), "--metrics", str(root / "placed.jsonl"),
                           "--rebalance-every", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = records(root / "placed.jsonl")
    assert got[2]["rebalance"]["moved_experts"] > 0
    for step in range(1, steps + 1):
        assert got[step]["loss"] == pytest.approx(off[step]["loss"], rel=1e-6), step
    assert layer_placement(placed, "layers.2") == ((7, 6, 5, 4), (3, 2, 1, 0))
    assert layer_placement(placed, "layers.3") == tuple(tuple(s) for s in plain.experts.shards)
    assert layer_placement(placed, "mtp.0") == ((1, 6, 0, 7), (2, 5, 3, 4))
