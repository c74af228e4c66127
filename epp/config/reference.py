"""The key reference of docs/configuration.md, generated from the section declarations.

``python -m epp.config.reference`` rewrites only the block between the two markers below, never
the prose around it; ``--check`` exits 1 when the block is stale (a unit test runs the same).
"""

from __future__ import annotations

import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from epp.config.file import File
from epp.config.schema import (
    Knob,
    Reload,
    choices_of,
    default_of,
    fields_of,
    section_class,
    section_info,
    unwrap_optional,
)

BEGIN = "<!-- BEGIN GENERATED: python -m epp.config.reference -->"
END = "<!-- END GENERATED -->"
DOCUMENT = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

_TYPES = {int: "integer", float: "number", bool: "true/false", str: "string"}


def reference() -> str:
    """Every section's keys as Markdown tables, in the file's order."""
    out: list[str] = []
    for f, declared, hint in fields_of(File):
        cls = section_class(hint)
        if cls is not None:
            out += _section(_path(f.name, hint), cls, declared.reload or Reload.APPLIED)
    return "\n".join(out).rstrip() + "\n"


def _path(prefix: str, hint: Any) -> str:
    """How a nested section's keys are addressed: ``pools.NAME``, ``endpoints[]``."""
    hint, _ = unwrap_optional(hint)
    origin = typing.get_origin(hint)
    if origin in (Mapping, dict):
        return f"{prefix}.NAME"
    if origin is tuple:
        return f"{prefix}[]"
    return prefix


def _section(path: str, cls: type[Any], inherited: Reload) -> list[str]:
    info = section_info(cls)
    policy = info.reload if info is not None else inherited
    doc = info.doc if info is not None else ""
    lines = [f"### `{path}`", "", f"{policy.value.capitalize()}: {doc}.", ""]
    lines += ["| key | value | default | meaning |", "|---|---|---|---|"]
    nested: list[tuple[str, type[Any], Reload]] = []
    for f, declared, hint in fields_of(cls):
        inner = section_class(hint)
        key_policy = declared.reload or policy
        if declared.entries is not None:
            # ``[...]``: a list's entries; ``{KEY: ...}``: a mapping's, named as its shape says.
            suffix = {"[": "[]", "{": "." + declared.shape[1:].split(":")[0]}.get(
                declared.shape[:1], ""
            )
            nested.append((f"{path}.{f.name}{suffix}", declared.entries, key_policy))
        elif inner is not None and not declared.shape:
            nested.append((_path(f"{path}.{f.name}", hint), inner, key_policy))
        meaning = declared.doc
        if key_policy is not policy:
            meaning += f" ({key_policy.value})"
        value = _value(f, hint, declared, inner)
        default = _default(f, declared, inner)
        cells = (f"`{f.name}`", value, default, meaning)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines.append("")
    for sub_path, inner, sub_policy in nested:
        lines += _section(sub_path, inner, sub_policy)
    return lines


def _value(f: Any, hint: Any, declared: Knob, inner: type[Any] | None) -> str:
    """What the key takes: its shape, a section, choices, or a type with its range."""
    plain, optional = unwrap_optional(hint)
    if declared.shape:
        text = f"`{declared.shape}`"
    elif declared.entries is not None or inner is not None:
        text = "mapping: below" if plain is inner or inner is None else "entries: below"
    elif choices_of(plain, declared):
        text = " | ".join(f"`{c}`" for c in choices_of(plain, declared))
    elif typing.get_origin(plain) is tuple:
        text = f"list of {_TYPES.get(typing.get_args(plain)[0], 'values')}"
    else:
        noun = declared.noun or _TYPES.get(plain, str(plain))
        text = f"{noun}{declared.bounds.describe()}".replace(">=", "≥").replace("<=", "≤")
    if declared.secret:
        text += f"; a secret: `${{ENV}}` expanded, or read from the file `{f.name}_file` names"
    if declared.required:
        text += "; required"
    elif optional and not declared.shape and inner is None and declared.entries is None:
        text += " (optional)"
    return text


def _default(f: Any, declared: Knob, inner: type[Any] | None) -> str:
    if inner is not None or declared.required:
        return ""
    value = default_of(f)
    if value is None or (declared.secret and not value):
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`' if not value else f"`{value}`"
    if isinstance(value, Mapping):
        return "`{}`" if not value else f"`{dict(value)}`"
    if isinstance(value, tuple):
        return "`[]`" if not value else f"`{list(value)}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def rewritten(document: str) -> str:
    """``document`` with its generated block replaced by the current reference."""
    head, begin, rest = document.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"the document lacks the markers {BEGIN} ... {END}")
    return f"{head}{BEGIN}\n\n{reference()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    text = DOCUMENT.read_text()
    new = rewritten(text)
    if "--check" in argv:
        if new != text:
            print(f"{DOCUMENT}: the reference is stale; run python -m epp.config.reference")
            return 1
        return 0
    if new != text:
        DOCUMENT.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
