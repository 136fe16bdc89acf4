"""The layout search estimates lazily (moeplan/search_eval.py ``_Screen``): each option's floor is never above its
estimate, and what it chooses to simulate is exactly what ranking every estimate would choose."""
import pytest

from moeplan.compiler import DEFAULT_PIPELINE, Pipeline
from moeplan.estimate import slot_weights
from moeplan.ir import named_layers
from moeplan.search import Fixed, build_options, pipeline_budget
from moeplan.search_eval import _SHARED, _estimate_class, _follow_ups, _lean, _Outcome, _Pool, _Screen, _shape_tasks
from moeplan.spec import load_spec
from moeplan.targets import load_target
from moeplan.trace import trace_model


@pytest.fixture(scope="module", params=[("tiny-pangu", "cpu", 16), ("qwen2-57b-a14b", "h100", 32)])
def screened(request):
    model, target, devices = request.param
    spec, tgt = load_spec(model), load_target(target)
    graph = trace_model(spec, seq_len=spec.seq_len)
    budget = pipeline_budget(Pipeline.parse(DEFAULT_PIPELINE), tgt)
    built = build_options(graph=graph, target=tgt, num_devices=devices, budget=budget,
                          fixed=Fixed(global_batch=spec.global_batch, seq_len=spec.seq_len))
    slots = [k for _, k in named_layers(spec)]
    _SHARED.update(graph=_lean(graph), target=tgt, budget=budget)
    tasks = _shape_tasks(built.options, slots, slot_weights(graph, slots))
    full = _Screen(_Pool(1), tasks)
    yield tasks, full, full.ranked()
    _SHARED.clear()


def test_floor_never_above_the_estimate(screened):
    _, full, every = screened
    assert len(every) > 100
    assert all(f <= k[1] for f, k in zip(full.floor, full.key))


@pytest.mark.parametrize("n", [1, 4])
def test_best_is_the_head_of_every_estimate(screened, n):
    tasks, _, every = screened
    lazy = _Screen(_Pool(1), tasks)
    assert lazy.best(n) == every[:n]
    assert lazy.estimated < len(every)  # the floors left most options unestimated


@pytest.mark.parametrize("ratio", [0.8, 1.3])
def test_follow_ups_are_those_of_every_estimate(screened, ratio):
    """With the first four simulated, a measured ratio on one class and none on the others, and the step to beat
    between the estimates, the lazy follow-ups are the follow-ups of every estimate, in the same order."""
    tasks, full, every = screened
    lazy = _Screen(_Pool(1), tasks)
    first = lazy.best(4)
    out = _Outcome(keep=1)
    out.ratios = {_estimate_class(full.item(first[0])[3]): ratio}
    beat = sorted(k[1] for k in full.key if not k[0])[len(every) // 50]
    out.best = [(-beat, -1, None)]  # type: ignore[list-item]
    chosen, left = lazy.follow_ups(out, set(first), limit=4)
    rest = [full.item(i) for i in every[4:]]
    want = _follow_ups(rest, out, limit=4)
    assert [lazy.item(i)[2:] for i in chosen] == [rest[i][2:] for i in want] and want
    assert sorted(lazy.bound[i] for i in left) == sorted(x[1] for j, x in enumerate(rest) if j not in want)
