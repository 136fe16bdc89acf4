"""Golden tests: every prediction moeplan prints or saves, pinned byte for byte (docs/architecture.md §8.11).

Three kinds, each stored next to this file under ``__snapshots__/test_golden/`` by syrupy:

- ``test_compile``: the saved plan (YAML bytes) and the printed summary of reference compiles, run through the CLI
  in this process — tiny-pangu on the ``cpu`` emulator at several layouts and strategies, the 718B default compile,
  DeepSeek-V3 at its published recipe, Pangu Pro MoE and a dense model;
- ``test_pass_state``: per pass of the default pipeline, the decision it adds to the compiler state on tiny-pangu;
- ``test_benchmark_table``: the tables ``benchmarks/published_runs.py`` and ``benchmarks/overlap_ablation.py``
  print.

Only wall-clock figures are masked (``compiled in … s``, the ``--exact`` estimate of the search's closing line and
the machine's worker count in it, the plan's ``provenance.pass_s`` and ``compile_s``, a benchmark's closing
seconds); everything else is compared exactly. A failure here means a prediction moved. If it
moved on purpose, regenerate with ``python -m pytest tests/golden --snapshot-update`` and say in the commit message
what changed and why.
"""
from __future__ import annotations

import dataclasses
import enum
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode
from typer.testing import CliRunner

from moeplan import cli
from moeplan.compiler import DEFAULT_PIPELINE, Pipeline
from moeplan.layout import Layout
from moeplan.spec import load_spec
from moeplan.state import PlanState, Strategy
from moeplan.targets import load_target
from moeplan.trace import trace_model

ROOT = Path(__file__).resolve().parents[2]
UNIFORM = "shard,partition-stages{layer_layout=uniform},place-experts,schedule,plan-memory,simulate"

COMPILES: dict[str, list[str]] = {
    # tiny-pangu on the CPU emulator: the search's default, interleaved 1F1B with TP and EP, DualPipeV with F&B
    # pairs, zero-bubble with the per-tensor ILP under a tight budget, MindSpeed's per-tensor rule, FSDP.
    "tiny-default": ["tiny-pangu", "--target", "cpu", "--devices", "4"],
    "tiny-interleaved-tp-ep": ["tiny-pangu", "--target", "cpu", "--devices", "8", "--tp", "2", "--pp", "2",
                               "--vpp", "2", "--ep", "2", "--micro-batch", "1", "--schedule", "interleaved"],
    "tiny-dualpipev-fb": ["tiny-pangu", "--target", "cpu", "--devices", "4", "--tp", "1", "--pp", "2", "--ep", "2",
                          "--micro-batch", "1", "--schedule", "dualpipev", "--overlap", "fb,dp"],
    "tiny-zero-bubble-ilp": ["tiny-pangu", "--target", "cpu", "--devices", "4", "--tp", "1", "--pp", "2",
                             "--ep", "2", "--micro-batch", "1", "--schedule", "zero-bubble", "--recompute", "ilp",
                             "--memory-budget", "0.0115"],
    "tiny-mindspeed-etp1": ["tiny-pangu", "--target", "cpu", "--devices", "8", "--tp", "2", "--pp", "2",
                            "--ep", "2", "--etp", "1", "--micro-batch", "1", "--recompute", "mindspeed",
                            "--memory-budget", "0.0115"],
    # FSDP (the cpu runtime has none): Llama 3.2 1B fully sharded over 8 H100, as NeMo AutoModel trains it
    "llama3.2-1b-fsdp8": ["llama3.2-1b", "--target", "h100", "--devices", "8", "--tp", "1", "--pp", "1",
                          "--dp-shard", "8", "--micro-batch", "8", "--global-batch", "64", "--recompute", "none"],
    # the README's main job
    "pangu-ultra-718b-default": ["pangu-ultra-moe-718b", "--target", "ascend-910b", "--devices", "6144"],
    # DeepSeek-V3 at its published layout and recipe (benchmarks/published_runs.yaml, deepseek-v3-2048xh800-isca25-mpft)
    "deepseek-v3-published": ["deepseek-v3", "--target", "h800", "--devices", "2048", "--tp", "1", "--pp", "16",
                              "--ep", "64", "--etp", "1", "--cp", "1", "--global-batch", "15360", "--seq-len", "4096",
                              "--schedule", "dualpipev", "--dispatcher", "dedup", "--overlap", "fb,pp",
                              "--recompute", "modules:layernorm,mla_up_proj,moe_act", "--training-dtype", "fp8",
                              "--fp8-activation-input", "--pipeline", UNIFORM],
    "pangu-pro-72b": ["pangu-pro-moe-72b", "--target", "ascend-910b:313t", "--devices", "512", "--tp", "4",
                      "--pp", "4", "--ep", "8"],
    # a dense model: Llama 3 70B as Megatron-Bridge 25.09 trains it on 64 H100 (published_runs.yaml,
    # llama3-70b-64xh100-bridge-25.09)
    "llama3-70b-dense": ["llama3-70b", "--target", "h100", "--devices", "64", "--tp", "4", "--pp", "8", "--vpp", "5",
                         "--cp", "1", "--micro-batch", "1", "--global-batch", "128", "--seq-len", "8192",
                         "--schedule", "interleaved", "--overlap", "dp", "--recompute", "none", "--training-dtype",
                         "fp8", "--grad-dtype", "bf16", "--pipeline", UNIFORM],
}


