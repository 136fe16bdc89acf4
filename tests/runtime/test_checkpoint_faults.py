"""Checkpoints and faults through ``moeplan run`` (issue 3, "Done when: Checkpoints and faults").

An uninterrupted 6-step run checkpoints every 2 steps. A second run is SIGKILLed on rank 1 mid-run: every process
exits within 60 s with a line naming rank 1, the newest complete checkpoint loads, and ``--resume`` says which one
and continues to step 6 with exactly the uninterrupted run's losses.

The kill test used to fail now and then: the other rank, stopped by the agent while writing its error report, left
a truncated file that the agent could not parse. Ranks now write the report atomically; a test stops a rank at the
last moment before its report is complete.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moeplan.plan import save_plan
from moeplan.runtime.checkpoint import newest_checkpoint
from moeplan.runtime.data import stdlib_tokens

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from inprocess import run_moeplan  # noqa: E402
from test_executor import make_plan  # noqa: E402

STEPS = 6


def moeplan(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeplan.cli", *args], capture_output=True, text=True, timeout=240,
                          **kw)


def losses(path: Path) -> dict[int, float]:
    return {d["step"]: d["loss"] for d in map(json.loads, path.read_text().splitlines())}


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out += [int(entry.name), *_children(int(entry.name))]
    return out


def worker_pid(launcher: int, rank: int) -> int | None:
    """The pid of the ``moeplan.runtime.worker`` process of ``rank`` under the launcher process."""
    for pid in _children(launcher):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"moeplan.runtime.worker" in cmd and f"RANK={rank}".encode() in env:
            return pid
    return None


def run_until(launcher: subprocess.Popen, metrics: Path, *, ranks: tuple[int, ...], steps: int) -> list[int]:
    """The worker pids of ``ranks`` under ``launcher`` (a ``moeplan run``), once ``metrics`` holds ``steps`` lines;
    fails when the run ends first or after 120 s."""
    deadline = time.monotonic() + 120
    pids: list[int | None] = [None] * len(ranks)
    while None in pids:  # find the workers first: scanning /proc is slow next to a step
        assert launcher.poll() is None and time.monotonic() < deadline, "workers did not start"
        pids = [worker_pid(launcher.pid, r) for r in ranks]
        time.sleep(0.05)
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert launcher.poll() is None and time.monotonic() < deadline, f"run did not reach step {steps}"
        time.sleep(0.002)  # a step takes tens of ms
    return pids  # type: ignore[return-value]


def signal_a_rank(launcher: subprocess.Popen, metrics: Path, *, ranks: tuple[int, ...], steps: int,
                  sig: signal.Signals) -> tuple[list[int], str, float]:
    """Once the workers of ``ranks`` have trained ``steps`` steps (:func:`run_until`), send ``sig`` to the last of
    them: (the workers' pids, the launcher's stderr, seconds from the signal to the launcher's exit). The launcher is
    killed if it is still running after that."""
    try:
        workers = run_until(launcher, metrics, ranks=ranks, steps=steps)
        os.kill(workers[-1], sig)
        t0 = time.monotonic()
        _, stderr = launcher.communicate(timeout=60)
        return workers, stderr, time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    save_plan(make_plan(2, dict(pp=2, vpp=1, tp=1, cp=1, micro_batch=4)), root / "plan.yaml")
    np.save(root / "tokens.npy", stdlib_tokens("train")[:20_000].numpy())
    return root


@pytest.fixture(scope="module")
def uninterrupted(setup) -> dict[int, float]:
    proc = moeplan("run", str(setup / "plan.yaml"), "--steps", str(STEPS), "--data", str(setup / "tokens.npy"),
                   "--metrics", str(setup / "full.jsonl"), "--checkpoint-every", "2", "--checkpoint-dir",
                   str(setup / "ck_full"))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (setup / "ck_full").iterdir()) == [".lock", "step-00000002", "step-00000004",
                                                                   "step-00000006"]  # .lock: the run's hold
    return losses(setup / "full.jsonl")


def test_killed_rank_stops_every_rank_and_resume_reproduces_losses(setup, uninterrupted):
    ck, metrics = setup / "ck", setup / "killed.jsonl"
    args = [sys.executable, "-m", "moeplan.cli", "run", str(setup / "plan.yaml"), "--data", str(setup / "tokens.npy"),
            "--metrics", str(metrics), "--checkpoint-every", "2", "--checkpoint-dir", str(ck)]
    launcher = subprocess.Popen([*args, "--steps", "1000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # kill rank 1 at step 3 or 4, well before STEPS
    workers, stderr, took = signal_a_rank(launcher, metrics, ranks=(0, 1), steps=3, sig=signal.SIGKILL)
    assert launcher.returncode != 0 and took < 60
    assert "rank 1 failed" in stderr and "SIGKILL" in stderr, stderr
    assert "Traceback" not in stderr and "[rank" not in stderr, stderr  # one line, not every casualty's traceback
    assert all(not Path(f"/proc/{p}").exists() or "Z" in Path(f"/proc/{p}/stat").read_text().split()[2]
               for p in workers)
    ref = newest_checkpoint(ck)
    assert ref is not None and ref.step >= 2 and ref.step % 2 == 0
    assert not (ck / f".step-{ref.step:08d}.tmp").exists()
    resumed = moeplan(*args[3:], "--steps", str(STEPS), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert (f"moeplan run: resumed from checkpoint {ck / f'step-{ref.step:08d}'} (after step {ref.step}); "
            f"running steps {ref.step + 1}..{STEPS}") in resumed.stderr.splitlines()
    got = losses(metrics)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(ref.step + 1, STEPS + 1)] == [uninterrupted[s] for s in range(ref.step + 1, STEPS + 1)]


def test_a_stopped_rank_is_found_by_its_heartbeat(setup):
    """SIGSTOP of one rank: the others waited out the collective timeout and the launcher blamed one of them, after
    91.6 s. The launcher's watchdog now kills the rank whose heartbeat stopped (moeplan.runtime.heartbeat) and names
    it, in one line; with --timeout 20 it has 10 s to see it."""
    metrics = setup / "stopped.jsonl"
    launcher = subprocess.Popen([sys.executable, "-m", "moeplan.cli", "run", str(setup / "plan.yaml"), "--data",
                                 str(setup / "tokens.npy"), "--metrics", str(metrics), "--steps", "100000",
                                 "--timeout", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (pid,), stderr, took = signal_a_rank(launcher, metrics, ranks=(1,), steps=2, sig=signal.SIGSTOP)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert launcher.returncode == 1 and took < 30, (took, stderr)
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 stopped: no heartbeat for 1"), stderr
    assert "Traceback" not in stderr and "[rank" not in stderr, stderr
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_resume_from_another_layout_is_refused(setup, uninterrupted):
    other = setup / "other.yaml"
    save_plan(make_plan(2, dict(pp=1, tp=1, cp=1, ep=1, micro_batch=4)), other)
    proc = run_moeplan("run", str(other), "--steps", "8", "--data", str(setup / "tokens.npy"), "--resume",
                   "--checkpoint-dir", str(setup / "ck_full"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "step-00000006" in lines[0] and "dp=1 vs 2" in lines[0] and "resume needs the same layout" in lines[0]


class _Plant:
    """Unpickled, creates the file ``path`` (what a crafted checkpoint would run)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _tampered(setup: Path, tmp_path: Path, change) -> Path:
    """A copy of the uninterrupted run's checkpoints with ``change(step_folder)`` applied to the newest."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(setup / "ck_full", ck)
    change(ck / "step-00000006")
    return ck


def _resume(setup: Path, ck: Path, plan: Path | None = None) -> subprocess.CompletedProcess:
    """``moeplan run --resume`` in this process: refused before launch, or the test fails by launching ranks."""
    return run_moeplan("run", str(plan or setup / "plan.yaml"), "--steps", "8", "--data", str(setup / "tokens.npy"),
                   "--resume", "--checkpoint-dir", str(ck))


def _flip_byte(folder: Path) -> None:
    shard = next(p for p in sorted(folder.iterdir()) if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _truncate(folder: Path) -> None:
    shard = next(p for p in sorted(folder.iterdir()) if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])


def _extra_file(folder: Path) -> None:
    (folder / "__9_0.distcp").write_bytes(b"x")


def _garbage_manifest(folder: Path) -> None:
    (folder / "moeplan.json").write_text("{not json")


@pytest.mark.parametrize("change, says", [(_flip_byte, "does not match its sha256"),
                                          (_truncate, "does not match its sha256"),
                                          (_extra_file, "__9_0.distcp is not in moeplan.json"),
                                          (_garbage_manifest, "moeplan.json is not readable JSON")])
def test_a_damaged_checkpoint_is_refused_before_launch(setup, uninterrupted, tmp_path, change, says):
    proc = _resume(setup, _tampered(setup, tmp_path, change))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "step-00000006" in lines[0] and says in lines[0]


@pytest.mark.parametrize("forge_manifest", [False, True])
def test_a_planted_pickle_is_never_unpickled(setup, uninterrupted, tmp_path, forge_manifest):
    """A ``.metadata`` that runs a command when unpickled: refused by its hash, and with the manifest forged to
    match, by the unpickler that builds only what DCP metadata holds; either way the command never runs, in the
    CLI's check or on a rank (moeplan.runtime.checkpoint.load_checkpoint)."""
    import hashlib
    import pickle

    from moeplan.errors import PlanError
    from moeplan.plan import load_plan
    from moeplan.runtime.checkpoint import CheckpointRef, verify_checkpoint

    pwned = tmp_path / "pwned"

    def plant(folder: Path) -> None:
        (folder / ".metadata").write_bytes(pickle.dumps(_Plant(str(pwned))))
        if forge_manifest:
            info = json.loads((folder / "moeplan.json").read_text())
            info["files"][".metadata"] = hashlib.sha256((folder / ".metadata").read_bytes()).hexdigest()
            (folder / "moeplan.json").write_text(json.dumps(info))

    ck = _tampered(setup, tmp_path, plant)
    proc = _resume(setup, ck)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert ("refers to posix.system" if forge_manifest else "does not match its sha256") in lines[0]
    plan = load_plan(setup / "plan.yaml")
    with pytest.raises(PlanError, match="not loaded|sha256"):
        verify_checkpoint(CheckpointRef(6, ck / "step-00000006"), layout=plan.layout, model=plan.model.fingerprint)
    assert not pwned.exists()


def test_a_checkpoint_of_another_model_is_refused(setup, uninterrupted, tmp_path):
    """Same layout, another model (tiny-pangu with 3 layers): the manifest's fingerprint tells them apart."""
    from moeplan.compile import compile_model
    from moeplan.search import Fixed
    from moeplan.spec import ModelSpec, load_spec
    from moeplan.targets import load_target

    tiny = load_spec("tiny-pangu")
    other = ModelSpec.model_validate({**tiny.model_dump(), "name": "tiny-other", "num_layers": tiny.num_layers - 1})
    plan = compile_model(spec=other, target=load_target("cpu", devices_per_node=4), num_devices=2,
                         fixed=Fixed(global_batch=8, seq_len=64, pp=2, vpp=1, tp=1, cp=1, micro_batch=4), workers=1,
                         candidates=1).plan
    save_plan(plan, tmp_path / "other.yaml")
    proc = _resume(setup, setup / "ck_full", tmp_path / "other.yaml")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "written for another model" in lines[0] and "resume needs the same model" in lines[0]


def test_the_killed_rank_is_named_not_the_rank_whose_receive_broke(tmp_path):
    """torch elastic times failures in whole seconds; a tie must not name the peer that only lost its connection."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from moeplan.runtime.launch import _failure_line

    report = tmp_path / "rank0.json"
    report.write_text(json.dumps({"message": {"message": "RuntimeError: [pair.cc:537] Read error: Connection reset "
                                                         "by peer.", "extraInfo": {"timestamp": "0"}}}))
    broke = ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGTERM, error_file=str(report))
    killed = ProcessFailure(local_rank=1, pid=11, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none.json"))
    line = _failure_line(ChildFailedError("worker", {0: broke, 1: killed}))
    assert line == "rank 1 failed: killed by signal 9 (SIGKILL); the other ranks were stopped"
    # a rank that raised an error of its own is still named first
    report.write_text(json.dumps({"message": {"message": "RuntimeError: out of memory",
                                              "extraInfo": {"timestamp": "0"}}}))
    own = ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(report))
    assert _failure_line(ChildFailedError("worker", {0: own, 1: killed})).startswith("rank 0 failed: RuntimeError: out")
    # the agent's SIGTERM to the other ranks, with no report, is not the cause either
    stopped = ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "none.json"))
    assert _failure_line(ChildFailedError("worker", {0: stopped, 1: killed})).startswith("rank 1 failed: killed")


def test_a_rank_stopped_while_reporting_leaves_no_half_report(tmp_path, monkeypatch):
    """Once rank 1 has died, the agent SIGTERMs rank 0 and then parses the error file of every rank that has exited
    (torch SubprocessContext._poll). A rank stopped while writing its report must leave no file there, or the launch
    fails with a JSONDecodeError instead of naming rank 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler, ProcessFailure

    from moeplan.runtime.launch import _failure_line
    from moeplan.runtime.worker import AtomicErrorHandler

    report = tmp_path / "error.json"
    # a rank SIGTERMed at the last moment before its report is complete: just before the rename
    script = ("import os, signal\n"
              "from moeplan.runtime.worker import AtomicErrorHandler\n"
              "os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGTERM)\n"
              "try:\n"
              "    raise RuntimeError('Connection reset by peer')\n"
              "except RuntimeError as e:\n"
              "    AtomicErrorHandler().record_exception(e)\n")
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(report)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert not report.exists() and len(list(tmp_path.iterdir())) == 1  # the complete temp file only
    stopped = ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGTERM, error_file=str(report))
    killed = ProcessFailure(local_rank=1, pid=11, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none.json"))
    assert _failure_line(ChildFailedError("worker", {0: stopped, 1: killed})) == (
        "rank 1 failed: killed by signal 9 (SIGKILL); the other ranks were stopped")
    # not stopped, the same rank leaves the report torch elastic parses
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(report))
    try:
        raise RuntimeError("out of memory")
    except RuntimeError as e:
        AtomicErrorHandler().record_exception(e)
    assert ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(report)).message["message"] == (
        "RuntimeError: out of memory")
    # torch's own handler, stopped inside its write, leaves a file the agent cannot parse (the flake)
    report.unlink()
    def stopped_inside_the_write(*args, **kwargs):
        raise SystemExit("stopped")

    monkeypatch.setattr(json, "dump", stopped_inside_the_write)
    with pytest.raises(SystemExit):
        try:
            raise RuntimeError("Connection reset by peer")
        except RuntimeError as e:
            ErrorHandler().record_exception(e)
    monkeypatch.undo()
    with pytest.raises(json.JSONDecodeError):
        ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGTERM, error_file=str(report))


