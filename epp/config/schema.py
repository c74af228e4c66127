"""How a configuration key is declared: once, on its section's dataclass field.

A section is a frozen dataclass; each field is a :func:`knob` carrying the key's default, its
allowed range or choices, what a reload does with it and a one-line doc. The walker
(:mod:`epp.config.walker`) validates a YAML value against these declarations, the reference in
docs/configuration.md is generated from them (:mod:`epp.config.reference`), and the reload
logic reads their policies (:func:`reload_policy`).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from epp.bounds import Bounds

if TYPE_CHECKING:
    from epp.config.walker import Node


class Reload(enum.Enum):
    """What a configuration reload does with a changed key."""

    APPLIED = "reloadable"
    RESTART = "restart-only"


# A reader for a key whose shape the field's type cannot say (``host:port`` lists, entries that
# are a string or a mapping): it reports its own problems on the node and returns the value.
Reader = Callable[["Node"], Any]


@dataclass(frozen=True, slots=True)
class Knob:
    """One key's declaration (see :func:`knob`)."""

    doc: str
    bounds: Bounds = Bounds()
    noun: str = ""
    choices: tuple[str, ...] = ()
    ignore_case: bool = False
    reload: Reload | None = None
    secret: bool = False
    required: bool = False
    read: Reader | None = None
    shape: str = ""
    entries: type[Any] | None = None


def knob(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    noun: str = "",
    choices: tuple[str, ...] = (),
    ignore_case: bool = False,
    reload: Reload | None = None,
    secret: bool = False,
    required: bool = False,
    read: Reader | None = None,
    shape: str = "",
    entries: type[Any] | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A section field: ``default`` (or ``factory``), the range (``noun`` names what a bounded
    number is, "fraction" or "percentage"), the choices of a string (a ``Literal`` type says
    them too), the reload policy (None: the section's), whether the key is a secret (its
    ``_file`` twin is accepted and it is never shown), ``required``, a custom ``read`` for
    shapes a type cannot say, the ``shape`` the reference shows for it and the section class
    its ``entries`` are read as (shown below it)."""
    meta = Knob(
        doc,
        Bounds(ge, gt, le, lt),
        noun,
        choices,
        ignore_case,
        reload,
        secret,
        required,
        read,
        shape,
        entries,
    )
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"knob": meta}, repr=not secret)
    return dataclasses.field(default=default, metadata={"knob": meta}, repr=not secret)


def knob_of(f: dataclasses.Field[Any]) -> Knob:
    found = f.metadata.get("knob")
    if not isinstance(found, Knob):
        raise TypeError(f"field {f.name} is not declared with knob()")
    return found


@dataclass(frozen=True, slots=True)
class SectionInfo:
    """A section class's own declaration: its doc and the reload policy its keys inherit."""

    doc: str
    reload: Reload


def section(doc: str, reload: Reload = Reload.APPLIED) -> Callable[[type[Any]], type[Any]]:
    """Mark a frozen dataclass as a configuration section."""

    def mark(cls: type[Any]) -> type[Any]:
        cls.__epp_section__ = SectionInfo(doc, reload)
        return cls

    return mark


def section_info(cls: Any) -> SectionInfo | None:
    found = getattr(cls, "__epp_section__", None)
    return found if isinstance(found, SectionInfo) else None


def is_section(hint: Any) -> bool:
    return isinstance(hint, type) and section_info(hint) is not None


def fields_of(cls: type[Any]) -> list[tuple[dataclasses.Field[Any], Knob, Any]]:
    """Each field of a section with its declaration and resolved type."""
    hints = typing.get_type_hints(cls)
    return [(f, knob_of(f), hints[f.name]) for f in dataclasses.fields(cls)]


def unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """``(X, True)`` for ``X | None``, else ``(hint, False)``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(members) == 1:
            return members[0], True
    return hint, False


def choices_of(hint: Any, declared: Knob) -> tuple[str, ...]:
    if typing.get_origin(hint) is Literal:
        return tuple(str(a) for a in typing.get_args(hint))
    return declared.choices


def default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def policies(cls: type[Any], inherited: Reload, forced: bool = False) -> dict[str, Reload]:
    """Every key below section ``cls`` (dotted, ``*`` for a mapping's names) and its policy: a
    knob's own ``reload`` holds for it and everything below it, else its section's, else the
    enclosing one's (``inherited``; ``forced``: an enclosing knob's, which overrides)."""
    info = section_info(cls)
    own = inherited if forced or info is None else info.reload
    found: dict[str, Reload] = {}
    for f, declared, hint in fields_of(cls):
        inner = section_class(hint)
        inner_info = section_info(inner) if inner is not None else None
        force = forced or declared.reload is not None
        if declared.reload is not None:
            policy = declared.reload
        elif forced or inner_info is None:
            policy = own
        else:
            policy = inner_info.reload
        found[f.name] = policy
        if inner is not None:
            prefix = f.name + (".*" if typing.get_origin(_plain(hint)) in (Mapping, dict) else "")
            for key, sub in policies(inner, policy, force).items():
                found[f"{prefix}.{key}"] = sub
    return found


def _plain(hint: Any) -> Any:
    return unwrap_optional(hint)[0]


def section_class(hint: Any) -> type[Any] | None:
    """The section class ``hint`` holds: itself, or a mapping's or tuple's values."""
    hint = _plain(hint)
    if is_section(hint):
        return typing.cast(type[Any], hint)
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (Mapping, dict) and len(args) == 2 and is_section(_plain(args[1])):
        return typing.cast(type[Any], _plain(args[1]))
    if origin is tuple and args and is_section(_plain(args[0])):
        return typing.cast(type[Any], _plain(args[0]))
    return None
