"""In-process state store: the embedded default for a single epp process."""

from __future__ import annotations

from collections.abc import Iterable

from epp.observability import STORE_UP
from epp.state.local import LocalSnapshot
from epp.state.snapshot import EndpointState, Snapshot
from epp.state.store import StateStore


class MemoryStore(StateStore):
    """Keeps endpoint state in this process only; nothing to connect to, so it is always up."""

    def __init__(self) -> None:
        self._local = LocalSnapshot()

    async def start(self) -> None:
        STORE_UP.set(1)

    async def stop(self) -> None:
        return None

    def snapshot(self) -> Snapshot:
        return self._local.current

    async def put_endpoint(self, state: EndpointState) -> None:
        self._local.update((state,))

    async def retain(self, addresses: Iterable[str]) -> None:
        self._local.retain(addresses)