def test_two_runs_started_together_on_one_folder(setup, uninterrupted, tmp_path):
    """Two ``moeplan run`` given the same --checkpoint-dir, started at once: one crashed and the other's checkpoint
    mixed both runs' tensors (issue 34). Now one holds the folder and trains, the other is refused in one line
    before it launches a rank, and the checkpoints are the winner's alone: its steps 2 and 4, its losses."""
    ck, data = tmp_path / "ck", str(setup / "tokens.npy")
    runs = [subprocess.Popen([sys.executable, "-m", "moeplan.cli", "run", str(setup / "plan.yaml"), "--steps", "4",
                              "--data", data, "--checkpoint-every", "2", "--checkpoint-dir", str(ck), "--metrics",
                              str(tmp_path / f"m{i}.jsonl")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(2)]
    results = [(p.wait(timeout=120), p.communicate()[1]) for p in runs]
    assert sorted(code for code, _ in results) == [0, 2], results
    refused = next(err for code, err in results if code == 2).strip().splitlines()
    assert len(refused) == 1 and "another moeplan run (pid " in refused[0] and "is using it" in refused[0], refused
    won = next(i for i, (code, _) in enumerate(results) if code == 0)
    assert not (tmp_path / f"m{1 - won}.jsonl").exists()  # refused before it trained or wrote anything
    assert losses(tmp_path / f"m{won}.jsonl") == {s: v for s, v in uninterrupted.items() if s <= 4}
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "step-00000002", "step-00000004"]


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs (needs root and mount(8), else the test is skipped): smaller than one rank's checkpoint."""
    where = tmp_path / "full"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_full_disk_ends_the_run_with_one_line_naming_it(setup, full_disk):
    """End to end on a real full file system: the run stops at its first checkpoint with one line that names the
    rank, ENOSPC, the folder and the bytes, and no traceback (before, the real ENOSPC was buried in a flood of
    tracebacks from every rank). A disk already full refuses the run before launch: the lock file cannot be
    written."""
    proc = moeplan("run", str(setup / "plan.yaml"), "--steps", "4", "--data", str(setup / "tokens.npy"),
                   "--checkpoint-every", "2", "--checkpoint-dir", str(full_disk / "ck"))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert errors[0].startswith("error: rank ") and "checkpoint of step 2 into " in errors[0], errors[0]
    # the cause in brackets is the rank's own exception: OSError [Errno 28], or torch's zip writer's short write
    assert "No space left on device: the file system has 0 bytes free" in errors[0], errors[0]
    fd = os.open(full_disk / "filler", os.O_WRONLY | os.O_CREAT)  # fill what is left, unbuffered
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    proc = moeplan("run", str(setup / "plan.yaml"), "--steps", "4", "--data", str(setup / "tokens.npy"),
                   "--checkpoint-every", "2", "--checkpoint-dir", str(full_disk / "ck2"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "checkpoint_dir=" in lines[0] and "No space left on device" in lines[0], lines[0]


def test_a_full_disk_is_named_in_the_runs_one_line():
    """A checkpoint onto a full disk: torch's CheckpointException (a BaseException, which torch elastic's error
    report skips) ended the rank with a bare "exit code 1" under a flood of tracebacks, and its zip writer can report
    the short write as ``unexpected pos``. Checked by hand on a 200 KiB tmpfs: 'error: rank 1 failed:
    CheckpointError: checkpoint of step 2 into '/tmp/full/ck': No space left on device: the file system has 0
    bytes free, this rank's part is 2,469,416 bytes (RuntimeError: ... unexpected pos 704 vs 598)'."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from moeplan.runtime.checkpoint import write_error

    def failed(exc: BaseException) -> BaseException:
        try:
            raise exc
        except BaseException as e:  # noqa: BLE001 - wrapped as torch wraps each rank's failure
            return e

    zip_short = failed(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
    enospc = failed(OSError(28, "No space left on device"))
    e = CheckpointException("write", {0: _wrap_exception(zip_short), 1: _wrap_exception(enospc)})
    full = str(write_error(e, root=Path("/ck"), step=2, need_bytes=100, free_bytes=0))
    assert full == ("checkpoint of step 2 into '/ck': No space left on device: the file system has 0 bytes free, "
                    "this rank's part is 100 bytes (OSError: [Errno 28] No space left on device)")
    other = str(write_error(CheckpointException("write", {0: _wrap_exception(zip_short)}), root=Path("/ck"), step=2,
                            need_bytes=100, free_bytes=10**9))
    assert other == "checkpoint of step 2 into '/ck': RuntimeError: [enforce fail at inline_container.cc:672] . " \
                    "unexpected pos 704 vs 598"
