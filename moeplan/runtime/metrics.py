"""Per-step measurement of a rank (docs/architecture.md §7): action wall times, saved-activation bytes, bytes and time per comm
class, and the JSON line each step writes.

- :class:`SavedActivationMeter` counts what autograd keeps for backward with
  ``torch.autograd.graph.saved_tensors_hooks``: parameters (and views of them) are skipped, tensors sharing a
  storage are counted once (the storage's bytes), and a tensor is live from its pack until autograd drops it. Under
  ``torch.utils.checkpoint`` the outer hooks see only the region's inputs, so the selective-checkpoint policy adds
  the outputs it keeps with :meth:`SavedActivationMeter.keep`, and the recompute of a whole-layer region counts what
  it re-made and autograd still holds when it ends with :meth:`SavedActivationMeter.hold` (the layer's backward
  working set, released as autograd frees it).
- :class:`CommMeter` is a ``TorchDispatchMode`` active during F and B: it sees every ``c10d`` /
  ``_c10d_functional`` op the layers issue (TP/SP, EP dispatch/combine, CP), classifies it by its process group
  and adds the op's wall time until completion (it waits on the op's ``Work``, which the synchronous
  ``torch.distributed`` calls the layers make would do right after anyway). Its Python dispatch costs every op a
  few microseconds, so it runs only on metered steps and only on ranks with in-layer groups. The bytes of the
  in-layer collectives come from the layers' own tally (moeplan.runtime.parallel.CommLog, every step); the
  runtime's p2p and optimizer traffic is recorded directly with :meth:`CommTotals.add`.
- :func:`model_state_bytes` counts the model states a rank holds (``params_bytes``, ``grads_bytes``,
  ``optimizer_bytes`` of :class:`RankStep`): the storages of its parameters, of their gradients (the ``.grad``
  tensors and the optimizer's flat gradient shards) and of the optimizer's persistent state (master shards, Adam
  moments and step counts, the norm-weight shards), each storage once, read right after the optimizer step, when
  all of them exist. No allocator is asked, so it is the same on every backend.
- How busy the machine was (for ``moeplan compare``'s warning): every :class:`RankStep` records its process's CPU
  seconds since the previous one (``time.process_time``, all threads), and every :class:`StepRecord` the machine's
  CPU accounting since the previous one (:class:`HostLoad`: busy and stolen CPU-seconds from ``/proc/stat``, the
  1-minute load average). Both are read from the rank's :class:`LoadMeter` (made with the rank's setup, which holds
  the previous readings) when the record is built, at the end of the step.
"""
from __future__ import annotations

import json
import os
import threading
import time
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Mapping

import torch
from torch.distributed.distributed_c10d import ProcessGroup, Work
from torch.utils._python_dispatch import TorchDispatchMode

from moeplan.files import loads_json
from moeplan.placement import LayerRebalance

COMM_CLASSES = ("tp", "ep", "cp", "dp", "pp", "other")


class _Packed:
    """A saved tensor held for autograd; tells the meter when autograd lets go of it."""

    __slots__ = ("tensor", "meter", "ptr")

    def __init__(self, tensor: torch.Tensor, meter: "SavedActivationMeter", ptr: int) -> None:
        self.tensor, self.meter, self.ptr = tensor, meter, ptr

    def __del__(self) -> None:
        self.meter._release(self.ptr)


