"""The per-rank entry point of ``moeplan run`` (``python -m moeplan.runtime.worker REQUEST``, REQUEST the
:class:`~moeplan.runtime.request.RunRequest` as JSON).

Started by :func:`moeplan.runtime.launch.launch_local` (one process per emulated device), or run in-process by
``moeplan run`` under ``torchrun`` on a cluster (:func:`run_rank` with the request it built); reads RANK /
WORLD_SIZE / LOCAL_RANK from the environment, initialises the process group of the plan's backend (gloo, nccl or
hccl) with an explicit timeout, and :func:`train` runs the steps.

One step: the global batch of the step (moeplan.runtime.data) → this rank's micro-batches → the action list
(:class:`~moeplan.runtime.executor.PipelineExecutor`) → one TP all-reduce of the TP-replicated parameters'
gradients → tied-gradient sums across PP → the distributed optimizer
(ZeRO-1 AdamW, clipping) → an all-gather of every rank's measurements → every ``rebalance_every`` steps a rebalance
of the expert placement (moeplan.runtime.rebalance) → rank 0 writes the JSON line and advances the progress bar;
every ``checkpoint_every`` steps a checkpoint.

A rank reports its own exception to torch elastic in the error file the agent names (:func:`run_rank`), written
atomically; SIGINT (Ctrl-C) ends it at once, quietly, with exit code 130 (:func:`exit_on_interrupt`): the launcher
prints the one line.
"""
from __future__ import annotations

import os
import signal


def exit_on_interrupt(before_exit: Callable[[], None] | None = None) -> None:
    """Make SIGINT end this process at once with exit code 130 (128 + SIGINT) and no traceback, after
    ``before_exit`` (rank 0 restores the terminal under its progress bar).

    Ctrl-C sends SIGINT to the terminal's foreground group, which holds the launcher (``moeplan run`` or torchrun);
    its elastic agent then sends the same signal to every rank, each of which torch starts in a session of its own.
    A rank that raised KeyboardInterrupt would print a traceback, and its peers, whose collectives then break,
    another each; the launcher alone reports the interrupt. Python runs the handler between bytecodes, so a rank blocked in
    a collective exits when the collective returns, at the latest when its peers' exits break it. What was written
    stays consistent: a checkpoint is published by a rename (moeplan.runtime.checkpoint), a metrics line by one
    ``write`` call.
    """
    def handler(signum: int, frame) -> None:
        if before_exit is not None:
            before_exit()
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, handler)


if __name__ == "__main__":  # a rank: a Ctrl-C while the imports below load (seconds) must be quiet as well; only
    exit_on_interrupt()  # os and signal load before it (the interpreter's own start, ~20 ms, is Python's to handle)

import json
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from moeplan.files import write_atomic
from moeplan.plan import Plan, load_plan
from moeplan.runtime.build import LayerDict, build_rank_modules, node_group_ranks, tp_replicated_params
from moeplan.runtime.checkpoint import load_checkpoint, newest_checkpoint, rank_state, save_checkpoint
from moeplan.runtime.data import MicroBatch, check_tokens, global_batch, load_tokens, rank_microbatches
from moeplan.runtime.executor import PipelineExecutor, has_pairs, layer_calls
from moeplan.runtime.expert_parallel import ParallelMoE, ParallelRouter, start_step, take_expert_counts
from moeplan.runtime.groups import ParallelGroups, RankCoords, make_groups, make_stream_groups
from moeplan.runtime.launch import DIST_BACKEND, check_runnable, pin_to_cpu
from moeplan.runtime.load_record import LoadRecorder
from moeplan.runtime.heartbeat import ENV as HEARTBEAT_ENV, start_beating
from moeplan.runtime.metrics import (CommTotals, LoadMeter, RankStep, SavedActivationMeter, StepRecord,
                                     model_state_bytes, rank_step_from_vector, rank_step_vector)
from moeplan.runtime.optimizer import (DistributedAdamW, OptimConfig, ReplicatedGrads, TiedGrads, param_entries,
                                       synced_after_backward)
from moeplan.runtime.overlap import PairRunner
from moeplan.runtime.rebalance import Rebalancer, initial_placements
from moeplan.runtime.parallel import CommLog, all_gather_flat
from moeplan.runtime.request import RunRequest

#: process-group kind -> comm class of the collectives on it (ParallelGroups fields)

