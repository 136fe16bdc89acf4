"""Error types of moeplan (docs/architecture.md §8.7).

User input errors are ``ValueError`` subclasses; the CLI maps them to exit code 2. A plan that cannot fit raises
``InfeasibleError`` (exit code 3). Every message names the field, the given value and the rule.
"""
from __future__ import annotations


class MoeplanError(Exception):
    """Base of every error moeplan raises on purpose."""


class SpecError(MoeplanError, ValueError):
    """A model spec, config file or registry name is invalid."""


class TargetError(MoeplanError, ValueError):
    """A target description is invalid or unknown."""


class LayoutError(MoeplanError, ValueError):
    """A parallel layout does not fit the model or the device count."""


class PlanError(MoeplanError, ValueError):
    """A saved plan is malformed, of another schema version, or internally inconsistent."""


class InfeasibleError(MoeplanError):
    """No plan fits: the message names the per-device memory that would be needed; ``needs_bytes`` carries it as a
    number when one is known."""

    def __init__(self, message: str, *, needs_bytes: float | None = None) -> None:
        super().__init__(message)
        self.needs_bytes = needs_bytes


def field_error(cls: type[MoeplanError], field: str, value: object, rule: str) -> MoeplanError:
    """Build an error whose one-line message names the field, the value and the rule."""
    return cls(f"{field}={value!r}: {rule}")
