"""Expert load as data: how many routed tokens each expert of each MoE layer received, per step (docs/load-balance.md).

A :class:`LoadTrace` holds ``counts[step, layer, expert]``: the (token, expert) copies the router sent to each
routed expert of each MoE layer in one training step (or one window of inference), summed over every rank and
micro-batch of the step. ``layers`` names the MoE layers by their decoder-layer index in the model (0-based, the
MTP block's MoE layer after the last decoder layer); ``model`` and ``source`` say where the counts came from.

moeplan's own file (``moeplan run --record-load FILE`` writes it) is JSON::

    {"format": "moeplan.expert-load/1", "model": "tiny-pangu", "num_experts": 8, "layers": [1, 2, 3],
     "source": "moeplan run plan.yaml ...", "ep": 2, "placement": [[0, 1, 2, 3], [4, 5, 6, 7]],
     "steps": [1, 2, ...], "counts": [[[12, 40, ...], ...], ...]}

``ep``/``placement`` (optional): the expert group size and the experts each of its ranks held when the counts were
taken. :func:`read_trace` also reads the public formats people already have (a ``layer -> counts`` JSON object,
DeepSeek EPLB's ``weight``, SGLang's expert-distribution dump; :data:`READERS`); vLLM writes no such file (see
:func:`read_trace`). :func:`check_against` refuses a trace that does not fit a model. The metrics
(:func:`rank_tokens`, :func:`imbalance`, :func:`balancedness`, :func:`cv`) and :func:`predict` are pure functions
of the counts.
"""
from __future__ import annotations

import json
import os
import pickle
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moeplan.errors import LoadError
from moeplan.files import MAX_INPUT_BYTES, read_json, write_atomic

if TYPE_CHECKING:
    from moeplan.spec import ModelSpec

FORMAT = "moeplan.expert-load/1"
READERS = ("moeplan", "bincounts", "eplb", "sglang")
"""The formats :func:`read_trace` reads, by the name its ``format=`` override takes."""


@dataclass(frozen=True, eq=False)
class LoadTrace:
    """Routed-token counts ``counts [steps, layers, experts]`` (int64, ≥ 0) with where they came from.

    Raises LoadError when the shape does not match ``steps``/``layers``/``num_experts`` or a count is negative.
    """

    model: str
    num_experts: int
    layers: tuple[int, ...]
    steps: tuple[int, ...]
    counts: np.ndarray
    source: str = ""
    ep: int | None = None
    placement: tuple[tuple[int, ...], ...] | None = None
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        c = np.asarray(self.counts)
        if c.ndim != 3:
            raise LoadError(f"counts: must be [steps, layers, experts], got {c.ndim} dimensions")
        want = (len(self.steps), len(self.layers), self.num_experts)
        if c.shape != want:
            raise LoadError(f"counts: shape {list(c.shape)} must be [steps, layers, experts] = {list(want)}")
        if not np.issubdtype(c.dtype, np.integer):
            raise LoadError(f"counts: must be integers, got {c.dtype}")
        if c.size and c.min() < 0:
            s, l, e = (int(i) for i in np.argwhere(c < 0)[0])
            raise LoadError(f"counts[step {self.steps[s]}][layer {self.layers[l]}][expert {e}]={int(c[s, l, e])}: "
                            f"must be ≥ 0")
        if len(set(self.layers)) != len(self.layers):
            raise LoadError(f"layers={list(self.layers)}: each MoE layer once")
        object.__setattr__(self, "counts", c.astype(np.int64, copy=False))

    def window(self, start: int, stop: int) -> LoadTrace:
        """The steps at positions ``[start, stop)`` of this trace."""
        return LoadTrace(self.model, self.num_experts, self.layers, self.steps[start:stop], self.counts[start:stop],
                         self.source, self.ep, self.placement, self.notes)

    def to_json(self) -> str:
        doc = {"format": FORMAT, "model": self.model, "num_experts": self.num_experts, "layers": list(self.layers),
               "source": self.source, "ep": self.ep,
               "placement": None if self.placement is None else [list(s) for s in self.placement],
               "steps": list(self.steps), "counts": self.counts.tolist()}
        return json.dumps(doc, separators=(",", ":")) + "\n"


