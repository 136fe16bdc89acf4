"""Fixtures shared by the runtime's numerics tests: the token file and the single-process reference losses, made once
per session (six modules compare against the same 20 steps)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moeplan.runtime.data import stdlib_tokens

from test_executor import STEPS, TOKENS, reference_losses  # noqa: E402


@pytest.fixture(scope="session")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, stdlib_tokens("train")[:TOKENS].numpy())
    return str(path)


@pytest.fixture(scope="session")
def reference(data_file) -> list[float]:
    return reference_losses(torch.from_numpy(np.load(data_file)), steps=STEPS)
