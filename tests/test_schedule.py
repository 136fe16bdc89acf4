"""Pass ``schedule``: action lists cross-checked against torch.distributed.pipelining's own generators."""
import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import _Action, _simulate_comms_compute

from moeplan.actions import NOOP_KINDS, Action, pair, parse_action, placement_of, stage_of, stage_rank
from moeplan.errors import LayoutError, PlanError
from moeplan.ir import ModelGraph
from moeplan.layout import Layout
from moeplan.passes.schedule import SchedulePass, build_actions, interleaved_1f1b, max_in_flight, one_f_one_b, pair_fb, schedule_fits, split_fb, torch_compute_order
from moeplan.spec import load_spec
from moeplan.state import PlanState, StagePlan, Strategy
from moeplan.targets import load_target


def compute_only(actions):
    return [[a for a in rank if parse_action(a).kind in ("F", "B")] for rank in actions]


def torch_order(name, pp, m, vpp=None):
    ops = get_schedule_ops(name, pp, m, vpp)
    return [[str(a) for a in rank if a is not None and str(a)[-1].isdigit()] for rank in ops]


def fix_torch_1f1b_last_rank(order, m):
    """torch 2.13 ``Schedule1F1B._get_pipeline_order`` numbers the last rank's forwards 1..m instead of 0..m-1
    (``forward_mb`` starts at 0 and is incremented before the first steady F when there is no warm-up); its runtime
    (``_step_microbatches``) runs F0 first. Undo that off-by-one so the order can be compared."""
    last = order[-1]
    forwards = [parse_action(a).microbatch for a in last if parse_action(a).kind == "F"]
    if forwards == list(range(1, m + 1)):
        order[-1] = [_shift(a) for a in last]
    return order


def _shift(text):
    a = parse_action(text)
    return f"{a.stage}F{a.microbatch - 1}" if a.kind == "F" else text


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 5), (4, 4), (4, 8), (3, 7), (8, 16)])
def test_1f1b_compute_order_equals_torch(pp, m):
    ours = compute_only(one_f_one_b(pp, m))
    theirs = fix_torch_1f1b_last_rank(torch_order("1F1B", pp, m), m)
    assert ours == theirs


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 3, 8), (3, 2, 6), (4, 2, 12),
                                      (8, 4, 16), (16, 2, 32)])
def test_interleaved_compute_order_equals_torch(pp, vpp, m):
    assert compute_only(interleaved_1f1b(pp, vpp, m)) == torch_order("Interleaved1F1B", pp, m, vpp)


def test_interleaved_megatron_warmup_and_chunk_order():
    """Megatron-LM: rank r warms up with (pp − r − 1)·2 + (vpp − 1)·pp forward chunks, in groups of pp micro-batches."""
    pp, vpp, m = 4, 2, 8
    for r, rank in enumerate(compute_only(interleaved_1f1b(pp, vpp, m))):
        first_b = next(i for i, a in enumerate(rank) if "B" in a)
        assert first_b == (pp - r - 1) * 2 + (vpp - 1) * pp + 1  # warm-up, then one steady F before the first B
    rank0 = compute_only(interleaved_1f1b(pp, vpp, m))[0]
    assert rank0[:8] == ["0F0", "0F1", "0F2", "0F3", "4F0", "4F1", "4F2", "4F3"]
    assert [a for a in rank0 if "B" in a][:4] == ["4B0", "4B1", "4B2", "4B3"]


@pytest.mark.parametrize("actions,num_stages", [(one_f_one_b(4, 6), 4), (interleaved_1f1b(4, 2, 8), 8),
                                                (interleaved_1f1b(2, 3, 4), 6)])
def test_comms_progress_in_torch_dry_run(actions, num_stages):
    pp = len(actions)
    order = {r: [_Action.from_str(a) for a in rank] for r, rank in enumerate(actions)}
    done = _simulate_comms_compute(order, lambda s: s % pp, num_stages)  # raises ValueError on a deadlock
    assert sum(a is not None for rank in done.values() for a in rank) == sum(len(r) for r in actions)


def test_comm_placement():
    actions = one_f_one_b(3, 3)
    assert actions[0][:4] == ("0F0", "0SEND_F0", "0F1", "0SEND_F1")
    assert actions[2][:4] == ("2RECV_F0", "2F0", "2B0", "2SEND_B0")
    assert actions[1][actions[1].index("1B0") - 1] == "1RECV_B0"
    assert one_f_one_b(1, 3) == (("0F0", "0B0", "0F1", "0B1", "0F2", "0B2"),)
    inter = interleaved_1f1b(2, 2, 2)
    assert "1SEND_F0" in inter[1] and "2RECV_F0" in inter[0]  # the last rank's chunk 0 feeds rank 0's chunk 1


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 2), (8, 3), (16, 64), (1, 4)])
def test_1f1b_in_flight(pp, m):
    assert max_in_flight(one_f_one_b(pp, m), pp=pp) == tuple(min(pp - r, m) for r in range(pp))