def write_trace(trace: LoadTrace, path: str | Path, *, field: str = "record-load") -> None:
    """Write ``trace`` to ``path`` in moeplan's format (atomically; OutputError when it cannot)."""
    write_atomic(path, trace.to_json(), field=field)


# ---- the model's MoE layers ----------------------------------------------------------------------------------------
def moe_layers(spec: ModelSpec) -> tuple[int, ...]:
    """The decoder-layer indices of ``spec``'s MoE layers, in order: ``num_dense_layers .. num_layers − 1``, then
    one per MTP module, ``num_layers .. num_layers + num_mtp_layers − 1`` (each MTP module holds an MoE decoder
    layer, :class:`~moeplan.spec.ModelSpec`). Empty for a dense model."""
    return (*range(spec.num_dense_layers, spec.num_layers),
            *range(spec.num_layers, spec.num_layers + spec.num_mtp_layers))


def moe_layer_name(spec: ModelSpec, layer: int) -> str:
    """The model's name (moeplan.models.layer_names) of the MoE layer at decoder-layer index ``layer``
    (:func:`moe_layers`): ``layers.i``, or ``mtp.j`` for the MTP block's layer ``num_layers + j``."""
    return f"layers.{layer}" if layer < spec.num_layers else f"mtp.{layer - spec.num_layers}"


def _span(a: int, b: int) -> str:
    return str(a) if a == b else f"{a}–{b}"


def _layers_text(spec: ModelSpec) -> str:
    """``MoE layers 3–60, MTP 61``: the MoE layers of ``spec`` in words."""
    parts = [f"MoE layers {_span(spec.num_dense_layers, spec.num_layers - 1)}"] if spec.num_moe_layers else []
    if spec.num_mtp_layers:
        parts.append(f"MTP {_span(spec.num_layers, spec.num_layers + spec.num_mtp_layers - 1)}")
    return ", ".join(parts) or "no MoE layers"


def _short(seq: Sequence[int]) -> str:
    """A list for a one-line message: whole up to 8 items, else its ends and its length."""
    return str(list(seq)) if len(seq) <= 8 else f"[{seq[0]}, {seq[1]}, ..., {seq[-1]}] ({len(seq)} items)"


def check_against(trace: LoadTrace, spec: ModelSpec) -> None:
    """Refuse ``trace`` unless it fits ``spec``: ``num_experts`` equals the spec's routed experts per MoE layer and
    every layer of the trace is one of the model's MoE layers (:func:`moe_layers`; a trace may cover some of them,
    e.g. the decoder layers without the MTP block). Raises LoadError with one line naming the field, the value and
    the rule."""
    moe = moe_layers(spec)
    if not moe:
        raise LoadError(f"model={spec.name!r}: has no MoE layers, so no expert load")
    if trace.num_experts != spec.num_experts:
        raise LoadError(f"num_experts={trace.num_experts}: {spec.name} has {spec.num_experts} routed experts per "
                        f"MoE layer")
    bad = [layer for layer in trace.layers if layer not in moe]
    if bad:
        raise LoadError(f"layers={_short(trace.layers)}: layer {bad[0]} is not an MoE layer of {spec.name} "
                        f"({_layers_text(spec)})")


# ---- counts from any container -------------------------------------------------------------------------------------
Namer = Callable[[tuple[int, ...]], str]


def _indexed(base: str) -> Namer:
    """``weight[3][7]``: element names under ``base``."""
    return lambda idx: base + "".join(f"[{i}]" for i in idx)


def _ragged(values: list, name: Namer, idx: tuple[int, ...] = ()) -> str | None:
    """Why nested lists ``values`` are not a rectangular array of numbers (ragged rows, a row that is not a list,
    an item that is not a number: true/false and strings included), or None."""
    if all(type(v) is int or type(v) is float for v in values):  # a row of numbers; bool is not int here
        return None
    lists = [isinstance(v, list) for v in values]
    if not any(lists):
        i = next(i for i, v in enumerate(values) if type(v) is not int and type(v) is not float)
        return f"{name(idx + (i,))}={values[i]!r:.40}: must be a number"
    if not all(lists):
        i = lists.index(False)
        return f"{name(idx + (i,))}={values[i]!r:.40}: must be a list like {name(idx + (0,))} (ragged rows)"
    for i, row in enumerate(values):
        if len(row) != len(values[0]):
            return (f"{name(idx + (i,))}: length {len(row)}, {name(idx + (0,))} has length {len(values[0])}: rows "
                    f"must be equally long (ragged rows)")
    return next(filter(None, (_ragged(v, name, idx + (i,)) for i, v in enumerate(values))), None)


