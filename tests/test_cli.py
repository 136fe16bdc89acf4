"""The CLI contract: one-line errors with exit 2 (bad input) or 3 (infeasible), nothing written on failure."""
import json
import subprocess
import sys

import pytest
from inprocess import run_moeplan

from moeplan.plan import SCHEMA_VERSION


moeplan = run_moeplan


def assert_one_line_error(proc, code, *needles):
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture()
def bad_spec(tmp_path):
    def write(name, text):
        p = tmp_path / name
        p.write_text(text)
        return str(p)
    return write


TINY_GQA = ("vocab_size: 256\nhidden_size: 64\nnum_layers: 2\nnum_dense_layers: 2\ndense_ffn_size: 128\n"
            "attention: gqa\nnum_heads: {heads}\nnum_kv_heads: {kv}\nhead_dim: 16\nseq_len: 64\nglobal_batch: 8\n")


@pytest.mark.parametrize("args, needles", [
    (["compile", "no-such-model", "--target", "cpu", "--devices", "2"], ["model='no-such-model'", "registry"]),
    (["compile", "tiny-pangu", "--target", "tpu-v9", "--devices", "2"], ["target='tpu-v9'", "unknown"]),
    (["compile", "tiny-pangu", "--target", "cpu", "--devices", "0"], ["devices=0", "positive"]),
    (["compile", "tiny-pangu", "--target", "cpu", "--devices", "2", "--tp", "-2"], ["tp=-2", "positive"]),
    (["compile", "tiny-pangu", "--target", "cpu", "--devices", "3", "--tp", "3"], ["tp=3", "attention heads"]),
    (["compile", "tiny-pangu", "--target", "cpu", "--devices", "3", "--tp", "1", "--pp", "1", "--ep", "3",
      "--cp", "1"], ["ep=3", "experts (8) must be divisible"]),
    (["compile", "tiny-pangu", "--target", "cpu", "--devices", "2", "--seq-len", "0"], ["seq_len=0"]),
    (["describe", "tiny-pangu", "--seq-len", "-1"], ["seq_len=-1"]),
    (["simulate", "missing-plan.yaml"], ["plan='missing-plan.yaml'", "cannot read"]),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, needles):
    out = tmp_path / "plan.yaml"
    proc = moeplan(*args, "-o", str(out)) if args[0] == "compile" else moeplan(*args)
    assert_one_line_error(proc, 2, *needles)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_bad_model_files_exit_2(tmp_path, bad_spec):
    cases = [
        (bad_spec("h.yaml", TINY_GQA.format(heads=3, kv=2)), ["num_heads=3", "divisible by num_kv_heads (2)"]),
        (bad_spec("y.yaml", "vocab_size: [256\n"), ["malformed YAML"]),
        (bad_spec("config.json", '{"hidden_size": 64,'), ["malformed JSON"]),
    ]
    for path, needles in cases:
        proc = moeplan("compile", path, "--target", "cpu", "--devices", "2", "-o", str(tmp_path / "p.yaml"))
        assert_one_line_error(proc, 2, *needles)
        assert not (tmp_path / "p.yaml").exists()


def test_infeasible_exits_3_naming_memory(tmp_path):
    proc = moeplan("compile", "llama3-70b", "--target", "cpu", "--devices", "2", "-o", str(tmp_path / "p.yaml"))
    assert_one_line_error(proc, 3, "GiB per device")
    assert not (tmp_path / "p.yaml").exists()


def test_compile_json_summary_and_simulate(tmp_path):
    out = tmp_path / "tiny.yaml"
    proc = moeplan("compile", "tiny-pangu", "--target", "cpu", "--devices", "4", "--json", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert set(summary["layout"]) == {"tp", "pp", "vpp", "ep", "etp", "cp", "dp", "micro_batch", "global_batch",
                                      "seq_len"}
    pred = summary["predicted"]
    assert {"step_time_s", "tokens_per_s", "mfu", "bubble", "peak_memory_bytes"} <= set(pred)
    assert len(pred["peak_memory_bytes"]) == summary["layout"]["pp"] and summary["compile_s"] > 0
    sim = moeplan("simulate", str(out), "--json")
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["step_time_s"] == pytest.approx(pred["step_time_s"], rel=1e-9)
    schema = moeplan("schema")
    assert json.loads(schema.stdout)["properties"]["schema_version"]


def test_edited_plan_refused(tmp_path):
    out = tmp_path / "tiny.yaml"
    assert moeplan("compile", "tiny-pangu", "--target", "cpu", "--devices", "2", "--pp", "2", "-o",
                   str(out)).returncode == 0
    text = out.read_text()
    (tmp_path / "v.yaml").write_text(text.replace(f"schema_version: {SCHEMA_VERSION}", "schema_version: 7"))
    assert_one_line_error(moeplan("simulate", str(tmp_path / "v.yaml")), 2, "schema_version=7")
    (tmp_path / "a.yaml").write_text(text.replace("- 0F0", "- 0X0", 1))
    assert_one_line_error(moeplan("simulate", str(tmp_path / "a.yaml")), 2, "'0X0' is not an action")


def test_a_ctrl_c_python_wraps_is_still_an_interrupt(capsys):
    """Ctrl-C while a module defines a class whose attribute has ``__set_name__`` (torch's ``Source.guard_source``, a
    cached_property) reaches moeplan as a RuntimeError caused by the KeyboardInterrupt: CI once saw it reported as an
    internal error. It ends as any Ctrl-C does: one line, exit 130."""
    from moeplan.cli_errors import Invocation, exit_on_error
    from moeplan.interrupts import INTERRUPTED_EXIT, interrupted

    class Named:
        def __set_name__(self, owner, name):
            raise KeyboardInterrupt

    with pytest.raises(RuntimeError) as caught:
        type("Source", (), {"guard_source": Named()})
    assert interrupted(caught.value) and not interrupted(RuntimeError("a bug"))
    with pytest.raises(SystemExit) as ended:
        exit_on_error(caught.value, Invocation(command="run"))
    assert ended.value.code == INTERRUPTED_EXIT
    assert capsys.readouterr().err.strip() == "moeplan run: interrupted (Ctrl-C); nothing was written"


def test_a_ctrl_c_the_command_handled_keeps_its_one_line_and_exit(capsys):
    """``moeplan run`` turns a Ctrl-C during the launch into RunInterrupted (``raise ... from None``), prints its line
    and exits 130 with typer.Exit. The error report took that Exit, whose context chain reaches the KeyboardInterrupt,
    for an unhandled Ctrl-C and printed a second line ("moeplan run: interrupted (Ctrl-C); nothing was written")."""
    import typer

    from moeplan.cli_errors import GuardedGroup, err

    app = typer.Typer(cls=GuardedGroup, add_completion=False)

    @app.command("run")
    def run() -> None:
        try:
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise RuntimeError("interrupted by SIGINT; every rank was stopped") from None
        except RuntimeError as e:
            err.print(f"moeplan run: {e}")
            raise typer.Exit(130)

    @app.command("other")
    def other() -> None:
        pass

    with pytest.raises(SystemExit) as ended:
        app(["run"])
    assert ended.value.code == 130
    assert capsys.readouterr().err.splitlines() == ["moeplan run: interrupted by SIGINT; every rank was stopped"]


SWALLOWED = """
import gc, sys, time, weakref
from moeplan.interrupts import keep_swallowed_interrupts
if sys.argv[1] == "guarded":
    keep_swallowed_interrupts()
class Lock: pass
def callback(ref):
    raise KeyboardInterrupt  # what SIGINT does when it lands in importlib's module-lock callback
lock = Lock(); ref = weakref.ref(lock, callback)
try:
    del lock
    for _ in range(10000):  # the command goes on
        time.sleep(0.0001)
    print("went on")
except KeyboardInterrupt:
    print("interrupted")
"""


@pytest.mark.parametrize("mode, says", [("guarded", "interrupted"), ("python", "went on")])
def test_a_ctrl_c_python_swallows_still_ends_the_command(mode, says):
    """A Ctrl-C that lands in a weakref callback (CI: importlib's ``_get_module_lock`` callback while torch loaded)
    is "Exception ignored" by Python, and ``moeplan run`` trained on. With moeplan's hook it reaches the main flow as
    a KeyboardInterrupt; without it (the control) the program goes on."""
    proc = subprocess.run([sys.executable, "-c", SWALLOWED, mode], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == says, proc.stderr
    assert ("Exception ignored" in proc.stderr) == (mode == "python"), proc.stderr
