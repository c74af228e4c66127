"""MetricsScraper against real aiohttp servers on 127.0.0.1 serving vLLM metrics pages."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from epp.devstack import free_port
from epp.observability import RESPONSES
from epp.sources.scraper import MetricsScraper
from epp.state.memory import MemoryStore
from epp.state.snapshot import EndpointState, Snapshot
from tests.unit.conftest import eventually

PAGE = (Path(__file__).resolve().parent.parent / "fixtures" / "metrics_sample_v0.txt").read_text()


class FakeVllm:
    """A /metrics server whose answer, delay and liveness a test controls."""

    def __init__(self) -> None:
        self.page = PAGE
        self.status = 200
        self.delay = 0.0
        # When set, answers wait until it is (the test decides when a scrape completes).
        self.gate: asyncio.Event | None = None
        self.hits = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _metrics(self, _: web.Request) -> web.Response:
        self.hits += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if self.gate is not None:
                await self.gate.wait()
            return web.Response(text=self.page, status=self.status, content_type="text/plain")
        finally:
            self.in_flight -= 1

    async def start(self) -> None:
        """Listen on a free port the first time, on the same port after a stop."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@pytest.fixture
async def servers() -> AsyncIterator[Callable[[], FakeVllm]]:
    started: list[FakeVllm] = []

    def make() -> FakeVllm:
        server = FakeVllm()
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop()


async def _server(make: Callable[[], FakeVllm]) -> FakeVllm:
    server = make()
    await server.start()
    return server


