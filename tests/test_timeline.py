"""Timeline simulator: closed forms (docs/references.md §4.3), hand-derived overlap cases, DAG references, broken schedules."""
import random
from typing import NamedTuple

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from moeplan.actions import parse_action
from moeplan.cost_models.timeline import Repeated, _pack_programs, action_time_s, action_times_s, simulate
from moeplan.cost_models import timeline_core
from moeplan.cost_models.timeline_types import RunSettings, StageProgram, concat_segments
from moeplan.errors import PlanError
from moeplan.passes.schedule import build_actions, interleaved_1f1b, max_in_flight, one_f_one_b
from moeplan.state import CommOp, Segment

NONE = RunSettings(mechanisms=frozenset())


def uniform(num_stages, f=1.0, b=2.0, act=1.0, w=0.0):
    return [StageProgram.uniform(f, b, w, act) for _ in range(num_stages)]


def p2p(s):
    return RunSettings(p2p_s=s)


def comm(cls, seconds, tier="inter"):
    return CommOp(cls, "all_to_all", "fwd", 1000, 8, tier, seconds)


def compute(name, seconds, after=(), kernels=1, deferrable=False):
    return Segment(name, "compute", seconds, after=after, kernels=kernels, deferrable=deferrable)


def collective(name, seconds, after, cls="ep", async_by=None, host_sync=False, tier="inter"):
    return Segment(name, "comm", seconds, after=after, comm=comm(cls, seconds, tier), kernels=1, async_by=async_by,
                   host_sync=host_sync)


def moe_like():
    """attention 1 → dispatch 0.5 (ep) → [shared 0.4 beside it] → experts 1 → combine 0.5 → post 0.2."""
    return (compute("attn", 1.0), collective("dispatch", 0.5, (0,), async_by="shared-expert"),
            compute("shared", 0.4, (0,)), compute("experts", 1.0, (1,)),
            collective("combine", 0.5, (3,), async_by="shared-expert"), compute("post", 0.2, (4, 2)))


# ---- closed forms ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(1, 4), (2, 1), (2, 2), (4, 4), (4, 8), (4, 13), (8, 8), (8, 32), (16, 64),
                                 (16, 256)])
def test_1f1b_closed_form(p, m):
    t = simulate(one_f_one_b(p, m), stages=uniform(p))
    assert t.step_time_s == pytest.approx((m + p - 1) * 3.0)
    assert abs(t.bubble - (p - 1) / (m + p - 1)) <= 0.002
    assert t.bubble_per_rank == pytest.approx([t.bubble] * p)


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 8), (4, 2, 4), (4, 2, 8), (4, 3, 8), (4, 4, 16), (8, 2, 16),
                                   (8, 4, 32), (16, 2, 64), (16, 3, 32)])
def test_interleaved_closed_form(p, v, m):
    """Per chunk F = 1, B = 2: bubble ((p−1)/v) / (m + (p−1)/v), step (m·v + p − 1)·(F + B) (SC'21 §2.2.2)."""
    t = simulate(interleaved_1f1b(p, v, m), stages=uniform(p * v))
    x = (p - 1) / v
    assert abs(t.bubble - x / (m + x)) <= 0.002
    assert t.step_time_s == pytest.approx((m * v + p - 1) * 3.0)


def test_pangu_bubbles():
    """docs/references.md §4.3 at Pangu Ultra MoE's p = 16, m = 64: 18.99 % with 1F1B, 10.49 % interleaved with v = 2."""
    assert round(100 * simulate(one_f_one_b(16, 64), stages=uniform(16)).bubble, 2) == 18.99
    assert round(100 * simulate(interleaved_1f1b(16, 2, 64), stages=uniform(32)).bubble, 2) == 10.49


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16), (8, 32)])
@pytest.mark.parametrize("f,i,w", [(1, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1.5, 0.5)])
def test_zero_bubble_closed_form(p, m, f, i, w):
    """torch's Interleaved Zero Bubble with two chunks per rank idles ZB-H1's (p − 1)(F + B − W) (Qi et al.,
    ICLR'24 §3; docs/references.md §4.3), with per-chunk F, B (input gradient) and W."""
    t = simulate(build_actions("zero-bubble", pp=p, vpp=2, num_microbatches=m), stages=uniform(2 * p, f, i, 0, w))
    for busy in t.busy_s:
        assert t.step_time_s - busy == pytest.approx((p - 1) * (f + i - w))