class TextFile(SingleFileSnapshotExtension):
    """One golden text file per snapshot (readable in a diff), ``.txt``."""

    _write_mode = WriteMode.TEXT
    file_extension = "txt"


class YamlFile(TextFile):
    file_extension = "yaml"


def mask_plan(text: str) -> str:
    """The plan's YAML with its wall-clock fields masked: the values under ``provenance.pass_s`` and ``compile_s``."""
    lines, in_pass_s = [], False
    for line in text.splitlines():
        if in_pass_s and line.startswith("    "):
            line = line.split(": ")[0] + ": <seconds>"
        else:
            in_pass_s = line == "  pass_s:"
        lines.append("  compile_s: <seconds>" if line.startswith("  compile_s: ") else line)
    return "\n".join(lines) + "\n"


def mask_summary(text: str, output: Path) -> str:
    text = re.sub(r"compiled in \d+\.\d+ s", "compiled in <seconds> s", text)
    text = re.sub(r"about \d+(\.\d+)? (s|min|h) at [0-9.e+-]+ s each on \d+ workers?",
                  "about <duration> at <seconds> s each on <workers>", text)
    return text.replace(str(output), output.name)


def compile_cli(args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """Run ``moeplan compile ARGS -o plan.yaml`` in this process; return (printed summary, plan YAML), masked."""
    buf = io.StringIO()
    monkeypatch.setattr(cli, "out", Console(file=buf, width=cli.PIPE_WIDTH))
    output = tmp_path / "plan.yaml"
    res = CliRunner().invoke(cli.app, ["compile", *args, "-o", str(output)])
    assert res.exit_code == 0, (res.output, res.exception)
    return mask_summary(buf.getvalue(), output), mask_plan(output.read_text())


@pytest.mark.parametrize("name", list(COMPILES))
def test_compile(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, snapshot) -> None:
    summary, plan = compile_cli(COMPILES[name], tmp_path, monkeypatch)
    assert plan == snapshot(name="plan", extension_class=YamlFile)
    assert summary == snapshot(name="summary", extension_class=TextFile)


def to_data(x: object) -> object:
    """A decision as plain data (dicts, lists, numbers, strings) for the amber snapshot: dataclasses by field,
    enums by value, mappings with string keys, sets sorted."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: to_data(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, dict):
        return {str(to_data(k)): to_data(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_data(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted(to_data(v) for v in x)
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


PASS_CASES = {  # layout, strategy
    "pp2-vpp2-ep2-interleaved": (dict(tp=1, pp=2, vpp=2, ep=2, etp=1, cp=1, dp=2, micro_batch=1, global_batch=8,
                                      seq_len=64), Strategy(schedule="interleaved", overlap=frozenset({"dp", "pp"}),
                                                      recompute="selective")),
    "tp2-ep2-etp1-1f1b": (dict(tp=2, pp=1, vpp=1, ep=2, etp=1, cp=1, dp=2, micro_batch=2, global_batch=8,
                               seq_len=64),
                          Strategy(overlap=frozenset({"shared-expert", "dp"}), recompute="mindspeed")),
}


@pytest.fixture(scope="module")
def tiny_graph():
    spec = load_spec("tiny-pangu")
    return trace_model(spec, seq_len=spec.seq_len)


@pytest.mark.parametrize("case", list(PASS_CASES))
def test_pass_state(case: str, tiny_graph, snapshot) -> None:
    layout, strategy = PASS_CASES[case]
    state = PlanState(graph=tiny_graph, target=load_target("cpu", devices_per_node=8), layout=Layout(**layout),
                      strategy=strategy)
    for p in Pipeline.parse(DEFAULT_PIPELINE).passes:
        state = p.run(state)
        added = {name: to_data(getattr(state, name)) for name in p.provides}
        assert added == snapshot(name=p.name)


BENCHMARKS = {"published_runs": ["benchmarks/published_runs.py"],
              "overlap_ablation": ["benchmarks/overlap_ablation.py"]}


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_benchmark_table(name: str, snapshot) -> None:
    res = subprocess.run([sys.executable, *BENCHMARKS[name]], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    table = re.sub(r"(?m)(; |^)\d+ s$", r"\1<seconds> s", res.stdout)
    assert table == snapshot(name="table", extension_class=TextFile)
