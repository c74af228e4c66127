"""The state store interface shared by the in-process and Redis backends.

Writers (metric sources) call the async ``put_*`` methods; the picker calls :meth:`snapshot`,
which must never perform I/O. A backend that talks to the network does so in background tasks
and keeps serving its last local snapshot when the network is gone.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable

from epp.state.snapshot import EndpointState, Snapshot


class StateStore(abc.ABC):
    """Holds endpoint state and serves an immutable local :class:`Snapshot`."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Begin background work (connections, refresh loops)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop background work and release connections."""

    @abc.abstractmethod
    def snapshot(self) -> Snapshot:
        """Return the current local snapshot. Must not block or touch the network."""

    @abc.abstractmethod
    async def put_endpoint(self, state: EndpointState) -> None:
        """Record a fresh observation of one endpoint (local first, shared in the background)."""

    def set_refresh_interval(self, interval: float) -> None:  # noqa: B027 - optional hook
        """Follow a new scrape interval (a configuration reload). Stores that sync in the
        background refresh once per interval; the in-process store has nothing to refresh."""

    async def first_sync(self) -> None:  # noqa: B027 - optional hook
        """Return once the shared state has been read (callers bound the wait). A
        process that starts serving before then answers from its own empty view: a restarted
        epp of an active-active group refused requests with 503 while the others' observations
        were one round trip away. The in-process store has nothing to wait for."""

    @abc.abstractmethod
    async def retain(self, addresses: Iterable[str]) -> None:
        """Forget endpoints not in ``addresses`` (after a configuration reload)."""
