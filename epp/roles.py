"""What part of a request a replica serves under prefill/decode disaggregation (docs/pd.md).

A replica is ``prefill`` (only prefill legs: the prompt's KV, handed to a decode replica),
``decode`` (whole requests, or the decode leg of a disaggregated one) or ``both`` (the default:
aggregated serving, and decode legs). Kubernetes Pods say it with llm-d's label
``llm-d.ai/role``; static and DNS pools with a ``role`` field. llm-d's ``prefill-decode`` is
``both`` here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
# The Pod label llm-d reads a replica's role from.
ROLE_LABEL = "llm-d.ai/role"
_ALIASES: Mapping[str, Role] = {"prefill-decode": "both"}


def parse_role(value: object) -> Role | None:
    """The role ``value`` names (llm-d's spellings included), or None when it names none."""
    if not isinstance(value, str):
        return None
    text = value.strip().lower()
    if text in _ALIASES:
        return _ALIASES[text]
    return next((r for r in ROLES if r == text), None)


def role_of(roles: Mapping[str, Role], address: str) -> Role:
    """``address``'s role; an endpoint nobody gave a role serves both."""
    return roles.get(address, "both")