class RecordingStore(MemoryStore):
    """A MemoryStore that also keeps every state it was given, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.puts: list[EndpointState] = []

    async def put_endpoint(self, state: EndpointState) -> None:
        self.puts.append(state)
        await super().put_endpoint(state)


def _state(store: MemoryStore, address: str) -> EndpointState | None:
    return store.snapshot().get(address)


def _ready(store: MemoryStore, address: str) -> bool:
    state = _state(store, address)
    return state is not None and state.ready


def _scrapes(address: str, result: str) -> float:
    return (
        REGISTRY.get_sample_value("epp_scrapes_total", {"endpoint": address, "result": result})
        or 0.0
    )


async def test_endpoint_is_unready_until_first_scrape_then_ready(servers) -> None:
    server = await _server(servers)
    server.gate = asyncio.Event()  # the first scrape is still in flight while we look
    store = MemoryStore()
    scraper = MetricsScraper(store, interval=0.02)
    scraper.set_endpoints({server.address: "pool-a"})
    started = time.time()
    await scraper.start()
    try:
        await eventually(lambda: _state(store, server.address) is not None, what="first publish")
        assert not _ready(store, server.address)
        assert (
            REGISTRY.get_sample_value(
                "epp_endpoint_ready", {"pool": "pool-a", "endpoint": server.address}
            )
            == 0.0
        )

        server.gate.set()
        await eventually(lambda: _ready(store, server.address), what="ready")
        state = _state(store, server.address)
        assert state is not None
        assert state.pool == "pool-a"
        assert state.failures == 0
        assert (state.metrics.running, state.metrics.waiting) == (3, 2)
        assert started <= state.scraped_at <= time.time()  # wall-clock time of the scrape
        assert _scrapes(server.address, "ok") >= 1
        assert (
            REGISTRY.get_sample_value(
                "epp_endpoint_ready", {"pool": "pool-a", "endpoint": server.address}
            )
            == 1.0
        )
    finally:
        await scraper.stop()


async def test_a_joining_endpoint_is_scraped_at_once_not_a_random_phase_later(servers) -> None:
    """Discovery may replace every member of a pool at once: until a new member's first scrape
    the pool has no candidate, so that scrape must not wait for a phase of the interval."""
    first, joining = await _server(servers), await _server(servers)
    store = MemoryStore()
    # An hour's interval: a random phase would come under the 10 s bound once in 360 runs,
    # while 10 s leaves a loaded machine room for a scrape that comes at once.
    scraper = MetricsScraper(store, interval=3600.0)
    scraper.set_endpoints({first.address: "pool-a"})
    await scraper.start()
    try:
        await eventually(lambda: _ready(store, first.address), within=10.0, what="first ready")
        scraper.set_endpoints({joining.address: "pool-a"})  # every member replaced
        await eventually(lambda: _ready(store, joining.address), within=10.0, what="the joiner")
        assert joining.hits == 1
    finally:
        await scraper.stop()


async def test_stopped_replica_goes_unready_quickly_and_comes_back(servers, caplog) -> None:
    caplog.set_level(logging.INFO, logger="epp.sources.scraper")
    server = await _server(servers)
    store = RecordingStore()
    scraper = MetricsScraper(store)  # defaults: 50 ms, 1 s timeout, 3 failures
    scraper.set_endpoints({server.address: "p"})
    await scraper.start()
    try:
        await eventually(lambda: _ready(store, server.address), what="ready")
        errors_before = _scrapes(server.address, "error")

        await server.stop()
        stopped_at = len(store.puts)
        timeouts_before = _scrapes(server.address, "timeout")
        await eventually(lambda: not _ready(store, server.address), what="unready")
        # Connection refused is immediate: the failures are errors, never a timeout's wait
        # (how long they take is a matter for the machine's load, not for this test).
        assert _scrapes(server.address, "timeout") == timeouts_before
        outage = store.puts[stopped_at:]
        # Ready through two failures, unready from the third; last known metrics are kept.
        assert [(s.failures, s.ready) for s in outage[:3]] == [(1, True), (2, True), (3, False)]
        assert all(s.metrics.running == 3 and s.scraped_at > 0 for s in outage)
        await asyncio.sleep(0.2)  # more failures: still exactly one warning
        assert _scrapes(server.address, "error") - errors_before >= 5

        await server.start()  # same port
        await eventually(lambda: _ready(store, server.address), what="ready again")
        state = _state(store, server.address)
        assert state is not None
        assert state.failures == 0
    finally:
        await scraper.stop()
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    warnings = [m for level, m in messages if level == logging.WARNING]
    assert len(warnings) == 1
    assert "unready" in warnings[0]
    readies = [m for level, m in messages if level == logging.INFO and "is ready" in m]
    assert len(readies) == 2  # first success, and recovery


async def test_slow_replica_times_out_and_counts_as_failure(servers) -> None:
    server = await _server(servers)
    store = MemoryStore()
    scraper = MetricsScraper(store, interval=0.02, timeout=0.1, failure_threshold=2)
    scraper.set_endpoints({server.address: "p"})
    await scraper.start()
    try:
        await eventually(lambda: _ready(store, server.address), what="ready")
        timeouts_before = _scrapes(server.address, "timeout")
        server.delay = 0.5
        took = await eventually(lambda: not _ready(store, server.address), what="unready")
        # Two timeouts, not an instant failure. Not ">= 0.2": a scrape sent just before the
        # delay was set can be answered with it, so the first timeout may end up to one
        # interval early (seen: 0.197 s). The second timeout starts after the first ends, so
        # at least one whole timeout passes after the delay is set.
        assert took >= 0.1
        assert _scrapes(server.address, "timeout") - timeouts_before >= 2
    finally:
        await scraper.stop()


@pytest.mark.parametrize(
    ("status", "page"),
    [(503, PAGE), (200, "<html>gateway</html>")],
    ids=["http-503", "not-a-metrics-page"],
)
async def test_bad_answers_are_failures(servers, status: int, page: str) -> None:
    server = await _server(servers)
    server.status, server.page = status, page
    store = MemoryStore()
    scraper = MetricsScraper(store, interval=0.01, failure_threshold=2)
    scraper.set_endpoints({server.address: "p"})
    await scraper.start()
    try:
        await eventually(lambda: server.hits >= 4, what="several scrapes")
        state = _state(store, server.address)
        assert state is not None
        assert not state.ready
        assert state.failures >= 3
        assert state.scraped_at == 0.0
        assert _scrapes(server.address, "error") >= 3
    finally:
        await scraper.stop()


async def test_dead_endpoint_does_not_affect_others(servers) -> None:
    good = await _server(servers)
    dead = f"127.0.0.1:{free_port()}"
    store = MemoryStore()
    scraper = MetricsScraper(store, interval=0.02)
    scraper.set_endpoints({good.address: "p", dead: "p"})
    await scraper.start()
    try:
        await eventually(lambda: getattr(_state(store, dead), "failures", 0) >= 5, what="failures")
        assert _ready(store, good.address)
        # The good endpoint goes on being scraped beside the failing one.
        ok = _scrapes(good.address, "ok")
        await eventually(lambda: _scrapes(good.address, "ok") >= ok + 3, what="more good scrapes")
        assert _ready(store, good.address)
        assert not _ready(store, dead)
    finally:
        await scraper.stop()


async def test_scrapes_of_one_endpoint_never_overlap(servers) -> None:
    server = await _server(servers)
    server.delay = 0.06  # three intervals per answer
    store = MemoryStore()
    scraper = MetricsScraper(store, interval=0.02, timeout=1.0)
    scraper.set_endpoints({server.address: "p"})
    await scraper.start()
    try:
        await asyncio.sleep(0.5)
    finally:
        await scraper.stop()
    assert server.max_in_flight == 1
    assert 4 <= server.hits <= 10


async def test_set_endpoints_adds_removes_and_moves_endpoints(servers) -> None:
    a = await _server(servers)
    b = await _server(servers)
    store = MemoryStore()
    scraper = MetricsScraper(store, interval=0.02)
    scraper.set_endpoints({a.address: "p1"})
    await scraper.start()
    try:
        await eventually(lambda: _ready(store, a.address), what="a ready")
        assert b.hits == 0

        scraper.set_endpoints({a.address: "p1", b.address: "p1"})
        await eventually(lambda: _ready(store, b.address), what="b ready")
        RESPONSES.labels(a.address, "2xx").inc()  # a served a response

        scraper.set_endpoints({b.address: "p2"})
        await eventually(lambda: _state(store, a.address) is None, what="a forgotten")
        # Its series go with it: label sets stay bounded by the endpoints that exist.
        labels = {"endpoint": a.address, "code": "2xx"}
        assert REGISTRY.get_sample_value("epp_endpoint_responses_total", labels) is None
        await eventually(
            lambda: getattr(_state(store, b.address), "pool", None) == "p2", what="b moved"
        )
        assert (
            REGISTRY.get_sample_value("epp_endpoint_ready", {"pool": "p1", "endpoint": b.address})
            is None
        )
        hits = a.hits
        await asyncio.sleep(0.1)
        assert a.hits == hits  # no longer scraped
        assert _state(store, a.address) is None  # and not written back by a late scrape
        assert _ready(store, b.address)
    finally:
        await scraper.stop()


class _CountingStore(MemoryStore):
    """Counts reads of the snapshot: one per followed endpoint per sweep (``_catch_up``)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def snapshot(self) -> Snapshot:
        self.reads += 1
        return super().snapshot()