@pytest.mark.parametrize("kind", ["zbv", "dualpipev"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 20), (8, 16)])
def test_v_schedules_simulate_and_beat_1f1b(kind, p, m):
    """ZB-V and DualPipeV (V placement) run deadlock-free with and without fb pairs; with F = B = W per chunk each
    rank idles (p − 1)·F, a third of 1F1B's (p − 1)(F + B + W), ZB-H1's (docs/references.md §4.3: "a third of 1F1B when
    F = B = W")."""
    for fb in (False, True):
        t = simulate(build_actions(kind, pp=p, vpp=2, num_microbatches=m, fb=fb), stages=uniform(2 * p, 1, 1, 0, 1))
        for busy in t.busy_s:
            assert t.step_time_s - busy == pytest.approx(p - 1)


def test_dualpipev_bubble_is_below_the_dualpipe_formula():
    """The DualPipe README's (PP/2 − 1)(F&B + B − 3W) over PP = 2p stages, with F&B = F + B (no comm to hide), is an
    upper bound torch's DualPipeV order beats: (p − 1)(F + 2B − 3W) vs what each rank idles."""
    p, m, f, i, w = 4, 16, 1.0, 2.0, 1.0
    t = simulate(build_actions("dualpipev", pp=p, vpp=2, num_microbatches=m, fb=True), stages=uniform(2 * p, f, i, 0, w))
    b = i + w
    assert max(t.step_time_s - x for x in t.busy_s) <= (p - 1) * ((f + b) + b - 3 * w) + 1e-9


@pytest.mark.parametrize("actions,num_stages", [(one_f_one_b(4, 8), 4), (one_f_one_b(8, 3), 8),
                                                (interleaved_1f1b(4, 2, 8), 8), (interleaved_1f1b(16, 2, 64), 32)])
def test_activation_peak_equals_in_flight(actions, num_stages):
    t = simulate(actions, stages=uniform(num_stages, act=3.0), settings=p2p(0.1))
    assert t.peak_activation_bytes == tuple(3.0 * n for n in max_in_flight(actions, pp=len(actions)))


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("interleaved", 2)])
def test_fb_pairs_keep_one_more_micro_batch(kind, v):
    """fb pairs each steady F with the B after it and needs one more warm-up forward (Megatron-LM's combined 1F1B):
    one more micro-batch in flight on every rank, and no deadlock."""
    plain = build_actions(kind, pp=4, vpp=v, num_microbatches=8)
    paired = build_actions(kind, pp=4, vpp=v, num_microbatches=8, fb=True)
    assert any("OVERLAP_F_B" in a for rank in paired for a in rank)
    assert max_in_flight(paired, pp=4) == tuple(n + 1 for n in max_in_flight(plain, pp=4))
    simulate(paired, stages=uniform(4 * v))


# ---- p2p ------------------------------------------------------------------------------------------------------------
def test_p2p_hand_derived():
    """pp = 2, F = 1, B = 2. m = 1, p2p 0.5: F0 [0,1], send [1,1.5], F0' [1.5,2.5], B0' [2.5,4.5], send [4.5,5],
    B0 [5,7]. m = 2 adds F1 [1,2] (send [2,2.5]), F1' [4.5,5.5], B1' [5.5,7.5], send [7.5,8], B1 [8,10]."""
    t = simulate(one_f_one_b(2, 1), stages=uniform(2), settings=p2p(0.5))
    assert t.step_time_s == pytest.approx(7.0)
    assert dict(t.exposed_comm_s) == pytest.approx({"pp": 0.5})
    t = simulate(one_f_one_b(2, 2), stages=uniform(2), settings=p2p(0.5))
    assert t.step_time_s == pytest.approx(10.0)
    assert [e.start_s for e in t.events if e.rank == 0 and e.stream == "compute"] == pytest.approx([0, 1, 5, 8])
    assert t.exposed_comm_per_rank_s[0]["pp"] == pytest.approx(1.0)  # B0 and B1 each wait 0.5 on a transfer
    assert t.exposed_comm_per_rank_s[1]["pp"] == pytest.approx(0.5)  # F1's input arrived while B0 ran
    # the bubble is the idle time not spent waiting on a transfer: (10 − 6 − 1) / 10 and (10 − 6 − 0.5) / 10
    assert t.busy_s == pytest.approx((6.0, 6.0)) and t.bubble == pytest.approx((0.3 + 0.35) / 2)


