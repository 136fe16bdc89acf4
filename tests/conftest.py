"""Shared fixtures: the tiny registry model and a factory for variants of it."""
from __future__ import annotations

from typing import Callable

import pytest

from moeplan.spec import ModelSpec, load_spec


@pytest.fixture(scope="session")
def tiny() -> ModelSpec:
    return load_spec("tiny-pangu")


@pytest.fixture(scope="session")
def make_spec(tiny: ModelSpec) -> Callable[..., ModelSpec]:
    """``make_spec(**changes)``: tiny-pangu with some fields changed (validated)."""

    def make(**changes: object) -> ModelSpec:
        return ModelSpec.model_validate({**tiny.model_dump(), **changes})

    return make