def _is_tensor(x: object) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch for files that hold none)."""
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach")


def _array(values: object, name: Namer) -> np.ndarray:
    """``values`` (nested lists, a numpy array or a torch tensor) as a numeric numpy array. Raises LoadError for
    ragged rows and for items that are not numbers (true/false included)."""
    if _is_tensor(values):
        t = values.detach().cpu()
        values = (t.double() if t.is_floating_point() else t).numpy()
    if isinstance(values, list):
        problem = _ragged(values, name)
        if problem:
            raise LoadError(problem)
    a = np.asarray(values)
    if a.dtype.kind not in "iuf":
        got = {"b": "true/false", "O": "integers beyond 2^63 or other objects"}.get(a.dtype.kind, str(a.dtype))
        raise LoadError(f"{name(())}: counts must be numbers, got {got}")
    return a


def _counts(values: object, name: Namer, dims: str) -> np.ndarray:
    """``values`` as int64 counts with ``len(dims.split(', '))`` dimensions named by ``dims`` (e.g. ``layers,
    experts``). Raises LoadError with one line for the wrong number of dimensions, an empty dimension, and the first
    count that is not finite, not a whole number, negative or beyond int64."""
    a = _array(values, name)
    want = len(dims.split(", "))
    if a.ndim != want:
        raise LoadError(f"{name(())}: must be [{dims}], got {a.ndim} dimension(s) of shape {list(a.shape)}")
    if 0 in a.shape:
        raise LoadError(f"{name(())}: shape {list(a.shape)} [{dims}] is empty; a trace needs at least one count")
    for bad, rule in ((~np.isfinite(a), "must be finite"), (a != np.round(a), "must be whole numbers of tokens"),
                      (a < 0, "must be ≥ 0"), (a >= 2.0**63, "must be below 2^63")):
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise LoadError(f"{name(idx)}={a[idx].item()!r}: counts {rule}")
    return a.astype(np.int64)


# ---- reading -------------------------------------------------------------------------------------------------------
def _sniff(path: str | Path, where: str) -> str:
    """The kind of file at ``path`` by its first bytes: ``npy`` (NumPy's magic), ``torch`` (a zip archive, what
    ``torch.save`` writes, or a pickle, its legacy format) or ``json``. Raises LoadError for a file that cannot be
    read, is not a regular file, is empty or is larger than :data:`~moeplan.files.MAX_INPUT_BYTES`."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise LoadError(f"{where}: is not a regular file; moeplan reads only regular files")
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as e:
        raise LoadError(f"{where}: cannot read ({e.strerror or e})") from None
    if st.st_size == 0:
        raise LoadError(f"{where}: is empty; an expert-load trace holds counts")
    if st.st_size > MAX_INPUT_BYTES:
        raise LoadError(f"{where}: larger than {MAX_INPUT_BYTES // 2**20} MiB (docs/inputs.md)")
    if head == b"\x93NUMPY":
        return "npy"
    return "torch" if head.startswith((b"PK\x03\x04", b"\x80")) else "json"


def _load(path: str | Path, kind: str, where: str, field: str) -> object:
    """The object in ``path``: JSON, a ``.npy`` array (``allow_pickle=False``) or what ``torch.save`` wrote, loaded
    with ``weights_only=True`` (tensors and plain values only; nothing else is unpickled)."""
    if kind == "json":
        return read_json(path, field=field, error=LoadError)
    if kind == "npy":
        try:
            return np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise LoadError(f"{where}: not a .npy array of numbers moeplan reads ({str(e).splitlines()[0]})") from None
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise LoadError(f"{where}: holds objects other than tensors and plain values; moeplan loads torch files "
                        f"with weights_only=True and never unpickles arbitrary objects") from None
    except Exception as e:  # a damaged archive raises RuntimeError, EOFError, zipfile errors, ...
        raise LoadError(f"{where}: not a file torch.load reads ({type(e).__name__})") from None