@pytest.mark.parametrize("pp,vpp,m", [(4, 2, 8), (4, 2, 4), (16, 2, 64), (8, 4, 16), (4, 3, 12)])
def test_interleaved_in_flight_matches_megatron_warmup(pp, vpp, m):
    got = max_in_flight(interleaved_1f1b(pp, vpp, m), pp=pp)
    assert got == tuple(min((pp - r - 1) * 2 + (vpp - 1) * pp + 1, m * vpp) for r in range(pp))


@pytest.mark.parametrize("pp,vpp", [(4, 2), (16, 2), (8, 4)])
def test_interleaved_first_stage_memory_factor(pp, vpp):
    """docs/references.md §4.2: interleaving multiplies first-stage activation memory by 1 + (p−1)/(p·v) (one chunk = 1/v)."""
    m = 4 * pp
    ratio = (max_in_flight(interleaved_1f1b(pp, vpp, m), pp=pp)[0] / vpp) / max_in_flight(one_f_one_b(pp, m), pp=pp)[0]
    assert ratio == pytest.approx(1 + (pp - 1) / (pp * vpp))


def test_in_flight_with_split_backward():
    """Activations are freed at W, not at I (the timeline does the same)."""
    assert max_in_flight([["0F0", "0F1", "0I0", "0F2", "0W0", "0I1", "0W1", "0I2", "0W2"]], pp=1) == (3,)
    assert max_in_flight([["0F0", "0F1", "0I0", "0W0", "0F2", "0I1", "0W1", "0I2", "0W2"]], pp=1) == (2,)


def test_errors():
    with pytest.raises(LayoutError, match=r"schedule='interleaved': .*micro-batches \(6\) divisible by pp \(4\)"):
        interleaved_1f1b(4, 2, 6)
    with pytest.raises(LayoutError, match="vpp >= 2"):
        interleaved_1f1b(4, 1, 8)
    with pytest.raises(LayoutError, match="pp=0"):
        one_f_one_b(0, 8)
    with pytest.raises(PlanError, match="pp=3"):
        max_in_flight(one_f_one_b(2, 2), pp=3)
    with pytest.raises(LayoutError, match=r"dualpipev needs at least 2·pp = 8 micro-batches"):
        build_actions("dualpipev", pp=4, vpp=2, num_microbatches=6)
    with pytest.raises(LayoutError, match=r"zbv places two chunks per rank"):
        build_actions("zbv", pp=4, vpp=3, num_microbatches=8)
    with pytest.raises(LayoutError, match=r"zero-bubble .* needs vpp >= 2"):
        build_actions("zero-bubble", pp=4, vpp=1, num_microbatches=8)


@pytest.mark.parametrize("kind,vpp", [("zero-bubble", 2), ("zero-bubble", 3), ("zbv", 2), ("dualpipev", 2)])
def test_torch_orders_with_our_comms_progress_in_torch_dry_run(kind, vpp):
    """The compute order is torch's; the p2p we add around it passes torch's own dry run (no deadlock)."""
    pp, m = 4, 8
    actions = build_actions(kind, pp=pp, vpp=vpp, num_microbatches=m, fb=kind == "dualpipev")
    placement = placement_of(kind)
    # torch's dry run knows no OVERLAP_F_B: check the pairs as their F then their B
    ours = {r: [_Action.from_str(a) for a in split_fb(rank)] for r, rank in enumerate(actions)}
    torch_compute = get_schedule_ops({"zero-bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble",
                                      "dualpipev": "DualPipeV"}[kind], pp, m, num_stages_per_rank=vpp)
    for r, rank in enumerate(actions):
        mine = [a for a in rank if "SEND" not in a and "RECV" not in a]
        assert mine == [str(a) for a in torch_compute[r] if a is not None]
    _simulate_comms_compute(ours, lambda s: stage_rank(s, pp=pp, placement=placement), pp * vpp)


