"""``moeplan run`` / ``compare`` / ``calibrate`` through the command line.

Hand-edited invalid plans are refused with one line (exit 2) before any process starts; a cuda plan prints the
torchrun command, and that command, printed for a cpu plan (``--print-command``), runs under torchrun; Ctrl-C prints
one line and exits 130; a short run's metrics carry the numbers the runtime must produce; compare and calibrate work.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from moeplan.plan import SCHEMA_VERSION, PlanSchedule, load_plan, save_plan
from moeplan.plan_schedule import encode_actions
from moeplan.calibrate import LOADED_BYTES, LOADED_OPS, fit_alpha_launch
from moeplan.runtime.checkpoint import newest_checkpoint
from moeplan.runtime.data import stdlib_tokens
from moeplan.targets import load_target

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from inprocess import run_moeplan  # noqa: E402
from test_executor import make_plan  # noqa: E402

STEPS = 3


def moeplan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeplan.cli", *args], capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    save_plan(make_plan(2, dict(pp=2, vpp=1, tp=1, cp=1, micro_batch=2)), root / "plan.yaml")
    np.save(root / "tokens.npy", stdlib_tokens("train")[:20_000].numpy())
    return root


def _edited(root: Path, name: str, edit) -> str:
    data = yaml.safe_load((root / "plan.yaml").read_text())
    edit(data)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _actions(edit):
    """An edit of the plan's per-rank action lists (written back with every action listed)."""
    def apply(data):
        sched = PlanSchedule.model_validate(data["schedule"])
        actions = [list(a) for a in sched.actions]
        edit(actions)
        data["schedule"] = {"kind": sched.kind, "p2p": "listed", "ranks": [encode_actions(a) for a in actions]}
    return apply


def _swap_first_b_for_w(actions):
    actions[0][actions[0].index("0B0")] = "0W0"


EDITS = {
    "unknown_action": (_actions(lambda a: a[0].insert(0, "0X1")), "'0X1' is not an action"),
    "layer_on_two_ranks": (lambda d: d["stages"]["chunks"][1][0].insert(0, "layers.0"),
                           "layer 'layers.0' is on pp rank 0 and pp rank 1"),
    "device_count": (lambda d: d["layout"].update(num_devices=4), "layout.num_devices=4: must equal"),
    "schema_version": (lambda d: d.update(schema_version=SCHEMA_VERSION + 1), f"schema_version={SCHEMA_VERSION + 1}"),
    "missing_recv": (_actions(lambda a: a[1].remove("1RECV_F0")), "0SEND_F0 and 1RECV_F0"),
    "w_without_i": (_actions(_swap_first_b_for_w), "stage 0 micro-batch 0 has 1 F, 0 B, 0 I, 1 W"),
    "expert_twice": (lambda d: d["experts"].update(shards=[[0, 0, 1, 2, 3, 4, 5, 6]]), "every expert 0..7"),
}


