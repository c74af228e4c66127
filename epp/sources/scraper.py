"""Poll every replica's ``/metrics`` and keep its :class:`EndpointState` in the store.

Each pool's page is read by its engine's parser (:mod:`epp.sources.vllm_metrics` by default,
:mod:`epp.sources.sglang_metrics` for ``engine: sglang`` pools).

One task per endpoint, each awaiting its own scrape before sleeping, so scrapes of one endpoint
never overlap and a slow or dead endpoint only delays itself. Each task keeps its endpoint's
connection alive between scrapes rather than reopening it every 50 ms
(:mod:`epp.sources.metrics_client`), and a page identical to the last one parsed is not parsed
again (an idle replica's page does not change). A failed poll keeps the last metrics; only
``failure_threshold`` consecutive failures make an endpoint unready, so one dropped packet does
not shift traffic.

When several epp processes share Redis, ``owns`` says which endpoints this process holds the
scrape lease for (:mod:`epp.state.shared.lease`); the others are followed through the store instead:
their gauges mirror the lease holder's observations, and a process that takes a lease over
continues from the latest of them (failure count included), so an endpoint that was failing for
the previous owner does not look fresh and ready to the next.

Cost on the replica: a real vLLM renders its ~50 KB page on its API server's CPU for every
poll, so each process polling it every 50 ms takes a noticeable share of a core from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from epp.observability import (
    ENDPOINT_METRICS_AGE,
    ENDPOINT_READY,
    SCRAPES,
    forget_endpoint_responses,
)
from epp.sources.metrics_client import MetricsConnection
from epp.sources.sglang_metrics import parse_sglang_metrics
from epp.sources.vllm_metrics import parse_vllm_metrics
from epp.state.snapshot import EndpointMetrics, EndpointState
from epp.state.store import StateStore

log = logging.getLogger(__name__)


class Parser(Protocol):
    """Reads one engine's /metrics page (only one data-parallel rank's series if ``rank`` is
    given); raises ValueError for a page that is not that engine's."""

    def __call__(self, text: str, rank: int | None = None) -> EndpointMetrics: ...


PARSERS: Mapping[str, Parser] = {"vllm": parse_vllm_metrics, "sglang": parse_sglang_metrics}

# Each period is interval * U(1 - JITTER, 1 + JITTER): endpoints start at random phases and keep
# drifting apart, so they are not polled in lockstep even after a shared outage re-aligned them.
_JITTER = 0.1


@dataclass
class _Endpoint:
    """Per-endpoint scrape state, owned by that endpoint's task."""

    address: str
    pool: str
    # A data-parallel rank's endpoint reads its replica's page, only its rank's series.
    replica: str = ""
    rank: int | None = None
    ready: bool = False
    failures: int = 0
    metrics: EndpointMetrics = field(default_factory=EndpointMetrics)
    scraped_at: float = 0.0
    task: asyncio.Task[None] | None = None
    # The page ``metrics`` were parsed from (empty when they came from elsewhere: the store).
    page: bytes = b""
    connection: MetricsConnection = field(init=False)

    def __post_init__(self) -> None:
        self.connection = MetricsConnection(self.replica or self.address)


