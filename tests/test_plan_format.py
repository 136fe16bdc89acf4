"""The plan on disk: the schedule's one-line-per-rank encoding (moeplan/plan_schedule.py) and a described JSON Schema
(moeplan/plan.py)."""
import pytest
from hypothesis import given, settings, strategies as st

from moeplan.errors import PlanError
from moeplan.passes.schedule import build_actions
from moeplan.plan import PlanSchedule, plan_json_schema
from moeplan.plan_schedule import decode_actions, encode_actions

_COMPUTE = st.sampled_from(["F", "B", "I", "W"])
_ACTION = st.one_of(
    st.builds(lambda s, k, m: f"{s}{k}{m}", st.integers(0, 40), _COMPUTE, st.integers(0, 300)),
    st.builds(lambda s, k, m: f"{s}{k}{m}", st.integers(0, 40), st.sampled_from(["SEND_F", "RECV_F", "SEND_B",
                                                                                  "RECV_B"]), st.integers(0, 300)),
    st.builds(lambda a, m, b, n: f"({a}F{m};{b}B{n})OVERLAP_F_B", st.integers(0, 40), st.integers(0, 300),
              st.integers(0, 40), st.integers(0, 300)))


@st.composite
def _runs(draw):
    """Action lists with runs in them: blocks repeated with the micro-batch numbers counting up."""
    out = []
    for _ in range(draw(st.integers(0, 6))):
        block = draw(st.lists(_ACTION, min_size=1, max_size=4))
        for r in range(draw(st.integers(1, 5))):
            out += [decode_actions(f"{a}*{r + 1}")[-1] for a in block]
    return out


@given(st.one_of(st.lists(_ACTION, max_size=30), _runs()))
@settings(max_examples=300, deadline=None)
def test_encoding_round_trips(actions):
    line = encode_actions(actions)
    assert decode_actions(line) == actions
    assert "\n" not in line and len(line) <= sum(len(a) + 1 for a in actions)


def test_runs_are_folded():
    acts = ["3RECV_F0", "3F0", "3SEND_F0", "3RECV_F1", "3F1", "3SEND_F1", "3F7", "3F8", "3F9", "(3F10;5B2)OVERLAP_F_B",
            "(3F11;5B3)OVERLAP_F_B"]
    assert encode_actions(acts) == "<3RECV_F0 3F0 3SEND_F0>*2 3F7*3 (3F10;5B2)OVERLAP_F_B*2"


@pytest.mark.parametrize("kind,pp,vpp,m,fb", [("1f1b", 4, 1, 8, False), ("interleaved", 4, 2, 8, True),
                                               ("zero-bubble", 2, 2, 4, False), ("dualpipev", 2, 2, 8, True)])
def test_p2p_is_derived_and_given_back(kind, pp, vpp, m, fb):
    actions = build_actions(kind, pp=pp, vpp=vpp, num_microbatches=m, fb=fb)
    sched = PlanSchedule.of(kind, actions)
    assert sched.p2p == "derived" and not any("SEND" in line or "RECV" in line for line in sched.ranks)
    assert sched.actions == actions
    again = PlanSchedule.model_validate(sched.model_dump(mode="json"))
    assert again == sched and again.actions == actions


def test_p2p_not_from_the_rule_is_listed():
    actions = build_actions("1f1b", pp=2, vpp=1, num_microbatches=4)
    moved = [list(actions[0]), list(actions[1])]
    moved[1].insert(0, moved[1].pop(moved[1].index("1RECV_F1")))  # a receive posted early
    sched = PlanSchedule.of("1f1b", moved)
    assert sched.p2p == "listed" and sched.actions == tuple(map(tuple, moved))


@pytest.mark.parametrize("line,bad", [("0F0 0X1", "'0X1' is not an action"), ("<0F0 0B0>*0", "is not a run"),
                                      ("0F0*x", "is not a run"), ("0F0*2*3", "is not an action")])
def test_malformed_line_names_the_token(line, bad):
    with pytest.raises(PlanError, match=bad):
        decode_actions(line)


def test_every_schema_field_is_described():
    schema = plan_json_schema()
    defs = schema["$defs"]
    models = {"Plan": schema, **defs}
    for name, model in models.items():
        for field, prop in model.get("properties", {}).items():
            ref = prop.get("$ref", "").rsplit("/", 1)[-1]
            described = prop.get("description") or defs.get(ref, {}).get("description")
            assert described, f"{name}.{field} has no description"
