"""gRPC health: ``liveness`` while the process runs; ``readiness`` and the ext_proc service once
epp knows its endpoints AND has heard from each of them once (a scrape answered or failed, here
or, through Redis, in another epp).

GIE's endpoint picker serves as soon as the InferencePool has synced (``PoolHasSynced``), before
any metrics. epp waits for the first scrape round because its ready filter drops an endpoint
that has never answered: an epp that said "ready" earlier answered 503 ``no_ready_endpoint``
for up to one scrape round, and after a restart in an active-active group Envoy sent it
requests the other epp could have served (seen in tests/e2e/test_devstack_supervision.py).
Waiting costs at most one scrape timeout, and with every replica down epp still becomes ready
after the first failed round and answers a clear 503. Once ready, an endpoint that joins later
(discovery) does not take readiness away: it is an unready candidate until scraped.
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
        endpoints = self._store.snapshot().endpoints.values()
        ready = bool(endpoints) and (
            bool(self._ready) or all(e.scraped_at > 0.0 or e.failures > 0 for e in endpoints)
        )
        if ready != self._ready:
            status = _SERVING if ready else _NOT_SERVING
            await self.servicer.set("readiness", status)
            await self.servicer.set(EXT_PROC_SERVICE, status)
            self._ready = ready

    async def shutdown(self) -> None:
        await self.servicer.enter_graceful_shutdown()
