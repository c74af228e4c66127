"""The one walk over a YAML tree: every problem collected with its key path, parsing going on
with a default, so one pass reports everything."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from epp.config.schema import (
    Knob,
    choices_of,
    default_of,
    fields_of,
    is_section,
    unwrap_optional,
)
from epp.secrets import SecretError, expand, read_file

T = TypeVar("T")
S = TypeVar("S")


class ConfigError(ValueError):
    """Configuration problems; ``errors`` lists every one, each starting with the file and the
    dotted path of the bad key."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


_NAMES: dict[type, str] = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
}


class Node:
    """A value in the YAML tree that knows its dotted path; problems are collected in
    ``errors`` (shared by the whole tree)."""

    def __init__(self, value: Any, path: str, source: str, errors: list[str]) -> None:
        self.value = value
        self.path = path
        self.source = source
        self.errors = errors

    def report(self, message: str) -> None:
        self.errors.append(f"{self.source}: {self.path or '(top level)'}: {message}")

    def mapping(self) -> Mapping[str, Any]:
        if self.value is None:
            return {}
        if not isinstance(self.value, dict):
            self.report(f"must be a mapping, got {type(self.value).__name__}")
            self.value = {}  # reported once; read as empty from now on
        return self.value

    def only(self, *keys: str) -> None:
        for key in self.mapping():
            if key not in keys:
                self.at(str(key)).report(f"must be one of the known keys: {', '.join(keys)}")

    def at(self, key: str | int) -> Node:
        if isinstance(key, int):
            return Node(self.value[key], f"{self.path}[{key}]", self.source, self.errors)
        path = f"{self.path}.{key}".lstrip(".")
        return Node(self.mapping().get(key), path, self.source, self.errors)

    def child(self, key: str, required: bool = False) -> Node:
        node = self.at(key)
        if required and node.value is None:
            node.report("must be set")
        return node

    def items(self) -> list[tuple[str, Node]]:
        return [(str(k), self.at(k)) for k in self.mapping()]

    def list(self) -> list[Node]:
        if self.value is None:
            return []
        if not isinstance(self.value, list):
            self.report(f"must be a list, got {type(self.value).__name__}")
            self.value = []  # reported once; read as empty from now on
        return [self.at(i) for i in range(len(self.value))]

    def read(self, kind: type[T], default: T) -> T:
        """This value as ``kind`` (an int is a float too), else reported and ``default``."""
        value = self.value
        if value is None:
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            return value
        self.report(f"must be {_NAMES.get(kind, kind.__name__)}, got {value!r}")
        return default

    def get(self, key: str, kind: type[T], default: T) -> T:
        return self.at(key).read(kind, default)

    def optional_real(self, key: str) -> float | None:
        return None if self.at(key).value is None else self.get(key, float, 0.0)

    def secret(self, key: str) -> str:
        """``key`` with ``${NAME}`` expanded from the environment, or the contents of the
        file ``key_file`` names (:mod:`epp.secrets`); "" when neither is set."""
        path = self.get(f"{key}_file", str, "")
        value = self.at(key).value
        if path and value is not None:
            self.at(f"{key}_file").report(f"must not be set together with {key}")
            return ""
        if not path and value is not None and not isinstance(value, str):
            # Not the value itself, as read() would say: ``redis_password: 1234`` is a secret.
            self.at(key).report(f"must be a string, got {type(value).__name__}")
            return ""
        try:
            return read_file(path) if path else expand(value or "")
        except SecretError as exc:
            self.at(f"{key}_file" if path else key).report(str(exc))
            return ""


def deferred(node: Node) -> Any:
    """A reader that leaves a key to its section's builder (it depends on sibling keys)."""
    return node.value


def keys_of(cls: type[Any]) -> list[str]:
    """The YAML keys a section accepts (a secret's ``_file`` twin too)."""
    keys = []
    for f, declared, _ in fields_of(cls):
        keys.append(f.name)
        if declared.secret:
            keys.append(f"{f.name}_file")
    return keys


def read_section(cls: type[S], node: Node) -> S:
    """Section ``cls`` from ``node``: unknown keys, types, ranges and choices reported with
    their paths, a bad key read as its default; then the section's own ``checked(node)``
    (cross-key rules), when it has one."""
    node.only(*keys_of(cls))
    values = {f.name: _read_key(node, f, declared, hint) for f, declared, hint in fields_of(cls)}
    result = cls(**values)
    checked = getattr(result, "checked", None)
    return typing.cast(S, checked(node)) if checked is not None else result


def _read_key(node: Node, f: dataclasses.Field[Any], declared: Knob, hint: Any) -> Any:
    """A key's value: unset is its default (or reported when required); a custom reader
    reads only a value that is set."""
    child = node.at(f.name)
    if declared.secret:
        return node.secret(f.name)
    default = default_of(f)
    if child.value is None:
        if declared.required:
            child.report("must be set")
        return default
    if declared.read is not None:
        return declared.read(child)
    return read_value(child, hint, declared, default)


def read_value(node: Node, hint: Any, declared: Knob, default: Any) -> Any:
    """``node`` read as type ``hint``: a section, a mapping or tuple of them or of scalars,
    a choice, or a bounded scalar."""
    hint, _ = unwrap_optional(hint)
    if node.value is None:
        return default
    if is_section(hint):
        return read_section(hint, node)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Mapping, dict):
        read = {key: read_value(item, args[1], declared, None) for key, item in node.items()}
        return {key: value for key, value in read.items() if value is not None}
    if origin is tuple:
        read_items = [read_value(item, args[0], declared, None) for item in node.list()]
        return tuple(value for value in read_items if value is not None)
    choices = choices_of(hint, declared)
    if choices:
        return _choice(node, choices, declared.ignore_case, default)
    return _scalar(node, hint, declared, default)


def _choice(node: Node, choices: tuple[str, ...], ignore_case: bool, default: Any) -> Any:
    value = node.read(str, None)
    if value is None:
        return default
    if (value.lower() if ignore_case else value) not in choices:
        node.report(f"must be one of {', '.join(choices)}, got {value!r}")
        return default
    return value


def _scalar(node: Node, kind: Any, declared: Knob, default: Any) -> Any:
    value = node.read(kind, None)
    if value is None:
        return default
    if kind in (int, float) and not declared.bounds.contains(value):
        noun = f"a {declared.noun}" if declared.noun else _NAMES[kind]
        node.report(f"must be {noun}{declared.bounds.describe()}, got {value!r}")
        return default
    return value
