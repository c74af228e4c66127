"""The HTTP side of epp on the metrics port: Prometheus metrics and troubleshooting views.

- ``GET /metrics``: Prometheus exposition.
- ``GET /debug/endpoints``: every endpoint as epp sees it now (ready, scraped metrics, age, the
  in-flight work epp routed to it).
- ``GET /debug/decisions`` and ``/debug/decisions/{request_id}``: why recent requests went where
  they did (every candidate's weighted scores), kept when ``routing.explain`` is on or the log
  level is debug. Clients can send their own ``x-request-id`` to find their request.
"""

from __future__ import annotations

import dataclasses
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epp.router import Router


def build_app(router: Router) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def endpoints(_: web.Request) -> web.Response:
        now = time.time()
        inflight = router.fleet.inflight
        data = {
            address: {
                "pool": state.pool,
                "ready": state.ready,
                "age_seconds": round(state.age(now), 3),
                "consecutive_failures": state.failures,
                "metrics": _jsonable(dataclasses.asdict(state.metrics)),
                "in_flight": dataclasses.asdict(inflight.load(address)),
            }
            for address, state in sorted(router.fleet.store.snapshot().endpoints.items())
        }
        return web.json_response(data)

    async def decisions(_: web.Request) -> web.Response:
        return web.json_response(list(router.decisions.values())[-100:])

    async def decision(request: web.Request) -> web.Response:
        found = router.decisions.get(request.match_info["request_id"])
        if found is None:
            return web.json_response(
                {
                    "error": "unknown request id: decisions are kept only while routing.explain is "
                    "on or the log level is debug, for the last 1000 requests"
                },
                status=404,
            )
        return web.json_response(found)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/endpoints", endpoints)
    app.router.add_get("/debug/decisions", decisions)
    app.router.add_get("/debug/decisions/{request_id}", decision)
    return app


def _jsonable(value: object) -> object:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, frozenset | set):
        return sorted(value)
    return value