def _detect(obj: object) -> str:
    """Which of :data:`READERS` ``obj`` is written in, by its content."""
    if isinstance(obj, dict):
        if "format" in obj:
            return "moeplan"
        if "logical_count" in obj or "records" in obj:
            return "sglang"
        if set(obj) == {"weight"}:
            return "eplb"
        if obj and all(isinstance(k, str) and k.isdecimal() for k in obj):
            return "bincounts"
    if isinstance(obj, (list, np.ndarray)) or _is_tensor(obj):
        return "eplb"
    raise LoadError("not an expert-load trace moeplan reads: moeplan.expert-load/1 JSON, a layer -> counts JSON "
                    "object, an EPLB weight [layers, experts] (JSON, .npy, .pt) or an SGLang expert-distribution "
                    "dump (.pt)")


def read_trace(path: str | Path, *, field: str = "expert-load", format: str | None = None,
               spec: ModelSpec | None = None, first_moe_layer: int | None = None) -> LoadTrace:
    """The load trace in ``path``, in any format of :data:`READERS`, detected from the content (``format=`` forces
    one). With ``spec`` the layers are mapped onto the model's MoE layers where the file numbers them by ordinal,
    and the trace is checked with :func:`check_against`. Raises LoadError with one line, ``{field}='{path}': ...``,
    naming the field, the value and the rule (unreadable or empty file, wrong expert count for the model, negative
    or non-integer counts, layers the model does not have, ragged rows).

    The formats:

    * ``moeplan``: moeplan's own JSON (module docstring).
    * ``bincounts``: a JSON object ``{"0": [c_0, ..., c_{E-1}], "1": [...], ...}``, one list of per-expert counts
      per MoE layer, as huawei-csl/wse-workload-generator's ``data/workload/bincounts.json`` (DeepSeek-V3, 58 MoE
      layers × 256 experts, measured in inference; benchmarks/data/README.md). Counts may be floats holding whole
      numbers. The keys are MoE-layer ordinals, not decoder-layer indices: ordinal ``i`` is the ``i``-th entry of
      :func:`moe_layers` with ``spec``, ``first_moe_layer + i`` with ``first_moe_layer``, else ``i`` (a note in
      ``notes`` says so). One snapshot: a trace of one step.
    * ``eplb``: DeepSeek EPLB's input ``weight [layers, experts]`` (github.com/deepseek-ai/EPLB, ``eplb.py``,
      ``rebalance_experts``: "the load statistics for all logical experts", one row per MoE layer), as a JSON 2-D
      list, a JSON object ``{"weight": [[...]]}``, a ``.npy`` file (``np.load(allow_pickle=False)``) or a tensor
      saved by ``torch.save`` (``torch.load(weights_only=True)``). Rows are MoE-layer ordinals, mapped as for
      ``bincounts``; one step.
    * ``sglang``: the file SGLang's expert-distribution recorder writes in ``stat`` mode, rank 0's
      ``expert_distribution_recorder_{time}.pt`` under ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR`` (sgl-project/sglang
      ``python/sglang/srt/eplb/expert_distribution.py`` @02295fe5, ``_StatAccumulator.dump`` via
      ``ExpertDistributionRecorder.dump_record``): ``torch.save`` of ``{"rank": 0, "logical_count": int32 tensor
      [buffer slots, num_layers, num_logical_experts], "average_utilization_rate_over_window": float | None}``,
      counts all-reduced over the ranks, one slot per forward pass. Its ``num_layers`` is the model's
      ``num_hidden_layers`` (``get_model_config_for_expert_location``), so rows are decoder-layer indices and dense
      layers' rows are zero: with ``spec`` the model's decoder MoE layers are kept (a dense row with tokens is
      refused), without it the rows with any token. Slots never filled (all zero) are dropped; ``steps`` are the
      slot numbers, which follow time only while the circular buffer has not wrapped. The ``per_pass`` and
      ``per_token`` modes (``_DetailAccumulator.dump``: ``records`` per forward pass of one rank, physical experts)
      are refused: each file holds one rank's share only.

    vLLM writes no expert-load file: ``EplbState`` (vllm-project/vllm ``vllm/distributed/eplb/eplb_state.py``)
    keeps ``expert_load_pass`` and the sliding ``expert_load_window [window, num_moe_layers, physical experts]`` in
    device memory and only logs ``avg_tokens``, ``max_tokens`` and ``balancedness`` (``EplbState.step``); the
    offline-EPLB pull requests that would save the window (vllm-project/vllm #26176, closed, and #41141, open, when
    this was written) settle no format. A ``weight``-shaped array of logical counts from it reads as ``eplb``.
    """
    where = f"{field}={str(path)!r}"
    if format is not None and format not in READERS:
        raise LoadError(f"format={format!r}: one of {', '.join(READERS)}")
    if first_moe_layer is not None:
        if isinstance(first_moe_layer, bool) or not isinstance(first_moe_layer, int) or first_moe_layer < 0:
            raise LoadError(f"first_moe_layer={first_moe_layer!r}: must be an integer ≥ 0 (a decoder-layer index)")
        if spec is not None:
            raise LoadError(f"first_moe_layer={first_moe_layer}: give spec or first_moe_layer, not both (spec says "
                            f"where the MoE layers are)")
    kind = _sniff(path, where)
    obj = _load(path, kind, where, field)
    try:
        fmt = format or _detect(obj)
        if first_moe_layer is not None and fmt not in ("bincounts", "eplb"):
            raise LoadError(f"first_moe_layer={first_moe_layer}: only for files that number MoE layers by ordinal "
                            f"(bincounts, eplb); this is {fmt}")
        if fmt == "moeplan":
            trace = _from_moeplan(obj)
        elif fmt == "sglang":
            trace = _from_sglang(obj, spec, str(path))
        else:
            trace = _from_ordinals(obj, fmt, spec, first_moe_layer, str(path))
        if spec is not None:
            check_against(trace, spec)
    except LoadError as e:
        raise LoadError(f"{where}: {e}") from None
    return trace