class MetricsScraper:
    """Scrapes each endpoint every ``interval`` seconds and writes the result to ``store``."""

    def __init__(
        self,
        store: StateStore,
        *,
        interval: float = 0.05,
        timeout: float = 1.0,
        failure_threshold: int = 3,
        owns: Callable[[str], bool] | None = None,
    ) -> None:
        self._store = store
        self._interval = interval
        self._timeout = timeout
        self._threshold = failure_threshold
        # Set by set_timing: cuts every endpoint's current wait short so a new interval applies
        # at once, not after one more period of the old one.
        self._retimed = asyncio.Event()
        self.set_timing(interval, timeout, failure_threshold)
        self._owns = owns or (lambda _address: True)
        self._wanted: dict[str, str] = {}
        self._ranks: dict[str, tuple[str, int]] = {}
        self._tls: dict[str, tuple[ssl.SSLContext, str | None]] = {}
        self._parsers: dict[str, Parser] = {}
        self._endpoints: dict[str, _Endpoint] = {}
        self._started = False
        # Retain calls in flight; kept so stop() can wait for them and they are not collected.
        self._housekeeping: set[asyncio.Task[None]] = set()

    @property
    def timing(self) -> tuple[float, float, int]:
        """``(interval, timeout, failure_threshold)`` in force."""
        return self._interval, self._timeout, self._threshold

    def set_timing(self, interval: float, timeout: float, failure_threshold: int) -> None:
        """Scrape every ``interval`` from now on (a configuration reload), each scrape given up
        after ``timeout``, an endpoint unready after ``failure_threshold`` failures in a row."""
        if interval <= 0 or timeout <= 0 or failure_threshold < 1:
            raise ValueError("interval and timeout must be > 0, failure_threshold >= 1")
        changed = interval != self._interval
        self._interval = interval
        self._timeout = timeout
        self._threshold = failure_threshold
        if changed:
            self._retimed.set()
            self._retimed = asyncio.Event()

    def set_endpoints(self, endpoints: Mapping[str, str]) -> None:
        """Scrape exactly ``endpoints`` (address -> pool name) from now on.

        Safe to call at any time from the event loop thread (before :meth:`start` it only
        records the list). New endpoints start unready until their first successful scrape;
        removed ones stop being scraped and are dropped from the store.
        """
        self._wanted = dict(endpoints)
        if self._started:
            self._reconcile()

    def set_ranks(self, ranks: Mapping[str, tuple[str, int]]) -> None:
        """Endpoints that are data-parallel ranks: address -> (replica whose page to read, rank).
        Applies to endpoints added by the next :meth:`set_endpoints`; an endpoint whose rank
        changed is replaced then."""
        self._ranks = dict(ranks)

    def set_tls(self, pools: Mapping[str, tuple[ssl.SSLContext, str | None]]) -> None:
        """Scrape the replicas of these pools over https with (context, server name to verify,
        default the endpoint's IP); every other pool over http. Applies from the next scrape."""
        self._tls = dict(pools)

    def set_engines(self, pools: Mapping[str, str]) -> None:
        """Read the pages of these pools (pool -> engine name, a key of :data:`PARSERS`) with
        their engine's parser; every other pool's as vLLM's. Applies from the next scrape; a
        changed parser also parses an unchanged page again."""
        parsers = {pool: PARSERS[engine] for pool, engine in pools.items()}
        if parsers != self._parsers:
            for endpoint in self._endpoints.values():
                endpoint.page = b""
        self._parsers = parsers

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._reconcile()

    async def stop(self) -> None:
        tasks = [e.task for e in self._endpoints.values() if e.task is not None]
        for task in tasks:
            task.cancel()
        # Pending retains are local and quick; let them finish so the store matches the list.
        await asyncio.gather(*tasks, *self._housekeeping, return_exceptions=True)
        self._endpoints.clear()
        self._started = False

    def _reconcile(self) -> None:
        removed = [
            e
            for a, e in self._endpoints.items()
            if a not in self._wanted or (e.replica, e.rank) != self._ranks.get(a, ("", None))
        ]
        for endpoint in removed:
            del self._endpoints[endpoint.address]
            if endpoint.task is not None:
                endpoint.task.cancel()
            _forget_series(endpoint)
        for address, pool in self._wanted.items():
            known = self._endpoints.get(address)
            if known is None:
                added = _Endpoint(address, pool, *self._ranks.get(address, ("", None)))
                self._endpoints[address] = added
                added.task = asyncio.create_task(self._run(added), name=f"epp-scrape-{address}")
            elif known.pool != pool:
                # Moved to another pool: the next write carries the new pool name.
                ENDPOINT_READY.remove(known.pool, address)
                known.pool = pool
                ENDPOINT_READY.labels(pool, address).set(1 if known.ready else 0)
        task = asyncio.create_task(self._retain([e.task for e in removed if e.task is not None]))
        self._housekeeping.add(task)
        task.add_done_callback(self._housekeeping.discard)

    async def _retain(self, cancelled: list[asyncio.Task[None]]) -> None:
        # Let removed tasks finish unwinding first so none of them writes after the retain.
        await asyncio.gather(*cancelled, return_exceptions=True)
        # The current endpoint list, not the one at call time: a later set_endpoints may have
        # run while we waited, and an older list would drop endpoints it added.
        await self._store.retain(list(self._endpoints))

    async def _run(self, endpoint: _Endpoint) -> None:
        try:
            await self._poll(endpoint)
        finally:
            endpoint.connection.close()

    async def _poll(self, endpoint: _Endpoint) -> None:
        ENDPOINT_READY.labels(endpoint.pool, endpoint.address).set(0)
        if self._owns(endpoint.address):
            await self._publish(endpoint)  # known, but unready until the first successful scrape
        loop = asyncio.get_running_loop()
        # The first scrape at once: a joining endpoint is routable only after it, and a pool
        # whose members were all replaced (discovery) has no candidate until then. Later ones
        # at a random phase, so that endpoints added together do not scrape in step.
        next_at = loop.time()
        period = random.uniform(0.0, self._interval)
        while True:
            self._catch_up(endpoint)
            if self._owns(endpoint.address):
                await self._scrape(endpoint)
            next_at += period
            period = self._interval * random.uniform(1.0 - _JITTER, 1.0 + _JITTER)
            # After a scrape slower than the interval (a timeout), skip the missed ticks
            # instead of firing them back to back.
            next_at = max(next_at, loop.time())
            if await self._pause(next_at - loop.time()):
                # New timing: start over from now, at a random phase of the new interval.
                next_at = loop.time() + random.uniform(0.0, self._interval)
                await self._pause(next_at - loop.time())

    async def _pause(self, seconds: float) -> bool:
        """Sleep ``seconds``; True if :meth:`set_timing` changed the interval meanwhile."""
        retimed = self._retimed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await retimed.wait()
        return retimed.is_set()

    async def _scrape(self, endpoint: _Endpoint) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                page = await endpoint.connection.fetch(self._tls.get(endpoint.pool))
            if page != endpoint.page:
                parse = self._parsers.get(endpoint.pool, parse_vllm_metrics)
                metrics = parse(page.decode("utf-8", "replace"), endpoint.rank)
                endpoint.page = page
            else:
                metrics = endpoint.metrics
        except TimeoutError:
            self._failed(endpoint, "timeout", f"no answer within {self._timeout:g}s")
        # Any other error, including a bug in parsing, is this endpoint's failed scrape and must
        # not end its task or touch other endpoints.
        except Exception as exc:
            self._failed(endpoint, "error", str(exc) or type(exc).__name__)
        else:
            SCRAPES.labels(endpoint.address, "ok").inc()
            if not endpoint.ready:
                log.info("endpoint %s (pool %s) is ready", endpoint.address, endpoint.pool)
                ENDPOINT_READY.labels(endpoint.pool, endpoint.address).set(1)
            endpoint.ready = True
            endpoint.failures = 0
            endpoint.metrics = metrics
            endpoint.scraped_at = time.time()
        if endpoint.scraped_at > 0.0:
            ENDPOINT_METRICS_AGE.labels(endpoint.address).set(time.time() - endpoint.scraped_at)
        await self._publish(endpoint)

    def _catch_up(self, endpoint: _Endpoint) -> None:
        """Take the store's observation of ``endpoint`` if it is newer than ours.

        Ordered as the Redis store orders them, by (scraped_at, failures). A follower takes every
        observation of the lease holder; a new lease holder continues from the previous one's
        latest, which may be later than the last one it followed (both scraped during the
        handover), so that its own failures count as newer everywhere. Alone, the store only
        ever holds our own observations and this changes nothing.
        """
        state = self._store.snapshot().get(endpoint.address)
        if state is None or (state.scraped_at, state.failures) <= (
            endpoint.scraped_at,
            endpoint.failures,
        ):
            return
        if state.ready != endpoint.ready:
            ENDPOINT_READY.labels(endpoint.pool, endpoint.address).set(1 if state.ready else 0)
        endpoint.ready = state.ready
        endpoint.failures = state.failures
        endpoint.metrics = state.metrics
        endpoint.page = b""
        endpoint.scraped_at = state.scraped_at
        if state.scraped_at > 0.0:
            ENDPOINT_METRICS_AGE.labels(endpoint.address).set(state.age())

    def _failed(self, endpoint: _Endpoint, result: str, reason: str) -> None:
        SCRAPES.labels(endpoint.address, result).inc()
        endpoint.failures += 1
        # Logged once per outage: when the threshold is crossed, whether the endpoint was ready
        # before or has never answered yet, or when a lowered threshold (a reload) is already
        # behind a ready endpoint's count.
        if endpoint.failures < self._threshold or (
            endpoint.failures > self._threshold and not endpoint.ready
        ):
            return
        log.warning(
            "endpoint %s (pool %s) is unready after %d failed scrapes: %s",
            endpoint.address,
            endpoint.pool,
            endpoint.failures,
            reason,
        )
        if endpoint.ready:
            endpoint.ready = False
            ENDPOINT_READY.labels(endpoint.pool, endpoint.address).set(0)

    async def _publish(self, endpoint: _Endpoint) -> None:
        await self._store.put_endpoint(
            EndpointState(
                address=endpoint.address,
                pool=endpoint.pool,
                ready=endpoint.ready,
                metrics=endpoint.metrics,
                scraped_at=endpoint.scraped_at,
                failures=endpoint.failures,
            )
        )


def _forget_series(endpoint: _Endpoint) -> None:
    """Drop a removed endpoint's label sets so dashboards do not show it forever."""
    ENDPOINT_READY.remove(endpoint.pool, endpoint.address)
    ENDPOINT_METRICS_AGE.remove(endpoint.address)
    for result in ("ok", "error", "timeout"):
        SCRAPES.remove(endpoint.address, result)
    forget_endpoint_responses(endpoint.address)
