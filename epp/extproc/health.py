"""gRPC health: ``liveness`` while the process runs; ``readiness`` and the ext_proc service once
epp knows its endpoints (the first scrape round has reported), as GIE's endpoint picker does.

Readiness does not require a *ready* endpoint: with none, epp still answers every request with a
clear 503, which beats Envoy failing over to nothing.
"""

from __future__ import annotations

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from epp.state import StateStore

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    def __init__(self, store: StateStore) -> None:
        self.servicer = HealthServicer()
        self._store = store
        self._ready: bool | None = None

    async def start(self) -> None:
        await self.servicer.set("liveness", _SERVING)
        await self.servicer.set("", _SERVING)
        await self.refresh()

    async def refresh(self) -> None:
        """Recompute readiness from the snapshot; cheap enough to call on every tick."""
        ready = bool(self._store.snapshot().endpoints)
        if ready != self._ready:
            status = _SERVING if ready else _NOT_SERVING
            await self.servicer.set("readiness", status)
            await self.servicer.set(EXT_PROC_SERVICE, status)
            self._ready = ready

    async def shutdown(self) -> None:
        await self.servicer.enter_graceful_shutdown()