def test_v_placement():
    assert [stage_rank(s, pp=4, placement="v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_of(r, c, pp=4, placement="v") for r in range(4) for c in range(2)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert placement_of("dualpipev") == placement_of("zbv") == "v" and placement_of("interleaved") == "loop"


def test_fb_pairs_and_splits():
    paired = pair_fb(["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"])
    assert paired == ["0F0", "0F1", "(0F2;0B0)OVERLAP_F_B", "(0F3;0B1)OVERLAP_F_B", "0B2", "0B3"]
    assert split_fb(paired) == ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"]


def make_state(pp, vpp, num_microbatches, schedule="1f1b"):
    spec = load_spec("tiny-pangu")
    layout = Layout(tp=1, pp=pp, vpp=vpp, ep=1, etp=1, cp=1, dp=1, micro_batch=1, global_batch=num_microbatches,
                    seq_len=64)
    chunks = tuple(tuple((f"layers.{c * pp + r}",) for c in range(vpp)) for r in range(pp))
    stages = StagePlan(chunks=chunks, chunk_time_s=tuple((1.0,) * vpp for _ in range(pp)), imbalance=0.0,
                       empty_layers=(), reason="test", placement=placement_of(schedule))
    graph = ModelGraph(spec=spec, seq_len=64, layers={}, layer_sequence=())  # the pass reads only layout and stages
    return PlanState(graph=graph, target=load_target("cpu"), layout=layout, stages=stages,
                     strategy=Strategy(schedule=schedule))


def test_pass_builds_the_strategy_schedule():
    out = SchedulePass().run(make_state(2, 2, 4, "interleaved"))
    assert out.schedule.kind == "interleaved" and out.schedule.actions == interleaved_1f1b(2, 2, 4)
    out = SchedulePass().run(make_state(2, 1, 3))
    assert out.schedule.kind == "1f1b" and out.schedule.actions == one_f_one_b(2, 3)
    with pytest.raises(LayoutError, match="vpp=1"):
        SchedulePass().run(make_state(2, 2, 4))
    with pytest.raises(LayoutError, match=r"micro-batches \(3\)"):
        SchedulePass().run(make_state(2, 2, 3, "interleaved"))
    paired = SchedulePass().run(make_state(2, 2, 8, "interleaved").with_(
        strategy=Strategy(schedule="interleaved", overlap=frozenset({"fb"}))))
    assert any("OVERLAP_F_B" in a for rank in paired.schedule.actions for a in rank)
    with pytest.raises(PlanError, match="placement"):
        SchedulePass().run(make_state(2, 2, 8, "interleaved").with_(strategy=Strategy(schedule="dualpipev")))
    state = make_state(2, 2, 4)
    with pytest.raises(PlanError, match="stages"):
        SchedulePass().run(state.with_(stages=None))


def test_zero_bubble_fits_exactly_when_torch_builds_it():
    """schedule_fits accepts zero-bubble for just the (pp, m) torch's ScheduleInterleavedZeroBubble constructs: m
    must be a multiple of its number of rounds, max(1, m // pp) (m = 30 on pp 4 crashed a search before)."""
    with pytest.raises(LayoutError, match=r"zero-bubble needs micro-batches \(30\) divisible by its rounds"):
        build_actions("zero-bubble", pp=4, vpp=2, num_microbatches=30)
    for pp in (2, 3, 4):
        for m in range(1, 3 * pp + 2):
            fit = schedule_fits("zero-bubble", pp=pp, vpp=2, num_microbatches=m)
            try:
                torch_compute_order("zero-bubble", pp, 2, m)
                built = True
            except ValueError:
                built = False
            assert built == fit.fits, (pp, m, fit.reason)


@pytest.mark.parametrize("kind, vpp", [("zero-bubble", 2), ("zero-bubble", 3), ("zbv", 2), ("dualpipev", 2)])
def test_torch_orders_are_what_torch_visualizer_builds(kind, vpp):
    """torch_compute_order builds torch's schedules with a plain stand-in stage; torch's get_schedule_ops (an
    autospec mock stage) gives the same per-rank compute actions, and fails for the same (pp, m)."""
    from unittest import mock

    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from moeplan.passes.schedule import _TORCH_NAMES

    for pp in (2, 4, 8):
        for m in (pp - 1, pp, 2 * pp, 3 * pp + 1, 4 * pp):
            try:
                with mock.patch.object(_PipelineScheduleRuntime, "_prepare_schedule_with_comms", lambda self, o: None):
                    ops = get_schedule_ops(_TORCH_NAMES[kind], pp, m, num_stages_per_rank=vpp)
                want: object = tuple(tuple(str(a) for a in rank if a is not None) for rank in ops)
            except ValueError:
                want = ValueError
            try:
                got: object = torch_compute_order.__wrapped__(kind, pp, vpp, m)
            except ValueError:
                got = ValueError
            assert got == want, (kind, pp, vpp, m)


@pytest.mark.parametrize("kind, vpps", [("1f1b", (1,)), ("interleaved", (2, 3)), ("zero-bubble", (2,)),
                                        ("zbv", (2,)), ("dualpipev", (2,))])
def test_in_flight_vectors_stop_changing_past_the_cap(kind, vpps):
    """in_flight_by_rank counts a long schedule's in-flight vectors on a shorter one of the same pattern: for every
    rank they equal the vectors walked from the full action list."""
    from moeplan.actions import placement_of, stage_of
    from moeplan.cost_models.memory import in_flight_vectors
    from moeplan.passes.schedule import build_actions, in_flight_by_rank, schedule_fits

    for pp in (2, 3, 4):
        for vpp in vpps:
            for fb in ((False, True) if kind in ("1f1b", "interleaved", "dualpipev") else (False,)):
                cap = max(2 * pp * vpp, pp * pp) if kind == "zero-bubble" else 2 * pp * vpp
                for m in range(cap, 3 * cap + 1):
                    if not schedule_fits(kind, pp=pp, vpp=vpp, num_microbatches=m).fits:
                        continue
                    actions = build_actions(kind, pp=pp, vpp=vpp, num_microbatches=m, fb=fb)
                    full = tuple(in_flight_vectors(actions[r], [stage_of(r, c, pp=pp, placement=placement_of(kind))
                                                                for c in range(vpp)]) for r in range(pp))
                    assert in_flight_by_rank(kind, pp=pp, vpp=vpp, num_microbatches=m, fb=fb) == full, (pp, vpp, m)


_KINDS = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", *NOOP_KINDS)


@given(st.integers(0, 999), st.sampled_from(_KINDS), st.integers(0, 99_999), st.integers(0, 999), st.integers(0, 9_999))
def test_one_grammar_both_ways(stage, kind, mb, stage2, mb2):
    """Every action the plan, the schedule, the simulator and the executor read prints back to its own text
    (``Action.__str__`` is ``parse_action``'s inverse), an OVERLAP_F_B pair included."""
    a = Action(stage, kind, -1 if kind in NOOP_KINDS else mb)
    assert parse_action(str(a)) == a and str(parse_action(str(a))) == str(a)
    text = pair(str(Action(stage, "F", mb)), str(Action(stage2, "B", mb2)))
    assert text == f"({stage}F{mb};{stage2}B{mb2})OVERLAP_F_B" and str(parse_action(text)) == text
    with pytest.raises(PlanError, match="an OVERLAP_F_B pair is an F then a B"):
        pair(str(Action(stage, "B", mb)), str(Action(stage2, "F", mb2)))


@pytest.mark.parametrize("vpp", [1, 3])
def test_fb_pairs_never_wait_on_each_other(vpp):
    """Issue 34: a pair never holds the forward and the backward of one micro-batch (pp 2, one micro-batch per
    replica: '(0F0;0B0)'), and pairs on two ranks never wait on each other (interleaved pp 2 × vpp 3, 2 micro-batches:
    rank 0's '(4F1;4B0)' needed 5B0, paired on rank 1 with 5F1, which needed 4F1); both compiles were refused as a
    schedule deadlock by the simulator. Now they compile, the blocked pair run as its F then its B."""
    from moeplan.compile import compile_model
    from moeplan.search import Fixed
    from moeplan.spec import load_spec
    from moeplan.targets import load_target

    fixed = dict(micro_batch=4, schedule="1f1b") if vpp == 1 else dict(micro_batch=2, schedule="interleaved")
    plan = compile_model(spec=load_spec("tiny-pangu"), target=load_target("cpu", devices_per_node=2), num_devices=4,
                         fixed=Fixed(global_batch=8, seq_len=64, pp=2, vpp=vpp, ep=2, tp=1, cp=1,
                                     overlap=frozenset({"fb"}), **fixed), workers=1, candidates=1).plan
    assert plan.prediction.step_time_s > 0 and "fb" in plan.comm.overlap
    pairs = [parse_action(a).parts for acts in plan.schedule.actions for a in acts
             if parse_action(a).kind == "OVERLAP_F_B"]
    assert all(f.microbatch != b.microbatch for f, b in pairs)
    assert len(pairs) == (0 if vpp == 1 else 1)  # rank 1 keeps (5F1;5B0); rank 0's (4F1;4B0) runs unpaired
