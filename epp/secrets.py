"""Secrets for the configuration from the environment or from files, so none has to be inline.

Every configuration key that holds a secret (``store.redis_password``, ``server.debug_token``,
...) takes one of:

- ``KEY: ${NAME}``: the value with each ``${NAME}`` replaced by the environment variable NAME
  (``redis_url: redis://redis:6379/0`` stays as it is; a value may mix text and references).
  An unset variable is an error, never an empty secret.
- ``KEY_file: /path``: the file's contents, one trailing newline removed (``echo pw > file``
  and a Kubernetes Secret mounted as a volume both work). The path itself is not expanded.

Errors name the key, the variable or the path, never the secret.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

# A token, a password or a URL: far below this. A larger file is a wrong path, not a secret.
MAX_SECRET_BYTES = 64 * 1024

_REFERENCE = re.compile(r"\$\{([^}]*)\}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class SecretError(ValueError):
    """A reference that cannot be resolved; the message never contains a secret."""


def expand(value: str, environ: Mapping[str, str] | None = None) -> str:
    """``value`` with every ``${NAME}`` replaced by the environment variable NAME."""
    env = os.environ if environ is None else environ
    missing: list[str] = []

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if not _NAME.fullmatch(name):
            raise SecretError(f"${{{name}}} is not an environment variable reference")
        if name not in env:
            missing.append(name)
            return ""
        return env[name]

    expanded = _REFERENCE.sub(substitute, value)
    if missing:
        raise SecretError(f"environment variable {', '.join(missing)} is not set")
    return expanded


def read_file(path: str, limit: int = MAX_SECRET_BYTES) -> str:
    """The contents of ``path`` without its trailing newline; at most ``limit`` bytes."""
    try:
        with Path(path).open("rb") as file:
            data = file.read(limit + 1)
    except OSError as exc:
        raise SecretError(f"cannot read {path}: {exc.strerror}") from None
    if len(data) > limit:
        raise SecretError(f"{path} is larger than {limit} bytes")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise SecretError(f"{path} is not UTF-8 text") from None
    text = text.removesuffix("\n").removesuffix("\r")
    if not text:
        raise SecretError(f"{path} is empty")
    return text
