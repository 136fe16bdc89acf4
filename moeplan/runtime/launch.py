"""Launching a plan (docs/architecture.md §7): checks before any process starts, local processes for the CPU emulator, the
``torchrun`` command for a cluster.

- :func:`check_runnable` refuses, with one line (PlanError), a plan the runtime cannot execute: a schedule,
  dispatcher, overlap mechanism or FP8 training it does not run yet (:func:`check_strategy`: it runs the 1F1B,
  interleaved, zero-bubble, ZB-V and DualPipeV orders, the V-placed ones included, with the overlap mechanisms of
  ``moeplan.mechanisms.runtime_mechanisms``; the flat, hierarchical and dedup dispatchers, in fp32 or bf16),
  a layout the process groups cannot realise, an action list that is not a complete, matched, deadlock-free
  pipeline schedule, an expert placement that does not cover the experts, a device count other than the launched
  world, a target backend this machine lacks. ``load_plan`` has already checked the schema version and the plan's consistency.
- :func:`launch_local` starts ``num_devices`` processes of :mod:`moeplan.runtime.worker` on this machine, each given
  the :class:`~moeplan.runtime.request.RunRequest` as one JSON argument, with torch.distributed's own elastic
  launcher (what ``torchrun --standalone`` runs: c10d rendezvous on localhost, no restarts, ``OMP_NUM_THREADS=1``
  per rank, each rank bound to its own core by the worker: :func:`pin_to_cpu`).
  If a rank dies (signal or exception), the agent stops the others and :class:`RunFailed` names the first failed
  rank. A signal to the launcher (Ctrl-C: SIGINT to the whole process group) stops every rank and raises
  :class:`RunInterrupted`; the ranks themselves exit quietly (:func:`moeplan.runtime.worker.exit_on_interrupt`).
- :func:`torchrun_command` is the command to run on every node for a ``cuda``/``npu`` target (or for any target,
  ``moeplan run --print-command``); it runs ``moeplan run`` with the same options on every rank
  (:meth:`RunRequest.cli_args <moeplan.runtime.request.RunRequest.cli_args>`).

Backends by target: ``cpu`` → gloo, ``cuda`` → nccl, ``npu`` → hccl (``torch_npu``, imported lazily; untested).
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import tempfile
import uuid
from collections import Counter
from typing import Literal

from moeplan.actions import parse_action
from moeplan.errors import MoeplanError, PlanError
from moeplan.mechanisms import runtime_mechanisms
from moeplan.plan import Plan
from moeplan.runtime import heartbeat
from moeplan.runtime.groups import check_layout_for_runtime
from moeplan.runtime.request import RunRequest

DIST_BACKEND = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class RunFailed(MoeplanError):
    """A rank of a launched run failed; the message names the rank and why in one line, ``traceback`` is that rank's
    (from its error report; ``moeplan --debug run`` prints it), empty when there is none."""

    def __init__(self, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.traceback = traceback


class RunInterrupted(RunFailed):
    """The launcher got a signal (Ctrl-C: SIGINT) and stopped every rank. ``exit_code`` is the shell's convention
    for a process ended by that signal, 128 + its number (130 for SIGINT; POSIX ``wait`` status, as bash reports it:
    https://www.gnu.org/software/bash/manual/html_node/Exit-Status.html)."""

    def __init__(self, sig: signal.Signals, checkpoint_dir: str | None):
        from moeplan.runtime.checkpoint import newest_checkpoint

        ref = newest_checkpoint(checkpoint_dir) if checkpoint_dir else None
        where = (f"newest complete checkpoint: step {ref.step} ({ref.path}), continue with --resume" if ref else
                 f"no complete checkpoint under {checkpoint_dir}" if checkpoint_dir else "no --checkpoint-dir")
        super().__init__(f"interrupted by {sig.name}; every rank was stopped; {where}")
        self.exit_code = 128 + sig.value


def pin_to_cpu(local_rank: int, local_world: int) -> int | None:
    """Bind every thread of this process to the ``local_rank``-th of the CPUs it may use, so that an emulated
    ``cpu`` device is one core: its compute, its gloo transport threads and both halves of an OVERLAP_F_B pair
    share that core. Unbound, a 2-rank run on 2 cores had the same compute times but its ranks' waits for each
    other's messages grew about 2–3× and its step 1.1–1.35× (docs/runtime.md, "One core per rank"). Returns the
    CPU, or None (nothing bound) when this machine gives the process fewer usable CPUs than there are local ranks.
    Raises OSError only if the kernel refuses the binding."""
    cpus = sorted(os.sched_getaffinity(0))
    if local_world > len(cpus):
        return None
    cpu = cpus[local_rank]
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cpu})
    return cpu