def _from_moeplan(doc: object) -> LoadTrace:
    if not isinstance(doc, dict):
        raise LoadError(f"document: moeplan's format is a JSON object, got {type(doc).__name__}")

    def need(key: str, kind: type | tuple[type, ...]) -> object:
        if key not in doc:
            raise LoadError(f"{key}: required, missing")
        v = doc[key]
        if not isinstance(v, kind) or isinstance(v, bool):
            raise LoadError(f"{key}={v!r:.60}: wrong type")
        return v

    if doc.get("format") != FORMAT:
        raise LoadError(f"format={doc.get('format')!r:.60}: moeplan reads {FORMAT}")
    experts = need("num_experts", int)
    if experts < 1:
        raise LoadError(f"num_experts={experts}: must be ≥ 1")
    layers, steps = need("layers", list), need("steps", list)
    for name, seq in (("layers", layers), ("steps", steps)):
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in seq):
            raise LoadError(f"{name}={seq!r:.60}: must be integers ≥ 0")
    ep, placement = doc.get("ep"), doc.get("placement")
    if ep is not None and (not isinstance(ep, int) or isinstance(ep, bool) or ep < 1):
        raise LoadError(f"ep={ep!r:.60}: an integer ≥ 1 or null")
    if placement is not None:
        ok = isinstance(placement, list) and all(isinstance(s, list) for s in placement)
        flat = [e for s in placement for e in s] if ok else []
        if not ok or not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < experts for e in flat):
            raise LoadError(f"placement={placement!r:.60}: a list per rank of expert numbers 0..{experts - 1}")
    raw = need("counts", list)
    counts = (np.zeros((0, len(layers), experts), np.int64) if raw == [] and not steps
              else _counts(raw, _indexed("counts"), "steps, layers, experts"))
    return LoadTrace(model=str(doc.get("model", "")), num_experts=experts, layers=tuple(layers), steps=tuple(steps),
                     counts=counts, source=str(doc.get("source", "")), ep=ep,
                     placement=None if placement is None else tuple(tuple(s) for s in placement))