async def test_endpoints_another_process_scrapes_cost_no_timer_each(
    servers: Callable[[], FakeVllm], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A timer per followed endpoint and interval cost every process of a group ~35% of a core
    # at 1,000 endpoints; one sweep per interval follows them all.
    replica = await _server(servers)
    ours = replica.address
    followed = {f"10.0.0.{i}:8000": "p" for i in range(100)}
    owned: set[str] = set()
    store = _CountingStore()
    scraper = MetricsScraper(store, interval=0.01, timeout=0.5, owns=owned.__contains__)
    scraper.set_endpoints({**followed, ours: "p"})
    loop = asyncio.get_running_loop()
    timers = 0
    call_at = loop.call_at

    def counting(*args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        nonlocal timers
        timers += 1
        return call_at(*args, **kwargs)

    monkeypatch.setattr(loop, "call_at", counting)
    await scraper.start()
    try:
        await eventually(lambda: store.reads >= 10 * len(followed), what="ten sweeps")
        # Every followed endpoint was mirrored each sweep, with about one timer per sweep.
        assert timers * 10 < store.reads, (timers, store.reads)
        assert replica.hits == 0
        # Taken over: scraped within a sweep, and from then on every interval.
        owned.add(ours)
        await eventually(lambda: replica.hits >= 3, what="scrapes once ours")
    finally:
        await scraper.stop()