class SavedActivationMeter:
    """Live and peak bytes of saved activations on this rank (see the module docstring). Bytes are storage bytes.

    Cheap by design (it runs on every saved tensor of every step): one storage lookup per pack, plain dicts.
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._lock = threading.RLock()  # the halves of an OVERLAP_F_B pair pack and release on two threads
        self._param_storages = frozenset(p.untyped_storage().data_ptr() for p in params)
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.host_live_bytes = 0
        self.host_peak_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.host_peak_bytes = self.host_live_bytes

    def _acquire(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            refs = self._refs.get(ptr, 0)
            if refs == 0:
                self._sizes[ptr] = nbytes
                self.live_bytes += nbytes
                if self.live_bytes > self.peak_bytes:
                    self.peak_bytes = self.live_bytes
            self._refs[ptr] = refs + 1

    def _release(self, ptr: int) -> None:
        with self._lock:
            refs = self._refs[ptr] - 1
            if refs:
                self._refs[ptr] = refs
            else:
                del self._refs[ptr]
                self.live_bytes -= self._sizes.pop(ptr)

    def pack(self, t: torch.Tensor) -> object:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._param_storages or ptr == 0:  # a parameter (or a view of one), or an empty tensor
            return t
        self._acquire(ptr, storage.nbytes())
        return _Packed(t, self, ptr)

    @staticmethod
    def unpack(packed: object) -> torch.Tensor:
        return packed.tensor if type(packed) is _Packed else packed

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context manager that routes autograd's saved tensors through this meter."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def keep(self, t: torch.Tensor, record: list[int]) -> None:
        """Count ``t`` (kept by a selective-checkpoint policy) as live; ``record`` collects it for :meth:`drop`."""
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._param_storages and ptr != 0:
                self._acquire(ptr, storage.nbytes())
                record.append(ptr)

    def drop(self, record: list[int]) -> None:
        """Release what :meth:`keep` counted into ``record`` (the region was recomputed)."""
        for ptr in record:
            self._release(ptr)
        record.clear()

    def hold(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` as live until it is freed (a weak-reference finaliser releases it): what a whole-layer
        checkpoint's recompute re-made and autograd keeps for the layer's backward (moeplan.runtime.executor).
        Parameters and empty storages are skipped; a storage already counted gains a reference, not bytes."""
        ptr = storage.data_ptr()
        if ptr in self._param_storages or ptr == 0:
            return
        self._acquire(ptr, storage.nbytes())
        weakref.finalize(storage, self._release, ptr)

    def keep_host(self, nbytes: int, record: list[int]) -> None:
        """Count ``nbytes`` swapped to host (moeplan.runtime.activations); ``record`` collects them for
        :meth:`drop_host`."""
        self.host_live_bytes += nbytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_live_bytes)
        record.append(nbytes)

    def drop_host(self, record: list[int]) -> None:
        self.host_live_bytes -= sum(record)
        record.clear()


def model_state_bytes(params: Iterable[torch.Tensor], grads: Iterable[torch.Tensor | None],
                      optimizer: Iterable[torch.Tensor]) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes: the bytes of the distinct storages of each group of tensors, a
    storage counted once over all three groups (in that order: an optimizer tensor that is a view of a parameter
    counts as the parameter). ``None`` and empty tensors are skipped."""
    seen: set[int] = set()

    def count(tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in seen:
                continue
            seen.add(ptr)
            total += storage.nbytes()
        return total

    return count(params), count(grads), count(optimizer)


@dataclass
class CommTotals:
    """Per comm class during one step: ``seconds`` the compute stream waited on the class, ``busy`` seconds its
    collectives were in flight, and ``nbytes`` this rank contributed. A synchronous collective is waited on for as
    long as it is in flight (busy = seconds); an asynchronous one is in flight longer than it is waited on."""

    seconds: Counter = field(default_factory=Counter)
    nbytes: Counter = field(default_factory=Counter)
    busy: Counter = field(default_factory=Counter)

    def add(self, comm_class: str, seconds: float, nbytes: int, busy_s: float | None = None) -> None:
        """Add a collective: ``seconds`` waited, ``nbytes`` sent, ``busy_s`` in flight (default: ``seconds``)."""
        self.seconds[comm_class] += seconds
        self.nbytes[comm_class] += nbytes
        self.busy[comm_class] += seconds if busy_s is None else busy_s

    def reset(self) -> None:
        self.seconds.clear()
        self.nbytes.clear()
        self.busy.clear()


def wait_all(out: object) -> None:
    """Wait for the ``Work`` handles a c10d op returned (so the op's time includes its completion)."""
    for item in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(item, torch.ScriptObject):
            try:
                Work.unbox(item).wait()
            except (RuntimeError, TypeError):
                continue


class CommMeter(TorchDispatchMode):
    """Times and sizes the collectives issued while active; ``classes`` maps a group name to its comm class."""

    def __init__(self, classes: Mapping[str, str], totals: CommTotals) -> None:
        super().__init__()
        self._classes = dict(classes)
        self.totals = totals

    def _classify(self, args: tuple, kwargs: dict) -> str:
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.ScriptObject):
                try:
                    return self._classes.get(ProcessGroup.unbox(a).group_name, "other")
                except (RuntimeError, TypeError):
                    continue
            if isinstance(a, str) and a in self._classes:
                return self._classes[a]
        return "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in ("c10d", "_c10d_functional"):
            return func(*args, **kwargs)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        wait_all(out)  # the op only enqueues; the caller's wait would fall outside the timer
        self.totals.add(self._classify(args, kwargs), time.perf_counter() - t0, 0)
        return out


