"""Hardening (issue 34): nothing a user owns is destroyed, and bad run options are refused before launch, with one
line and exit 2. (Checkpoints as data: tests/runtime/test_checkpoint_faults.py; plan text: tests/test_export.py.)"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from inprocess import run_moeplan
from moeplan.errors import OutputError
from moeplan.files import check_output, write_atomic

COMPILE = ["compile", "tiny-pangu", "--target", "cpu", "--devices", "2"]


def test_a_device_is_never_replaced_by_a_file(tmp_path):
    """``-o /dev/null`` (or ``/dev/full``) as root used to turn the device into a regular file. Tested on a device
    node of the test's own (null's numbers, made in tmp_path), so a regression harms no device of the machine."""
    device = tmp_path / "null"
    try:
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs root")
    proc = run_moeplan(*COMPILE, "-o", device)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "is a character device; moeplan writes only regular files" in proc.stderr
    assert stat.S_ISCHR(os.stat(device).st_mode) and os.stat(device).st_rdev == os.makedev(1, 3)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="is a FIFO"):
        write_atomic(fifo, "x")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_an_input_that_is_not_a_regular_file_is_refused_at_once(tmp_path):
    """A FIFO as model file blocked forever, a ``.yaml`` symlink to /dev/zero read until memory ran out; a file
    larger than any of moeplan's is refused from its first 256 MiB."""
    from moeplan.files import MAX_INPUT_BYTES

    fifo, zero, huge = tmp_path / "fifo.yaml", tmp_path / "zero.yaml", tmp_path / "huge.yaml"
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    with open(huge, "wb") as f:
        f.truncate(MAX_INPUT_BYTES + 1)  # sparse: nothing written
    for path, says in ((fifo, "is a FIFO"), (zero, "is a character device"), (huge, "larger than 256 MiB")):
        proc = run_moeplan("describe", path)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr


def test_a_read_only_file_is_kept(tmp_path):
    """Also as root, whom the file system would let replace it: the mode says read-only."""
    out = tmp_path / "plan.yaml"
    out.write_text("mine")
    out.chmod(0o444)
    proc = run_moeplan(*COMPILE, "-o", out)
    assert proc.returncode == 2 and "is read-only (mode -r--r--r--)" in proc.stderr, proc.stderr
    assert out.read_text() == "mine" and stat.S_IMODE(out.stat().st_mode) == 0o444


def test_a_symlink_is_written_through_and_modes_are_kept(tmp_path):
    target = tmp_path / "real.yaml"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    write_atomic(link, "new")
    assert link.is_symlink() and link.read_text() == "new" and target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.yaml", "real.yaml"]  # no temp file left


def test_check_output_refuses_before_the_work(tmp_path):
    with pytest.raises(OutputError, match="does not exist"):
        check_output(tmp_path / "nodir" / "x.yaml")
    with pytest.raises(OutputError, match="is a folder"):
        check_output(tmp_path)


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("adv") / "plan.yaml"
    assert run_moeplan(*COMPILE, "-o", path).returncode == 0
    return path


def test_a_fresh_run_keeps_an_earlier_runs_metrics(plan, tmp_path):
    """A fresh run deleted an existing --metrics file (an earlier run's measurements); it is refused before launch
    now. ``--resume`` keeps the file's lines up to the checkpoint, as before."""
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1}\n')
    proc = run_moeplan("run", plan, "--steps", "2", "--metrics", metrics)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "holds an earlier run's lines" in proc.stderr and metrics.read_text() == '{"step": 1}\n'


def test_outputs_are_checked_before_the_work(plan, tmp_path, monkeypatch):
    """``timeline -o X --png nodir/g.png`` wrote X, then refused the PNG; ``calibrate -o nodir/t.yaml`` measured
    for a minute, then refused to write. Both now refuse first: every output or none."""
    trace = tmp_path / "t.json"
    proc = run_moeplan("timeline", plan, "-o", trace, "--png", tmp_path / "nodir" / "g.png")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "png=" in proc.stderr, proc.stderr
    assert not trace.exists()

    def measure():
        raise AssertionError("calibrate measured before checking its output")

    monkeypatch.setattr("moeplan.calibrate.calibrate", measure)
    proc = run_moeplan("calibrate", "-o", tmp_path / "nodir" / "t.yaml")
    assert proc.returncode == 2 and "output=" in proc.stderr and "does not exist" in proc.stderr, proc.stderr