def in_layer_classes(groups: ParallelGroups) -> dict[str, str]:
    """Process-group name -> comm class of the in-layer collectives on it (the p2p and optimizer traffic is tallied
    by the executor and optimizer themselves). ``tp_cp`` carries the micro-batch-wide routing statistics (EP) and
    ``etp`` the expert-TP gathers (EP), as cost_models/sharding.py prices them, and the hierarchical and dedup dispatchers'
    node groups (``expert_inter``, ``expert_intra``; pass :func:`layer_groups`) their exchanges (EP); ``dp`` the
    routing statistics of the dp-group and global-batch auxiliary losses (EP, unpriced); the first class wins for a
    shared group."""
    out: dict[str, str] = {}
    for group, cls in ((groups.cp, "cp"), (groups.tp, "tp"), (groups.tp_cp, "ep"), (groups.expert, "ep"),
                       (groups.etp, "ep"), (groups.expert_inter, "ep"), (groups.expert_intra, "ep"),
                       (groups.dp, "ep")):
        if group is not None:
            out.setdefault(group.group_name, cls)
    return out


def layer_groups(modules: dict[int, LayerDict], groups: ParallelGroups) -> ParallelGroups:
    """The groups this rank's layers run on: ``groups`` with the expert node groups that build_rank_modules created
    for the hierarchical and dedup dispatchers (read off its MoE layers; ``groups`` when it has none)."""
    return next((m.env.groups for layers in modules.values() for m in layers.modules()
                 if isinstance(m, ParallelMoE)), groups)


def device_for(backend: str, local_rank: int) -> torch.device:
    """The torch device of this rank for a target backend (``cpu``, ``cuda:{local_rank}``, ``npu:{local_rank}``)."""
    if backend == "cpu":
        return torch.device("cpu")
    if backend == "npu":
        import torch_npu  # noqa: F401  (registers the npu device and hccl; untested here)
    getattr(torch, backend).set_device(local_rank)
    return torch.device(backend, local_rank)


@dataclass(frozen=True)
class RankSetup:
    """Everything a rank builds once: coordinates, groups, modules, executor, optimizer and their meters."""

    coords: RankCoords
    groups: ParallelGroups
    modules: dict[int, LayerDict]
    executor: PipelineExecutor
    optimizer: DistributedAdamW
    ties: TiedGrads
    replicated: ReplicatedGrads
    comm: CommTotals
    layer_log: CommLog
    meter: SavedActivationMeter
    load: LoadMeter
    """How busy this process and its machine were since the previous step record (since the setup began, for the
    first): each record's ``cpu_s`` and ``host``."""
    rebalancer: Rebalancer
    """Every MoE layer's expert placement, and the rebalances of ``--rebalance-every``."""


def setup_rank(plan: Plan, request: RunRequest, *, device: torch.device,
               aux_loss_coeff: float | None = None) -> RankSetup:
    """Collective: groups, this rank's modules (moeplan.runtime.build), executor and optimizer. ``aux_loss_coeff``:
    the MoE load-balance loss weight (None: ``request.aux_loss_coeff``, 0 when that is None, as
    moeplan.models.MoEModel's default), its gradient scaled like the executor's ``1/num_microbatches`` loss scale,
    over the tokens of ``request.aux_loss_scope`` (moeplan.runtime.expert_parallel.ParallelRouter)."""
    if aux_loss_coeff is None:
        aux_loss_coeff = request.aux_loss_coeff or 0.0
    load = LoadMeter()  # the first step's CPU and host figures include the setup
    rank, lay = dist.get_rank(), plan.layout
    timeout = timedelta(seconds=request.timeout_s)
    coords, groups = make_groups(lay, rank, timeout=timeout)
    layer_log = CommLog(devices_per_node=plan.target.devices_per_node)
    modules = build_rank_modules(plan, coords, groups, seed=request.seed, device=device, comm_log=layer_log,
                                 aux_loss_coeff=aux_loss_coeff, aux_loss_scale=1.0 / lay.num_microbatches,
                                 aux_loss_scope=request.aux_loss_scope or "micro-batch")
    if request.force_balanced_routing:  # random router scores, a different stream on every rank
        torch.manual_seed(request.seed * dist.get_world_size() + rank)
        for layers in modules.values():
            for m in layers.modules():
                if isinstance(m, ParallelRouter):
                    m.force_balanced = True
    comm = CommTotals()
    dense, expert = param_entries(plan, modules)
    ties = TiedGrads(plan, modules, rank=rank, comm=comm, timeout=timeout)
    replicated = ReplicatedGrads(tp_replicated_params(modules), groups.tp, comm=comm)
    optimizer = DistributedAdamW(dense=dense, expert=expert, dense_group=groups.dp_cp, expert_group=groups.expert_dp,
                                 grad_scale=1.0 / lay.dp, config=OptimConfig(lr=request.lr), comm=comm,
                                 device=device, reduce_at_step=synced_after_backward(replicated, ties))
    meter = SavedActivationMeter([e.param for e in dense + expert])
    pairs = PairRunner(make_stream_groups(lay, node_group_ranks(plan), timeout=timeout)) if has_pairs(plan) else None
    executor = PipelineExecutor(plan, pp_rank=coords.pp_rank, pp_ranks=groups.pp_ranks, modules=modules, meter=meter,
                                comm_classes=in_layer_classes(layer_groups(modules, groups)),
                                localize=lambda mb: _to(mb, device),
                                call=layer_calls(plan, coords.pp_rank, meter, modules, device), device=device,
                                pairs=pairs, grads_ready=optimizer.grads_ready if "dp" in plan.comm.overlap else None)
    rebalancer = Rebalancer(plan, modules, optimizer, groups.expert, every=request.rebalance_every or 0,
                            threshold=request.rebalance_threshold or 0.0, device=_comm_device(plan))
    return RankSetup(coords, groups, modules, executor, optimizer, ties, replicated, comm, layer_log, meter, load,
                     rebalancer)


