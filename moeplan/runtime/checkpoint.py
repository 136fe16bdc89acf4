"""Checkpoints with ``torch.distributed.checkpoint`` (docs/architecture.md §7): complete or absent, never half-written.

Layout on disk: ``{dir}/step-{NNNNNNNN}/`` holds one DCP checkpoint (``.metadata`` plus one file per rank) and
its manifest ``moeplan.json``: the step, the model's fingerprint (``plan.model.fingerprint``), the layout that wrote
it and the sha256 of every other file. Every rank writes into ``{dir}/.step-{NNNNNNNN}.tmp/``; after ``dcp.save``
returns on every rank (the coordinator has written ``.metadata``) and a barrier, rank 0 hashes the files, writes the
manifest last and renames the folder (an atomic ``rename`` on one filesystem), so a crash at any point leaves either
the complete folder or no folder of that step. :func:`newest_checkpoint` ignores temporary folders.

Files are data: :func:`verify_checkpoint` checks the manifest (model, layout, step, the set of files and each
hash) before torch reads anything, so a corrupt, truncated, swapped or foreign file is refused in one line. DCP keeps
``.metadata`` as a pickle; it is read with an unpickler that builds only the classes DCP metadata holds
(:data:`METADATA_GLOBALS`, torch dtypes), so a planted pickle runs nothing even with a manifest forged to match.

State keys are prefixed with the global rank (``rank3/model/1/layers.4.mlp.experts.w1``), so nothing is treated as
replicated across ranks and every rank restores exactly its own tensors; resuming therefore needs the same layout,
which :func:`load_checkpoint` checks.

Expert placement (moeplan.runtime.rebalance): which logical expert each local slot of the stacked expert tensors
holds can change during a run (``--rebalance-every``), and is the same on every rank that knows it, so the manifest
records it once for every MoE layer, ``experts.placement`` (layer name -> expert-group rank -> logical experts by
slot), with the load counted since the last rebalance, ``experts.window`` (layer name -> routed token copies per
expert, summed over ranks). :func:`verify_checkpoint` checks it against the placement a fresh run starts with (same
ranks, slot counts and experts); a manifest without it (written before placements could change) means that one.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from moeplan.errors import PlanError
from moeplan.plan import PlanLayout

_STEP_DIR = re.compile(r"^step-(\d{8})$")
INFO_FILE = "moeplan.json"
_METADATA = ".metadata"
#: the globals DCP's ``.metadata`` pickle refers to (torch 2.13, found by loading real checkpoints), besides the
#: torch dtypes; anything else is refused unbuilt
METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")})


@dataclass(frozen=True)
class CheckpointRef:
    """A complete checkpoint: the step it was taken after (1-based count of finished steps) and its folder."""

    step: int
    path: Path


def rank_state(rank: int, modules: Mapping[int, nn.ModuleDict], optim_state: Mapping[str, torch.Tensor],
               step: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of this rank to save or load into (live tensors: loading restores them in place)."""
    state: dict[str, torch.Tensor] = {f"rank{rank}/step": step}
    for stage, layers in modules.items():
        for name, p in layers.named_parameters():
            state[f"rank{rank}/model/{stage}/{name}"] = p.data
    for name, t in optim_state.items():
        state[f"rank{rank}/optim/{name}"] = t
    return state


@contextmanager
def checkpoint_lock(root: str | Path) -> Iterator[None]:
    """Hold ``root`` (a run's ``--checkpoint-dir``, created if missing) for one run: an exclusive ``flock`` on
    ``root/.lock``, which records the holder's pid and is released when the holder exits, however it exits. Two runs
    writing one folder would mix their tensors in each other's checkpoints. Raises PlanError (one line, naming the
    holder's pid) when another run holds it."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise PlanError(f"checkpoint_dir={str(root)!r}: cannot use it ({e.strerror or e})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            raise PlanError(f"checkpoint_dir={str(root)!r}: another moeplan run (pid {holder or '?'}) is using it; "
                            f"give each run its own folder") from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        except OSError as e:  # a full disk: refused before launch, not an internal error
            raise PlanError(f"checkpoint_dir={str(root)!r}: cannot use it ({e.strerror or e})") from None
        yield
    finally:
        os.close(fd)


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def save_checkpoint(state: dict[str, torch.Tensor], *, root: str | Path, step: int, layout: PlanLayout,
                    model: str, experts: Mapping[str, object] | None = None) -> Path:
    """Collective: write ``state`` of every rank as the checkpoint of ``step`` of the model whose fingerprint is
    ``model``; returns its final folder. ``experts``: the manifest's ``experts`` section (rank 0's is written; see
    the module docstring), None for none."""
    root = Path(root)
    tmp, final = root / f".step-{step:08d}.tmp", _step_dir(root, step)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a killed run
    dist.barrier()
    import torch.distributed.checkpoint as dcp  # here, not at the top: 1 s of every rank's start-up (DTensor, sympy)

    try:
        dcp.save(state, checkpoint_id=str(tmp))
    except dcp.api.CheckpointException as e:  # a BaseException: neither torch elastic's report nor ours took it
        need = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
        raise write_error(e, root=root, step=step, need_bytes=need, free_bytes=shutil.disk_usage(root).free) from None
    dist.barrier()
    if dist.get_rank() == 0:
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
        (tmp / INFO_FILE).write_text(json.dumps({"step": step, "model": model, "layout": layout.model_dump(),
                                                 "files": files, **({"experts": experts} if experts else {})}))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    dist.barrier()
    return final


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def newest_checkpoint(root: str | Path) -> CheckpointRef | None:
    """The complete checkpoint with the highest step under ``root``, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = [CheckpointRef(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / _METADATA).is_file() and (p / INFO_FILE).is_file()]
    return max(found, key=lambda c: c.step, default=None)


