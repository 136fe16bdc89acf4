"""The runtime's data: deterministic stdlib byte tokens, token files, and the same global batches for every layout."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moeplan.errors import PlanError
from moeplan.runtime.data import (VAL_EVERY, check_tokens, file_tokens, global_batch, rank_microbatches,
                                  stdlib_files, stdlib_tokens)


@pytest.fixture()
def fake_stdlib(tmp_path):
    root = tmp_path / "lib"
    for rel, text in {"b.py": "bb", "a.py": "a", "pkg/c.py": "ccc", "site-packages/x.py": "x", "d.txt": "d"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_stdlib_files_sorted_without_site_packages(fake_stdlib):
    assert [p.relative_to(fake_stdlib).as_posix() for p in stdlib_files(fake_stdlib)] == ["a.py", "b.py",
                                                                                          "pkg/c.py"]


def test_stdlib_tokens_are_the_files_bytes_in_order(fake_stdlib):
    assert bytes(stdlib_tokens("train", root=fake_stdlib).tolist()) == b"a\nbb\nccc\n"


def test_stdlib_split_is_by_file_index(tmp_path):
    for i in range(2 * VAL_EVERY):
        (tmp_path / f"f{i:03d}.py").write_text(str(i))
    val = bytes(stdlib_tokens("val", root=tmp_path).tolist())
    assert val == f"{VAL_EVERY - 1}\n{2 * VAL_EVERY - 1}\n".encode()
    assert len(stdlib_tokens("train", root=tmp_path)) + len(val) == sum(len(str(i)) + 1 for i in range(2 * VAL_EVERY))


def test_real_stdlib_is_deterministic_and_byte_level():
    a, b = stdlib_tokens("train"), stdlib_tokens("train")
    assert a.dtype == torch.uint8 and len(a) > 1_000_000 and torch.equal(a[:100_000], b[:100_000])


def test_global_batch_wraps_and_shifts():
    tokens = torch.arange(50)
    batch = global_batch(tokens, step=1, global_batch=3, seq_len=4)  # sequences 3, 4, 5 of 10 (5 tokens each)
    assert batch.tolist() == [[15, 16, 17, 18, 19], [20, 21, 22, 23, 24], [25, 26, 27, 28, 29]]
    assert global_batch(tokens, step=3, global_batch=4, seq_len=4)[:, 0].tolist() == [10, 15, 20, 25]  # 12..15 % 10


@pytest.mark.parametrize("dp, micro_batch", [(1, 1), (2, 2), (4, 1), (1, 8)])
def test_microbatches_of_all_dp_ranks_make_the_global_batch(dp, micro_batch):
    batch = global_batch(torch.arange(1000) % 256, step=2, global_batch=8, seq_len=6)
    parts = [mb for d in range(dp) for mb in rank_microbatches(batch, dp_rank=d, dp=dp, micro_batch=micro_batch)]
    assert len(parts) == 8 // micro_batch and all(p.tokens.shape == (micro_batch, 6) for p in parts)
    assert torch.equal(torch.cat([p.tokens for p in parts]), batch[:, :-1])
    assert torch.equal(torch.cat([p.labels for p in parts]), batch[:, 1:])


def test_token_files(tmp_path):
    (tmp_path / "t.txt").write_text("héllo")
    np.save(tmp_path / "t.npy", np.array([1, 2, 300], dtype=np.int32))
    torch.save(torch.tensor([7, 8]), tmp_path / "t.pt")
    assert file_tokens(tmp_path / "t.txt").tolist() == list("héllo".encode())
    assert file_tokens(tmp_path / "t.npy").tolist() == [1, 2, 300]
    assert file_tokens(tmp_path / "t.pt").tolist() == [7, 8]


def test_bad_token_files_are_one_line_plan_errors(tmp_path):
    np.save(tmp_path / "f.npy", np.ones((2, 2), dtype=np.float32))
    with pytest.raises(PlanError, match="1-D integer"):
        file_tokens(tmp_path / "f.npy")
    with pytest.raises(PlanError, match="cannot read"):
        file_tokens(tmp_path / "missing.txt")
    with pytest.raises(PlanError, match="vocab_size=256"):
        check_tokens(torch.tensor([1, 300]), vocab_size=256, seq_len=1)
    with pytest.raises(PlanError, match="fewer than one sequence"):
        check_tokens(torch.tensor([1, 2]), vocab_size=256, seq_len=4)
    with pytest.raises(PlanError, match="divisible by dp·micro_batch"):
        rank_microbatches(torch.zeros(6, 5), dp_rank=0, dp=4, micro_batch=1)