def _to(mb: MicroBatch, device: torch.device) -> MicroBatch:
    return MicroBatch(tokens=mb.tokens.to(device), labels=mb.labels.to(device))


def run_one_step(plan: Plan, setup: RankSetup, tokens: torch.Tensor, step: int, *, metered: bool = True) -> StepRecord:
    """Run step ``step`` (0-based) on this rank; collective. Returns the step's record (the same on every rank).
    Unmetered steps skip the saved-activation and in-layer collective meters (their peak is recorded as -1)."""
    lay, coords = plan.layout, setup.coords
    setup.comm.reset()
    setup.layer_log.clear()
    setup.meter.reset_peak()
    t0 = time.perf_counter()
    start_step(setup.modules)
    batch = global_batch(tokens, step=step, global_batch=lay.global_batch, seq_len=lay.seq_len)
    mbs = rank_microbatches(batch, dp_rank=coords.dp_rank, dp=lay.dp, micro_batch=lay.micro_batch)
    loss_sum, times = setup.executor.run_step(mbs, setup.comm, metered=metered)
    t1 = time.perf_counter()
    setup.replicated.sync()
    setup.ties.sync()
    norm = setup.optimizer.step()
    t2 = time.perf_counter()
    states = measure_model_states(setup)  # every state exists now: .grad, shards, moments (before zero_grad)
    metering_s = time.perf_counter() - t2  # kept out of the step's times
    setup.optimizer.zero_grad()
    times["OPTIMIZER"] += time.perf_counter() - t1 - metering_s
    step_s = time.perf_counter() - t0 - metering_s
    for cls, nbytes in setup.layer_log.bytes_by_class().items():
        setup.comm.add(cls, 0.0, nbytes)
    last = plan.stages.rank_of(lay.pp * lay.vpp - 1)  # the PP rank of the last stage (rank 0 under the V placement)
    counts = coords.pp_rank == last and coords.tp_rank == 0 and coords.cp_rank == 0
    mine = RankStep(rank=coords.rank, pp_rank=coords.pp_rank, action_s=dict(times), comm_s=dict(setup.comm.seconds),
                    comm_busy_s=dict(setup.comm.busy), comm_tier_bytes=setup.layer_log.tier_bytes_by_class(),
                    comm_bytes=dict(setup.comm.nbytes), peak_saved_bytes=setup.meter.peak_bytes if metered else -1,
                    peak_host_bytes=setup.meter.host_peak_bytes, params_bytes=states[0], grads_bytes=states[1],
                    optimizer_bytes=states[2], cpu_s=setup.load.cpu_s())
    extra = torch.tensor([loss_sum / lay.num_microbatches / lay.dp if counts else 0.0, step_s], dtype=torch.float64)
    vec = torch.cat([rank_step_vector(mine), extra]).to(_comm_device(plan))
    gathered = torch.empty(dist.get_world_size() * vec.numel(), dtype=vec.dtype, device=vec.device)
    all_gather_flat(gathered, vec)
    rows = gathered.cpu().view(dist.get_world_size(), -1)
    step_time = float(rows[:, -1].max())
    return StepRecord(step=step + 1, loss=float(rows[:, -2].sum()), step_time_s=step_time,
                      tokens_per_s=lay.global_batch * lay.seq_len / step_time, grad_norm=norm,
                      ranks=tuple(rank_step_from_vector(r[:-2]) for r in rows), host=setup.load.host())