def under_torchrun() -> bool:
    """Whether this process was started by torchrun / an elastic agent (it then is one rank of the run)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def check_schedule(plan: Plan) -> None:
    """Raise PlanError unless every PP rank runs F and B (or I then W) once per own stage and micro-batch (an
    ``OVERLAP_F_B`` pair counts as its F and its B), every SEND has the matching RECV on the neighbour stage's
    rank (and vice versa), and no action waits on one that can never run (the deadlock check of
    ``cost_models.timeline.simulate``, run with unit costs)."""
    lay = plan.layout
    num_stages = lay.pp * lay.vpp
    rank_of = plan.stages.rank_of

    counts: Counter = Counter()
    for r, actions in enumerate(plan.schedule.actions):
        for text in actions:
            a = parse_action(text)
            if a.kind not in ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "OVERLAP_F_B"):
                raise PlanError(f"schedule.actions[{r}]: {text!r} is not executable by the runtime")
            for part in a.parts or (a,):
                counts[(part.kind, part.stage, part.microbatch)] += 1
    for s in range(num_stages):
        for m in range(lay.num_microbatches):
            f, b, i, w = (counts[(k, s, m)] for k in ("F", "B", "I", "W"))
            if f != 1 or not ((b == 1 and i == w == 0) or (b == 0 and i == w == 1)):
                raise PlanError(f"schedule.actions[{rank_of(s)}]: stage {s} micro-batch {m} has {f} F, {b} B, "
                                f"{i} I, {w} W; the runtime needs one F and one B (or one I and one W)")
            for send, recv, peer in (("SEND_F", "RECV_F", s + 1), ("SEND_B", "RECV_B", s - 1)):
                if not 0 <= peer < num_stages:
                    continue
                want = int(rank_of(peer) != rank_of(s))  # same-rank neighbours hand over in memory
                if counts[(send, s, m)] != want or counts[(recv, peer, m)] != want:
                    raise PlanError(f"schedule.actions: {s}{send}{m} and {peer}{recv}{m} must each appear "
                                    f"{want} time(s) (found {counts[(send, s, m)]} and {counts[(recv, peer, m)]})")
    # the dependencies, as `simulate` steps them (every action of a unit cost): a deadlock is refused here, before
    # any rank starts, not found by the ranks waiting out their timeout
    from moeplan.cost_models.timeline import simulate
    from moeplan.cost_models.timeline_types import StageProgram

    simulate(plan.schedule.actions, stages=[StageProgram.uniform(1.0, 1.0, 1.0)] * num_stages)


def check_experts(plan: Plan) -> None:
    """Raise PlanError unless ``experts.shards`` has one list per expert shard covering every expert once."""
    spec, lay = plan.model.spec, plan.layout
    shards = plan.experts.shards
    if not spec.num_experts:
        return
    if len(shards) != lay.expert_shards:
        raise PlanError(f"experts.shards: {len(shards)} lists for ep·tp/etp = {lay.expert_shards} shards")
    flat = sorted(e for s in shards for e in s)
    if flat != list(range(spec.num_experts)):
        raise PlanError(f"experts.shards: must hold every expert 0..{spec.num_experts - 1} exactly once")


def check_runnable(plan: Plan, *, world_size: int | None = None, need_backend: bool = True) -> None:
    """Refuse a plan the runtime cannot execute here (see the module docstring); one-line PlanError."""
    check_strategy(plan)
    check_layout_for_runtime(plan.layout)
    if len(plan.memory.ranks) != plan.layout.pp:
        raise PlanError(f"memory.ranks: {len(plan.memory.ranks)} entries for pp={plan.layout.pp} ranks")
    check_schedule(plan)
    check_experts(plan)
    if world_size is not None and world_size != plan.layout.num_devices:
        raise PlanError(f"layout.num_devices={plan.layout.num_devices}: {world_size} processes were launched")
    if need_backend:
        check_backend(plan.target.backend)


def check_strategy(plan: Plan) -> None:
    """Raise PlanError for what moeplan's runtime does not execute yet (module docstring), naming the compile flag
    that plans without it."""
    if plan.comm.dispatcher not in ("flat", "hierarchical", "dedup"):
        raise PlanError(f"comm.dispatcher={plan.comm.dispatcher!r}: the runtime has the flat, hierarchical and dedup "
                        f"dispatchers; compile with --dispatcher flat")
    runs = runtime_mechanisms()  # fb: moeplan.runtime.overlap; pp: receives posted early, executor; dp: per-stage
    # gradient reduce-scatters posted as each stage's backward ends, optimizer; shared-expert: expert_parallel
    missing = [m for m in plan.comm.overlap if m not in runs]
    if missing:
        raise PlanError(f"comm.overlap={plan.comm.overlap!r}: the runtime does not run {', '.join(missing)} "
                        f"(it runs {', '.join(sorted(runs))}); compile with --overlap "
                        f"{','.join(m for m in plan.comm.overlap if m in runs) or 'none'}")
    if plan.target.training_dtype == "fp8":
        raise PlanError("target.training_dtype='fp8': the runtime has no FP8 GEMMs; compile with --training-dtype bf16")
    if plan.layout.dp_shard > 1:
        raise PlanError(f"layout.dp_shard={plan.layout.dp_shard}: the runtime shards optimizer states only (ZeRO-1), "
                        f"not parameters (FSDP); compile with --dp-shard 1")
    prec = plan.memory.precision
    if (prec.grad_dtype, prec.main_params_dtype, prec.moments_dtype) != ("fp32", "fp32", "fp32") or not (
            prec.distributed_optimizer):
        raise PlanError(f"memory.precision={prec.short()!r}: the runtime keeps fp32 gradients, master weights and "
                        f"moments with the distributed optimizer; compile without --grad-dtype, --main-params-dtype, "
                        f"--optimizer-dtype and --no-distributed-optimizer")


def check_backend(backend: Literal["cpu", "cuda", "npu"]) -> None:
    """Raise PlanError unless this machine has the target's device type."""
    import torch

    if backend == "cuda" and not torch.cuda.is_available():
        raise PlanError("target.backend='cuda': no CUDA device on this machine")
    if backend == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise PlanError("target.backend='npu': torch_npu is not installed on this machine") from None
        if not torch.npu.is_available():
            raise PlanError("target.backend='npu': no Ascend NPU on this machine")


