"""``epp serve``: wire configuration, state store, metric source, router and gRPC servers.

Background tasks (scraping, store sync, health, config reload) write state; the gRPC handlers
only read it. A reload validates the new file first and keeps the old configuration if the new
one is bad; streams in flight finish with the configuration they started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import replace
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2_grpc

from epp._proto import ext_proc_pb2_grpc
from epp.admin import build_app
from epp.config import Config, ConfigError, load_config
from epp.extproc.health import Health
from epp.extproc.servicer import ExtProcServicer
from epp.observability import CONFIG_RELOADS
from epp.prefix.invalidation import CacheInvalidator
from epp.router import Router
from epp.sources.kv_events import KvEventSubscriber
from epp.sources.scraper import MetricsScraper
from epp.state import StateStore
from epp.state.fleet import FleetState
from epp.state.memory import MemoryStore
from epp.state.shared.connect import hash_tag
from epp.state.shared.sessions import SharedSessionTable
from epp.state.shared.sync import SharedState

log = logging.getLogger("epp.server")

RELOAD_POLL_SECONDS = 1.0

GRPC_OPTIONS = [
    # Envoy sends request body chunks of up to 1 MiB.
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # Envoy keeps its HTTP/2 connection to epp alive with pings; gRPC's default policy answers
    # frequent pings with GOAWAY "too many pings", which kills every stream in flight (seen as
    # a 500 on long uploads). Accept them.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
]


def make_store(config: Config) -> StateStore:
    if config.store.backend == "redis":
        from epp.state.redis_store import RedisStore

        return RedisStore(
            config.store.redis_url,
            # Hash-tagged like every shared key: all in one Redis Cluster slot.
            key_prefix=hash_tag(config.store.key_prefix),
            refresh_interval=config.scrape.interval,
        )
    return MemoryStore()


def make_shared(config: Config, store: StateStore) -> tuple[FleetState, SharedState | None]:
    """The routing state, and with Redis what makes this process one of an active-active group."""
    if config.store.backend != "redis":
        return FleetState(store), None
    # Sessions are replicated through the table subclass that records local bindings.
    fleet = FleetState(store, sessions=SharedSessionTable())
    shared = SharedState(
        config.store.redis_url,
        fleet,
        key_prefix=config.store.key_prefix,
        interval=config.scrape.interval,
    )
    return fleet, shared


class Server:
    """One epp process."""

    def __init__(self, config_path: Path, config: Config) -> None:
        self.config_path = config_path
        self.store = make_store(config)
        self.fleet, self.shared = make_shared(config, self.store)
        self.router = Router(config, self.fleet)
        self.scraper = MetricsScraper(
            self.store,
            interval=config.scrape.interval,
            timeout=config.scrape.timeout,
            failure_threshold=config.scrape.failure_threshold,
            owns=self.shared.owns if self.shared is not None else None,
        )
        self.health = Health(self.store)
        self._invalidator = CacheInvalidator(self.fleet.prefix)
        self.kv_events = KvEventSubscriber(self.fleet.precise)
        self._grpc: grpc.aio.Server | None = None
        self._admin: web.AppRunner | None = None
        self._health_grpc: grpc.aio.Server | None = None
        self._stopping = asyncio.Event()
        self._mtime = _mtime(config_path)

    async def run(self) -> None:
        config = self.router.config
        await self.store.start()
        if self.shared is not None:
            self.shared.set_endpoints(config.endpoint_pools())
            await self.shared.start()
        self.scraper.set_endpoints(config.endpoint_pools())
        await self.scraper.start()
        self._apply_prefix_sources(config)
        await self.kv_events.start()

        self._grpc = grpc.aio.server(options=GRPC_OPTIONS)
        ext_proc_pb2_grpc.add_ExternalProcessorServicer_to_server(
            ExtProcServicer(self.router), self._grpc
        )
        host = config.server.host
        self._grpc.add_insecure_port(f"{host}:{config.server.extproc_port}")
        self._health_grpc = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self._health_grpc)
        self._health_grpc.add_insecure_port(f"{host}:{config.server.health_port}")
        self._admin = web.AppRunner(build_app(self.router), access_log=None)
        await self._admin.setup()
        await web.TCPSite(self._admin, host, config.server.metrics_port).start()
        await self._grpc.start()
        await self._health_grpc.start()
        await self.health.start()
        log.info(
            "epp serving ext_proc on %s:%d (health :%d, metrics :%d), %d models, %d endpoints",
            host,
            config.server.extproc_port,
            config.server.health_port,
            config.server.metrics_port,
            len(config.models),
            len(config.endpoint_pools()),
        )

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stopping.set)
        ticker = asyncio.create_task(self._tick())
        await self._stopping.wait()
        server = self.router.config.server
        log.info(
            "epp stopping: NOT_SERVING for %.1fs, then up to %.0fs for open streams",
            server.drain_seconds,
            server.shutdown_grace_seconds,
        )
        ticker.cancel()
        await self.health.shutdown()
        await asyncio.sleep(server.drain_seconds)
        await self._grpc.stop(grace=server.shutdown_grace_seconds)
        await self._health_grpc.stop(grace=0)
        if self._admin is not None:
            await self._admin.cleanup()
        await self.scraper.stop()
        await self.kv_events.stop()
        if self.shared is not None:
            await self.shared.stop()
        await self.store.stop()

    async def _tick(self) -> None:
        """Refresh health often; look for a changed config file about once a second."""
        elapsed = 0.0
        while True:
            await asyncio.sleep(0.1)
            await self.health.refresh()
            self._invalidator.observe(self.store.snapshot(), self.router.config.endpoint_pools())
            elapsed += 0.1
            if elapsed >= RELOAD_POLL_SECONDS:
                elapsed = 0.0
                mtime = _mtime(self.config_path)
                if mtime != self._mtime:
                    self._mtime = mtime
                    await self.reload()

    def _apply_prefix_sources(self, config: Config) -> None:
        """Point the precise prefix scorer's inputs (tokenizers, KV events) at ``config``."""
        self.fleet.tokenizers.set_models({m: spec.tokenizer for m, spec in config.models.items()})
        self.kv_events.set_endpoints(config.kv_events)

    async def reload(self) -> bool:
        """Load the config file again; apply it if valid, else keep the current one."""
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            CONFIG_RELOADS.labels("rejected").inc()
            log.error("configuration reload rejected, keeping the current one: %s", exc)
            return False
        old = self.router.config
        if (new.server, new.store) != (old.server, old.store):
            log.warning("server and store settings change only on restart; applying the rest")
            new = replace(new, server=old.server, store=old.store)
        self.router.config = new
        if self.shared is not None:
            self.shared.set_endpoints(new.endpoint_pools())
        self.scraper.set_endpoints(new.endpoint_pools())
        self._apply_prefix_sources(new)
        CONFIG_RELOADS.labels("ok").inc()
        log.info(
            "configuration reloaded: %d models, %d endpoints",
            len(new.models),
            len(new.endpoint_pools()),
        )
        return True


def _mtime(path: Path) -> float:
    with contextlib.suppress(OSError):
        return os.stat(path).st_mtime
    return 0.0


def serve(config_path: Path, config: Config) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is optional on exotic platforms
        asyncio.run(Server(config_path, config).run())
    else:
        uvloop.run(Server(config_path, config).run())
    return 0