def _from_ordinals(obj: object, fmt: str, spec: ModelSpec | None, first: int | None, path: str) -> LoadTrace:
    """A ``bincounts`` object or an EPLB ``weight``: one row of counts per MoE-layer ordinal, one step."""
    if fmt == "bincounts":
        if not isinstance(obj, dict) or not obj:
            raise LoadError("document: a layer -> counts JSON object with at least one layer, e.g. {\"0\": [...]}")
        bad = next((k for k in obj if not (isinstance(k, str) and k.isdecimal())), None)
        if bad is not None:
            raise LoadError(f'["{bad}"]: keys must be MoE-layer ordinals "0", "1", ...')
        keys = sorted(obj, key=int)
        twice = next((a for a, b in zip(keys, keys[1:]) if int(a) == int(b)), None)
        if twice is not None:
            raise LoadError(f'["{twice}"]: MoE-layer ordinal {int(twice)} given twice')
        ordinals = [int(k) for k in keys]

        def name(idx: tuple[int, ...]) -> str:
            return f'["{keys[idx[0]]}"]' + "".join(f"[{j}]" for j in idx[1:]) if idx else "document"

        counts = _counts([obj[k] for k in keys], name, "layers, experts")
        source = f"layer -> counts {path}"
    else:
        weight = obj["weight"] if isinstance(obj, dict) and set(obj) == {"weight"} else obj
        if isinstance(weight, dict):
            raise LoadError(f"document: keys {_short(list(weight))}: an EPLB weight is [layers, experts] or "
                            f"{{\"weight\": [layers, experts]}}")
        counts = _counts(weight, _indexed("weight"), "layers, experts")
        ordinals = list(range(counts.shape[0]))
        source = f"EPLB weight {path}"
    notes: tuple[str, ...] = ()
    if spec is not None:
        moe = moe_layers(spec)
        if ordinals[-1] >= len(moe):
            raise LoadError(f"layers: MoE-layer ordinal {ordinals[-1]} but {spec.name} has {len(moe)} MoE layers "
                            f"({_layers_text(spec)})")
        layers = tuple(moe[o] for o in ordinals)
    else:
        layers = tuple((first or 0) + o for o in ordinals)
        if first is None:
            notes = ("layers are the file's MoE-layer ordinals, not decoder-layer indices: give spec or "
                     "first_moe_layer to map them",)
    return LoadTrace(model=spec.name if spec else "", num_experts=counts.shape[1], layers=layers, steps=(0,),
                     counts=counts[None], source=source, notes=notes)


def _from_sglang(obj: object, spec: ModelSpec | None, path: str) -> LoadTrace:
    """SGLang's ``stat``-mode dump (:func:`read_trace`)."""
    if isinstance(obj, dict) and "records" in obj:
        raise LoadError("records: an SGLang per_pass/per_token dump holds one rank's physical-expert counts; record "
                        "with --expert-distribution-recorder-mode stat for the counts of all ranks")
    if not isinstance(obj, dict) or "logical_count" not in obj:
        raise LoadError("logical_count: required, missing (SGLang's stat-mode dump holds it)")
    counts = _counts(obj["logical_count"], _indexed("logical_count"), "slots, layers, experts")
    slots = np.flatnonzero(counts.sum(axis=(1, 2)))
    if not slots.size:
        raise LoadError("logical_count: every slot is zero; nothing was recorded between start and dump")
    counts = counts[slots]
    if spec is not None:
        if counts.shape[1] != spec.num_layers:
            raise LoadError(f"logical_count: {counts.shape[1]} layers, {spec.name} has {spec.num_layers} decoder "
                            f"layers")
        dense = np.flatnonzero(counts[:, :spec.num_dense_layers].sum(axis=(0, 2)))
        if dense.size:
            raise LoadError(f"logical_count[:, {dense[0]}]: dense layer {dense[0]} of {spec.name} has routed "
                            f"tokens; its row must be 0")
        layers = np.arange(spec.num_dense_layers, spec.num_layers)
        notes = ()
    else:
        layers = np.flatnonzero(counts.sum(axis=(0, 2)))
        notes = ("layers without any token (the dense ones) were dropped: give spec to keep exactly the MoE layers",)
    return LoadTrace(model=spec.name if spec else "", num_experts=counts.shape[2],
                     layers=tuple(int(x) for x in layers), steps=tuple(int(s) for s in slots),
                     counts=counts[:, layers], source=f"SGLang expert distribution {path}",
                     notes=("steps are SGLang's buffer slots: time order only until the circular buffer wraps",
                            *notes))


