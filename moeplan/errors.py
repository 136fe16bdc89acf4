"""Error types of moeplan (docs/architecture.md §8.7).

User input errors are ``ValueError`` subclasses; the CLI maps them to exit code 2. A plan that cannot fit raises
``InfeasibleError`` (exit code 3). Every message names the field, the given value and the rule.
"""
from __future__ import annotations


class MoeplanError(Exception):
    """Base of every error moeplan raises on purpose."""


class SpecError(MoeplanError, ValueError):
    """A model spec, config file or registry name is invalid; ``reason``: the rule broken, without this spec's
    figures (``moeplan explore`` counts rejected architectures by it), when a spec rule raised it, else None."""

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class TargetError(MoeplanError, ValueError):
    """A target description is invalid or unknown."""


class LayoutError(MoeplanError, ValueError):
    """A parallel layout does not fit the model or the device count; ``rejection`` is the typed reason
    (:class:`moeplan.layout.Rejection`) when a layout rule raised it, else None."""

    def __init__(self, message: str, *, rejection: object = None) -> None:
        super().__init__(message)
        self.rejection = rejection


class PlanError(MoeplanError, ValueError):
    """A saved plan is malformed, of another schema version, or internally inconsistent."""


class OutputError(MoeplanError, ValueError):
    """An output file cannot be written: its folder does not exist, it is a folder, or the file system refuses."""


class InfeasibleError(MoeplanError):
    """No plan fits: the message names the per-device memory that would be needed; ``needs_bytes`` carries it as a
    number when one is known."""

    def __init__(self, message: str, *, needs_bytes: float | None = None) -> None:
        super().__init__(message)
        self.needs_bytes = needs_bytes


class SubfieldError(ValueError):
    """Raised by a pydantic validator of a mapping for a rule on one of its keys: :func:`validation_message` names
    ``field`` under the mapping and shows ``value``, not the whole mapping."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        super().__init__(rule)
        self.field, self.value, self.rule = field, value, rule


def validation_message(error: dict, *, where: str) -> str:
    """One line for the first error of a pydantic ``ValidationError`` (``e.errors()[0]``): the field's dotted path,
    the value given (a repr of at most 60 characters, however large or nested the value) and the rule, then
    ``({where})``, e.g. ``in model.yaml``. A bound's message points to docs/inputs.md, which gives its reason."""
    import reprlib

    field = ".".join(str(p) for p in error["loc"]) or "document"
    field = field if field.isprintable() else repr(field)
    if error["type"] == "missing":
        return f"{field}: required, missing ({where})"
    given, rule = error.get("input"), error["msg"].removeprefix("Value error, ")
    if isinstance(sub := error.get("ctx", {}).get("error"), SubfieldError):
        field, given, rule = f"{field}.{sub.field}", sub.value, sub.rule
    short = reprlib.Repr()  # bounded: a huge or deeply nested value is cut, never walked whole
    short.maxlevel, short.maxstring, short.maxother, short.maxlist, short.maxdict = 2, 40, 40, 4, 4
    value = short.repr(given)
    value = value if len(value) <= 60 else value[:57] + "..."
    if error["type"] in ("less_than_equal", "less_than", "too_long"):
        where += "; docs/inputs.md gives the reason for the bound"
    return f"{field}={value}: {rule} ({where})"


class LoadError(MoeplanError, ValueError):
    """An expert-load trace is malformed or does not match the model (wrong expert count, negative counts, layers
    the model does not have); one line naming the field, the value and the rule (exit code 2)."""
