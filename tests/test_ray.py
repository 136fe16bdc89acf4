"""Search tasks on a Ray cluster (moeplan/ray_pool.py): on a local cluster (head, 2 CPUs) the exact search and the
architecture search give what the forked workers give, a task whose worker dies runs again, and without Ray the
command is refused in one line."""
import logging
import os
import sys

import pytest
import ray
from inprocess import run_moeplan
from test_cli import assert_one_line_error

from moeplan.compile import compile_model
from moeplan.explore import explore, load_space
from moeplan.ray_pool import RayPool
from moeplan.search import Fixed
from moeplan.spec import load_spec
from moeplan.targets import load_target


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


def _ranked(result):
    return [(e.state.layout, e.state.strategy, e.state.prediction.step_time_s) for e in result.ranked]


def test_exact_search_on_ray_is_the_local_exact_search(cluster):
    kw = dict(spec=load_spec("tiny-pangu"), target=load_target("cpu"), num_devices=16,
              fixed=Fixed(global_batch=32, seq_len=64), candidates=None, keep=3)
    local = compile_model(**kw, workers=2).result
    on_ray = compile_model(**kw, ray="auto").result  # joins the cluster this process runs
    assert _ranked(on_ray) == _ranked(local) and len(local.ranked) == 3
    assert (on_ray.num_evaluated, on_ray.num_pruned, on_ray.num_open) == (local.num_evaluated, local.num_pruned, 0)
    assert on_ray.rejected == local.rejected and on_ray.workers == 2


def test_explore_on_ray_is_the_local_explore(cluster, tmp_path):
    from test_explore import write

    space = load_space(write(tmp_path, {"name": "small", "base": "tiny-pangu",
                                        "choices": {"num_layers": {"min": 2, "max": 3}, "top_k": [1, 2]}}))
    local = explore(space, target=load_target("h100"), num_devices=8, verify=2, workers=1)
    said = []
    on_ray = explore(space, target=load_target("h100"), num_devices=8, verify=2, ray="auto",
                     verified=lambda v, name: said.append(name))
    assert on_ray.screened == local.screened and on_ray.shortlist == local.shortlist
    assert [(v.index, v.layout, v.strategy, v.step_s) for v in on_ray.verified] == \
        [(v.index, v.layout, v.strategy, v.step_s) for v in local.verified] and len(said) == 2


def test_a_task_whose_worker_dies_is_run_again(cluster, tmp_path):
    marker = tmp_path / "died"

    def once(x):  # the first call kills its worker process
        if not marker.exists():
            marker.write_text("")
            os._exit(1)
        return 2 * x

    with RayPool("auto") as pool:
        assert list(pool.imap(once, range(3))) == [0, 2, 4] and pool.workers == 2
    assert marker.exists()


def test_without_ray_it_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    proc = run_moeplan("compile", "tiny-pangu", "--target", "cpu", "--devices", "2", "--ray", "local")
    assert_one_line_error(proc, 2, "ray='local'", 'pip install "moeplan[ray]"')


def test_an_address_where_no_cluster_answers_is_one_line():
    proc = run_moeplan("compile", "tiny-pangu", "--target", "cpu", "--devices", "2", "--ray", "127.0.0.1:1")
    assert_one_line_error(proc, 2, "ray='127.0.0.1:1'", "no Ray cluster answers there")