# ---- metrics -------------------------------------------------------------------------------------------------------
def _shares(shards: Sequence, experts: int, name: str) -> np.ndarray:
    """``share[e, r]``: the fraction of expert ``e``'s tokens that rank ``r`` computes, for one layer's shards."""
    share = np.zeros((experts, len(shards)))
    for r, held in enumerate(shards):
        if not isinstance(held, (Sequence, np.ndarray)):
            raise LoadError(f"{name}[{r}]={held!r:.20}: must be a list of the experts rank {r} holds")
        for e in held:
            if isinstance(e, bool) or not isinstance(e, (int, np.integer)) or not 0 <= e < experts:
                raise LoadError(f"{name}[{r}]: expert {e!r:.20} must be an integer in 0..{experts - 1}")
            share[e, r] += 1
    held_by = share.sum(axis=1)
    if not held_by.all():
        raise LoadError(f"{name}: expert {int(np.flatnonzero(held_by == 0)[0])} is held by no rank; its tokens "
                        f"would be lost")
    return share / held_by[:, None]


def rank_tokens(counts: np.ndarray, shards: Sequence) -> np.ndarray:
    """Tokens each EP rank computes: ``tokens[..., layer, r] = Σ_e counts[..., layer, e] · n(e, r) / n(e)``, where
    ``n(e, r)`` is how many copies of (logical) expert ``e`` rank ``r`` holds and ``n(e)`` the copies over all
    ranks: a replicated expert's tokens are split evenly among its replicas, as vLLM's EPLB dispatch does in
    expectation (its FusedMoE layer picks the replica of each (token, expert) by flattened position modulo the
    replica count, earlier at random).

    ``counts``: ``[..., layers, experts]`` tokens (any leading dimensions, e.g. steps). ``shards``: ``shards[r]`` =
    the experts physical rank ``r`` holds, the same for every layer (:attr:`LoadTrace.placement`), or a list per
    layer of such lists (``shards[layer][r]``). Returns float64 ``[..., layers, ranks]``, tokens. Raises LoadError
    for counts with fewer than 2 dimensions, an expert number out of range, an expert no rank holds, per-layer
    shards whose layer or rank count does not match."""
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim < 2:
        raise LoadError(f"counts: must be [..., layers, experts], got {c.ndim} dimension(s)")
    layers, experts = c.shape[-2:]
    if not len(shards):
        raise LoadError("shards: no ranks")
    items = [x for rank in shards if isinstance(rank, (Sequence, np.ndarray)) for x in rank]
    if not items:
        raise LoadError("shards: no rank holds an expert")
    if all(isinstance(x, (int, np.integer)) for x in items):
        return c @ _shares(shards, experts, "shards")
    if len(shards) != layers:
        raise LoadError(f"shards: {len(shards)} layers of shards, counts have {layers} layers")
    share = [_shares(s, experts, f"shards[{i}]") for i, s in enumerate(shards)]
    ranks = {s.shape[1] for s in share}
    if len(ranks) > 1:
        raise LoadError(f"shards: layers have {sorted(ranks)} ranks; every layer needs the same EP ranks")
    return np.einsum("...le,ler->...lr", c, np.stack(share))


def _per_rank(tokens_per_rank: np.ndarray) -> np.ndarray:
    a = np.asarray(tokens_per_rank, dtype=np.float64)
    if a.ndim < 1 or a.shape[-1] == 0:
        raise LoadError(f"tokens_per_rank: shape {list(a.shape)} must be [..., ranks] with at least one rank")
    if not np.isfinite(a).all() or (a < 0).any():
        raise LoadError("tokens_per_rank: must be finite and ≥ 0")
    return a


def imbalance(tokens_per_rank: np.ndarray) -> np.ndarray:
    """Device-level imbalance ``max_r T_r / mean_r T_r − 1`` over the last axis (ranks): 0 when every rank gets the
    same tokens, 1 when the busiest rank gets twice the mean; 0 for a layer without tokens. The measure of device
    imbalance in the Pangu Ultra MoE report (arXiv 2505.04519; docs/references.md §1.1 lists its claims; the
    report's own formula was not checked here). ``tokens_per_rank``: ``[..., ranks]`` (:func:`rank_tokens`);
    returns float64 ``[...]``. Raises LoadError for no ranks or negative or non-finite tokens."""
    a = _per_rank(tokens_per_rank)
    mean = a.mean(axis=-1)
    return np.where(mean > 0, a.max(axis=-1) / np.where(mean > 0, mean, 1.0) - 1.0, 0.0)


