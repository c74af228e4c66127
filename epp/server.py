"""``epp serve``: wire configuration, state store, metric source, router and gRPC servers.

Background tasks (scraping, store sync, health, config reload) write state; the gRPC handlers
only read it. A reload validates the new file first and keeps the old configuration if the new
one is bad; streams in flight finish with the configuration they started with. What a reload
applies is decided by the schema's reload policies (:data:`epp.config.SECTIONS`): restart-only
sections are logged once and counted in ``epp_config_restart_required_total{section}``; each
reloadable one is applied by what the server registers for it in :attr:`Server.appliers` (the
scrape timing included, with everything derived from the interval).
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
from prometheus_client import REGISTRY

from epp._proto import ext_proc_pb2_grpc
from epp.admin import build_app
from epp.admission.budget_sync import BudgetSync
from epp.config import SECTIONS, Config, ConfigError, Reload, load_config
from epp.config.appliers import Appliers
from epp.config_advice import advice
from epp.data_parallel import rank_changes, replica_of
from epp.discovery import Discovery, DiscoveryOptions, KubernetesSpec
from epp.discovery.manager import pool_specs
from epp.discovery.pool_resources import ClusterResources
from epp.extproc.health import Health
from epp.extproc.servicer import ExtProcServicer
from epp.gc_tuning import settle_heap
from epp.metrics.pool_gauges import PoolGauges
from epp.observability import CONFIG_RELOADS, CONFIG_RESTART_REQUIRED
from epp.prefix.approximate import APPROX_PREFIX
from epp.prefix.invalidation import CacheInvalidator
from epp.prefix.precise import PRECISE_INDEX, TOKENIZERS
from epp.router import Router
from epp.sources.kv_events import KvEventSubscriber
from epp.sources.scraper import MetricsScraper
from epp.state import StateStore
from epp.state.fleet import FleetState
from epp.state.memory import MemoryStore
from epp.state.shared.connect import hash_tag
from epp.state.shared.sync import LEASE_INTERVALS, SharedState
from epp.tls import client_context, grpc_credentials, server_context
from epp.tracing import Tracing

log = logging.getLogger("epp.server")

# How long a starting epp waits for the shared state before serving from its own.
FIRST_SYNC_SECONDS = 1.0
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
    fleet = FleetState(store)
    if config.store.backend != "redis":
        return fleet, None
    shared = SharedState(
        config.store.redis_url,
        fleet,
        key_prefix=config.store.key_prefix,
        interval=config.scrape.interval,
    )
    return fleet, shared


class Server:
    """One epp process.

    ``config`` is what runs (command-line overrides applied), ``loaded`` the file as read at
    start (default: ``config``): a reload compares restart-only sections with the file, so an
    override is not reported as a change on every reload. ``discovery``: command-line additions
    to endpoint discovery (--pool-name, --eds-dir). ``own_process``: the process is this
    server's alone (``epp serve``), so once started it tunes the garbage collector for serving
    (:mod:`epp.gc_tuning`); a test or an embedding keeps its interpreter's settings.
    """

    def __init__(
        self,
        config_path: Path,
        config: Config,
        *,
        loaded: Config | None = None,
        discovery: DiscoveryOptions | None = None,
        own_process: bool = False,
    ) -> None:
        self.config_path = config_path
        self._own_process = own_process
        self._loaded = loaded if loaded is not None else config
        # Restart-only section -> the file's value last reported as not applied.
        self._reported: dict[str, object] = {}
        self.store = make_store(config)
        self.fleet, self.shared = make_shared(config, self.store)
        self.router = Router(config, self.fleet)
        # Tenant budgets shared by the group (with Redis; alone, the ledger is the budget).
        self.budget_sync = (
            None
            if self.shared is None
            else BudgetSync(
                config.store.redis_url,
                self.router.budgets,
                self.shared.keys,
                self.shared.me,
                interval=config.scrape.interval,
                member_ttl=LEASE_INTERVALS * config.scrape.interval,
            )
        )
        self.scraper = MetricsScraper(
            self.store,
            interval=config.scrape.interval,
            timeout=config.scrape.timeout,
            failure_threshold=config.scrape.failure_threshold,
            owns=self.shared.owns if self.shared is not None else None,
        )
        self.health = Health(self.store)
        self.pool_gauges = PoolGauges(
            self.store.snapshot, lambda: self.router.config.pools, self.router.demand
        )
        self._invalidator = CacheInvalidator(lambda: self.fleet.states.named(APPROX_PREFIX))
        self.kv_events = KvEventSubscriber(self.fleet.states.get(PRECISE_INDEX))
        self.discovery = Discovery(self._endpoints_changed, discovery)
        # Rewrites and objectives from the cluster, for pools that follow an InferencePool.
        self._overrides = (discovery or DiscoveryOptions()).overrides
        self.resources = ClusterResources(self._resources_changed)
        self._grpc: grpc.aio.Server | None = None
        self._admin: web.AppRunner | None = None
        self._health_grpc: grpc.aio.Server | None = None
        self._stopping = asyncio.Event()
        self._mtime = _mtime(config_path)
        self.appliers = self._register_appliers()

    def _register_appliers(self) -> Appliers:
        """What applies each reloadable section on a reload, in this order."""
        appliers = Appliers()
        appliers.register(self._discover, ["pools.*.discovery"])
        # The router swaps everything derived from these at once (epp.router); passive health
        # and the scraper's targets follow in the same call. ``edge`` is carried by the running
        # configuration only: Envoy reads it when ``epp envoy-config`` renders it again.
        appliers.register(
            self._use,
            [
                "models",
                "pools",
                "routing",
                "request",
                "admission",
                "budgets",
                "overflow",
                "autoscaling",
                "scheduling",
                "health",
                "edge",
            ],
        )
        appliers.register(self._apply_prefix_sources, ["models.*.tokenizer", "pools.*.endpoints"])
        appliers.register(self._apply_trust, ["pools.*.metrics_tls"])
        appliers.register(self._apply_scrape, ["scrape"])
        return appliers

    async def run(self) -> None:
        config = self.router.config
        await self.store.start()
        self._discover(config)
        config = self._use(config)
        if self.shared is not None:
            await self.shared.start()
        if self.budget_sync is not None:
            await self.budget_sync.start()
        await self.scraper.start()
        # Serve only once the group's endpoint states are in the local snapshot (bounded: with
        # Redis down, local state after one second rather than not at all).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FIRST_SYNC_SECONDS):
                await self.store.first_sync()
        self._apply_prefix_sources(config)
        self._apply_trust(config)
        await self.kv_events.start()
        if config.tracing.enabled:
            self.router.tracing = Tracing(config.tracing)
        await self._listen(config)
        if self._own_process:
            # Everything above lives as long as the process: out of the collector's way.
            settle_heap()
        tls = config.server.tls
        log.info(
            "epp serving ext_proc on %s:%d (health :%d, metrics :%d, %s), %d models, %d endpoints",
            config.server.host,
            config.server.extproc_port,
            config.server.health_port,
            config.server.metrics_port,
            "plaintext" if tls is None else "mTLS" if tls.client_ca else "TLS",
            len(config.models),
            len(config.endpoint_pools()),
        )
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stopping.set)
        ticker = asyncio.create_task(self._tick())
        await self._stopping.wait()
        ticker.cancel()
        await self._stop()

    async def _listen(self, config: Config) -> None:
        """Start the ext_proc, gRPC health and metrics/admin servers."""
        self._grpc = grpc.aio.server(options=GRPC_OPTIONS)
        ext_proc_pb2_grpc.add_ExternalProcessorServicer_to_server(
            ExtProcServicer(self.router), self._grpc
        )
        host = config.server.host
        tls = config.server.tls
        self._health_grpc = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self._health_grpc)
        # Health shares the ext_proc port's credentials: Envoy's health checks use the epp
        # cluster's transport socket.
        for server, port in (
            (self._grpc, config.server.extproc_port),
            (self._health_grpc, config.server.health_port),
        ):
            if tls is None:
                server.add_insecure_port(f"{host}:{port}")
            else:
                server.add_secure_port(f"{host}:{port}", grpc_credentials(tls))
        REGISTRY.register(self.pool_gauges)
        self._admin = web.AppRunner(build_app(self.router, config.server), access_log=None)
        await self._admin.setup()
        await web.TCPSite(
            self._admin,
            host,
            config.server.metrics_port,
            ssl_context=None if tls is None else server_context(tls),
        ).start()
        await self._grpc.start()
        await self._health_grpc.start()
        await self.health.start()

    async def _stop(self) -> None:
        """Drain (NOT_SERVING, then open streams finish), then stop everything started."""
        server = self.router.config.server
        log.info(
            "epp stopping: NOT_SERVING for %.1fs, then up to %.0fs for open streams",
            server.drain_seconds,
            server.shutdown_grace_seconds,
        )
        await self.health.shutdown()
        await asyncio.sleep(server.drain_seconds)
        if self._grpc is not None:
            await self._grpc.stop(grace=server.shutdown_grace_seconds)
        if self._health_grpc is not None:
            await self._health_grpc.stop(grace=0)
        if self._admin is not None:
            await self._admin.cleanup()
        REGISTRY.unregister(self.pool_gauges)
        await self.discovery.stop()
        await self.resources.stop()
        await self.scraper.stop()
        await self.kv_events.stop()
        if self.budget_sync is not None:
            await self.budget_sync.stop()
        if self.shared is not None:
            await self.shared.stop()
        await self.store.stop()
        if self.router.tracing is not None:
            # Exports what is still queued (blocking I/O: off the event loop).
            await asyncio.to_thread(self.router.tracing.shutdown)

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
        tokenizers = self.fleet.states.get(TOKENIZERS)
        tokenizers.set_models({m: spec.tokenizer for m, spec in config.models.items()})
        self.kv_events.set_endpoints(
            config.kv_events, {a: r.index for a, r in config.ranks.items()}
        )

    def _apply_trust(self, config: Config) -> None:
        """TLS for scraping (files read on start and on every reload, so renewed certificates
        are picked up), a word about explain output going to every client, and what else the
        configuration cannot do as it appears to (epp.config_advice)."""
        self.scraper.set_tls(
            {pool: (client_context(t), t.server_name) for pool, t in config.metrics_tls.items()}
        )
        if config.routing.explain and not (
            config.routing.explain_token or config.server.debug_token
        ):
            log.warning(
                "routing.explain is on without routing.explain_token or server.debug_token: "
                "every client receives x-epp-scores (docs/security.md)"
            )
        for warning in advice(config):
            log.warning("configuration: %s", warning)

    async def reload(self) -> bool:
        """Load the config file again; apply it if valid, else keep the current one."""
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            CONFIG_RELOADS.labels("rejected").inc()
            log.error("configuration reload rejected, keeping the current one: %s", exc)
            return False
        new = self._keep_restart_only(new)
        self.appliers.apply(new)
        CONFIG_RELOADS.labels("ok").inc()
        running = self.router.config
        log.info(
            "configuration reloaded: %d models, %d endpoints",
            len(running.models),
            len(running.endpoint_pools()),
        )
        return True

    def _use(self, config: Config) -> Config:
        """Route with ``config``, its pools holding the endpoints discovery last published.

        The router's candidate lists and the scraper's targets change in this one call: an
        endpoint that left is out of scheduling at once; one that joined starts unready and
        becomes a candidate only after its first successful scrape.
        """
        pools = self.discovery.apply(config)
        if pools != dict(config.pools):
            config = replace(config, pools=pools)
        roles = self.discovery.roles(config)
        if roles != dict(config.roles):
            config = replace(config, roles=roles)
        replicas = {
            pool: tuple(dict.fromkeys(replica_of(config.ranks, a) for a in addrs))
            for pool, addrs in pools.items()
        }
        if config.data_parallel or config.ranks:
            config = replace(config, **rank_changes(config))
        self.router.config = config
        endpoints = config.endpoint_pools()
        # Overflow pools' replicas are scraped too (spillover needs to know they have room),
        # but they are no candidates of ours and no part of the health tracking.
        scraped = config.spillover.endpoints() | endpoints
        if self.shared is not None:
            self.shared.set_endpoints(scraped)
        self.scraper.set_engines(config.engines)
        self.scraper.set_ranks({a: (r.replica, r.index) for a, r in config.ranks.items()})
        self.scraper.set_endpoints(scraped)
        self.fleet.health.configure(config.health, endpoints)
        self.fleet.latency.configure(config.weights, endpoints)
        self.discovery.export(replicas)  # Envoy knows replicas, not their ranks
        return config

    def _endpoints_changed(self) -> None:
        self._use(self.router.config)

    def _discover(self, config: Config) -> None:
        """Start, change or stop each pool's discovery source, and follow the InferencePools'
        objectives and rewrites."""
        self.discovery.configure(config)
        specs = pool_specs(config, self._overrides)
        self.resources.configure(
            {pool: s for pool, s in specs.items() if isinstance(s, KubernetesSpec)}
        )

    def _resources_changed(self) -> None:
        self.router.cluster = self.resources.current()

    def _keep_restart_only(self, new: Config) -> Config:
        """``new`` with the running value of every restart-only section; a change to one is
        logged and counted once (again only if the file changes it to yet another value)."""
        running = self.router.config
        kept: dict[str, object] = {}
        for section, reload in SECTIONS.items():
            if reload is not Reload.RESTART:
                continue
            wanted = getattr(new, section)
            if wanted == getattr(self._loaded, section):
                self._reported.pop(section, None)
            elif self._reported.get(section) != wanted:
                self._reported[section] = wanted
                CONFIG_RESTART_REQUIRED.labels(section).inc()
                log.warning(
                    "configuration reload: the %s section changed; it takes effect on restart "
                    "only and is NOT applied (the rest of the file is)",
                    section,
                )
            kept[section] = getattr(running, section)
        return replace(new, **kept)  # type: ignore[arg-type]

    def _apply_scrape(self, config: Config) -> None:
        """The scrape timing and what follows the interval: the state store's refresh and the
        shared-state sync (admission's staleness is derived in the configuration itself)."""
        scrape = config.scrape
        self.scraper.set_timing(scrape.interval, scrape.timeout, scrape.failure_threshold)
        self.store.set_refresh_interval(scrape.interval)
        if self.shared is not None:
            self.shared.set_interval(scrape.interval)
        if self.budget_sync is not None:
            self.budget_sync.set_interval(scrape.interval, LEASE_INTERVALS * scrape.interval)


def _mtime(path: Path) -> float:
    with contextlib.suppress(OSError):
        return os.stat(path).st_mtime
    return 0.0


def serve(
    config_path: Path,
    config: Config,
    *,
    loaded: Config | None = None,
    discovery: DiscoveryOptions | None = None,
) -> int:
    server = Server(config_path, config, loaded=loaded, discovery=discovery, own_process=True)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is optional on exotic platforms
        asyncio.run(server.run())
    else:
        uvloop.run(server.run())
    return 0