@pytest.mark.parametrize("options, says", [
    (["--metrics", "{plan}"], "metrics='{plan}': is the plan file of this run"),
    (["--metrics", "{dir}/nodir/m.jsonl"], "does not exist"),
    (["--metrics", "{dir}"], "is a folder"),
    (["--checkpoint-dir", "{plan}", "--checkpoint-every", "2"], "checkpoint_dir='{plan}': is a file"),
    (["--lr", "inf"], "lr=inf: must be a finite number > 0"),
    (["--lr", "nan"], "lr=nan: must be a finite number > 0"),
    (["--timeout", "nan"], "timeout=nan: must be a finite number > 0"),
    (["--timeout", "inf"], "timeout=inf: must be a finite number > 0"),
])
def test_run_options_are_refused_before_launch(plan, options, says):
    fill = {"plan": str(plan), "dir": str(plan.parent)}
    before = plan.read_bytes()
    proc = run_moeplan("run", plan, "--steps", "2", *(o.format(**fill) for o in options))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert says.format(**fill) in proc.stderr
    assert plan.read_bytes() == before


def test_ctrl_c_before_the_work_ends_prints_one_line(monkeypatch, tmp_path):
    """Ctrl-C during a compile (or in the first seconds of a run, before its ranks start) exited 130 with nothing
    said. The compile's forked search workers ignore SIGINT (a terminal sends it to the whole process group), so
    only this line is printed: checked by hand on the 718B compile, SIGINT to the group after 10 s, exit 130 in
    5.1 s with this one line and no plan written."""
    def interrupted(**kw):
        raise KeyboardInterrupt

    monkeypatch.setattr("moeplan.compile.compile_model", interrupted)
    proc = run_moeplan(*COMPILE, "-o", tmp_path / "p.yaml")
    assert (proc.returncode, proc.stderr) == (130, "moeplan compile: interrupted (Ctrl-C); nothing was written\n")
    assert list(tmp_path.iterdir()) == []


def test_a_deadlocking_schedule_is_refused_before_launch(plan, tmp_path):
    """Every F and B present and matched, but rank 0 runs a backward before its forward: ``simulate`` called it a
    deadlock while ``run`` launched the ranks, which waited out their timeout (60 s) and blamed another rank."""
    import yaml

    from moeplan.plan import decode_actions

    doc = yaml.safe_load(plan.read_text())
    actions = list(decode_actions(doc["schedule"]["ranks"][0], where=""))
    f = next(i for i, a in enumerate(actions) if re.fullmatch(r"\d+F\d+", a))
    b = next(i for i, a in enumerate(actions) if re.fullmatch(r"\d+[BI]\d+", a) and a[-1] == actions[f][-1])
    actions[f], actions[b] = actions[b], actions[f]
    doc["schedule"]["ranks"][0] = " ".join(actions)
    bad = tmp_path / "deadlock.yaml"
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = run_moeplan("run", bad, "--steps", "2")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "schedule deadlock: rank 0 action" in proc.stderr and "which can never run" in proc.stderr


def test_two_runs_cannot_share_a_checkpoint_dir(plan, tmp_path):
    """While one run holds ``--checkpoint-dir`` (its lock: moeplan.runtime.checkpoint.checkpoint_lock), a second is
    refused before launch, naming the holder; once the first ends, the folder is free again."""
    from moeplan.errors import PlanError
    from moeplan.runtime.checkpoint import checkpoint_lock

    ck = tmp_path / "ck"
    with checkpoint_lock(ck):
        proc = run_moeplan("run", plan, "--steps", "2", "--checkpoint-dir", ck, "--checkpoint-every", "1")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"another moeplan run (pid {os.getpid()}) is using it" in proc.stderr
        with pytest.raises(PlanError, match="another moeplan run"):
            with checkpoint_lock(ck):
                pass
    with checkpoint_lock(ck):
        pass
    assert not any(p.name.startswith("step-") for p in ck.iterdir())


@pytest.mark.parametrize("name, text, says", [
    ("model.yaml", "name: m\nhidden_size: 64\nhidden_size: 128\n", "duplicate key 'hidden_size' (line 3)"),
    ("config.json", '{"hidden_size": 64, "hidden_size": 128}', "duplicate key 'hidden_size'"),
])
def test_a_key_stated_twice_is_refused(tmp_path, name, text, says):
    """The last value used to win without a word."""
    from moeplan.errors import SpecError
    from moeplan.files import read_json, read_yaml

    path = tmp_path / name
    path.write_text(text)
    read = read_json if name.endswith(".json") else read_yaml
    with pytest.raises(SpecError, match=re.escape(says)):
        read(path, field="model", error=SpecError)
    proc = run_moeplan("describe", path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr


def test_a_yaml_merge_may_still_be_overridden(tmp_path):
    from moeplan.errors import SpecError
    from moeplan.files import read_yaml

    path = tmp_path / "m.yaml"
    path.write_text("base: &b {tp: 1, pp: 2}\nrun:\n  <<: *b\n  tp: 4\n")
    assert read_yaml(path, field="model", error=SpecError)["run"] == {"tp": 4, "pp": 2}
