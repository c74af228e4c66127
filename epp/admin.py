"""The HTTP side of epp on the metrics port: Prometheus metrics and troubleshooting views.

- ``GET /metrics``: Prometheus exposition.
- ``GET /debug/endpoints``: every endpoint as epp sees it now (ready, scraped metrics, age, the
  in-flight work epp routed to it, its passive-health circuit, its learned latency model).
  Strict JSON: a value that has none (the age of an endpoint never scraped) is ``null``, never
  ``Infinity``.
- ``GET /debug/decisions`` and ``/debug/decisions/{request_id}``: why recent requests went where
  they did (every candidate's weighted scores), kept when ``routing.explain`` is on or the log
  level is debug. Clients can send their own ``x-request-id`` to find their request.

``/metrics`` answers whoever reaches the port (Prometheus scrapes it from elsewhere). The
``/debug`` views name every replica, its load and recent requests' ids, so who may read them
is ``server.debug_access`` (docs/security.md):

- ``local`` (the default): without ``server.debug_token``, loopback peers only (``kubectl
  port-forward``, ``podman exec``, the host itself); with a token, every caller must send
  ``Authorization: Bearer <token>``, loopback ones too (a mesh sidecar forwards from loopback,
  so a loopback address proves nothing once a token says who may read);
- ``loopback``: loopback peers without the token, others with it (local development);
- ``any``: every caller.

Others get 403 with what to do.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import json
import math
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epp.config import ServerConfig
from epp.router import Router

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(router: Router, server: ServerConfig | None = None) -> web.Application:
    """``server`` says who may read ``/debug`` (default: loopback peers only)."""
    server = server if server is not None else ServerConfig()

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
                "metrics": dataclasses.asdict(state.metrics),
                "in_flight": dataclasses.asdict(inflight.load(address)),
                "health": router.fleet.health.describe(address, now),
                "latency": router.fleet.latency.describe(address, now),
            }
            for address, state in sorted(router.fleet.store.snapshot().endpoints.items())
        }
        return web.json_response(_jsonable(data), dumps=_strict_dumps)

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

    app = web.Application(middlewares=[_debug_guard(server)])
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/endpoints", endpoints)
    app.router.add_get("/debug/decisions", decisions)
    app.router.add_get("/debug/decisions/{request_id}", decision)
    return app


def _debug_guard(server: ServerConfig) -> Middleware:
    expected = f"Bearer {server.debug_token}".encode() if server.debug_token else None

    # A loopback peer passes without the token in "loopback" mode, and in "local" mode only
    # while no token is set.
    loopback_passes = server.debug_access == "loopback" or (
        server.debug_access == "local" and expected is None
    )

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        sent = request.headers.get("Authorization", "").encode()
        if (
            not request.path.startswith("/debug")
            or server.debug_access == "any"
            or (loopback_passes and _loopback(request.remote))
            or (expected is not None and hmac.compare_digest(sent, expected))
        ):
            return await handler(request)
        return web.json_response({"error": _refusal(server, expected is not None)}, status=403)

    return guard


def _refusal(server: ServerConfig, token_set: bool) -> str:
    if token_set and server.debug_access == "local":
        return (
            "/debug needs 'Authorization: Bearer <server.debug_token>' from every caller, "
            "local ones too (docs/security.md)"
        )
    return (
        "/debug answers only local callers: use kubectl port-forward or run curl on the host, "
        "send 'Authorization: Bearer <server.debug_token>' (with a token set), or set "
        "server.debug_access: any (docs/security.md)"
    )


def _loopback(remote: str | None) -> bool:
    try:
        address = ipaddress.ip_address(remote or "")
    except ValueError:  # no peer address (a Unix socket): not a local TCP caller
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return bool((mapped or address).is_loopback)


def _jsonable(value: object) -> object:
    """``value`` as strict JSON can hold it: sets sorted, non-finite numbers (never scraped:
    age ``inf``) as None."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, frozenset | set):
        return sorted(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _strict_dumps(value: object) -> str:
    # A non-finite number left in would fail here rather than reach a client as invalid JSON.
    return json.dumps(value, allow_nan=False)
