"""Honest defaults and output: where the training shape came from, full-width output off a terminal, help and
version, the models and targets lists, describe's wording, compare's dp rows and busy-machine warning, nested HF
configs."""
import io
import json
import os
import re
import subprocess
import sys
import time

import pytest
import typer.main
from rich.console import Console
from test_cli import assert_one_line_error

from moeplan.cli import PIPELINE_HELP, app
from moeplan.errors import SpecError
from moeplan.plan import MEMORY_TERMS
from moeplan.render import plural, shape_sources
from moeplan.runtime.compare import BUSY_SHARE, busy_warning, compare
from moeplan.runtime.metrics import HostLoad, LoadMeter, RankStep, StepRecord
from moeplan.spec import load_spec, registry_names
from moeplan.targets import target_names

TINY_DENSE = ("vocab_size: 256\nhidden_size: 64\nnum_layers: 2\nnum_dense_layers: 2\ndense_ffn_size: 128\n"
              "attention: gqa\nnum_heads: 4\nnum_kv_heads: 2\nhead_dim: 16\nseq_len: 64\nglobal_batch: 96\n")
DBRX = {"model_type": "dbrx", "d_model": 6144, "n_heads": 48, "n_layers": 40, "vocab_size": 100352,
        "attn_config": {"kv_n_heads": 8, "rope_theta": 500000},
        "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4}}


def piped(*args, cwd=None):
    """The CLI with stdout a pipe (not a terminal) and no COLUMNS, as in a CI log."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run([sys.executable, "-m", "moeplan.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd)


@pytest.fixture(scope="module")
def compiled():
    proc = piped("compile", "tiny-pangu", "--target", "cpu", "--devices", "2", "--tp", "1", "--pp", "1",
                 "--cp", "1", "--micro-batch", "4", "--global-batch", "8")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_piped_output_keeps_lines_and_cells_whole(compiled):
    header = compiled[0]
    assert header.startswith("tiny-pangu on 2 × cpu") and header.endswith("1 micro-batch of 8 × 64")
    assert max(map(len, compiled)) > 80  # the 80-column cut is gone
    mfu = next(line for line in compiled if "│ MFU" in line)
    assert "(docs/references.md §4.1))" in mfu  # the definition is not wrapped onto a second row
    memory_rows = [line for line in compiled if line.startswith("│ 0 ")]
    cells = [c.strip() for c in memory_rows[-1].strip("│").split("│")]  # every memory term in its own cell, in GiB
    assert cells[1] == "none" and len(cells) == 2 + len(MEMORY_TERMS) + 2 and all(
        re.fullmatch(r"[+-]?\d+\.\d\d", c) for c in cells[2:])
    assert not any(re.fullmatch(r"[│┃ ]*((GiB|ms|s)[│┃ ]*)+", line) for line in compiled)  # no row of bare units


def test_summary_names_where_the_training_shape_came_from(compiled):
    assert compiled[1] == ("global batch 8 sequences from the command line (--global-batch); seq_len 64 tokens "
                           "from the model YAML tiny-pangu.yaml of the registry")


def test_shape_sources_per_kind_of_model(tmp_path):
    yaml_model = tmp_path / "dense.yaml"
    yaml_model.write_text(TINY_DENSE)
    assert shape_sources("deepseek-v3") == {"seq_len": "registry entry deepseek-v3",
                                            "global_batch": "registry entry deepseek-v3"}
    assert shape_sources(str(yaml_model))["global_batch"] == f"model YAML {yaml_model}"
    assert load_spec(str(yaml_model)).global_batch == 96  # a model YAML carries its shape
    twin = shape_sources("examples/models/deepseek-v3/config.json", seq_len=2048)
    assert twin["seq_len"] == "command line (--seq-len)"
    assert twin["global_batch"] == ("config.json default (a config.json has no training shape; the registry entry "
                                    "deepseek-v3 uses 15360; --global-batch sets it)")
    assert load_spec("examples/models/deepseek-v3/config.json").global_batch == 1024  # the default it names
    other = tmp_path / "config.json"
    other.write_text("{}")
    assert shape_sources(str(other))["global_batch"] == ("config.json default (a config.json has no training "
                                                         "shape; --global-batch sets it)")


def test_compile_json_has_the_shape_sources():
    proc = piped("compile", "tiny-pangu", "--target", "cpu", "--devices", "1", "--seq-len", "32", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["shape_sources"] == {
        "seq_len": "command line (--seq-len)", "global_batch": "model YAML tiny-pangu.yaml of the registry"}


def test_every_option_and_argument_has_help():
    group = typer.main.get_command(app)
    missing = [f"{name} {p.name}" for name, cmd in group.commands.items() for p in cmd.params if not p.help]
    missing += [f"moeplan {p.name}" for p in group.params if not p.help and p.name != "help"]
    assert missing == []
    assert {"models", "targets"} <= set(group.commands)


def test_pipeline_help_lists_every_pass_in_default_order():
    from moeplan.compiler import DEFAULT_PIPELINE, pass_registry

    assert DEFAULT_PIPELINE.split(",") == sorted(pass_registry(), key=DEFAULT_PIPELINE.split(",").index)
    listed = PIPELINE_HELP.split(": ", 1)[1].split(" (the default")[0].split(", ")
    assert listed == DEFAULT_PIPELINE.split(",")


def test_version_models_and_targets():
    from moeplan import __version__

    assert piped("--version").stdout == f"moeplan {__version__}\n"
    models = {r["name"]: r for r in json.loads(piped("models", "--json").stdout)}
    assert sorted(models) == registry_names()
    assert models["deepseek-v3"]["global_batch"] == 15360 and models["llama3-70b"]["experts"] == 0
    targets = {r["name"]: r for r in json.loads(piped("targets", "--json").stdout)}
    assert {n.split(":")[0] for n in targets} == set(target_names())
    assert targets["ascend-910b:376t"]["default"] and not targets["ascend-910b:313t"]["default"]
    assert targets["ascend-910b:313t"]["bf16_flops"] < targets["ascend-910b:376t"]["bf16_flops"]
    table = piped("targets").stdout
    assert "ascend-910b:376t *" in table and "h800 " in table and "h800 *" not in table


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    """``moeplan describe X | head -1``: the closed pipe stops the command with 141 (128 + SIGPIPE, as a shell
    reports it) and nothing on stderr, not exit 1 (a bug) from rich's or click's own handler."""
    from moeplan.cli_errors import BROKEN_PIPE_EXIT

    proc = subprocess.Popen([sys.executable, "-m", "moeplan.cli", "describe", "tiny-pangu"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the command writes: it imports torch first
    _, stderr = proc.communicate(timeout=120)
    assert (proc.returncode, stderr) == (BROKEN_PIPE_EXIT, "")


def test_models_fit_80_columns_with_every_name_whole():
    from moeplan.render import models_rows, render_models

    rows = models_rows()
    for width in (80, 200):
        buf = io.StringIO()
        render_models(Console(file=buf, width=width), rows)
        lines = buf.getvalue().splitlines()
        assert max(map(len, lines)) <= width
        names = [line.split()[0].strip("│┃") or line.split()[1] for line in lines if line.strip()]
        assert set(registry_names()) <= set(names), width
        assert ("deepseek-v3/config.json" in buf.getvalue()) == (width >= 120)  # the file column, when it fits


def test_describe_of_a_dense_model_says_so(tmp_path):
    from moeplan.describe import describe_model
    from moeplan.render_describe import human, render_describe

    path = tmp_path / "dense.yaml"
    path.write_text(TINY_DENSE)
    spec = load_spec(str(path))
    buf = io.StringIO()
    render_describe(Console(file=buf, width=300), spec, describe_model(spec, seq_len=spec.seq_len))
    head = buf.getvalue().splitlines()[:3]
    assert "dense FFN, no experts, no MTP, seq_len 64 tokens" in head[0]
    assert "MTP" not in head[1] and "with MTP" not in head[2] and "top-0" not in head[0]
    assert (human(0), human(512), human(4.5e11, "FLOP"), human(7e10)) == ("0", "512", "450.00 GFLOP", "70.00 B")
    assert (plural(1, "micro-batch"), plural(3, "micro-batch"), plural(2, "layer")) == (
        "1 micro-batch", "3 micro-batches", "2 layers")


def _records(plan, *, busy: float, cpus: int = 2, steal: float = 0.0, rank_cpu: float = 0.05, steps: int = 6,
             host: bool = True) -> list[StepRecord]:
    """Synthetic metrics: every step 0.1 s long, each rank using ``rank_cpu`` CPU-seconds, the machine ``busy``."""
    ranks = tuple(RankStep(rank=r, pp_rank=r, action_s={"F": 0.01}, comm_s={"dp": 1e-3}, comm_bytes={"dp": 4096},
                           peak_saved_bytes=1, cpu_s=rank_cpu) for r in range(plan.layout.num_devices))
    return [StepRecord(step=s, loss=1.0, step_time_s=0.1, tokens_per_s=1.0, grad_norm=1.0, ranks=ranks,
                       host=HostLoad(wall_s=0.1, busy_cpu_s=busy, steal_cpu_s=steal, cpus=cpus, load_1m=3.5,
                                     local_ranks=None) if host else None) for s in range(1, steps + 1)]


@pytest.fixture(scope="module")
def pp2_plan():
    from moeplan.compile import compile_model
    from moeplan.search import Fixed
    from moeplan.targets import load_target

    return compile_model(spec=load_spec("tiny-pangu"), target=load_target("cpu"), num_devices=2,
                         fixed=Fixed(global_batch=8, seq_len=64, pp=2, vpp=1, tp=1, cp=1, ep=1), workers=1).plan


def test_compare_names_gradient_sync_not_dp_when_dp_is_1(pp2_plan):
    assert pp2_plan.layout.dp == 1
    names = [r.quantity for r in compare(pp2_plan, _records(pp2_plan, busy=0.1))]
    assert "pp0 comm grad sync" in names and "pp1 bytes grad sync" in names
    assert not any(n.endswith(" dp") for n in names)


def test_busy_machine_warning(pp2_plan):
    # 2 ranks on 2 CPUs, each using 0.05 of the 0.1 s step: the run's own 0.1 CPU-s
    assert busy_warning(_records(pp2_plan, busy=0.1)) is None  # nothing else ran
    assert busy_warning(_records(pp2_plan, busy=0.1 + 0.2 * BUSY_SHARE * 0.9)) is None  # below the threshold
    warning = busy_warning(_records(pp2_plan, busy=0.16, steal=0.01))  # 0.6 + 0.1 of the 2 CPUs went elsewhere
    assert warning == ("the machine was busy during steps 5-6: other processes used 0.60 and the hypervisor stole "
                       "0.10 of the 2 CPUs, 35% of the CPU time the run's 2 ranks could use (warning above 10%); "
                       "1-minute load average up to 3.5. Measured times are longer than on an idle machine and not "
                       "comparable with the prediction")
    assert busy_warning(_records(pp2_plan, busy=0.6, cpus=8)) is None  # others used 5 of the 6 CPUs the run left
    assert "the run's 2 ranks shared 1 CPU;" in busy_warning(_records(pp2_plan, busy=0.1, cpus=1))
    assert busy_warning(_records(pp2_plan, busy=1.0, host=False)) is None  # metrics without host figures


def test_compare_points_at_calibrate_when_a_shipped_cpu_target_is_far_off(pp2_plan):
    from moeplan.runtime.compare import Row, uncalibrated_warning

    predicted = pp2_plan.prediction.step_time_s
    far = [Row("step time", "s", predicted, 17.5 * predicted)]
    assert uncalibrated_warning(pp2_plan, far) == (
        "the measured step is 17.5x the predicted one, and the plan's target 'cpu' holds the shipped figures, not "
        "this machine's: run `moeplan calibrate -o mine.yaml`, then compile with `--target mine.yaml` "
        "(docs/runtime.md)")
    assert uncalibrated_warning(pp2_plan, [Row("step time", "s", predicted, 1.5 * predicted)]) is None  # near
    calibrated = pp2_plan.model_copy(update={"target": pp2_plan.target.model_copy(
        update={"cube_flops": 2 * pp2_plan.target.cube_flops})})  # a calibrate output saved as cpu.yaml
    assert uncalibrated_warning(calibrated, far) is None


def test_compare_cli_prints_the_warning_on_stderr(pp2_plan, tmp_path):
    from moeplan.plan import save_plan

    save_plan(pp2_plan, tmp_path / "plan.yaml")
    (tmp_path / "run.jsonl").write_text("".join(r.to_json() + "\n" for r in _records(pp2_plan, busy=0.16)))
    proc = piped("compare", str(tmp_path / "plan.yaml"), str(tmp_path / "run.jsonl"), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)[0]["quantity"] == "step time"
    assert proc.stderr.startswith("warning: the machine was busy during steps 5-6: other processes used 0.60")


def test_metrics_record_cpu_time_and_host_load():
    load = LoadMeter()  # starts the interval
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.2:
        pass
    step = RankStep(rank=0, pp_rank=0, action_s={}, comm_s={}, comm_bytes={}, peak_saved_bytes=1,
                    cpu_s=load.cpu_s())
    assert 0 < step.cpu_s <= time.perf_counter() - t0 + 0.02
    record = StepRecord(step=1, loss=1.0, step_time_s=0.2, tokens_per_s=1.0, grad_norm=1.0, ranks=(step,),
                        host=load.host())
    if sys.platform == "linux":
        assert record.host is not None and record.host.cpus >= 1 and record.host.busy_cpu_s >= 0
    assert StepRecord.from_json(record.to_json()) == record
    old = json.loads(record.to_json())
    del old["host"], old["ranks"][0]["cpu_s"]
    legacy = StepRecord.from_json(json.dumps(old))
    assert legacy.host is None and legacy.ranks[0].cpu_s == -1
    unmeasured = RankStep(rank=0, pp_rank=0, action_s={}, comm_s={}, comm_bytes={}, peak_saved_bytes=1)
    assert unmeasured.cpu_s == -1  # nothing is read unless a LoadMeter is


def test_nested_hf_config_is_named_unsupported(tmp_path):
    path = tmp_path / "dbrx" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(DBRX))
    with pytest.raises(SpecError, match=r"attn_config, ffn_config: nested config layout \(model_type 'dbrx'\) is "
                                        r"not supported"):
        load_spec(str(path))
    assert_one_line_error(piped("describe", str(path)), 2, "attn_config, ffn_config", "not supported")
