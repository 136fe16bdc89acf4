"""Timeline simulator: closed forms of FACTS §4.3, hand-derived p2p cases, a DAG reference, and broken schedules."""
import random

import networkx as nx
import pytest
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from moeplan.cost_models.timeline import StageCost, parse_action, simulate
from moeplan.errors import PlanError
from moeplan.passes.schedule import interleaved_1f1b, max_in_flight, one_f_one_b


def uniform(num_stages, f=1.0, b=2.0, act=1.0):
    return [StageCost(forward_s=f, backward_s=b, backward_input_s=b, backward_weight_s=0.0, activation_bytes=act)
            for _ in range(num_stages)]


@pytest.mark.parametrize("p,m", [(1, 4), (2, 1), (2, 2), (4, 4), (4, 8), (4, 13), (8, 8), (8, 32), (16, 64),
                                 (16, 1024)])
def test_1f1b_closed_form(p, m):
    t = simulate(one_f_one_b(p, m), stage_costs=uniform(p), p2p_s=0.0)
    assert t.step_time_s == pytest.approx((m + p - 1) * 3.0)
    assert abs(t.bubble - (p - 1) / (m + p - 1)) <= 0.002
    assert t.bubble_per_rank == pytest.approx([t.bubble] * p)


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 8), (4, 2, 4), (4, 2, 8), (4, 3, 8), (4, 4, 16), (8, 2, 16),
                                   (8, 4, 32), (16, 2, 64), (16, 3, 32)])
def test_interleaved_closed_form(p, v, m):
    """Per chunk F = 1, B = 2: bubble ((p−1)/v) / (m + (p−1)/v), step (m·v + p − 1)·(F + B) (SC'21 §2.2.2)."""
    t = simulate(interleaved_1f1b(p, v, m), stage_costs=uniform(p * v), p2p_s=0.0)
    x = (p - 1) / v
    assert abs(t.bubble - x / (m + x)) <= 0.002
    assert t.step_time_s == pytest.approx((m * v + p - 1) * 3.0)


def test_pangu_bubbles():
    """FACTS §4.3 at Pangu Ultra MoE's p = 16, m = 64: 18.99 % with 1F1B, 10.49 % interleaved with v = 2."""
    assert round(100 * simulate(one_f_one_b(16, 64), stage_costs=uniform(16), p2p_s=0.0).bubble, 2) == 18.99
    assert round(100 * simulate(interleaved_1f1b(16, 2, 64), stage_costs=uniform(32), p2p_s=0.0).bubble, 2) == 10.49


@pytest.mark.parametrize("actions,num_stages", [(one_f_one_b(4, 8), 4), (one_f_one_b(8, 3), 8),
                                                (interleaved_1f1b(4, 2, 8), 8), (interleaved_1f1b(16, 2, 64), 32)])
def test_activation_peak_equals_in_flight(actions, num_stages):
    t = simulate(actions, stage_costs=uniform(num_stages, act=3.0), p2p_s=0.1)
    assert t.peak_activation_bytes == tuple(3.0 * n for n in max_in_flight(actions, pp=len(actions)))


def test_p2p_hand_derived():
    """pp = 2, F = 1, B = 2. m = 1, p2p 0.5: F0 [0,1], send [1,1.5], F0' [1.5,2.5], B0' [2.5,4.5], send [4.5,5],
    B0 [5,7]. m = 2 adds F1 [1,2] (send [2,2.5]), F1' [4.5,5.5], B1' [5.5,7.5], send [7.5,8], B1 [8,10]."""
    costs = uniform(2)
    t = simulate(one_f_one_b(2, 1), stage_costs=costs, p2p_s=0.5)
    assert t.step_time_s == pytest.approx(7.0)
    assert dict(t.exposed_comm_s) == pytest.approx({"pp": 0.5})
    t = simulate(one_f_one_b(2, 2), stage_costs=costs, p2p_s=0.5)
    assert t.step_time_s == pytest.approx(10.0)
    assert [e.start_s for e in t.events if e.rank == 0 and e.stream == "compute"] == pytest.approx([0, 1, 5, 8])
    assert t.exposed_comm_per_rank_s[0]["pp"] == pytest.approx(1.0)  # B0 and B1 each wait 0.5 on a transfer
    assert t.exposed_comm_per_rank_s[1]["pp"] == pytest.approx(0.5)  # F1's input arrived while B0 ran
    assert t.busy_s == pytest.approx((6.0, 6.0)) and t.bubble == pytest.approx(0.4)


