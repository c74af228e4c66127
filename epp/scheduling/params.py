"""Typed plugin parameters: one frozen dataclass per plugin, ranges declared on its fields.

The same declaration serves the configuration validator (which reports every bad parameter
with its key path and never builds a plugin to find out) and direct construction in code and
tests (a bad value raises ``ValueError``), so a range is written once.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from epp.bounds import Bounds

P = TypeVar("P", bound="Params")


@dataclass(frozen=True, slots=True)
class Range(Bounds):
    """Bounds and allowed values of one parameter (None: unbounded on that side)."""

    choices: tuple[str, ...] | None = None


def param(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A parameter field with its default and allowed range."""
    return dataclasses.field(default=default, metadata={"range": Range(ge, gt, le, lt, choices)})


class Params:
    """Base of every plugin's parameters class; construction validates every field."""

    __slots__ = ()

    def __post_init__(self) -> None:
        problems = check(self)
        if problems:
            name, message = problems[0]
            raise ValueError(f"{name}: {message}")


@dataclass(frozen=True, slots=True)
class NoParams(Params):
    """For plugins that take no parameters."""


def parse_params(cls: type[P], values: Mapping[str, Any]) -> tuple[P | None, list[tuple[str, str]]]:
    """Build ``cls`` from configuration values, or return every problem as (key, message)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    problems: list[tuple[str, str]] = []
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        found = fields.get(key)
        if found is None:
            known = ", ".join(fields)
            message = f"must be one of the plugin's parameters: {known}" if known else ""
            problems.append((str(key), message or "must not be set: the plugin takes none"))
            continue
        converted, message = _convert(hints[key], _range(found), value)
        if message:
            problems.append((key, f"{message}, got {value!r}"))
        else:
            kwargs[key] = converted
    if problems:
        return None, problems
    return cls(**kwargs), []


def check(params: Params) -> list[tuple[str, str]]:
    """Problems with an already built parameters object (direct construction in code)."""
    hints = typing.get_type_hints(type(params))
    problems = []
    for f in dataclasses.fields(params):  # type: ignore[arg-type]
        value = getattr(params, f.name)
        _, message = _convert(hints[f.name], _range(f), value)
        if message:
            problems.append((f.name, f"{message}, got {value!r}"))
    return problems


def _range(f: dataclasses.Field[Any]) -> Range:
    found = f.metadata.get("range")
    return found if isinstance(found, Range) else Range()


def _convert(hint: Any, bounds: Range, value: Any) -> tuple[Any, str]:
    """``(value as the field's type, "")`` or ``(None, "must ...")``."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, members[0]
    if value is None and optional:
        return None, ""
    nullable = " or null" if optional else ""
    if hint is bool:
        ok = isinstance(value, bool)
        return value, "" if ok else f"must be true or false{nullable}"
    if hint is str:
        if isinstance(value, str) and (bounds.choices is None or value in bounds.choices):
            return value, ""
        if bounds.choices is not None:
            return None, "must be one of " + ", ".join(repr(c) for c in bounds.choices)
        return None, f"must be a string{nullable}"
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        ok = numeric and isinstance(value, int) and bounds.contains(value)
        return value, "" if ok else f"must be an integer{bounds.describe()}{nullable}"
    ok = numeric and bounds.contains(float(value))
    return (
        float(value) if ok else None
    ), "" if ok else f"must be a number{bounds.describe()}{nullable}"