def measure_model_states(setup: RankSetup) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes this rank holds (moeplan.runtime.metrics.model_state_bytes): every
    parameter of its stages; their ``.grad`` tensors and the optimizer's flat gradient shards; the optimizer's
    persistent state. Each storage once. Call after the optimizer step, before ``zero_grad``."""
    params = {id(p): p for layers in setup.modules.values() for p in layers.parameters()}.values()
    grad_shards, state = setup.optimizer.state_storages()
    return model_state_bytes(params, [*(p.grad for p in params), *grad_shards], state)


def _comm_device(plan: Plan) -> torch.device:
    if plan.target.backend == "cpu":
        return torch.device("cpu")
    return torch.device(plan.target.backend, torch.accelerator.current_device_index())


def _resume(plan: Plan, request: RunRequest, setup: RankSetup, step_tensor: torch.Tensor) -> int:
    """Collective: load the newest complete checkpoint into this rank; the number of steps it had finished (0 when
    there is none). Rank 0 says on stderr which checkpoint it resumed from."""
    ref = newest_checkpoint(request.checkpoint_dir) if request.checkpoint_dir else None
    if ref is None:
        if dist.get_rank() == 0:
            print(f"moeplan run: no complete checkpoint under {request.checkpoint_dir}; starting at step 0",
                  file=sys.stderr)
        return 0
    state = rank_state(dist.get_rank(), setup.modules, setup.optimizer.state_tensors(), step_tensor)
    experts = load_checkpoint(state, ref, layout=plan.layout, model=plan.model.fingerprint,
                              placements=initial_placements(plan))
    setup.rebalancer.restore(experts)
    setup.optimizer.sync_params()
    if dist.get_rank() == 0:
        print(f"moeplan run: resumed from checkpoint {ref.path} (after step {ref.step}); running steps "
              f"{ref.step + 1}..{request.steps}", file=sys.stderr)
    return int(step_tensor.item())


def _keep_records(path: Path, upto: int) -> None:
    """Drop the metrics lines of steps after ``upto`` (a resumed run rewrites them); atomic rewrite."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and StepRecord.from_json(ln).step <= upto]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(ln + "\n" for ln in lines))
    tmp.replace(path)


