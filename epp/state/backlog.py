"""Prefill work epp has sent to each endpoint and not yet seen drain: the TTFT scorer's memory.

Kept in the fleet state rather than on the scorer so that it survives configuration reloads
(plugins are rebuilt from the new file on every reload). The drain rate is the scorer's
parameter, so this table stores only what was queued and when; per process, like the scorer's
view of its own picks.
"""

from __future__ import annotations


class PrefillBacklog:
    """Endpoint -> (prefill tokens queued, as of this wall-clock time)."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[float, float]] = {}

    def get(self, address: str) -> tuple[float, float] | None:
        return self._entries.get(address)

    def set(self, address: str, tokens: float, as_of: float) -> None:
        self._entries[address] = (tokens, as_of)
