"""``fb`` overlap in the runtime (moeplan/runtime/overlap.py): the OVERLAP_F_B pairs of a plan run their forward and
backward halves on two threads sharing one compute stream, the backward half's collectives on its own process
groups. The numerics do not change: over 20 steps the per-step loss matches the single-process run to 1e-4, on 2
ranks (EP 2, 1F1B with fb) and on 4 ranks as 2 nodes × 2 with EP over both nodes (hierarchical dispatcher, in
tests/runtime/test_dispatchers.py's job).
"""
from __future__ import annotations

import threading
import time

import torch

from moeplan.actions import parse_action
from moeplan.compile import compile_model
from moeplan.plan import save_plan
from moeplan.runtime.groups import StreamGroups
from moeplan.runtime.metrics import CommTotals
from moeplan.runtime.overlap import ComputeStream, PairRunner
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.targets import load_target

from test_executor import STEPS, _assert_close, launch_function, train_plans  # noqa: E402


def make_plan(devices: int, *, fb: bool):
    return compile_model(spec=load_spec("tiny-pangu"), target=load_target("cpu", devices_per_node=2),
                         num_devices=devices, fixed=Fixed(global_batch=8, seq_len=64, pp=1, tp=1, cp=1, ep=devices,
                                                          micro_batch=1, schedule="1f1b", dispatcher="flat",
                                                          overlap=frozenset({"fb"} if fb else set())),
                         workers=1, candidates=1).plan


def test_fb_plans_pair_forward_with_backward():
    plan = make_plan(2, fb=True)
    kinds = [parse_action(a).kind for a in plan.schedule.actions[0]]
    assert "fb" in plan.comm.overlap and kinds.count("OVERLAP_F_B") == plan.layout.num_microbatches - 1
    assert "OVERLAP_F_B" not in [parse_action(a).kind for a in make_plan(2, fb=False).schedule.actions[0]]


def test_fb_overlap_matches_single_process(tmp_path, data_file, reference):
    """2 ranks, EP 2; the 4-rank hierarchical case runs with the dispatchers (tests/runtime/test_dispatchers.py)."""
    path = tmp_path / "fb.yaml"
    save_plan(make_plan(2, fb=True), path)
    _assert_close(launch_function(train_plans, 2, [str(path)], STEPS, data_file)[0][0], reference)


def test_compute_stream_charges_idle_time_to_the_collective_that_ends_it():
    """Half A gives the stream up for a collective while half B is not ready: the stream idles until A's
    collective completes, charged to A's class; B waiting on A's compute is no idle time."""
    stream, totals = ComputeStream(), CommTotals()
    stream.totals = totals
    stream.acquire()  # half A computes
    stream.release()  # A starts an ep collective; nobody waits: idle from here
    time.sleep(0.05)
    stream.acquire("ep")  # A's collective completed
    assert totals.seconds["ep"] >= 0.05

    got = threading.Event()

    def half_b() -> None:
        stream.acquire()
        got.set()
        stream.release()

    t = threading.Thread(target=half_b)
    t.start()
    time.sleep(0.05)  # B waits for the stream while A computes
    assert not got.is_set()
    stream.release()  # A starts a tp collective: B takes the stream at once, no idle time
    t.join()
    before = totals.seconds["ep"]
    stream.acquire("tp")
    assert totals.seconds["tp"] < 0.05 and totals.seconds["ep"] == before


def test_pair_worker_thread_uses_the_creators_intra_op_threads():
    """The backward half's thread runs its kernels with the thread count of the runner's creator, not the process
    default (which, on a rank bound to one core without OMP_NUM_THREADS=1, ran 2 threads on that core)."""
    before = torch.get_num_threads()
    seen: list[int] = []
    try:
        torch.set_num_threads(1)
        runner = PairRunner(StreamGroups(clones={}, classes={}))
        torch.set_num_threads(2)  # the creator's count at construction is what the worker keeps
        runner.run(lambda: None, lambda: seen.append(torch.get_num_threads()))
        runner.close()
    finally:
        torch.set_num_threads(before)
    assert seen == [1]