def test_p2p_host_cost_holds_the_compute_stream_at_each_send_and_recv():
    """As test_p2p_hand_derived (m = 1, p2p 0.5) with 0.1 of compute stream per SEND and RECV: rank 1 posts RECV_F
    [0, 0.1]; rank 0 runs F0 [0, 1], posts SEND_F [1, 1.1] (transfer [1.1, 1.6]) and RECV_B [1.1, 1.2]; rank 1 runs
    F0' [1.6, 2.6], B0' [2.6, 4.6], posts SEND_B [4.6, 4.7] (transfer [4.7, 5.2]); B0 [5.2, 7.2]. Each rank's two
    posts are exposed pp time beside its 0.5 wait on a transfer."""
    t = simulate(one_f_one_b(2, 1), stages=uniform(2), settings=RunSettings(p2p_s=0.5, p2p_host_s=0.1))
    assert t.step_time_s == pytest.approx(7.2)
    assert [e.start_s for e in t.events if e.stream == "compute"] == pytest.approx([0, 1.6, 2.6, 5.2])
    assert [r["pp"] for r in t.exposed_comm_per_rank_s] == pytest.approx([0.7, 0.7])


def test_p2p_serializes_on_its_link():
    """p2p 1.5 > F: rank 0's second SEND_F waits for the first ([1, 2.5] then [2.5, 4]); step 12 by hand."""
    t = simulate(one_f_one_b(2, 2), stages=uniform(2), settings=p2p(1.5))
    sends = sorted(x for e in t.events if e.rank == 0 and e.stream == "comm" for x in (e.start_s, e.end_s))
    assert sends == pytest.approx([1.0, 2.5, 2.5, 4.0])
    assert t.step_time_s == pytest.approx(12.0)
    assert t.rank_end_s == pytest.approx((12.0, 10.0))  # rank 1's last SEND_B ends at 10


def test_p2p_without_overlap_blocks_the_sender():
    """Without mechanism pp the sender's compute stream waits for each SEND: rank 0's F1 starts at 1.5, not 1."""
    t = simulate(one_f_one_b(2, 2), stages=uniform(2), settings=RunSettings(p2p_s=0.5, mechanisms=frozenset()))
    assert [e.start_s for e in t.events if e.rank == 0 and e.stream == "compute"][1] == pytest.approx(1.5)