def _proc_stat() -> tuple[float, float, int] | None:
    """Busy (user + nice + system) and stolen CPU-seconds since boot, summed over the machine's CPUs, and the number
    of CPUs, from the ``cpu`` lines of /proc/stat (proc(5); ticks of ``SC_CLK_TCK``); None where there is none."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ticks = [int(x) for x in lines[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    cpus = sum(1 for ln in lines if ln.startswith("cpu") and ln[3:4].isdigit())
    return sum(ticks[:3]) / hz, (ticks[7] if len(ticks) > 7 else 0) / hz, cpus


class _Since:
    """The increase of each figure of ``read()`` since the previous call (since construction, for the first); None
    when ``read()`` returns None."""

    def __init__(self, read: Callable[[], tuple[float, ...] | None]) -> None:
        self._read = read
        self._last = read()

    def __call__(self) -> tuple[float, ...] | None:
        now, last = self._read(), self._last
        self._last = now
        return None if now is None or last is None else tuple(a - b for a, b in zip(now, last))


def _host_reading() -> tuple[float, float, float] | None:
    stat = _proc_stat()
    return None if stat is None else (time.perf_counter(), stat[0], stat[1])


@dataclass(frozen=True)
class HostLoad:
    """What the machine of global rank 0 did between two step records (about one step), for telling whether other
    work competed with the run: wall seconds, CPU-seconds busy (user + nice + system) and stolen by the hypervisor,
    summed over all ``cpus`` CPUs of /proc/stat (proc(5)), the 1-minute load average at the end (runnable and
    uninterruptible tasks, the run's own included) and the run's ranks on this machine (``LOCAL_WORLD_SIZE``, set by
    torch's elastic launcher; None outside it)."""

    wall_s: float
    busy_cpu_s: float
    steal_cpu_s: float
    cpus: int
    load_1m: float
    local_ranks: int | None


class LoadMeter:
    """How busy this process and its machine were between two readings (see the module docstring): each reading
    covers the time since the previous one of its kind (since the meter was made, for the first). The meter owns
    its last readings, so two meters (two runs in one process, a test) do not share an interval."""

    def __init__(self) -> None:
        self._cpu = _Since(lambda: (time.process_time(),))
        self._host = _Since(_host_reading)

    def cpu_s(self) -> float:
        """CPU seconds (user + system, all threads) this process used since the previous call: a RankStep's
        ``cpu_s``."""
        delta = self._cpu()
        assert delta is not None  # time.process_time always reads
        return delta[0]

    def host(self) -> HostLoad | None:
        """The machine's :class:`HostLoad` since the previous call; None without /proc/stat (not Linux)."""
        delta, stat = self._host(), _proc_stat()
        if delta is None or stat is None:
            return None
        local = os.environ.get("LOCAL_WORLD_SIZE")
        return HostLoad(wall_s=delta[0], busy_cpu_s=delta[1], steal_cpu_s=delta[2], cpus=stat[2],
                        load_1m=os.getloadavg()[0], local_ranks=int(local) if local else None)


@dataclass(frozen=True)
class RankStep:
    """What one rank measured in one step: seconds per action kind (F, B, SEND_F, ...), seconds and bytes per comm
    class (in-layer collectives, p2p, optimizer), and the peak saved-activation bytes (-1 on an unmetered step,
    which also lacks the in-layer collectives)."""

    rank: int
    pp_rank: int
    action_s: Mapping[str, float]
    comm_s: Mapping[str, float]
    comm_bytes: Mapping[str, int]
    peak_saved_bytes: int
    peak_host_bytes: int = 0  # swapped activations held on the host (moeplan.runtime.activations)
    cpu_s: float = -1.0
    """CPU seconds (user + system, all threads) this rank's process used since its previous RankStep
    (:meth:`LoadMeter.cpu_s`; since the rank's setup, for the first): about one step; -1 where unknown (metrics
    written before the field)."""
    comm_busy_s: Mapping[str, float] = field(default_factory=dict)
    """Seconds per comm class that its collectives were in flight (``comm_s`` is the part the compute stream waited
    for); a class missing here was synchronous: busy = comm_s."""
    comm_tier_bytes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Bytes this rank sent per comm class over each link tier, ``{cls: {"intra": n, "inter": n}}``: the in-layer
    collectives (tp, ep, cp) as moeplan.runtime.parallel.CommLog counts them (every step); empty in metrics written
    before the field."""
    params_bytes: int = -1
    """Bytes of this rank's parameters (:func:`model_state_bytes`, after the step's optimizer step); -1 where
    unknown (metrics written before the field)."""
    grads_bytes: int = -1
    """Bytes of their gradients: the ``.grad`` tensors and the optimizer's flat gradient shards; -1 where unknown."""
    optimizer_bytes: int = -1
    """Bytes of the optimizer's persistent state: master shards, Adam moments and step counts, norm-weight shards;
    -1 where unknown."""

    def busy_s(self, comm_class: str) -> float:
        """Seconds ``comm_class``'s collectives were in flight this step."""
        return self.comm_busy_s.get(comm_class, self.comm_s.get(comm_class, 0.0))


TIERS = ("intra", "inter")
STATE_FIELDS = ("params_bytes", "grads_bytes", "optimizer_bytes")
"""The model-state fields of :class:`RankStep` (and of a rank's JSON object, absent where unknown)."""
ACTION_KINDS = ("F", "B", "I", "W", "OVERLAP_F_B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "SEND_WAIT", "OPTIMIZER")


def rank_step_vector(step: RankStep) -> torch.Tensor:
    """Pack a RankStep into a float64 vector (fixed layout) for an all-gather across ranks."""
    values = [float(step.rank), float(step.pp_rank), float(step.peak_saved_bytes), float(step.peak_host_bytes),
              step.cpu_s]
    values += [step.action_s.get(k, 0.0) for k in ACTION_KINDS]
    values += [step.comm_s.get(c, 0.0) for c in COMM_CLASSES]
    values += [float(step.comm_bytes.get(c, 0)) for c in COMM_CLASSES]
    values += [step.busy_s(c) for c in COMM_CLASSES]
    values += [float(step.comm_tier_bytes.get(c, {}).get(t, 0)) for c in COMM_CLASSES for t in TIERS]
    values += [float(step.params_bytes), float(step.grads_bytes), float(step.optimizer_bytes)]
    return torch.tensor(values, dtype=torch.float64)


def rank_step_from_vector(v: torch.Tensor) -> RankStep:
    vals = v.tolist()
    a, c = 5, 5 + len(ACTION_KINDS)
    b = c + len(COMM_CLASSES)
    d = b + len(COMM_CLASSES)
    e = d + len(COMM_CLASSES)
    tiers = [vals[e + i * len(TIERS):e + (i + 1) * len(TIERS)] for i in range(len(COMM_CLASSES))]
    f = e + len(COMM_CLASSES) * len(TIERS)
    return RankStep(rank=int(vals[0]), pp_rank=int(vals[1]), peak_saved_bytes=int(vals[2]),
                    params_bytes=int(vals[f]), grads_bytes=int(vals[f + 1]), optimizer_bytes=int(vals[f + 2]),
                    peak_host_bytes=int(vals[3]), cpu_s=vals[4],
                    action_s={k: x for k, x in zip(ACTION_KINDS, vals[a:c]) if x},
                    comm_s={k: x for k, x in zip(COMM_CLASSES, vals[c:b]) if x},
                    comm_bytes={k: int(x) for k, x in zip(COMM_CLASSES, vals[b:d]) if x},
                    comm_busy_s={k: x for k, x in zip(COMM_CLASSES, vals[d:e]) if x},
                    comm_tier_bytes={k: {t: int(x) for t, x in zip(TIERS, v)} for k, v in zip(COMM_CLASSES, tiers)
                                     if any(v)})


@dataclass(frozen=True)
class RebalanceRecord:
    """A rebalance after a step (``moeplan run --rebalance-every``): ``seconds`` the whole of it took and
    ``migrate_s`` the weight and optimizer-state migration (wall seconds, the slowest rank), ``moved_bytes`` sent to
    other ranks by the migration (summed over ranks), and every MoE layer's :class:`LayerRebalance` by layer name."""

    seconds: float
    migrate_s: float
    moved_bytes: int
    layers: Mapping[str, LayerRebalance]

    @property
    def moved_experts(self) -> int:
        """Logical experts that changed rank, summed over the layers."""
        return sum(len(x.moved) for x in self.layers.values())

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "migrate_s": self.migrate_s, "moved_bytes": self.moved_bytes,
                "moved_experts": self.moved_experts,
                "layers": {k: {"imbalance_before": x.imbalance_before, "imbalance_after": x.imbalance_after,
                               "applied": x.applied, "moved": list(x.moved),
                               "placement": [list(s) for s in x.placement]}
                           for k, x in self.layers.items()}}

    @staticmethod
    def from_dict(d: dict) -> "RebalanceRecord":
        return RebalanceRecord(seconds=d["seconds"], migrate_s=d["migrate_s"], moved_bytes=d["moved_bytes"],
                               layers={k: LayerRebalance(imbalance_before=x["imbalance_before"],
                                                         imbalance_after=x["imbalance_after"], applied=x["applied"],
                                                         moved=tuple(x["moved"]),
                                                         placement=tuple(tuple(s) for s in x["placement"]))
                                       for k, x in d["layers"].items()})


@dataclass(frozen=True)
class StepRecord:
    """One JSON line of ``--metrics``: the step (1-based), its loss, wall time and throughput, every rank's
    measurements (``ranks``, ordered by global rank) and how busy rank 0's machine was (``host``,
    :meth:`LoadMeter.host` when the record is built; None where unknown). ``rebalance``: the rebalance that ran after
    the step (``--rebalance-every``; not part of ``step_time_s``), None (and no key in the JSON) on other steps."""

    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    grad_norm: float
    ranks: tuple[RankStep, ...]
    host: HostLoad | None = None
    rebalance: RebalanceRecord | None = None

    @property
    def metered(self) -> bool:
        return all(r.peak_saved_bytes >= 0 for r in self.ranks)

    def to_json(self) -> str:
        return json.dumps({
            "step": self.step, "loss": self.loss, "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s, "grad_norm": self.grad_norm,
            "host": None if self.host is None else asdict(self.host),
            "ranks": [{"rank": r.rank, "pp_rank": r.pp_rank, "action_s": dict(r.action_s), "comm_s": dict(r.comm_s),
                       "comm_bytes": dict(r.comm_bytes), "comm_busy_s": dict(r.comm_busy_s),
                       "comm_tier_bytes": {k: dict(v) for k, v in r.comm_tier_bytes.items()},
                       "peak_saved_bytes": r.peak_saved_bytes if r.peak_saved_bytes >= 0 else None,
                       "peak_host_bytes": r.peak_host_bytes, "cpu_s": r.cpu_s,
                       **{k: getattr(r, k) for k in STATE_FIELDS if getattr(r, k) >= 0}}
                      for r in self.ranks],
            **({} if self.rebalance is None else {"rebalance": self.rebalance.to_dict()})})

    @staticmethod
    def from_json(line: str) -> "StepRecord":
        """The record of one metrics line. Raises ValueError for malformed JSON or a key stated twice, KeyError or
        TypeError for a missing or mistyped field."""
        d = loads_json(line)
        ranks = tuple(RankStep(rank=r["rank"], pp_rank=r["pp_rank"], action_s=r["action_s"], comm_s=r["comm_s"],
                               comm_bytes=r["comm_bytes"],
                               peak_saved_bytes=-1 if r["peak_saved_bytes"] is None else r["peak_saved_bytes"],
                               peak_host_bytes=r.get("peak_host_bytes", 0), cpu_s=r.get("cpu_s", -1.0),
                               comm_busy_s=r.get("comm_busy_s", {}), comm_tier_bytes=r.get("comm_tier_bytes", {}),
                               **{k: r.get(k, -1) for k in STATE_FIELDS})
                      for r in d["ranks"])
        host = d.get("host")
        return StepRecord(step=d["step"], loss=d["loss"], step_time_s=d["step_time_s"],
                          tokens_per_s=d["tokens_per_s"], grad_norm=d["grad_norm"], ranks=ranks,
                          host=None if host is None else HostLoad(**host),
                          rebalance=RebalanceRecord.from_dict(d["rebalance"]) if "rebalance" in d else None)