def torchrun_command(plan: Plan, request: RunRequest) -> str:
    """The POSIX shell command to run once on every node: ``torchrun`` starts ``devices_per_node`` ranks there
    (all of them on one node for a smaller plan), each running ``moeplan run`` with ``request``'s options. The
    nodes meet at the c10d rendezvous on ``$MASTER_ADDR:$MASTER_PORT`` (default ``localhost:29500``: one node needs
    no environment), which assigns the node ranks (torchrun's multi-node form:
    https://pytorch.org/docs/stable/elastic/run.html). Raises PlanError when the devices do not fill whole nodes
    (torchrun starts the same number of ranks on every node)."""
    per_node = min(plan.target.devices_per_node, plan.layout.num_devices)
    nnodes, rest = divmod(plan.layout.num_devices, per_node)
    if rest:
        raise PlanError(f"layout.num_devices={plan.layout.num_devices}: not a multiple of target.devices_per_node="
                        f"{per_node}; torchrun starts the same number of ranks on every node")
    args = " ".join(shlex.quote(a) for a in request.cli_args())
    return (f"torchrun --nnodes {nnodes} --nproc-per-node {per_node} --rdzv-backend c10d "
            f'--rdzv-endpoint "${{MASTER_ADDR:-localhost}}:${{MASTER_PORT:-29500}}" -m moeplan.cli run {args}')


# What a rank's collective raises when a peer process died: that rank is a casualty, not the cause.
_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused")


def _casualty(failure) -> bool:
    """True when ``failure`` (a torch elastic ProcessFailure) only followed another rank's: its report says a peer
    went away, or it ended by the SIGTERM the agent sends every other rank once one has failed.

    torch elastic orders failures by their timestamp, in whole seconds: a rank killed by a signal and the ranks
    stopped because of it often tie, and the tie went to the lower rank, which named a casualty as the cause. A
    casualty may write its report and then be stopped, so both tests are needed.
    """
    return failure.exitcode == -signal.SIGTERM or any(m in str(failure.message).lower() for m in _PEER_LOST)