def balancedness(tokens_per_rank: np.ndarray) -> np.ndarray:
    """``mean_r T_r / max_r T_r`` over the last axis (ranks), in (0, 1]: 1 when balanced; 1 for a layer without
    tokens. vLLM's EPLB metric: ``EplbState.step`` (vllm-project/vllm ``vllm/distributed/eplb/eplb_state.py``)
    logs ``balancedness = avg_tokens / max_tokens`` with the mean and max over EP ranks each summed over the MoE
    layers first (0.0 when no tokens); this is its per-layer form, equal to ``1 / (1 + imbalance)``. SGLang logs
    the same ratio per layer, smoothed, as ``(mean + 1e-5) / (max + 1e-5)`` (``compute_utilization_rate``,
    ``python/sglang/srt/eplb/expert_distribution.py``, "[Expert Balancedness]"). ``tokens_per_rank``:
    ``[..., ranks]``; returns float64 ``[...]``. Raises LoadError as :func:`imbalance`."""
    a = _per_rank(tokens_per_rank)
    top = a.max(axis=-1)
    return np.where(top > 0, a.mean(axis=-1) / np.where(top > 0, top, 1.0), 1.0)


def cv(tokens_per_rank: np.ndarray) -> np.ndarray:
    """Coefficient of variation ``std_r T_r / mean_r T_r`` over the last axis (ranks), with the population standard
    deviation (divide by the rank count): 0 when balanced; 0 for a layer without tokens. MindSpeed is said to
    report it; no MindSpeed definition was found (its ``print_expert_load``, ``mindspeed/core/transformer/moe/
    expert_placement/planner.py``, logs per-device min, max and ``torch.std``, the sample deviation, without
    dividing by the mean). ``tokens_per_rank``: ``[..., ranks]``; returns float64 ``[...]``. Raises LoadError as
    :func:`imbalance`."""
    a = _per_rank(tokens_per_rank)
    mean = a.mean(axis=-1)
    return np.where(mean > 0, a.std(axis=-1) / np.where(mean > 0, mean, 1.0), 0.0)


# ---- prediction ----------------------------------------------------------------------------------------------------
def predict(trace: LoadTrace, at: int, window: int, method: str = "mean", alpha: float | None = None) -> np.ndarray:
    """The expert load predicted for the step at position ``at`` of ``trace`` from the ``window`` steps before it,
    positions ``[at − window, at)`` (positions index ``trace.steps``, 0-based; ``at == len(trace.steps)`` predicts
    the step after the trace). Returns float64 ``[layers, experts]``, tokens per step.

    * ``mean``: the sliding mean ``(1/w) Σ_{i=at−w}^{at−1} x_i``.
    * ``ema``: the exponential moving average over the window, seeded with its oldest step: ``p = x_{at−w}``, then
      ``p ← α x_i + (1 − α) p`` for ``i = at−w+1 .. at−1``. ``alpha`` defaults to ``2 / (window + 1)``, whose mean
      age, ``(1 − α)/α``, equals the window mean's, ``(w − 1)/2``. EPLB's README names a moving average of past
      loads as the common predictor; MindSpeed's ``predict_expert_load`` (``mindspeed/core/transformer/moe/
      expert_placement/planner.py``) keeps an EMA with ``α = 0.1`` over the whole run.

    An honest evaluation predicts from ``[t − w, t)`` and scores on steps ``t, t + 1, ...`` only: a step inside the
    window must never be scored, or the prediction sees its own answer. Raises LoadError for ``window < 1``, a
    window that starts before the trace's first step or ends after its last, an unknown method, ``alpha`` outside
    (0, 1] or given for ``mean``."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise LoadError(f"window={window!r}: must be an integer ≥ 1 (steps)")
    n = len(trace.steps)
    if isinstance(at, bool) or not isinstance(at, int) or not window <= at <= n:
        raise LoadError(f"at={at!r}: the window [at − {window}, at) must lie in the trace's {n} steps, so at must be "
                        f"in {window}..{n}")
    x = trace.counts[at - window:at].astype(np.float64)
    if method == "mean":
        if alpha is not None:
            raise LoadError(f"alpha={alpha!r}: only for method='ema'")
        return x.mean(axis=0)
    if method != "ema":
        raise LoadError(f"method={method!r}: 'mean' or 'ema'")
    a = 2.0 / (window + 1) if alpha is None else alpha
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a <= 1:
        raise LoadError(f"alpha={alpha!r}: must be in (0, 1]")
    p = x[0]
    for step in x[1:]:
        p = a * step + (1 - a) * p
    return p