def train(plan: Plan, request: RunRequest, *, device: torch.device,
          on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
    """Run ``request.steps`` steps (fewer when resuming) on this rank; collective over the initialised process
    group. Returns the records of the steps run; rank 0 appends them to ``request.metrics`` and writes the load
    trace ``request.record_load`` (moeplan.runtime.load_record)."""
    setup = setup_rank(plan, request, device=device)
    tokens = load_tokens(request.data)
    check_tokens(tokens, vocab_size=plan.model.spec.vocab_size, seq_len=plan.layout.seq_len)
    step_tensor = torch.zeros((), dtype=torch.int64)
    start = _resume(plan, request, setup, step_tensor) if request.resume else 0
    metrics = Path(request.metrics) if request.metrics and dist.get_rank() == 0 else None
    if metrics is not None:
        if start:
            _keep_records(metrics, start)
        elif metrics.exists():
            metrics.unlink()
    records = []
    recorder = LoadRecorder(plan, request, start=start, device=_comm_device(plan)) if request.record_load else None
    for step in range(start, request.steps):
        record = run_one_step(plan, setup, tokens, step, metered=step % request.meter_every == 0)
        if recorder is not None:  # first: the rebalancer takes the counts and resets them itself
            recorder.add(step + 1, take_expert_counts(setup.modules, reset=not setup.rebalancer.every))
        if setup.rebalancer.every:
            setup.rebalancer.observe()
            if setup.rebalancer.due(step + 1):  # between the step's update and the next forward
                record = replace(record, rebalance=setup.rebalancer.rebalance())
        records.append(record)
        if metrics is not None:
            with metrics.open("a") as f:
                f.write(record.to_json() + "\n")
        if on_step is not None:
            on_step(record)
        if request.checkpoint_every and (step + 1) % request.checkpoint_every == 0 and request.checkpoint_dir:
            step_tensor.fill_(step + 1)
            if recorder is not None:  # the trace is complete up to the checkpoint a resume starts from
                recorder.sync()
            state = rank_state(dist.get_rank(), setup.modules, setup.optimizer.state_tensors(), step_tensor)
            save_checkpoint(state, root=request.checkpoint_dir, step=step + 1, layout=plan.layout,
                            model=plan.model.fingerprint, experts=setup.rebalancer.checkpoint_section())
    if recorder is not None:
        recorder.close()
    return records


class _WholeLines:
    """A text stream that passes on whole lines only, each in one write: rich ends its last render with a second
    write ("\\n"), and a launcher's error printed, or a SIGTERM arriving, between the two glued the error onto the
    unfinished progress line. A partial line is dropped at exit, never half-written."""

    def __init__(self, stream) -> None:
        self._stream, self._held = stream, ""

    def write(self, text: str) -> int:
        lines, newline, self._held = (self._held + text).rpartition("\n")
        if newline:
            self._stream.write(lines + newline)
            self._stream.flush()
        return len(text)

    def flush(self) -> None:
        """Nothing: a partial line waits for its end."""

    def isatty(self) -> bool:
        return False


def _progress(total: int, start: int):
    """A rich progress bar on stderr (loss, step time, tokens/s) and the per-step update function. On a terminal
    it redraws in place; otherwise rich prints its last state once, when it stops, as one whole line."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(file=_WholeLines(sys.stderr))
    progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
                        TimeRemainingColumn(), console=console)
    task = progress.add_task("train", total=total, completed=start, info="")

    def update(r: StepRecord) -> None:
        progress.update(task, completed=r.step, info=f"loss {r.loss:.4f} · {r.step_time_s * 1e3:.0f} ms/step · "
                                                     f"{r.tokens_per_s:,.0f} tokens/s")

    return progress, update


def main(request: RunRequest | None = None) -> int:
    """Entry point of one rank; returns the exit code (0, or 2 for a plan refused here). ``request``: what to run;
    None reads it from this process's one argument, the request as JSON (what launch_local passes)."""
    from moeplan.errors import MoeplanError

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    if request is None:
        if len(sys.argv) != 2:
            print("usage: python -m moeplan.runtime.worker REQUEST (a RunRequest as JSON)", file=sys.stderr)
            return 2
        request = RunRequest.model_validate_json(sys.argv[1])
    try:
        plan = load_plan(request.plan)
        world = int(os.environ["WORLD_SIZE"])
        check_runnable(plan, world_size=world)
    except MoeplanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    start_beating(rank)  # a local run's launcher watches the beats (moeplan.runtime.heartbeat)
    if plan.target.backend == "cpu" and not request.no_pin:  # before the process group starts its threads
        pin_to_cpu(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    device = device_for(plan.target.backend, local_rank)
    dist.init_process_group(DIST_BACKEND[plan.target.backend], rank=rank, world_size=world,
                            timeout=timedelta(seconds=request.timeout_s))
    try:
        if rank == 0:
            progress, update = _progress(request.steps, 0)
            # on a terminal, end the bar's line and show the cursor again; elsewhere print nothing more
            exit_on_interrupt(progress.stop if progress.console.is_terminal else None)
            with progress:
                train(plan, request, device=device, on_step=update)
        else:
            train(plan, request, device=device)
    finally:
        dist.destroy_process_group()
    return 0


class AtomicErrorHandler(ErrorHandler):
    """torch elastic's error handler, but the rank's report appears at ``$TORCHELASTIC_ERROR_FILE`` complete or
    not at all.

    Once a rank has failed, the agent sends SIGTERM to the others and then parses the error file of every rank
    that has exited (``SubprocessContext._poll`` after ``close``; a parse error is raised out of the launch). A
    peer stopped inside torch's ``open(file, "w")`` + ``json.dump`` left an empty or truncated file there, and the
    launch failed with a JSONDecodeError instead of naming the failed rank. Same JSON as torch's handler
    (https://pytorch.org/docs/stable/elastic/errors.html): ``message.message``, ``message.extraInfo``
    (``py_callstack``, ``timestamp`` in whole seconds since the epoch).
    """

    def record_exception(self, e: BaseException) -> None:
        """Write the report of ``e`` (the exception being handled) atomically; nothing without an error file."""
        path = self._get_error_file_path()
        if path:
            write_atomic(path, json.dumps({"message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}}}))


def run_rank(request: RunRequest | None = None) -> int | None:
    """:func:`main` as one rank of a torch elastic run (``moeplan run`` locally, or ``torchrun``): an exception is
    reported in the agent's error file (:class:`AtomicErrorHandler`) and re-raised, or, in a local run, ends the
    rank with exit code 1 (the launcher prints one line for the run); SIGINT exits quietly."""
    exit_on_interrupt()
    try:
        return record(main, error_handler=AtomicErrorHandler())(request)
    except Exception:
        if os.environ.get(HEARTBEAT_ENV):  # a local run: its launcher reports the first failure in one line (and its
            return 1  # traceback under `moeplan --debug run`), not every rank a traceback; torchrun prints them
        raise


if __name__ == "__main__":
    sys.exit(run_rank())
