"""Shipped hardware targets load, validate, and carry a source for every figure (targets/*.yaml)."""
from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest
import yaml

from moeplan.errors import TargetError
from moeplan.targets import load_target, target_names

SHIPPED = {"ascend-910b", "ascend-910c", "a100", "h100", "h800", "h200", "cpu"}
_TARGET_DIR = Path(str(resources.files("moeplan.targets")))


def _one_line_error(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert msg and "\n" not in msg
    return msg


def test_every_shipped_target_loads() -> None:
    assert SHIPPED <= set(target_names())
    for name in target_names():
        t = load_target(name)
        assert t.name == name
        assert t.cube_flops > t.vector_flops > 0
        assert t.intra_node.bandwidth_bytes_per_s >= t.inter_node.bandwidth_bytes_per_s
        ovh = t.memory_overheads  # what the runtime and one communicator per group take leaves room for a model
        assert ovh.runtime_bytes + 8 * ovh.communicator_bytes < t.memory_bytes / 4


def test_accelerators_scale_up_faster_than_scale_out() -> None:
    for name in SHIPPED - {"cpu"}:
        t = load_target(name)
        assert t.intra_node.bandwidth_bytes_per_s > 3 * t.inter_node.bandwidth_bytes_per_s
        assert t.intra_node.latency_s < t.inter_node.latency_s


def test_ascend_910b_figures_and_variants() -> None:
    default = load_target("ascend-910b")
    assert default.variant == "376t"
    assert default.cube_flops == 353.9e12
    assert default.devices_per_node == 8
    assert default.memory_bytes == 64 * 2**30
    assert default.matmul_alignment == 16
    assert default.inter_node.bandwidth_bytes_per_s == 25e9
    small = load_target("ascend-910b", variant="313t")
    assert small.cube_flops == 294.9e12 and small.variant == "313t"
    assert load_target("ascend-910b:313t") == small
    # a variant overrides only its own fields
    assert small.model_copy(update={"cube_flops": 353.9e12, "variant": "376t"}) == default


def test_ascend_910c_is_one_scale_up_domain() -> None:
    t = load_target("ascend-910c")
    assert t.devices_per_node == 384
    assert t.cube_flops == 353.9e12
    assert t.intra_node.bandwidth_bytes_per_s == 196e9


def test_nvidia_peaks_follow_the_datasheets() -> None:
    assert load_target("a100").cube_flops == 312e12
    for name in ("h100", "h800", "h200"):
        assert abs(load_target(name).cube_flops - 989e12) < 1e12
    # the H800 is the H100 with NVLink cut from 900 to 400 GB/s (bidirectional), same scale-out per GPU
    h100, h800 = load_target("h100"), load_target("h800")
    assert h800.intra_node.bandwidth_bytes_per_s / h100.intra_node.bandwidth_bytes_per_s == pytest.approx(400 / 900)
    assert load_target("h200").memory_bytes > 1.7 * h100.memory_bytes


def test_cpu_devices_per_node_is_settable() -> None:
    assert load_target("cpu", devices_per_node=4).devices_per_node == 4
    assert load_target("cpu", devices_per_node=2).cube_flops == load_target("cpu").cube_flops
    with pytest.raises(TargetError) as exc:
        load_target("cpu", devices_per_node=0)
    assert "devices_per_node" in _one_line_error(exc)


def test_unknown_name_and_variant() -> None:
    with pytest.raises(TargetError) as exc:
        load_target("tpu-v9")
    msg = _one_line_error(exc)
    assert "tpu-v9" in msg and "ascend-910b" in msg
    with pytest.raises(TargetError) as exc:
        load_target("ascend-910b", variant="999t")
    msg = _one_line_error(exc)
    assert "999t" in msg and "313t" in msg
    with pytest.raises(TargetError):
        load_target("h100:fast")


def test_malformed_yaml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\nbackend: npu\n")
    with pytest.raises(TargetError) as exc:
        load_target(str(bad))
    assert "malformed YAML" in _one_line_error(exc)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(TargetError) as exc:
        load_target(str(scalar))
    _one_line_error(exc)


def _shipped_copy(tmp_path: Path, name: str, old: str, new: str) -> str:
    text = (_TARGET_DIR / f"{name}.yaml").read_text()
    assert old in text
    path = tmp_path / f"{name}-edited.yaml"
    path.write_text(text.replace(old, new, 1))
    return str(path)


def test_a_target_file_by_path_and_bad_fields(tmp_path: Path) -> None:
    same = _shipped_copy(tmp_path, "ascend-910b", "devices_per_node: 8", "devices_per_node: 16")
    assert load_target(same).devices_per_node == 16
    negative = _shipped_copy(tmp_path, "ascend-910b", "bandwidth_bytes_per_s: 25.0e+9",
                             "bandwidth_bytes_per_s: -25.0e+9")
    with pytest.raises(TargetError) as exc:
        load_target(negative)
    assert "inter_node.bandwidth_bytes_per_s" in _one_line_error(exc)
    unknown_field = _shipped_copy(tmp_path, "h100", "backend: cuda", "backend: cuda\nwarp_size: 32")
    with pytest.raises(TargetError) as exc:
        load_target(unknown_field)
    assert "warp_size" in _one_line_error(exc)
    missing = _shipped_copy(tmp_path, "h100", "name: h100\n", "")
    with pytest.raises(TargetError) as exc:
        load_target(missing)
    assert "name" in _one_line_error(exc)
    for bad in ("  broadcast: 0.66", "  all_gather: -0.66"):  # a kind outside the collectives, a negative σ
        path = _shipped_copy(tmp_path, "cpu", "  all_gather: 0.66", bad)
        with pytest.raises(TargetError) as exc:
            load_target(path)
        assert "comm_compute_slowdown_by_kind" in _one_line_error(exc)
    bad_variants = _shipped_copy(tmp_path, "ascend-910b", "    cube_flops: 294.9e+12", "    - 294.9e+12")
    with pytest.raises(TargetError) as exc:
        load_target(bad_variants, variant="313t")
    _one_line_error(exc)


def _h100_with(tmp_path: Path, **efficiency: object) -> str:
    """A copy of h100.yaml with some ``efficiency`` fields replaced."""
    data = yaml.safe_load((_TARGET_DIR / "h100.yaml").read_text())
    data["efficiency"].update(efficiency)
    path = tmp_path / "h100-edited.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_attention_efficiency_is_a_number_or_a_table_over_sequence_length(tmp_path: Path) -> None:
    """attention_fwd / attention_bwd: one number (the same at every length) or a table [[seq_len, fraction], ...]
    with seq_len strictly increasing and fractions in (0, 1]; a bad table is refused in one line that names the
    field, the value and the rule."""
    eff = load_target("h100").efficiency
    for table in (eff.attention_fwd, eff.attention_bwd):
        lengths = [seq for seq, _ in table]
        assert lengths == sorted(set(lengths)) and lengths[0] <= 1024 and lengths[-1] >= 16384
        assert all(0 < f <= 1 for _, f in table)
    assert dict(eff.attention_fwd)[4096] == 0.585 and dict(eff.attention_bwd)[4096] == 0.548  # FA3 at 4k
    scalar = load_target(_h100_with(tmp_path, attention_fwd=0.585, attention_bwd=0.548)).efficiency
    assert (scalar.attention_fwd, scalar.attention_bwd) == (0.585, 0.548)
    path = _h100_with(tmp_path, attention_fwd=[[4096, 0.585], [1024, 0.428]])
    with pytest.raises(TargetError) as exc:
        load_target(path)
    assert _one_line_error(exc) == (f"efficiency.attention_fwd=[[4096, 0.585], [1024, 0.428]]: point 1: seq_len "
                                    f"1024 follows 4096; seq_len must be strictly increasing (target {path})")
    bad = {"strictly increasing": [[1024, 0.4], [1024, 0.5]],
           "must be in (0, 1]": [[1024, 0.4], [2048, 1.2]],
           "must be an integer": [[1024.5, 0.4]],
           "must be a pair": [[1024, 0.4, 0.5]],
           "at least one point": [],
           "must be a fraction in (0, 1]": 0.0}
    for rule, value in bad.items():
        with pytest.raises(TargetError) as exc:
            load_target(_h100_with(tmp_path, attention_bwd=value))
        msg = _one_line_error(exc)
        assert msg.startswith("efficiency.attention_bwd=") and rule in msg, msg


_NUMERIC_FIELD = re.compile(r"^(\s*)[A-Za-z_0-9]+:\s*[-+0-9.eE]+\s*(#.*)?$")


def _sourced(lines: list[str], i: int) -> bool:
    """Line i, or the nearest less-indented line above it (its parent key), carries a ``#`` comment."""
    if "#" in lines[i]:
        return True
    indent = len(lines[i]) - len(lines[i].lstrip())
    for line in reversed(lines[:i]):
        if line.strip() and not line.lstrip().startswith("#") and len(line) - len(line.lstrip()) < indent:
            return "#" in line
    return False


def test_every_figure_carries_a_source_comment() -> None:
    for name in target_names():
        lines = (_TARGET_DIR / f"{name}.yaml").read_text().splitlines()
        figures = [i for i, line in enumerate(lines) if _NUMERIC_FIELD.match(line)]
        assert len(figures) >= 15, name
        unsourced = [lines[i].strip() for i in figures if not _sourced(lines, i)]
        assert not unsourced, f"{name}: {unsourced}"


def test_launch_granularity_and_training_dtype() -> None:
    """Accelerators launch one production kernel per traced op and train in bf16; the cpu emulator is eager
    (per aten kernel, forward and backward costs) and trains in fp32."""
    for name in ("ascend-910b", "h100"):
        t = load_target(name)
        assert t.launch.granularity == "op" and t.training_dtype == "bf16" and t.dtype_bytes == 2
    cpu = load_target("cpu")
    assert cpu.launch.granularity == "kernel" and cpu.training_dtype == "fp32" and cpu.dtype_bytes == 4
    assert cpu.launch.forward_kernel_s > 0 and cpu.launch.backward_kernel_s > 0


@pytest.mark.parametrize("field,value,ok", [("schedules", [], False), ("dispatchers", [], False),
                                            ("overlap", [], True), ("overlap", "moeplan-runtime", True)])
def test_runtime_sets(tmp_path: Path, field: str, value: object, ok: bool) -> None:
    """A runtime that runs no schedule or no dispatcher leaves the search nothing: refused naming the field; one
    that overlaps nothing is valid (``overlap: []``)."""
    doc = yaml.safe_load((_TARGET_DIR / "cpu.yaml").read_text())
    doc["runtime"][field] = value
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(doc))
    if ok:
        assert isinstance(load_target(str(tmp_path / "t.yaml")).runtime.overlap, tuple)
        return
    with pytest.raises(TargetError) as exc:
        load_target(str(tmp_path / "t.yaml"))
    assert f"runtime.{field}=[]" in _one_line_error(exc)


