"""``epp pd-sidecar``: beside a decode replica, run a disaggregated request's two legs.

It listens on the port clients (Envoy) reach the replica on; the engine listens on another.
A POST to ``/v1/completions`` or ``/v1/chat/completions`` carrying the prefill header (set by
epp, :mod:`epp.scheduling.deciders`) is served in two legs: the prefill leg to the named
prefill replica (one token, not streamed, the same ``x-request-id``), then the decode leg to the
local engine, whose answer (streamed or not) goes back to the client as it arrives. Everything
else passes through untouched, but for a client's own ``kv_transfer_params``, which only the
sidecar may set. A prefill target outside the pool is refused (403); a failed prefill leg is
not the client's problem: the local engine prefills itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from epp.config import ConfigError, load_config
from epp.discovery.spec import DnsSpec
from epp.errors import RequestError
from epp.pd.allowed import Allowed
from epp.pd.legs import CONNECTORS, TRANSFER, Connector, decode_body, prefill_body
from epp.wire import PREFILL, PREFILL_HEADERS, REQUEST_ID

log = logging.getLogger("epp.pd")

PD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Connection-level headers a proxy must not forward (RFC 9110 7.6.1), and those recomputed.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


class Sidecar:
    def __init__(
        self,
        engine: str,
        allowed: Allowed,
        connector: Connector = "nixl",
        header: str = PREFILL,
        prefill_timeout: float = 60.0,
    ) -> None:
        self.engine = engine.rstrip("/")
        self.allowed = allowed
        self.connector = connector
        self.header = header
        self.prefill_timeout = aiohttp.ClientTimeout(total=prefill_timeout)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No total timeout: a decode leg lasts as long as the generation does. Bodies pass
            # as they are (compressed or not).
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                auto_decompress=False,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = _forwarded(request.headers)
        if request.method != "POST" or request.path not in PD_PATHS:
            return await self._relay(request, self.engine, body, headers)
        data = _json_object(body)
        if data is None:  # not JSON: the engine answers it
            return await self._relay(request, self.engine, body, headers)
        target = _first(request.headers.get(self.header, ""))
        if not target:
            if TRANSFER in data:
                data.pop(TRANSFER)
                body = _dump(data)
            return await self._relay(request, self.engine, body, headers)
        if target not in self.allowed:
            log.warning("refused prefill target %s (not a prefill replica of the pool)", target)
            return _error(
                RequestError(
                    403,
                    f"prefill target {target} is not a prefill replica of this pool",
                    type="permission_error",
                )
            )
        headers[REQUEST_ID] = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        decode = await self._prefill(request.path_qs, target, data, headers)
        return await self._relay(request, self.engine, _dump(decode), headers)

    async def _prefill(
        self, path: str, target: str, data: dict[str, Any], headers: CIMultiDict[str]
    ) -> dict[str, Any]:
        """Run the prefill leg; the decode leg's body, the client's own when the leg failed
        (the engine then prefills locally)."""
        fallback = {k: v for k, v in data.items() if k != TRANSFER}
        # The answer is read here, not relayed: ask for it uncompressed.
        leg = CIMultiDict((k, v) for k, v in headers.items() if k.lower() != "accept-encoding")
        try:
            async with self.session.post(
                f"http://{target}{path}",
                data=_dump(prefill_body(data, self.connector)),
                headers=leg,
                timeout=self.prefill_timeout,
            ) as response:
                raw = await response.read()
                if response.status != 200:
                    log.warning(
                        "prefill leg on %s answered %d; prefilling locally", target, response.status
                    )
                    return fallback
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("prefill leg on %s failed (%r); prefilling locally", target, exc)
            return fallback
        decode = decode_body(data, self.connector, _json_object(raw))
        if decode is None:
            log.warning(
                "prefill answer of %s has no usable %s; prefilling locally", target, TRANSFER
            )
            return fallback
        return decode

    async def _relay(
        self, request: web.Request, base: str, body: bytes, headers: CIMultiDict[str]
    ) -> web.StreamResponse:
        """Send the request to ``base`` and stream its answer back as it arrives."""
        try:
            upstream = await self.session.request(
                request.method, f"{base}{request.path_qs}", data=body, headers=headers
            )
        except aiohttp.ClientError as exc:
            log.warning("engine %s unreachable: %r", base, exc)
            return _error(
                RequestError(
                    503, "the local engine is unreachable", type="service_unavailable_error"
                )
            )
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in _HOP:
                    response.headers.add(key, value)
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


def _forwarded(headers: Mapping[str, str]) -> CIMultiDict[str]:
    drop = _HOP | set(PREFILL_HEADERS)
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop)


def _first(value: str) -> str:
    """The first address of a header value (GIE's name allows a comma-separated list)."""
    return value.split(",", 1)[0].strip()


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _dump(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()


def _error(error: RequestError) -> web.Response:
    return web.Response(status=error.status, body=error.body(), content_type="application/json")


def build_app(sidecar: Sidecar, max_body_bytes: int) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_route("*", "/{tail:.*}", sidecar.handle)

    async def lifecycle(app: web.Application) -> Any:
        follower = asyncio.create_task(sidecar.allowed.follow_dns())
        yield
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        await sidecar.close()

    app.cleanup_ctx.append(lifecycle)
    return app


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "pd-sidecar",
        help="run a decode replica's prefill/decode sidecar (docs/pd.md)",
        description="Beside a decode replica: runs the prefill leg of requests epp "
        "disaggregated on the prefill replica it names, then the decode leg on the local engine.",
    )
    p.add_argument("--listen", default="0.0.0.0:8000", help="host:port clients reach")
    p.add_argument("--engine", default="http://127.0.0.1:8200", help="the local engine's URL")
    p.add_argument("--connector", choices=CONNECTORS, default="nixl")
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="IP:PORT",
        help="a prefill replica the sidecar may call (repeatable)",
    )
    p.add_argument(
        "--prefill-dns",
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="a name whose addresses are prefill replicas, re-resolved every second "
        "(a headless Service; repeatable)",
    )
    p.add_argument(
        "--config",
        help="epp configuration: its prefill-role endpoints and prefill DNS pools are allowed",
    )
    p.add_argument("--header", choices=PREFILL_HEADERS, default=PREFILL)
    p.add_argument("--prefill-timeout", type=float, default=60.0, help="seconds")
    p.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024)
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    config = None
    if args.config:
        try:
            config = load_config(args.config)
        except ConfigError as exc:
            for line in exc.errors:
                print(line)
            return 1
    if not (args.prefill or args.prefill_dns) and config is None:
        print("pd-sidecar: no prefill replica allowed: give --prefill, --prefill-dns or --config")
        return 1
    names = []
    for item in args.prefill_dns:
        name, _, port = item.rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            print(f"pd-sidecar: --prefill-dns expects NAME:PORT, got {item!r}")
            return 1
        names.append(DnsSpec(name, int(port), role="prefill"))
    allowed = Allowed(args.prefill, config, names)
    host, _, port = args.listen.rpartition(":")
    sidecar = Sidecar(args.engine, allowed, args.connector, args.header, args.prefill_timeout)
    web.run_app(build_app(sidecar, args.max_body_bytes), host=host or None, port=int(port))
    return 0