def test_split_backward_sends_after_input_grad():
    """F = I = W = 1: the gradient leaves after I, so rank 0's I0 starts at 3 and the step is 5 (6 with full B)."""
    costs = uniform(2, f=1, b=1, w=1)
    actions = [["0F0", "0SEND_F0", "0RECV_B0", "0I0", "0W0"], ["1RECV_F0", "1F0", "1I0", "1SEND_B0", "1W0"]]
    assert simulate(actions, stages=costs).step_time_s == pytest.approx(5.0)
    full = [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    assert simulate(full, stages=costs).step_time_s == pytest.approx(6.0)


# ---- segments: blocking, mechanisms, pairs, host, contention ---------------------------------------------------------
def stage_of(fwd, bwd=()):
    bwd = tuple(bwd) or (compute("dx", 1.0),)
    return StageProgram(tuple(fwd), bwd, (), bwd)


def test_blocking_collectives_add_up_and_are_exposed():
    """Without mechanisms every collective holds the compute stream: F = 1 + 0.5 + 0.4 + 1 + 0.5 + 0.2 = 3.6, all
    1.0 s of EP exposed; the steady state of a single F is empty."""
    t = simulate([["0F0", "0B0"]], stages=[stage_of(moe_like())], settings=NONE)
    assert t.step_time_s == pytest.approx(3.6 + 1.0)
    assert t.comm["ep"].total_s == pytest.approx(1.0) and t.comm["ep"].exposed_s == pytest.approx(1.0)
    assert t.comm["ep"].overlap_rate == pytest.approx(0.0)


def test_shared_expert_overlap_hides_what_it_can():
    """shared-expert: the dispatch runs beside the shared expert (0.4 of its 0.5 hidden); experts wait the rest; the
    combine has nothing beside it. F = 1 + 0.5 + 1 + 0.5 + 0.2 = 3.2, EP exposed 0.1 + 0.5."""
    t = simulate([["0F0", "0B0"]], stages=[stage_of(moe_like())],
                 settings=RunSettings(mechanisms=frozenset({"shared-expert"})))
    assert t.step_time_s == pytest.approx(3.2 + 1.0)
    assert t.comm["ep"].exposed_s == pytest.approx(0.6)
    assert t.comm["ep"].overlap_rate == pytest.approx(0.4)


def test_fb_pair_hides_each_ones_collectives_under_the_others_compute():
    """Two chains a(1) → c(1) → b(1) overlapped: each one's collective hides under the other's compute, so the pair
    takes its 4 s of compute (plus nothing); serially 6."""
    chain = (compute("a", 1.0), collective("c", 1.0, (0,)), compute("b", 1.0, (1,)))
    assert action_time_s([chain], NONE) == pytest.approx(3.0)
    assert action_time_s([chain, chain], NONE) == pytest.approx(4.0)


def test_a_deferrable_weight_gradient_fills_a_wait():
    """Alone, a part waits 1 s for its collective; a ready weight gradient of the other part fills the gap."""
    wait = (compute("a", 1.0), collective("c", 1.0, (0,)), compute("b", 1.0, (1,)))
    other = (compute("x", 0.5), compute("w", 1.0, (0,), deferrable=True))
    assert action_time_s([wait, other], NONE) == pytest.approx(3.5)


def test_host_sync_exposes_launch_costs():
    """Host 0.1 s per kernel: the host runs ahead of a long compute segment, but after a sync it must issue the next
    kernels while the device waits. F: compute 1.0 (1 kernel) → counts (sync, 0.1) → two compute of 0.05 (1 kernel
    each): a is launched at 0.1 and ends at 1.1; counts (launched by 0.2) runs 1.1–1.2; the host waits for it, then
    0.05 for the sync, so b is launched at 1.35 (runs to 1.4) and c at 1.45 (runs to 1.5)."""
    segs = (compute("a", 1.0), collective("counts", 0.1, (0,), host_sync=True), compute("b", 0.05, (1,)),
            compute("c", 0.05, (2,)))
    t = action_time_s([segs], RunSettings(mechanisms=frozenset(), host_launch_s=0.1, host_sync_s=0.05))
    assert t == pytest.approx(1.5)


def test_a_wait_on_a_collective_then_on_a_late_host_is_charged_to_both():
    """Host 0.1 s per kernel, sync 0.3 s: a (0.1–1.1) → counts (asynchronous, 1.1–1.6, the host syncs on it) → b.
    The compute stream idles 1.1–2.0: the first 0.5 s for the collective (ep), the next 0.4 s for the host (its sync
    until 1.9, then b's launch), so nothing of the wait is left over as bubble."""
    segs = (compute("a", 1.0), collective("counts", 0.5, (0,), async_by="native", host_sync=True),
            compute("b", 0.1, (1,)))
    t = simulate([["0F0", "0B0"]], stages=[stage_of(segs, (compute("dx", 1.0, kernels=0),))],
                 settings=RunSettings(mechanisms=frozenset(), host_launch_s=0.1, host_sync_s=0.3))
    assert t.step_time_s == pytest.approx(2.1 + 1.0)
    assert t.comm["ep"].exposed_s == pytest.approx(0.5)
    assert t.host_wait_s[0] == pytest.approx(0.1 + 0.4)  # a's own launch at the start, then the 0.4 s
    assert t.bubble == pytest.approx(0.0)


def test_compute_slows_while_a_collective_runs_beside_it():
    """Slowdown 0.5: the shared expert's 0.4 s lies inside the dispatch [1.0, 1.5] and takes 0.6, ending at 1.6, so
    the experts (which waited for the dispatch until 1.5) start 0.1 later; nothing else overlaps a collective."""
    segs = moe_like()
    base = action_time_s([segs], RunSettings(mechanisms=frozenset({"shared-expert"})))
    slow = action_time_s([segs], RunSettings(mechanisms=frozenset({"shared-expert"}), compute_slowdown=0.5))
    assert base == pytest.approx(3.2) and slow - base == pytest.approx(0.1)


def test_a_collective_kind_with_its_own_slowdown_uses_it():
    """The dispatch is an all-to-all: with ``slowdown_by_kind`` listing all-to-all at 1.0 (and 0.5 for the rest)
    the shared expert's 0.4 s inside it takes 0.8, ending at 1.8, so the experts start 0.3 later than with no
    slow-down, 0.2 later than at 0.5; a kind not listed keeps ``compute_slowdown``."""
    segs = moe_like()
    on = frozenset({"shared-expert"})
    base = action_time_s([segs], RunSettings(mechanisms=on, compute_slowdown=0.5))
    own = action_time_s([segs], RunSettings(mechanisms=on, compute_slowdown=0.5, slowdown_by_kind={"all_to_all": 1.0}))
    other = action_time_s([segs], RunSettings(mechanisms=on, compute_slowdown=0.5,
                                              slowdown_by_kind={"all_gather": 1.0}))
    assert own - base == pytest.approx(0.2) and other == pytest.approx(base)


class _InFlight(NamedTuple):  # the part of the loop's State that the slow-down reads
    infl: np.ndarray
    infl_off: np.ndarray
    infl_n: np.ndarray


def _slowdown_s(start, end, intervals):
    """The loop's slow-down of a compute segment over [start, end] beside ``intervals`` (begin, end, σ), and the
    intervals it keeps."""
    st = _InFlight(np.array(intervals or [(0.0, 0.0, 0.0)], float), np.zeros(1, np.int64),
                   np.array([len(intervals)], np.int64))
    extra = timeline_core._slowdown(st, 0, start, end, np.zeros(2 + 2 * len(intervals)))
    return extra, [tuple(x) for x in st.infl[:st.infl_n[0]].tolist()]


def test_overlapping_collectives_slow_compute_by_the_largest_slowdown():
    """Two collectives in flight at once count once, at the larger σ: [0, 2] at 0.5 and [1, 3] at 1.0 over a 4 s
    segment: 1 s at 0.5, then 2 s at 1.0."""
    assert _slowdown_s(0.0, 4.0, [(0.0, 2.0, 0.5), (1.0, 3.0, 1.0)])[0] == pytest.approx(0.5 + 2.0)
    assert _slowdown_s(0.0, 4.0, [(0.0, 2.0, 0.5)])[0] == pytest.approx(1.0)
    # the first ended before the segment: pruned
    assert _slowdown_s(0.0, 4.0, [(-2.0, -1.0, 1.0), (3.5, 9.0, 0.2)]) == (pytest.approx(0.1), [(3.5, 9.0, 0.2)])
    # cuts at every interval end inside the segment: [0, 1] at 0.3, [1, 1.5] at 0.5, [1.5, 2] at 0.3
    assert _slowdown_s(0.0, 2.0, [(0.0, 2.0, 0.3), (1.0, 1.5, 0.5)])[0] == pytest.approx(0.3 + 0.25 + 0.15)


def test_priority_transfer_does_not_queue_behind_bulk():
    """A SEND issued while a 5 s EP transfer holds the link starts at once (and delays later bulk transfers by its
    own time); the link's bytes are conserved."""
    fwd = (compute("a", 1.0), collective("bulk", 5.0, (0,), async_by="shared-expert"), compute("b", 0.5, (0,)))
    t = simulate([["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]],
                 stages=[stage_of(fwd), stage_of((compute("f", 1.0),))],
                 settings=RunSettings(p2p_s=0.25, mechanisms=frozenset({"shared-expert", "pp"})))
    send = next(e for e in t.events if e.action == "0SEND_F0")
    assert send.start_s == pytest.approx(6.0)  # the F ends when its bulk transfer does, then the SEND starts at once


def test_concat_links_a_layer_to_the_previous_trailing_collective():
    one = (compute("a", 1.0), collective("c", 1.0, (0,), async_by="native"))
    joined = concat_segments([one, one])
    assert joined[2].after == (1,)


# ---- references -----------------------------------------------------------------------------------------------------
def reference_start_times(actions, stage_costs, p2p_s):
    """Independent reference: earliest start = longest path in the DAG of stream-order and data edges (networkx)."""
    g, owner, dur = nx.DiGraph(), {}, {}
    for r, rank in enumerate(actions):
        prev = {"compute": None, "comm": None}
        for text in rank:
            a = parse_action(text)
            if a.kind.startswith("RECV"):
                continue
            node = (a.kind, a.stage, a.microbatch)
            c = stage_costs[a.stage]
            dur[node] = {"F": c.seconds("F"), "B": c.seconds("B")}.get(a.kind, p2p_s)
            stream = "comm" if a.kind.startswith("SEND") else "compute"
            if prev[stream] is not None:
                g.add_edge(prev[stream], node)
            prev[stream] = node
            owner[a.stage] = r
            g.add_node(node)
    s_last = len(stage_costs) - 1
    for kind, s, mb in list(g.nodes):
        deps = {"SEND_F": [("F", s, mb)], "SEND_B": [("B", s, mb)], "B": [("F", s, mb)]}.get(kind, [])
        if kind == "F" and s > 0:
            deps.append(("F", s - 1, mb) if owner[s - 1] == owner[s] else ("SEND_F", s - 1, mb))
        if kind == "B" and s < s_last:
            deps.append(("B", s + 1, mb) if owner[s + 1] == owner[s] else ("SEND_B", s + 1, mb))
        g.add_edges_from((d, (kind, s, mb)) for d in deps)
    start = {}
    for node in nx.topological_sort(g):
        start[node] = max((start[p] + dur[p] for p in g.predecessors(node)), default=0.0)
    return start


@pytest.mark.parametrize("seed", range(6))
def test_matches_dag_reference(seed):
    rng = random.Random(seed)
    p, v = rng.choice([2, 3, 4]), rng.choice([1, 2, 3])
    m = p * rng.randint(1, 3)
    actions = interleaved_1f1b(p, v, m) if v > 1 else one_f_one_b(p, m)
    costs = [StageProgram.uniform(rng.uniform(0.2, 2), rng.uniform(0.5, 3), rng.uniform(0.1, 1), 1)
             for _ in range(p * v)]
    p2p_s = rng.uniform(0, 0.5)
    ref = reference_start_times(actions, costs, p2p_s)
    t = simulate(actions, stages=costs, settings=p2p(p2p_s))
    got = {(parse_action(e.action).kind, parse_action(e.action).stage, parse_action(e.action).microbatch): e.start_s
           for e in t.events if e.stream != "recv"}
    assert got == pytest.approx(ref)


def moe_like_backward():
    """The mirror of :func:`moe_like`: post → combine-grad → experts dX → dispatch-grad → attention dX, the shared
    expert's dX beside the collectives."""
    return (compute("post_dx", 0.2), collective("combine_g", 0.5, (0,), async_by="shared-expert"),
            compute("experts_dx", 1.0, (1,)), compute("shared_dx", 0.4, (0,)),
            collective("dispatch_g", 0.5, (2,), async_by="shared-expert"), compute("attn_dx", 1.0, (4, 3)))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_pooled_weight_gradients_carried_across_pairs_still_run(p, m):
    """A DualPipeV pair whose backward ends waiting on its collective carries into the next pair with its weight
    gradient pooled for a gap; that weight gradient must still run (a regression: it was dropped and the step
    never finished). Every rank runs all its compute: 2 chunks × m × (F 1 + dX 1 + W 0.5)."""
    dx = (compute("dx", 1.0), collective("g", 3.0, (0,)))
    stage = StageProgram((compute("f", 1.0),), dx, (compute("w", 0.5),),
                         dx + (compute("w", 0.5, (1,), deferrable=True),), 1.0)
    t = simulate(build_actions("dualpipev", pp=p, vpp=2, num_microbatches=m, fb=True), stages=[stage] * (2 * p),
                 settings=RunSettings(mechanisms=frozenset({"pp"})))
    assert t.busy_s == pytest.approx([2 * m * 2.5] * p)


def segment_dag_starts(t, stage, mechs):
    """Earliest start of every segment by a longest path (networkx) over: data dependencies, the compute stream's
    order and each tier's order as the simulation chose them, and — for a collective that blocks the compute stream
    (no mechanism hides it, not in a pair) — edges from the compute before it and to the compute after it in its
    part's list (it runs on the compute stream in program order)."""
    g = nx.DiGraph()
    events = sorted(t.segment_events, key=lambda e: (e.start_s, e.end_s))
    node = {(e.part, e.index): e for e in events}
    for e in events:
        g.add_node((e.part, e.index))
        for j in _segs(stage, e.part)[e.index].after:
            g.add_edge((e.part, j), (e.part, e.index))
    for stream in {s for e in events for s in e.stream.split("+")}:
        order = [(e.part, e.index) for e in events if stream in e.stream.split("+")]
        g.add_edges_from(zip(order, order[1:]))
    for e in events:
        segs = _segs(stage, e.part)
        if segs[e.index].kind == "comm" and segs[e.index].async_by not in mechs and "fb" not in mechs:
            before = [i for i in range(e.index) if segs[i].kind == "compute"]
            after = [i for i in range(e.index + 1, len(segs)) if segs[i].kind == "compute"]
            if before:
                g.add_edge((e.part, before[-1]), (e.part, e.index))
            if after:
                g.add_edge((e.part, e.index), (e.part, after[0]))
    dur = {k: v.end_s - v.start_s for k, v in node.items()}
    start = {}
    for n in nx.topological_sort(g):
        start[n] = max((start[q] + dur[q] for q in g.predecessors(n)), default=0.0)
    return start, {k: v.start_s for k, v in node.items()}


def _segs(stage, part):
    return stage.phase(parse_action(part).kind)


@pytest.mark.parametrize("mechs", [frozenset(), frozenset({"shared-expert"}), frozenset({"shared-expert", "fb"})])
def test_overlap_matches_a_longest_path_over_the_same_events(mechs):
    """One rank, two micro-batches of the MoE-like layer (fb pairs the second F with the first B): every segment
    starts exactly when the longest path over its data dependencies and its streams' orders says."""
    stage = StageProgram(moe_like(), moe_like_backward(), (), moe_like_backward())
    actions = [["0F0", "(0F1;0B0)OVERLAP_F_B", "0B1"]] if "fb" in mechs else [["0F0", "0F1", "0B0", "0B1"]]
    t = simulate(actions, stages=[stage], settings=RunSettings(mechanisms=mechs), detail=True)
    ref, got = segment_dag_starts(t, stage, mechs)
    assert got == pytest.approx(ref)
    assert max(e.end_s for e in t.segment_events) == pytest.approx(t.step_time_s)
    if "fb" in mechs:  # the pair hides collectives the lone actions cannot
        lone = simulate([["0F0", "0F1", "0B0", "0B1"]], stages=[stage], settings=RunSettings(mechanisms=mechs))
        assert t.step_time_s < lone.step_time_s


def test_torch_lowered_interleaved_schedule_simulates_alike():
    """torch's own lowering (early RECVs, UNSHARD/RESHARD/REDUCE_GRAD) gives the same step as ours at p2p = 0."""
    torch_lists = [[str(a) for a in rank if a is not None]
                   for rank in get_schedule_ops("Interleaved1F1B", 4, 8, 2, with_comms=True)]
    ours = simulate(interleaved_1f1b(4, 2, 8), stages=uniform(8))
    theirs = simulate(torch_lists, stages=uniform(8))
    assert theirs.step_time_s == pytest.approx(ours.step_time_s)
    assert theirs.peak_activation_bytes == ours.peak_activation_bytes


# ---- broken schedules -----------------------------------------------------------------------------------------------
def corrupt(actions, rank, fn):
    out = [list(r) for r in actions]
    out[rank] = fn(out[rank])
    return out


def test_backward_before_its_forward_is_a_deadlock():
    bad = corrupt(one_f_one_b(2, 2), 1, lambda r: ["1B0"] + [a for a in r if a != "1B0"])
    with pytest.raises(PlanError, match=r"deadlock: rank 1 action '1B0' waits on '1F0'"):
        simulate(bad, stages=uniform(2), settings=p2p(0.1))


def test_cross_rank_deadlock():
    """Rank 0 waits for micro-batch 1's gradient before it sends micro-batch 1's activations."""
    bad = [["0F0", "0SEND_F0", "0RECV_B1", "0B1", "0F1", "0SEND_F1", "0RECV_B0", "0B0"],
           ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"]]
    with pytest.raises(PlanError, match="deadlock: rank 0 action '0B1'"):
        simulate(bad, stages=uniform(2))


def test_malformed_schedules():
    good = one_f_one_b(2, 2)
    with pytest.raises(PlanError, match="no rank runs its SEND 0SEND_F1"):
        simulate(corrupt(good, 0, lambda r: [a for a in r if a != "0SEND_F1"]), stages=uniform(2))
    with pytest.raises(PlanError, match="'0SEND_F1': no rank runs its RECV 1RECV_F1"):
        simulate(corrupt(good, 1, lambda r: [a for a in r if a != "1RECV_F1"]), stages=uniform(2))
    late_recv = corrupt(good, 1, lambda r: [a for a in r if a != "1RECV_F1"] + ["1RECV_F1"])
    with pytest.raises(PlanError, match="'1F1': needs 1RECV_F1 earlier"):
        simulate(late_recv, stages=uniform(2))
    with pytest.raises(PlanError, match="appears twice"):
        simulate(corrupt(good, 0, lambda r: r + ["0F0"]), stages=uniform(2))
    with pytest.raises(PlanError, match="stage 0 already runs on rank 0"):
        simulate(corrupt(good, 1, lambda r: ["0F5"] + r), stages=uniform(2))
    with pytest.raises(PlanError, match="'0X1'"):
        simulate(corrupt(good, 0, lambda r: r + ["0X1"]), stages=uniform(2))
    with pytest.raises(PlanError, match="out of range"):
        simulate(good, stages=uniform(1))
    with pytest.raises(PlanError, match="waits on '0F1'"):
        simulate(corrupt(good, 0, lambda r: ["0SEND_F1"] + [a for a in r if a != "0SEND_F1"]), stages=uniform(2))


def test_stage_program_validation():
    with pytest.raises(PlanError, match="backward_input_s=-1"):
        StageProgram.uniform(1, -1)
    with pytest.raises(PlanError, match="p2p_s"):
        simulate(one_f_one_b(2, 1), stages=uniform(2), settings=RunSettings(p2p_s=-1))


@st.composite
def segment_lists(draw):
    """A random segment list: compute and collectives, deferrable weight gradients, dependencies on earlier
    segments (trailing collective runs and all-deferrable lists included)."""
    out = []
    for i in range(draw(st.integers(0, 7))):
        after = tuple(sorted(draw(st.sets(st.integers(0, i - 1), max_size=2)))) if i else ()
        secs = draw(st.sampled_from([0.0, 0.25, 1.0]))
        if draw(st.booleans()):
            out.append(collective(f"c{i}", secs, after, cls=draw(st.sampled_from(["ep", "tp"])),
                                  async_by=draw(st.sampled_from([None, "native", "shared-expert"])),
                                  host_sync=draw(st.booleans()), tier=draw(st.sampled_from(["intra", "inter"]))))
        else:
            out.append(compute(f"k{i}", secs, after, deferrable=draw(st.booleans())))
    return tuple(out)


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.tuples(segment_lists(), st.integers(1, 4)), min_size=1, max_size=3))
def test_a_repeated_list_packs_as_its_concatenation(parts):
    """``Repeated(part, n)`` is packed to the very arrays of ``concat_segments([part] * n)`` (the layout search
    prices overlapped pairs of 2 and 4 layers with it), beside plain lists, and times the same."""
    run = RunSettings(mechanisms=frozenset({"pp", "shared-expert"}), compute_slowdown=0.1, host_launch_s=0.01)
    lazy = [Repeated(p, n) if n > 1 else p for p, n in parts]
    built = [concat_segments([p] * n) for p, n in parts]
    a, b = _pack_programs(lazy, [0.0] * len(parts), run), _pack_programs(built, [0.0] * len(parts), run)
    for name in a.programs._fields:
        assert np.array_equal(getattr(a.programs, name), getattr(b.programs, name)), name
    assert a.classes == b.classes and np.array_equal(a.on_tier, b.on_tier) and np.array_equal(a.slowing, b.slowing)
    assert action_times_s([[x] for x in lazy], run) == action_times_s([[x] for x in built], run)