def test_a_named_runtime_sets_and_bounds_what_the_search_tries(tmp_path):
    """``runtime.name`` (moeplan/runtimes.py): the lists default to what the runtime runs, a list naming more is
    refused, and a target without a name writes no ``name`` (plans of earlier versions stay byte for byte)."""
    from moeplan.runtimes import RUNTIMES, Setup

    meg = load_target("h100", runtime="megatron-lm").runtime
    assert (meg.schedules, meg.dispatchers, meg.fsdp) == (("1f1b", "interleaved"), ("flat", "dedup"), True)
    assert meg.model_dump()["name"] == "megatron-lm" and "name" not in load_target("h100").runtime.model_dump()
    assert load_target("h100", runtime="mindspeed-llm").runtime.fsdp is False
    with pytest.raises(TargetError, match=r"^runtime.schedules=\['1f1b', .*\]: names zero-bubble, zbv, dualpipev, "
                                          r"which Megatron-LM does not run \(it runs 1f1b, interleaved\) "
                                          r"\(target cpu\)$"):
        load_target("cpu", runtime="megatron-lm")  # the cpu file lists the schedules moeplan runs
    rt = RUNTIMES["megatron-lm"]
    s = Setup(schedule="1f1b", pp=2, vpp=1, expert_shards=4, etp=1, dispatcher="flat",
              overlap=frozenset({"shared-expert", "fb", "dp"}))
    assert [r.mechanism for r in rt.refusals(s)] == ["fb", "shared-expert"]
    assert rt.allowed(s) == {"shared-expert", "dp"}  # fb needs VPP at pp 2; without fb, shared-expert is fine
    assert rt.allowed(Setup(**{**s.__dict__, "schedule": "interleaved", "vpp": 2})) == {"fb", "dp"}
    assert rt.refusals(Setup(**{**s.__dict__, "schedule": "interleaved", "vpp": 2, "overlap": frozenset({"fb"}),
                                "recompute": ("none", "full")}))[0].reason == "--overlap-moe-expert-parallel-comm refuses full recompute"
    ms = RUNTIMES["mindspeed-llm"]
    assert ms.allowed(Setup(**{**s.__dict__, "schedule": "dualpipev", "vpp": 2})) == {"shared-expert", "fb"}