def run_in_process(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """``moeplan ARGS`` through moeplan.cli.main in this process: (exit code, stderr, stdout)."""
    from moeplan.cli import main

    monkeypatch.setattr(sys, "argv", ["moeplan", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.err, captured.out


@pytest.mark.parametrize("name", list(EDITS))
def test_invalid_plans_are_refused_before_launch(pp2, name, monkeypatch, capsys):
    edit, needle = EDITS[name]
    metrics = pp2 / f"{name}.jsonl"
    monkeypatch.setattr("moeplan.runtime.launch.launch_local", lambda *a: pytest.fail("launched"))
    code, stderr, _ = run_in_process(monkeypatch, capsys, "run", _edited(pp2, name, edit), "--steps", "1",
                                     "--metrics", str(metrics))
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert needle in lines[0], lines[0]
    assert not metrics.exists()


def test_refusal_exits_2_with_one_line_from_the_shell(pp2):
    proc = moeplan("run", _edited(pp2, "shell", lambda d: d.update(schema_version=0)), "--steps", "1")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: schema_version=0: this moeplan reads schema version {SCHEMA_VERSION}"]


def test_devices_option_must_match_the_plan(pp2, monkeypatch, capsys):
    code, stderr, _ = run_in_process(monkeypatch, capsys, "run", str(pp2 / "plan.yaml"), "--steps", "1",
                                     "--devices", "4")
    assert code == 2 and "layout.num_devices=2: the plan is not for --devices 4" in stderr


def test_cuda_plan_prints_the_torchrun_command(pp2, monkeypatch, capsys):
    path = _edited(pp2, "cuda", lambda d: d["target"].update(backend="cuda", devices_per_node=8))
    code, _, stdout = run_in_process(monkeypatch, capsys, "run", path, "--steps", "7", "--seed", "3")
    assert code == 0
    from moeplan.runtime.launch import torchrun_command
    from moeplan.runtime.request import RunRequest

    from moeplan.cli import PRODUCTION_METER_EVERY

    want = torchrun_command(load_plan(path), RunRequest(plan=path, steps=7, seed=3,
                                                        meter_every=PRODUCTION_METER_EVERY))
    assert want.startswith("torchrun --nnodes 1 --nproc-per-node 2 ") and "-m moeplan.cli run" in want
    assert "--steps 7" in want and "--seed 3" in want and want in stdout.replace("\n", "")
    assert want.endswith(" --meter-every 100")  # the meter's hooks slow one production step in 100, not every one
    code, _, stdout = run_in_process(monkeypatch, capsys, "run", path, "--steps", "7", "--meter-every", "1")
    assert code == 0 and stdout.replace("\n", "").endswith(" --meter-every 1")  # asked for: kept


def test_run_request_is_spelled_as_moeplan_run_options():
    import typer.main

    from moeplan.cli import app
    from moeplan.cli_options import run_request
    from moeplan.runtime.request import RunRequest

    request = RunRequest(plan="/p.yaml", steps=5, metrics="/m.jsonl", data="/d.npy", checkpoint_every=2,
                         checkpoint_dir="/ck", resume=True, seed=3, lr=0.01, timeout_s=30.0, meter_every=4,
                         no_pin=True)
    run = typer.main.get_command(app).commands["run"]
    options = {o for p in run.params for o in p.opts}
    argv = request.cli_args()
    assert [a for a in argv if a.startswith("--")] == [
        "--steps", "--metrics", "--data", "--checkpoint-every", "--checkpoint-dir", "--resume", "--seed", "--lr",
        "--timeout", "--meter-every", "--no-pin"]
    assert {a for a in argv if a.startswith("--")} <= options
    # the printed torchrun command has every rank's `moeplan run` build this same request
    params = dict(run.make_context("run", list(argv)).params)
    del params["devices"], params["print_command"]
    assert run_request(params.pop("plan_path"), **params) == request
    assert "--no-pin" not in RunRequest(plan="/p.yaml", steps=5).cli_args()
    # launch_local hands it to every rank as one JSON argument
    assert RunRequest.model_validate_json(request.model_dump_json()) == request
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="frozen"):
        request.steps = 6  # type: ignore[misc]


PIN_PROBE = """
import json, os, sys, threading
from moeplan.runtime.launch import pin_to_cpu
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()      # a thread that exists before the binding
cpu = pin_to_cpu(int(sys.argv[1]), int(sys.argv[2]))
after = threading.Thread(target=stop.wait); after.start()        # one started after it
masks = sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")})
stop.set(); before.join(); after.join()
print(json.dumps({"cpu": cpu, "masks": masks}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="binding threads to CPUs needs Linux")
def test_pin_to_cpu_binds_every_thread_of_the_rank_to_one_core():
    def probe(local_rank: int, local_world: int) -> dict:
        out = subprocess.run([sys.executable, "-c", PIN_PROBE, str(local_rank), str(local_world)], check=True,
                             capture_output=True, text=True, timeout=60).stdout
        return json.loads(out)

    cpus = sorted(os.sched_getaffinity(0))
    last = probe(len(cpus) - 1, len(cpus))  # the last local rank gets the last usable CPU, every thread bound to it
    assert last == {"cpu": cpus[-1], "masks": [[cpus[-1]]]}
    assert probe(0, 1) == {"cpu": cpus[0], "masks": [[cpus[0]]]}
    # more local ranks than usable CPUs: nothing is bound
    assert probe(0, len(cpus) + 1) == {"cpu": None, "masks": [cpus]}


def test_torchrun_command_needs_whole_nodes(pp2):
    from moeplan.errors import PlanError
    from moeplan.runtime.launch import torchrun_command
    from moeplan.runtime.request import RunRequest

    plan = load_plan(pp2 / "plan.yaml")  # cpu target, 4 devices per node
    six = plan.model_copy(update={"layout": plan.layout.model_copy(update={"num_devices": 6})})
    with pytest.raises(PlanError, match="layout.num_devices=6: not a multiple of target.devices_per_node=4"):
        torchrun_command(six, RunRequest(plan="p.yaml", steps=1))


def _free_port() -> int:
    """A free port below Linux's ephemeral range (``ip_local_port_range``, 32768-60999 by default) and above Ray's
    worker ports (10002-19999): a port from ``bind(0)`` is one the kernel hands to the next ``bind(0)`` or outgoing
    connection too, and a run of the other test worker (the local launcher's store binds ``localhost:0``) took one
    between this test's probe and torchrun's bind, so torchrun met that store and failed."""
    for port in random.Random().sample(range(20000, 32768), 200):
        with socket.socket() as s:
            try:
                s.bind(("localhost", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


def test_printed_torchrun_command_runs_to_completion(pp2):
    """What a cuda user copies, printed for the cpu plan and run as printed: torchrun, 2 ranks on gloo, 2 steps."""
    metrics = pp2 / "torchrun.jsonl"
    printed = moeplan("run", str(pp2 / "plan.yaml"), "--steps", "2", "--metrics", str(metrics), "--data",
                      str(pp2 / "tokens.npy"), "--print-command")
    assert printed.returncode == 0, printed.stderr
    lines = printed.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("# cpu, 2 devices: run on every node")
    assert lines[1].startswith("torchrun --nnodes 1 --nproc-per-node 2 ")
    env = {**os.environ, "MASTER_PORT": str(_free_port()),  # the default 29500 may be taken on a shared machine
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MASTER_ADDR", None)
    proc = subprocess.run(printed.stdout, shell=True, env=env, cwd=pp2.parent, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]


def ctrl_c(launcher: subprocess.Popen, wait) -> str:
    """``wait()``, then SIGINT to the launcher's process group, as a terminal sends Ctrl-C; the launcher's stderr. The
    group is killed if it is still running after that."""
    try:
        wait()
        os.killpg(launcher.pid, signal.SIGINT)
        return launcher.communicate(timeout=60)[1]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def test_ctrl_c_prints_one_line_and_exits_130(pp2):
    """SIGINT to the process group, as a terminal sends it, once a step has been trained."""
    metrics = pp2 / "interrupted.jsonl"
    launcher = subprocess.Popen([sys.executable, "-m", "moeplan.cli", "run", str(pp2 / "plan.yaml"), "--steps", "10000",
                                 "--metrics", str(metrics), "--data", str(pp2 / "tokens.npy"), "--checkpoint-every",
                                 "1", "--checkpoint-dir", str(pp2 / "ck_interrupted")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def step_2_begun() -> None:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # step 1's checkpoint is complete
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not reach step 2"
            time.sleep(0.01)
    stderr = ctrl_c(launcher, step_2_begun)
    lines = stderr.splitlines()
    assert launcher.returncode == 130 and len(lines) == 1, stderr
    ref = newest_checkpoint(pp2 / "ck_interrupted")
    assert ref is not None and ref.step >= 1
    assert lines[0] == (f"moeplan run: interrupted by SIGINT; every rank was stopped; newest complete checkpoint: "
                        f"step {ref.step} ({ref.path}), continue with --resume")


def _site_packages_loaded(pid: int) -> bool:
    """Whether the process has mapped a shared library from site-packages: Python's own start (its ``site`` import,
    which runs the ``.pth`` files) is over, and the console script is importing moeplan's dependencies."""
    with open(f"/proc/{pid}/maps") as maps:
        return "/site-packages/" in maps.read()


@pytest.mark.parametrize("after_s", [0.1, 0.4, 1.5])
def test_ctrl_c_before_the_first_step_prints_one_line_and_exits_130(pp2, after_s):
    """SIGINT in the first seconds of the ``moeplan`` console script: while its modules load, while typer parses
    the arguments, while ``run`` checks the plan and starts the ranks. It printed the traceback of the interrupted
    import, or exited 130 with no line (typer's own handling; issue 34). Whenever it lands: exit 130 and one line.

    The delay counts from the first library moeplan's imports load. Before that the interpreter is still starting
    (``site``), where a Ctrl-C is Python's own ("Fatal Python error: init_import_site", exit 1): no code of the
    program runs yet, and a loaded machine stayed there for over 0.1 s."""
    script = Path(sys.executable).with_name("moeplan")
    launcher = subprocess.Popen([str(script), "run", str(pp2 / "plan.yaml"), "--steps", "10000", "--data",
                                 str(pp2 / "tokens.npy")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def imports_begun_then_wait():
        deadline = time.monotonic() + 60
        while not _site_packages_loaded(launcher.pid):
            assert launcher.poll() is None and time.monotonic() < deadline, "moeplan's imports did not begin"
            time.sleep(0.005)
        time.sleep(after_s)

    stderr = ctrl_c(launcher, imports_begun_then_wait)
    lines = stderr.splitlines()
    assert launcher.returncode == 130 and len(lines) == 1 and "interrupted" in lines[0], stderr


@pytest.fixture(scope="module")
def run_metrics(pp2) -> Path:
    metrics = pp2 / "run.jsonl"
    proc = moeplan("run", str(pp2 / "plan.yaml"), "--steps", str(STEPS), "--metrics", str(metrics), "--data",
                   str(pp2 / "tokens.npy"), "--meter-every", "2")
    assert proc.returncode == 0, proc.stderr
    return metrics


def test_metrics_lines_carry_the_measurements(pp2, run_metrics):
    plan = load_plan(pp2 / "plan.yaml")
    records = [json.loads(line) for line in run_metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    hidden_bytes = 2 * 64 * 64 * 4  # micro_batch × seq_len × hidden, fp32
    m = plan.layout.num_microbatches
    for r in records:
        assert r["loss"] > 0 and r["tokens_per_s"] == pytest.approx(8 * 64 / r["step_time_s"])
        first, last = r["ranks"]
        assert first["comm_bytes"]["pp"] == m * hidden_bytes == last["comm_bytes"]["pp"]
        assert first["action_s"]["F"] > 0 and first["action_s"]["B"] > 0 and last["action_s"]["RECV_F"] >= 0
        assert first["comm_bytes"]["dp"] == last["comm_bytes"]["dp"] > 0  # the tied embedding gradients
        if r["step"] % 2:  # metered (--meter-every 2: steps 1, 3)
            assert first["peak_saved_bytes"] > last["peak_saved_bytes"] > 0  # rank 0 holds 2 micro-batches
        else:
            assert first["peak_saved_bytes"] is None and last["peak_saved_bytes"] is None


def test_compare_json(pp2, run_metrics):
    proc = run_moeplan("compare", str(pp2 / "plan.yaml"), str(run_metrics), "--json", "--first-step", "2")
    assert proc.returncode == 0, proc.stderr
    rows = {r["quantity"]: r for r in json.loads(proc.stdout)}
    plan = load_plan(pp2 / "plan.yaml")
    records = [json.loads(line) for line in run_metrics.read_text().splitlines()]
    assert rows["step time"]["predicted"] == plan.prediction.step_time_s
    assert rows["step time"]["measured"] == records[1]["step_time_s"]  # the unmetered step of the window 2..3
    assert rows["pp1 peak saved activations"]["measured"] == records[2]["ranks"][1]["peak_saved_bytes"]
    assert rows["pp0 bytes pp"]["measured"] == rows["pp0 bytes pp"]["predicted"]  # p2p bytes: exact
    # the plan's bytes are in its target's training dtype (fp32 on the cpu target), the runtime's too
    pm = plan.memory.ranks[1]
    assert rows["pp1 peak saved activations"]["predicted"] == (pm.activation_bytes + pm.working_set_bytes) * 4 / (
        plan.target.dtype_bytes)


def test_compare_names_the_steps_it_compares_and_refuses_a_first_step_past_the_run(pp2, run_metrics):
    shown = run_moeplan("compare", str(pp2 / "plan.yaml"), str(run_metrics))  # 3 steps: every step after the first
    assert shown.returncode == 0 and "(median of steps 2..3)" in shown.stdout, shown.stderr
    past = run_moeplan("compare", str(pp2 / "plan.yaml"), str(run_metrics), "--first-step", "1000")
    assert past.returncode == 2 and past.stdout == ""
    assert past.stderr.strip().splitlines() == [
        "error: first_step=1000: the metrics end at step 3; give a step from 1 to 3"], past.stderr


def test_compare_rejects_another_layouts_metrics(pp2, run_metrics, tmp_path):
    other = tmp_path / "one.yaml"
    save_plan(make_plan(1, dict(pp=1, tp=1, cp=1, micro_batch=2)), other)
    proc = run_moeplan("compare", str(other), str(run_metrics))
    assert proc.returncode == 2 and "the run has 2 ranks, the plan 1" in proc.stderr
    # the same rank count, another layout: dp 2 against the run's pp 2 (compared without a word before, issue 34)
    save_plan(make_plan(2, dict(pp=1, tp=1, cp=1, ep=1, micro_batch=4)), other)
    proc = run_moeplan("compare", str(other), str(run_metrics))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "has ranks on pp ranks 0 ×1, 1 ×1; the plan has pp=1, 2 rank(s) each" in lines[0], lines[0]


def test_calibrate_writes_a_target_the_compiler_uses(tmp_path):
    """Three rounds of the loaded gloo measurement instead of the default 15 (most of calibrate's minute): the
    figures are noisier, and what this test checks is how they are measured and written."""
    out = tmp_path / "cpu-calibrated.yaml"
    refused = moeplan("calibrate", "--rounds", "0", "-o", str(out))
    assert refused.returncode == 2 and refused.stderr.strip() == "error: rounds=0: must be a positive integer"
    proc = moeplan("calibrate", "--target", "cpu", "--rounds", "3", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "between compute bursts, median of 3 rounds" in out.read_text()
    target = load_target(str(out))
    assert target.name == "cpu-calibrated" and target.backend == "cpu"
    assert 1e8 < target.cube_flops < 1e12 and 1e7 < target.vector_flops < target.cube_flops
    assert 1e-7 < target.launch.other_s < 1e-3 and target.intra_node.bandwidth_bytes_per_s > 1e7
    # an eager fp32 runtime: per-aten-kernel forward and backward costs, measured
    assert target.launch.granularity == "kernel" and target.training_dtype == "fp32"
    assert 1e-8 < target.launch.forward_kernel_s < 1e-3 and 1e-8 < target.launch.backward_kernel_s < 1e-3
    # α and launch.collective_s: fitted to the loaded gloo figures of the header (minus their S/B terms)
    line = next(x for x in out.read_text().splitlines() if "between compute bursts" in x)
    loaded = {op: float(t) * 1e-6 for op, t in (item.split()[:2] for item in line.split(": ", 1)[1].split(", "))}
    assert set(loaded) == set(LOADED_OPS) and all(t > 0 for t in loaded.values())
    bandwidth = target.intra_node.bandwidth_bytes_per_s
    alpha, launch = fit_alpha_launch({op: t - LOADED_OPS[op][0] * LOADED_BYTES / bandwidth
                                      for op, t in loaded.items()})
    assert target.intra_node.latency_s == pytest.approx(alpha, rel=1e-3, abs=5e-7)
    assert target.launch.collective_s == pytest.approx(launch, rel=1e-3, abs=5e-7)
    # per kind (reduce-scatter included), the loaded cost less its transfer time is the target's measured latency
    assert target.launch.collective_latency_s == pytest.approx(
        {op: max(0.0, t - LOADED_OPS[op][0] * LOADED_BYTES / bandwidth) for op, t in loaded.items()},
        rel=1e-3, abs=5e-7)
    assert target.inter_node == target.intra_node
    # per kind, σ: the collective's extra period posted asynchronously beside compute over its blocking cost;
    # comm_compute_slowdown is the all-to-all's
    line = next(x for x in out.read_text().splitlines() if "B posted before a compute burst" in x)
    items = line.split("waited after: ", 1)[1].split(" (", 1)[0].split(", ")
    beside = {kind: float(t) * 1e-6 for kind, t in (item.split()[:2] for item in items)}
    assert set(beside) == {"all_to_all", "all_gather", "reduce_scatter", "all_reduce"}
    assert target.comm_compute_slowdown_by_kind == pytest.approx(
        {kind: min(10.0, t / loaded[kind]) for kind, t in beside.items()}, rel=1e-3, abs=1e-3)
    assert target.comm_compute_slowdown == target.comm_compute_slowdown_by_kind["all_to_all"]
    # launch.p2p_host_s: the extra period per message of a send and a receive posted before a burst, waited after
    line = next(x for x in out.read_text().splitlines() if "(launch.p2p_host_s)" in x)
    per_message = float(line.split("waited after: ", 1)[1].split()[0]) * 1e-6
    assert target.launch.p2p_host_s == pytest.approx(per_message, rel=1e-3, abs=5e-7)
    plan = tmp_path / "plan.yaml"
    proc = run_moeplan("compile", "tiny-pangu", "--target", str(out), "--devices", "2", "--pp", "2", "-o", str(plan))
    assert proc.returncode == 0, proc.stderr
    assert load_plan(plan).target == target


def test_fit_alpha_launch_is_least_squares_over_alpha_steps():
    # steps: p2p, all_gather, all_to_all 1, all_reduce 2 -> α = 0.5, L = 0.5 fit these exactly
    assert fit_alpha_launch(dict(p2p=1.0, all_gather=1.0, all_to_all=1.0, all_reduce=1.5)) == pytest.approx((0.5, 0.5))
    # a noisy set: slope cov/var = 0.375/0.75 over x = (1, 1, 1, 2), y = (0.8, 1.0, 1.2, 1.5)
    assert fit_alpha_launch(dict(p2p=0.8, all_gather=1.0, all_to_all=1.2, all_reduce=1.5)) == pytest.approx((0.5, 0.5))
    # L would be negative (1 and 3 -> α 2, L -1): α alone through the origin, (1·1 + 2·3) / (1 + 4)
    assert fit_alpha_launch(dict(p2p=1.0, all_reduce=3.0)) == pytest.approx((1.4, 0.0))


def test_fit_alpha_launch_rejects_unknown_ops_and_one_step_count():
    with pytest.raises(ValueError, match="must be among"):
        fit_alpha_launch(dict(p2p=1.0, broadcast=2.0))
    with pytest.raises(ValueError, match="different α step counts"):
        fit_alpha_launch(dict(p2p=1.0, all_to_all=2.0))


def test_rate_scale_divides_the_efficiencies_and_prices_growth_linearly():
    # what calibrate --fit-model relies on: a micro-batch's predicted growth from 1 to 4 sequences is linear in the
    # rate scale (launch costs cancel), and the rate scale divides the compute and memory efficiencies
    from moeplan.compile import compile_model
    from moeplan.calibrate import predicted_actions_s, scaled_target
    from moeplan.search import Fixed
    from moeplan.spec import load_spec

    base, spec = load_target("cpu"), load_spec("tiny-pangu")

    def growth(rate: float) -> float:
        per_mb = []
        for size in (1, 4):
            plan = compile_model(spec=spec, target=scaled_target(base, 1.0, 1.0, rate), num_devices=1, workers=1,
                                 candidates=1, fixed=Fixed(global_batch=8, seq_len=64, tp=1, pp=1, vpp=1, ep=1, etp=1,
                                                           cp=1, micro_batch=size, recompute="none")).plan
            per_mb.append(sum(predicted_actions_s(plan)) / plan.layout.num_microbatches)
        return per_mb[1] - per_mb[0]

    scaled = scaled_target(base, 1.0, 1.0, 2.5)
    assert scaled.efficiency.compute == pytest.approx(base.efficiency.compute / 2.5)
    assert scaled.efficiency.memory == pytest.approx(base.efficiency.memory / 2.5)
    assert scaled.launch == base.launch
    g1, g2, g3 = growth(1.0), growth(2.0), growth(3.0)
    assert g1 > 0 and g2 - g1 > 0
    assert g3 - g2 == pytest.approx(g2 - g1, rel=1e-6)


def test_the_progress_line_off_a_terminal_reaches_stderr_whole(capfd):
    """Off a terminal, rank 0's last progress render is one write that ends its line: rich writes the line and
    its newline apart, and a launcher error printed between them was glued onto the progress line (CI saw
    ``…tokens/s 4:06:34error: rank 1 stopped``, and the test of that error found no line starting ``error:``)."""
    from moeplan.runtime import worker

    writes: list[str] = []

    class Recorder:
        def write(self, text: str) -> None:
            writes.append(text)

        def flush(self) -> None:
            pass

    lines = worker._WholeLines(Recorder())
    lines.write("step 3/3 loss 1.0")
    assert writes == []
    lines.write("\nstep")
    lines.write(" 4/4\n")
    assert writes == ["step 3/3 loss 1.0\n", "step 4/4\n"]
    progress, update = worker._progress(3, 0)
    with progress:
        pass
    err = capfd.readouterr().err
    assert err.startswith("step 0/3") and err.endswith("\n") and err.count("\n") == 1, repr(err)
