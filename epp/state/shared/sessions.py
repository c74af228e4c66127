"""A session table whose bindings other epp processes replay, so a session sticks group-wide.

:class:`~epp.state.sessions.SessionTable` is local; this subclass adds the
``take_recent``/``apply`` pair the approximate prefix index already has, which is all
:mod:`epp.state.shared.picks` needs. A binding is shipped with its absolute expiry so it ends at
the same moment everywhere, however late it arrives.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from epp.request import SESSION_DIGEST_BYTES
from epp.state.sessions import DEFAULT_MAX_SESSIONS, SessionTable

# Local bindings kept for shipping; the oldest are dropped beyond this (as in the prefix index).
RECENT_LIMIT = 4096


class Binding(NamedTuple):
    session: str
    endpoint: str
    expires_at: float


class SharedSessionTable(SessionTable):
    """Records local bindings for :meth:`take_recent`; :meth:`apply` takes remote ones."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        super().__init__(max_sessions)
        self._recent: deque[Binding] = deque(maxlen=RECENT_LIMIT)

    def bind(self, session: str, endpoint: str, now: float, ttl: float) -> None:
        super().bind(session, endpoint, now, ttl)
        self._recent.append(Binding(session, endpoint, now + ttl))

    def recent_count(self) -> int:
        """Additions made here and not yet taken by :meth:`take_recent`."""
        return len(self._recent)

    def take_recent(self) -> list[Binding]:
        batch = list(self._recent)
        self._recent.clear()
        return batch

    def apply(self, batch: Iterable[Binding]) -> None:
        """Replay other processes' bindings (not recorded again); expired ones are skipped,
        and so are session keys that are no digest (an older epp's raw header): a remote
        binding takes no more room than a local one."""
        now = time.time()
        for session, endpoint, expires_at in batch:
            if expires_at > now and _is_digest(session):
                super().bind(session, endpoint, now, expires_at - now)


def _is_digest(session: object) -> bool:
    if not isinstance(session, str) or len(session) != 2 * SESSION_DIGEST_BYTES:
        return False
    try:
        bytes.fromhex(session)
    except ValueError:
        return False
    return True
