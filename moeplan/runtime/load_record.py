"""``moeplan run --record-load FILE``: every step's routed token copies per expert and MoE layer, summed over the
ranks, written as an expert-load trace (moeplan.expert_load.LoadTrace; docs/load-balance.md).

After each step, every rank takes its MoE blocks' counts (moeplan.runtime.expert_parallel.take_expert_counts: its
own tokens' top-k choices, before any drop-and-pad drop) as one ``[MoE layers of the model, E]`` int64 tensor,
zeros for the layers of the other PP ranks. Every :data:`FLUSH_EVERY` steps (and at each checkpoint and the end)
one all-reduce (SUM) over the world (the default group) sums the pending steps, ``8·n·L·E`` bytes for ``n`` steps:
on the CPU emulator a tiny all-reduce costs milliseconds of latency, so one per step would cost more than the
bytes. Each token is routed on exactly one rank (SP/CP ranks hold different tokens, DP ranks different
micro-batches), so the sum is the step's copies over every micro-batch: ``k`` per token and layer.

Layers are numbered by decoder-layer index (moeplan.expert_load.moe_layers): ``layers.i`` is ``i``, the MTP block
``mtp.j`` is ``num_layers + j``. ``ep`` is the expert group size (``ep·tp/etp``, ``len(plan.experts.shards)``) and
``placement`` the plan's ``experts.shards`` (the placement at the start of the run: a ``--rebalance-every`` run
moves experts later).

Rank 0 rewrites the whole trace atomically (moeplan.files.write_atomic: a crash leaves the previous complete
trace, at most the steps since it lost): after a sum, when 20 times the previous rewrite's duration has passed
since it ended (so at most about 5 % of the run goes to rewriting, whatever the trace's size), at each checkpoint
and after the last step. A resumed run keeps the existing trace's steps up to the checkpoint when it is a trace of
this model with the same layers, and starts a new one at the checkpoint otherwise. At the end, rank 0 prints on
stderr what the recording cost it: milliseconds per step in all (the all-reduces and the rewrites) and in the
rewrites.
"""
from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist

from moeplan.errors import MoeplanError
from moeplan.expert_load import LoadTrace, moe_layer_name, moe_layers, read_trace, write_trace
from moeplan.plan import Plan
from moeplan.runtime.request import RunRequest

FLUSH_EVERY = 10
"""Steps whose counts are summed over the ranks by one all-reduce."""
WRITE_GAP = 20.0
"""Seconds between two rewrites of the trace, in units of the last rewrite's duration."""


class LoadRecorder:
    """Collects the world's counts step by step (:meth:`add`, collective every :data:`FLUSH_EVERY` steps; :meth:`sync`
    and :meth:`close` are collective) and, on rank 0, writes the trace
    ``request.record_load`` (module docstring). ``start``: steps the run had finished before this one began (a
    resume); ``device``: where the all-reduce runs (the backend's device)."""

    def __init__(self, plan: Plan, request: RunRequest, *, start: int, device: torch.device) -> None:
        spec = plan.model.spec
        self.path, self.device = request.record_load, device
        self.layers = moe_layers(spec)
        self.row = {moe_layer_name(spec, i): r for r, i in enumerate(self.layers)}
        self.num_experts = spec.num_experts
        self.writer = dist.get_rank() == 0
        self.base = LoadTrace(model=plan.model.name, num_experts=spec.num_experts, layers=self.layers, steps=(),
                              counts=np.zeros((0, len(self.layers), spec.num_experts), dtype=np.int64),
                              source=shlex.join(["moeplan", "run", *request.cli_args()]),
                              ep=len(plan.experts.shards), placement=tuple(tuple(s) for s in plan.experts.shards))
        self.steps: list[int] = []  # rank 0: the steps summed so far, and their counts
        self.counts: list[np.ndarray] = []
        self.pending: list[tuple[int, torch.Tensor]] = []  # this rank's steps not yet summed
        self.written_at, self.write_s, self.unwritten = 0.0, 0.0, False
        self.seconds, self.write_total, self.added, self.writes = 0.0, 0.0, 0, 0  # what recording cost rank 0
        if start and self.writer:
            self._keep(start)

    def _keep(self, upto: int) -> None:
        """The steps ≤ ``upto`` of an existing trace of this model and layers (nothing when there is none)."""
        if not Path(self.path).is_file():
            return
        try:
            old = read_trace(self.path, field="record_load")
        except MoeplanError as e:
            print(f"moeplan run: starting a new load trace: {e}", file=sys.stderr)
            return
        if (old.model, old.num_experts, old.layers) != (self.base.model, self.num_experts, self.layers):
            print(f"moeplan run: starting a new load trace: {self.path} holds another model's", file=sys.stderr)
            return
        for s, c in zip(old.steps, old.counts):
            if s <= upto:
                self.steps.append(s)
                self.counts.append(c)

    def add(self, step: int, counts: Mapping[str, torch.Tensor]) -> None:
        """Add step ``step`` (1-based) with this rank's ``counts`` (layer name -> ``[E]`` copies,
        moeplan.runtime.expert_parallel.take_expert_counts); every :data:`FLUSH_EVERY` steps, collective over the
        world: the pending steps are summed over the ranks and rank 0 rewrites the trace when it is due."""
        t0 = time.perf_counter()
        mine = torch.zeros((len(self.layers), self.num_experts), dtype=torch.int64)
        for name, c in counts.items():
            mine[self.row[name]] = c
        self.pending.append((step, mine))
        if len(self.pending) >= FLUSH_EVERY:
            self._flush()
            if self.writer and time.perf_counter() - self.written_at >= WRITE_GAP * self.write_s:
                self._write()
        self.seconds += time.perf_counter() - t0
        self.added += 1

    def sync(self) -> None:
        """Collective over the world: sum the pending steps and rewrite the trace with every step so far (at a
        checkpoint, so that a resume finds the trace complete up to it, and at the end)."""
        t0 = time.perf_counter()
        self._flush()
        if self.writer and self.unwritten:
            self._write()
        self.seconds += time.perf_counter() - t0

    def _flush(self) -> None:
        """Collective: one all-reduce (SUM) of the pending steps' ``[steps, layers, E]`` counts; rank 0 keeps them."""
        if not self.pending:
            return
        block = torch.stack([c for _, c in self.pending]).to(self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(block)
        if self.writer:
            self.steps += [s for s, _ in self.pending]
            self.counts += list(block.cpu().numpy())
            self.unwritten = True
        self.pending = []

    def _write(self) -> None:
        """Rank 0: rewrite the trace with every step so far (atomically; OutputError when it cannot)."""
        t0 = time.perf_counter()
        counts = np.stack(self.counts) if self.counts else self.base.counts
        write_trace(LoadTrace(self.base.model, self.num_experts, self.layers, tuple(self.steps), counts,
                              self.base.source, self.base.ep, self.base.placement), self.path, field="record_load")
        self.written_at = time.perf_counter()
        self.write_s, self.unwritten = self.written_at - t0, False
        self.write_total += self.write_s
        self.writes += 1

    def close(self) -> None:
        """Collective: :meth:`sync`; then rank 0 says on stderr what the recording cost it."""
        self.sync()
        if self.writer:
            per_step = 1e3 / max(self.added, 1)
            print(f"moeplan run: load trace {self.path}: {len(self.steps)} steps; recording took "
                  f"{self.seconds * per_step:.2f} ms per step, {self.write_total * per_step:.2f} of them in "
                  f"{self.writes} rewrites", file=sys.stderr)
