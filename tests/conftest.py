"""Shared fixtures: the tiny registry model, a factory for variants of it, and the README main job's plan."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from moeplan.plan import Plan, load_plan
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


GOLDEN_718B = (Path(__file__).parent / "golden" / "__snapshots__" / "test_golden"
               / "test_compile[pangu-ultra-718b-default][plan].yaml")


@pytest.fixture(scope="session")
def plan_718b(tmp_path_factory) -> Plan:
    """The plan of the README's main job (`moeplan compile pangu-ultra-moe-718b --target ascend-910b --devices
    6144`: pp 16, vpp 4, five comm classes), read from its golden file (tests/golden) with the masked wall-clock
    seconds set to 0, so that no test compiles it again."""
    path = tmp_path_factory.mktemp("golden") / "718b.yaml"
    path.write_text(GOLDEN_718B.read_text().replace("<seconds>", "0.0"))
    return load_plan(path)
