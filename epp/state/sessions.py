"""Where each client session last went, so its next request can follow (session affinity).

A conversation's next turn reuses the KV cache its previous turn left on one replica; the
session scorer reads this table to send it back there. The table is bounded: sessions expire
after their TTL (refreshed on every request) and, past ``max_sessions``, the least recently used
are dropped first, so a flood of one-off session ids cannot grow memory without limit.

The table is the session scorer's state (declared by
:mod:`epp.scheduling.scorers.session`): a binding a pick made moves with a retry to the
endpoint that served (:class:`Bound`, noted in ``journal``, see :mod:`epp.state.registry`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

DEFAULT_MAX_SESSIONS = 100_000


class _Binding(NamedTuple):
    endpoint: str
    expires_at: float


class Bound(NamedTuple):
    """A binding a pick made, as a journal keeps it (a :class:`~epp.state.registry.Footprint`)."""

    session: str
    endpoint: str
    owner: SessionTable

    def move(self, served: str, now: float) -> None:
        """Rebind the session to ``served`` (a retry ended there)."""
        self.owner.move(self.session, self.endpoint, served, now)


class SessionTable:
    """Session id -> endpoint with expiry; oldest binding first (an LRU)."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        if max_sessions <= 0:
            raise ValueError("max_sessions must be > 0")
        self.max_sessions = max_sessions
        self._bindings: OrderedDict[str, _Binding] = OrderedDict()
        # While set (a pick's post-pick hooks, epp.state.moves.Recording), each binding is also
        # noted here as Bound, so that a retry can move it (a list shared with the other
        # journaled states, hence Any).
        self.journal: list[Any] | None = None

    def get(self, session: str, now: float) -> str | None:
        """The endpoint ``session`` is bound to, or None if unknown or expired."""
        binding = self._bindings.get(session)
        if binding is None:
            return None
        if binding.expires_at <= now:
            del self._bindings[session]
            return None
        return binding.endpoint

    def bind(self, session: str, endpoint: str, now: float, ttl: float) -> None:
        """(Re)bind ``session`` to ``endpoint`` until ``now + ttl``."""
        if self.journal is not None:
            self.journal.append(Bound(session, endpoint, self))
        bindings = self._bindings
        bindings[session] = _Binding(endpoint, now + ttl)
        bindings.move_to_end(session)
        # Refreshing moves a binding to the end, so with one TTL the front expires first: expired
        # bindings are cleared here at O(1) amortised cost instead of by a sweeper task.
        while bindings and (
            len(bindings) > self.max_sessions or next(iter(bindings.values())).expires_at <= now
        ):
            bindings.popitem(last=False)

    def move(self, session: str, source: str, target: str, now: float) -> None:
        """Rebind ``session`` from ``source`` to ``target`` (a retry served it there), keeping
        its expiry; a binding that meanwhile points elsewhere, or expired, is left alone."""
        binding = self._bindings.get(session)
        if binding is None or binding.endpoint != source or binding.expires_at <= now:
            return
        # Through bind() so that a shared table ships the new binding to the other processes.
        self.bind(session, target, now, binding.expires_at - now)

    def __len__(self) -> int:
        return len(self._bindings)