def test_comm_stream_serializes_sends():
    """p2p 1.5 > F: rank 0's second SEND_F waits for the first ([1, 2.5] then [2.5, 4]); step 12 by hand."""
    t = simulate(one_f_one_b(2, 2), stage_costs=uniform(2), p2p_s=1.5)
    sends = [x for e in t.events if e.rank == 0 and e.stream == "comm" for x in (e.start_s, e.end_s)]
    assert sends == pytest.approx([1.0, 2.5, 2.5, 4.0])
    assert t.step_time_s == pytest.approx(12.0)
    assert t.rank_end_s == pytest.approx((12.0, 10.0))  # rank 1's last SEND_B ends at 10


def test_split_backward_sends_after_input_grad():
    """F = I = W = 1: the gradient leaves after I, so rank 0's I0 starts at 3 and the step is 5 (6 with full B)."""
    costs = [StageCost(forward_s=1, backward_s=2, backward_input_s=1, backward_weight_s=1, activation_bytes=1)] * 2
    actions = [["0F0", "0SEND_F0", "0RECV_B0", "0I0", "0W0"], ["1RECV_F0", "1F0", "1I0", "1SEND_B0", "1W0"]]
    t = simulate(actions, stage_costs=costs, p2p_s=0.0)
    assert t.step_time_s == pytest.approx(5.0)
    full = [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    assert simulate(full, stage_costs=costs, p2p_s=0.0).step_time_s == pytest.approx(6.0)


def test_exposed_comm_per_class():
    cost = StageCost(forward_s=1.0, backward_s=2.0, backward_input_s=1.5, backward_weight_s=0.5, activation_bytes=1,
                     fwd_comm_s={"ep": 0.2}, bwd_comm_s={"ep": 0.3, "tp": 0.1})
    t = simulate(interleaved_1f1b(2, 2, 4), stage_costs=[cost] * 4, p2p_s=0.0)
    for per_rank in t.exposed_comm_per_rank_s:  # 2 chunks × 4 micro-batches per rank
        assert per_rank["ep"] == pytest.approx(8 * 0.5) and per_rank["tp"] == pytest.approx(8 * 0.1)
        assert per_rank["pp"] == 0.0
    assert t.exposed_comm_s["ep"] == pytest.approx(4.0)


def reference_start_times(actions, stage_costs, p2p_s):
    """Independent reference: earliest start = longest path in the DAG of stream-order and data edges (networkx)."""
    g, owner = nx.DiGraph(), {}
    dur = {}
    for r, rank in enumerate(actions):
        prev = {"compute": None, "comm": None}
        for text in rank:
            a = parse_action(text)
            if a.kind.startswith("RECV"):
                continue
            node = (a.kind, a.stage, a.microbatch)
            c = stage_costs[a.stage]
            dur[node] = {"F": c.forward_s, "B": c.backward_s}.get(a.kind, p2p_s)
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
    costs = []
    for _ in range(p * v):
        bi, bw = rng.uniform(0.5, 3), rng.uniform(0.1, 1)
        costs.append(StageCost(forward_s=rng.uniform(0.2, 2), backward_s=bi + bw, backward_input_s=bi,
                               backward_weight_s=bw, activation_bytes=1))
    p2p = rng.uniform(0, 0.5)
    ref = reference_start_times(actions, costs, p2p)
    t = simulate(actions, stage_costs=costs, p2p_s=p2p)
    got = {(parse_action(e.action).kind, parse_action(e.action).stage, parse_action(e.action).microbatch): e.start_s
           for e in t.events if e.stream != "recv"}
    assert got == pytest.approx(ref)


def test_torch_lowered_interleaved_schedule_simulates_alike():
    """torch's own lowering (early RECVs, UNSHARD/RESHARD/REDUCE_GRAD) gives the same step as ours at p2p = 0."""
    torch_lists = [[str(a) for a in rank if a is not None]
                   for rank in get_schedule_ops("Interleaved1F1B", 4, 8, 2, with_comms=True)]
    ours = simulate(interleaved_1f1b(4, 2, 8), stage_costs=uniform(8), p2p_s=0.0)
    theirs = simulate(torch_lists, stage_costs=uniform(8), p2p_s=0.0)
    assert theirs.step_time_s == pytest.approx(ours.step_time_s)
    assert theirs.peak_activation_bytes == ours.peak_activation_bytes


def corrupt(actions, rank, fn):
    out = [list(r) for r in actions]
    out[rank] = fn(out[rank])
    return out


def test_backward_before_its_forward_is_a_deadlock():
    bad = corrupt(one_f_one_b(2, 2), 1, lambda r: ["1B0"] + [a for a in r if a != "1B0"])
    with pytest.raises(PlanError, match=r"deadlock: rank 1 action '1B0' waits on '1F0'"):
        simulate(bad, stage_costs=uniform(2), p2p_s=0.1)


def test_cross_rank_deadlock():
    """Rank 0 waits for micro-batch 1's gradient before it sends micro-batch 1's activations."""
    bad = [["0F0", "0SEND_F0", "0RECV_B1", "0B1", "0F1", "0SEND_F1", "0RECV_B0", "0B0"],
           ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"]]
    with pytest.raises(PlanError, match="deadlock: rank 0 action '0B1'"):
        simulate(bad, stage_costs=uniform(2), p2p_s=0.0)


def test_malformed_schedules():
    good = one_f_one_b(2, 2)
    with pytest.raises(PlanError, match="no rank runs its SEND 0SEND_F1"):
        simulate(corrupt(good, 0, lambda r: [a for a in r if a != "0SEND_F1"]), stage_costs=uniform(2), p2p_s=0.1)
    with pytest.raises(PlanError, match="'0SEND_F1': no rank runs its RECV 1RECV_F1"):
        simulate(corrupt(good, 1, lambda r: [a for a in r if a != "1RECV_F1"]), stage_costs=uniform(2), p2p_s=0.1)
    late_recv = corrupt(good, 1, lambda r: [a for a in r if a != "1RECV_F1"] + ["1RECV_F1"])
    with pytest.raises(PlanError, match="'1F1': needs 1RECV_F1 earlier"):
        simulate(late_recv, stage_costs=uniform(2), p2p_s=0.1)
    with pytest.raises(PlanError, match="appears twice"):
        simulate(corrupt(good, 0, lambda r: r + ["0F0"]), stage_costs=uniform(2), p2p_s=0.1)
    with pytest.raises(PlanError, match="stage 0 already runs on rank 0"):
        simulate(corrupt(good, 1, lambda r: ["0F5"] + r), stage_costs=uniform(2), p2p_s=0.1)
    with pytest.raises(PlanError, match="'0X1'"):
        simulate(corrupt(good, 0, lambda r: r + ["0X1"]), stage_costs=uniform(2), p2p_s=0.1)
    with pytest.raises(PlanError, match="out of range"):
        simulate(good, stage_costs=uniform(1), p2p_s=0.1)


def test_stage_cost_validation():
    with pytest.raises(PlanError, match="backward_s=3"):
        StageCost(forward_s=1, backward_s=3, backward_input_s=1, backward_weight_s=1, activation_bytes=0)
    with pytest.raises(PlanError, match="fwd_comm_s"):
        StageCost(forward_s=1, backward_s=2, backward_input_s=2, backward_weight_s=0, activation_bytes=0,
                  fwd_comm_s={"tp": 1.5})