def verify_checkpoint(ref: CheckpointRef, *, layout: PlanLayout, model: str,
                      placements: Mapping[str, Sequence[Sequence[int]]] | None = None) -> dict | None:
    """Raise PlanError (one line naming the checkpoint and what is wrong) unless ``ref``'s manifest says the model
    of fingerprint ``model`` and ``layout`` wrote it at its step, the folder holds exactly the manifest's files, each
    with its sha256, and ``.metadata`` refers to nothing outside :data:`METADATA_GLOBALS`. Reads files as bytes
    only: nothing is unpickled before it passes. With ``placements`` (every MoE layer's placement at the start of a
    run, moeplan.runtime.rebalance.initial_placements), the manifest's ``experts`` section must fit them
    (:func:`check_experts`). Returns that section, None when there is none."""
    where = f"checkpoint={str(ref.path)!r}"
    try:
        info = json.loads((ref.path / INFO_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PlanError(f"{where}: {INFO_FILE} is not readable JSON ({e}); resume needs a checkpoint moeplan "
                        f"wrote") from None
    if not isinstance(info, dict) or not isinstance(info.get("files"), dict) or "model" not in info:
        raise PlanError(f"{where}: {INFO_FILE} has no model fingerprint and file hashes (written by an older moeplan "
                        f"or by hand); resume needs a checkpoint whose files can be verified")
    if info.get("step") != ref.step:
        raise PlanError(f"{where}: {INFO_FILE} says step {info.get('step')!r}, the folder step {ref.step}")
    if info["model"] != model:
        raise PlanError(f"{where}: written for another model (fingerprint {info['model']} vs {model}); resume "
                        f"needs the same model")
    if info.get("layout") != layout.model_dump():
        theirs = info.get("layout") if isinstance(info.get("layout"), dict) else {}
        changed = sorted(k for k, v in layout.model_dump().items() if theirs.get(k) != v)
        raise PlanError(f"{where}: written by another layout ("
                        + ", ".join(f"{k}={theirs.get(k)} vs {getattr(layout, k)}" for k in changed)
                        + "); resume needs the same layout")
    present = {p.name for p in ref.path.iterdir()} - {INFO_FILE}
    for name in sorted(present ^ set(info["files"])):
        raise PlanError(f"{where}: {name} is {'not in' if name in present else 'missing, though listed in'} "
                        f"{INFO_FILE}; resume needs the checkpoint as it was written")
    for name in sorted(present):
        if not (ref.path / name).is_file() or _sha256(ref.path / name) != info["files"][name]:
            raise PlanError(f"{where}: {name} does not match its sha256 in {INFO_FILE} (corrupt, truncated or "
                            f"replaced); resume needs the checkpoint as it was written")
    read_metadata(ref.path / _METADATA, where=where)
    if placements is not None and "experts" in info:
        check_experts(info["experts"], placements, where=f"{where}: {INFO_FILE} experts")
    return info.get("experts")


def check_experts(experts: object, placements: Mapping[str, Sequence[Sequence[int]]], *, where: str) -> None:
    """Raise PlanError (one line starting with ``where``) unless ``experts`` is a manifest's ``experts`` section
    for a run that started from ``placements``: a ``placement`` for exactly those layers, each with the same number
    of ranks, slots per rank and experts (each once), and an optional ``window`` of non-negative integer counts, one
    per expert, for some of those layers."""
    rule = "resume needs a checkpoint moeplan wrote for this plan"
    if not isinstance(experts, dict) or not isinstance(experts.get("placement"), dict):
        raise PlanError(f"{where}: must hold a placement per MoE layer; {rule}")
    if set(experts["placement"]) != set(placements):
        raise PlanError(f"{where}: placement names layers {sorted(experts['placement'])}, the model has "
                        f"{sorted(placements)}; {rule}")
    for name, start in placements.items():
        got = experts["placement"][name]
        sizes = [len(s) for s in start]
        if not (isinstance(got, list) and all(isinstance(s, list) and all(type(e) is int for e in s) for s in got)
                and [len(s) for s in got] == sizes and sorted(e for s in got for e in s) == sorted(e for s in start
                                                                                             for e in s)):
            raise PlanError(f"{where}: placement[{name!r}]={got!r}: must hold each expert once, {sizes} per expert "
                            f"rank; {rule}")
    window = experts.get("window", {})
    experts_n = sum(len(s) for s in next(iter(placements.values()), ()))
    if not (isinstance(window, dict) and set(window) <= set(placements)
            and all(isinstance(c, list) and len(c) == experts_n and all(type(x) is int and x >= 0 for x in c)
                    for c in window.values())):
        raise PlanError(f"{where}: window must give {experts_n} non-negative token counts per MoE layer; {rule}")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                 torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which checkpoint metadata never holds")


def read_metadata(path: Path, *, where: str) -> object:
    """DCP's ``.metadata`` at ``path``, built by an unpickler limited to :data:`METADATA_GLOBALS` and torch dtypes.
    Raises PlanError (one line, ``where`` first) for anything else or a broken pickle."""
    try:
        with path.open("rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise PlanError(f"{where}: {path.name} {e}; not loaded") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise PlanError(f"{where}: {path.name} is not DCP metadata ({type(e).__name__}: {e}); not loaded") from None


def _verified_reader(path: Path):
    """DCP's file reader for the checkpoint at ``path``, with ``.metadata`` read by :func:`read_metadata` (the tensors
    DCP already reads with ``torch.load(weights_only=True)``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class VerifiedReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(Path(self.path) / _METADATA, where=f"checkpoint={str(self.path)!r}")
            if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return VerifiedReader(str(path))


def load_checkpoint(state: dict[str, torch.Tensor], ref: CheckpointRef, *, layout: PlanLayout, model: str,
                    placements: Mapping[str, Sequence[Sequence[int]]]) -> dict | None:
    """Collective: restore ``state`` in place from ``ref``; returns the manifest's ``experts`` section (the same on
    every rank; None when it has none), which the caller applies. Raises PlanError on every rank, before anything is
    unpickled, unless :func:`verify_checkpoint` with ``placements`` passes on rank 0 (which hashes the files once
    for all ranks)."""
    found: list = [None, None]  # (error, experts section)
    if dist.get_rank() == 0:
        try:
            found[1] = verify_checkpoint(ref, layout=layout, model=model, placements=placements)
        except PlanError as e:
            found[0] = str(e)
    dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        raise PlanError(found[0])
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, storage_reader=_verified_reader(ref.path))
    except dcp.api.CheckpointException as e:
        raise CheckpointError(f"checkpoint {str(ref.path)!r}: cannot be read: {_first_cause(e)}") from None
    return found[1]


class CheckpointError(RuntimeError):
    """A rank could not write or read a checkpoint: the first cause of torch's CheckpointException (a BaseException,
    which torch elastic's error report does not take) in one line, ``OSError: [Errno 28] No space left on device``,
    with the step and the folder."""


def write_error(e: BaseException, *, root: Path, step: int, need_bytes: int, free_bytes: int) -> CheckpointError:
    """The one-line error of a failed checkpoint write: the step, the folder and the cause. When the file system has
    less room than this rank's part (``need_bytes``), the cause is a full disk, whatever torch says: its zip writer
    can fail on a short write with ``unexpected pos 704 vs 598`` instead of the OSError."""
    cause = _first_cause(e)
    if free_bytes < need_bytes:
        cause = (f"No space left on device: the file system has {free_bytes:,} bytes free, this rank's part is "
                 f"{need_bytes:,} bytes ({cause})")
    return CheckpointError(f"checkpoint of step {step} into {str(root)!r}: {cause}")


def _first_cause(e: BaseException) -> str:
    """The cause in a torch ``CheckpointException``, as ``Type: message``: an OSError of the lowest rank that had one
    (it names the errno: a full disk makes other ranks fail inside torch's zip writer, ``unexpected pos``), else the
    lowest rank's exception."""
    failures = getattr(e, "failures", {}) or {}
    if not failures:
        return str(e).strip().splitlines()[-1]
    excs = [failures[r][0] for r in sorted(failures)]
    exc = next((x for x in excs if isinstance(x, OSError)), excs[0])
    return f"{type(exc).__name__}: {exc}"
