"""Training data for the runtime (docs/architecture.md §7): one deterministic token stream, the same for every layout.

Default source: byte-level tokens (vocabulary 256) of the Python standard library's ``.py`` sources on this machine
(``sysconfig.get_paths()["stdlib"]``, without ``site-packages``/``dist-packages``), files in sorted relative-path
order; unreadable files are skipped. The split is by file: every ``VAL_EVERY``-th file (by sorted index) is the
validation split, the rest the training split; each file's bytes are followed by one ``\\n``. ``--data FILE`` takes
a text file (its UTF-8 bytes, vocabulary 256), a ``.npy`` (numpy) or a ``.pt`` (torch) 1-D integer token array.

Batches: step ``s`` uses the global batch of sequences ``s·G .. s·G + G − 1`` (G = ``global_batch``), sequence
``i`` being tokens ``[i·(L+1), (i+1)·(L+1))`` of the stream (L = ``seq_len``; the stream wraps around). Each
sequence gives ``tokens = seq[:L]`` and ``labels = seq[1:]``. DP rank ``d`` takes sequences
``d·G/dp .. (d+1)·G/dp − 1`` of the global batch and cuts them into micro-batches of ``micro_batch`` sequences in
order (Megatron-LM's split), so the union over DP ranks and micro-batches is exactly the global batch.
"""
from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from moeplan.errors import PlanError

VAL_EVERY = 20
BYTE_VOCAB = 256
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: ``tokens`` and ``labels`` ``[micro_batch, seq_len]`` int64 (labels = tokens shifted by 1)."""

    tokens: torch.Tensor
    labels: torch.Tensor


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files under ``root`` (default: sysconfig's stdlib path), sorted by relative path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_tokens(split: Literal["train", "val"] = "train", root: Path | None = None) -> torch.Tensor:
    """Byte tokens (uint8, 1-D) of the ``split`` of the stdlib sources; see the module docstring for order/split."""
    chunks = []
    for i, path in enumerate(stdlib_files(root)):
        if (i % VAL_EVERY == VAL_EVERY - 1) != (split == "val"):
            continue
        try:
            chunks.append(path.read_bytes() + b"\n")
        except OSError:
            continue
    if not chunks:
        raise PlanError(f"data=stdlib: no readable .py files under {root or sysconfig.get_paths()['stdlib']}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def file_tokens(path: str | Path) -> torch.Tensor:
    """Tokens of a user's file: ``.npy``/``.pt`` 1-D integer arrays as given, anything else as UTF-8 bytes.

    Raises PlanError (one line) for an unreadable file, a non-1-D or non-integer array, or negative tokens.
    """
    path = Path(path)
    try:
        if path.suffix == ".npy":
            tokens = torch.from_numpy(np.load(path, allow_pickle=False))
        elif path.suffix == ".pt":
            tokens = torch.load(path, map_location="cpu", weights_only=True)
        else:
            tokens = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    except (OSError, ValueError, RuntimeError) as e:
        raise PlanError(f"data={str(path)!r}: cannot read a token file ({str(e).splitlines()[0]})") from None
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point() or not len(tokens):
        raise PlanError(f"data={str(path)!r}: must hold a non-empty 1-D integer token array")
    if int(tokens.min()) < 0:
        raise PlanError(f"data={str(path)!r}: tokens must be >= 0, found {int(tokens.min())}")
    return tokens


def load_tokens(data: str | Path | None) -> torch.Tensor:
    """The training token stream: ``data`` (a file, see :func:`file_tokens`) or the stdlib train split if None."""
    return stdlib_tokens("train") if data is None else file_tokens(data)


def check_tokens(tokens: torch.Tensor, *, vocab_size: int, seq_len: int) -> None:
    """Raise PlanError unless every token is below ``vocab_size`` and the stream holds one sequence of L+1."""
    top = int(tokens.max())
    if top >= vocab_size:
        raise PlanError(f"data: token {top} is out of the model's vocabulary (vocab_size={vocab_size})")
    if len(tokens) < seq_len + 1:
        raise PlanError(f"data: {len(tokens)} tokens is fewer than one sequence of seq_len+1={seq_len + 1}")


def global_batch(tokens: torch.Tensor, *, step: int, global_batch: int, seq_len: int) -> torch.Tensor:
    """Sequences of step ``step`` (0-based): ``[global_batch, seq_len + 1]`` int64, wrapping around the stream."""
    width = seq_len + 1
    num_seqs = len(tokens) // width
    first = step * global_batch
    index = (torch.arange(first, first + global_batch) % num_seqs)[:, None] * width + torch.arange(width)
    return tokens[index].long()


def rank_microbatches(batch: torch.Tensor, *, dp_rank: int, dp: int, micro_batch: int) -> list[MicroBatch]:
    """This DP rank's micro-batches of a global batch ``[G, L+1]``: contiguous ``G/dp`` rows cut every
    ``micro_batch`` rows. Raises PlanError unless ``dp·micro_batch`` divides G."""
    rows = batch.shape[0]
    if rows % (dp * micro_batch):
        raise PlanError(f"global_batch={rows}: must be divisible by dp·micro_batch = {dp * micro_batch}")
    per_rank = rows // dp
    mine = batch[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [MicroBatch(tokens=mb[:, :-1].contiguous(), labels=mb[:, 1:].contiguous())
            for mb in mine.split(micro_batch)]