def _first_failure(error: Exception) -> RunFailed:
    """:func:`_failure_line` with the failed rank's traceback (from its error report; empty without one)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    stack = ""
    if isinstance(error, ChildFailedError):
        data = _report(_first(error)[1])
        stack = str(data.get("extraInfo", {}).get("py_callstack", "")) if isinstance(data, dict) else ""
    return RunFailed(_failure_line(error), stack)


def _first(error) -> tuple[int, object]:
    """(rank, failure) of the failed rank that is not a casualty of another (:func:`_casualty`): the earliest, then
    the lowest rank."""
    return min(error.failures.items(), key=lambda kv: (_casualty(kv[1]), kv[1].timestamp, kv[0]))


def _report(failure) -> object:
    """The ``message`` of a failure's error report (a dict), or None."""
    return failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None


def _failure_line(error: Exception) -> str:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if not isinstance(error, ChildFailedError):
        return f"launch failed: {error}"
    rank, failure = _first(error)
    data = _report(failure)
    if isinstance(data, dict):
        reason = str(data.get("message", "")).strip().splitlines()[-1:] or [""]
        why = reason[0]
    elif failure.exitcode < 0:
        why = f"killed by signal {-failure.exitcode} ({failure.signal_name()})"
    elif failure.exitcode == 128 + signal.SIGINT:  # a rank that got SIGINT alone (worker.exit_on_interrupt)
        why = "interrupted by SIGINT"
    else:
        why = f"exit code {failure.exitcode}"
    return f"rank {rank} failed: {why}; the other ranks were stopped"


def launch_local(plan: Plan, request: RunRequest) -> None:
    """Run ``request`` on ``plan.layout.num_devices`` local processes; raises RunFailed naming the failed rank, or
    RunInterrupted when this process got SIGINT (Ctrl-C), SIGTERM, SIGHUP or SIGQUIT (the agent has stopped the
    ranks by then)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every rank
    # hide the agent's log lines ("Received 2 death signal", "failed (exitcode: 1)"): torch gives each of its
    # loggers an explicit level (torch/distributed/elastic/utils/logging.py) and creates some during the launch, so
    # the filter sits on the handlers their records reach
    def quiet(record: logging.LogRecord) -> bool:
        return not record.name.startswith(("torch.distributed.elastic", "torch.distributed.launcher"))

    handlers, logger = [], logging.getLogger("torch.distributed.elastic")
    while logger is not None:
        handlers += logger.handlers
        logger = logger.parent if logger.propagate else None
    for handler in handlers:
        handler.addFilter(quiet)
    dog = None
    try:
        with tempfile.TemporaryDirectory(prefix="moeplan-run-") as logs:
            config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=plan.layout.num_devices,
                                  run_id=str(uuid.uuid4()), rdzv_backend="c10d", rdzv_endpoint="localhost:0",
                                  max_restarts=0, monitor_interval=0.1, start_method="spawn",
                                  logs_specs=DefaultLogsSpecs(log_dir=logs))
            beats = os.path.join(logs, "heartbeats")
            os.mkdir(beats)
            os.environ[heartbeat.ENV] = beats  # inherited by every rank (moeplan.runtime.heartbeat)
            with heartbeat.Watchdog(beats, stale_after=heartbeat.stale_after_s(request.timeout_s)) as dog:
                # the request as one JSON argument (moeplan.runtime.request): the worker validates it back
                elastic_launch(config, entrypoint=sys.executable)("-m", "moeplan.runtime.worker",
                                                                  request.model_dump_json())
    except ChildFailedError as e:
        raise (RunFailed(dog.found) if dog is not None and dog.found else _first_failure(e)) from None
    except SignalException as e:
        raise RunInterrupted(e.sigval, request.checkpoint_dir) from None
    except KeyboardInterrupt:  # Ctrl-C before the agent installed its signal handlers; its shutdown stopped the ranks
        raise RunInterrupted(signal.SIGINT, request.checkpoint_dir) from None
    finally:
        os.environ.pop(heartbeat.ENV, None)
        for handler in handlers:
            handler.removeFilter(quiet)
