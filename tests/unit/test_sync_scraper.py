"""Scraper + RedisStore + leases: one scrape per interval for the group, one view of readiness."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from epp.sources.scraper import MetricsScraper
from epp.state.fleet import FleetState
from epp.state.redis_store import RedisStore
from epp.state.shared.connect import hash_tag
from epp.state.shared.sync import SharedState
from tests.unit.conftest import SHARED_URL, eventually

TICK = 0.02
# Leases renew at a slower tick than the scrapes: a lease lives three ticks, and at 20 ms a busy
# machine's scheduling delays alone let one lapse and move, which these tests would count as
# a second scraper or a flap.
LEASE_TICK = 0.25
PAGE = 'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'


class Replica:
    """A /metrics endpoint that counts its scrapes and can be taken down."""

    def __init__(self) -> None:
        self.scrapes = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def handle(self, _request: web.Request) -> web.Response:
        self.scrapes += 1
        return web.Response(text=PAGE)

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Process:
    """What one epp process runs for endpoint state: store, shared state, scraper."""

    store: RedisStore
    shared: SharedState
    scraper: MetricsScraper

    def ready(self, address: str) -> bool | None:
        state = self.store.snapshot().get(address)
        return None if state is None else state.ready

    async def crash(self) -> None:
        """Stop without leaving the group or releasing leases (SIGKILL-like)."""
        await self.scraper.stop()
        self.shared._stopping = True
        assert self.shared._task is not None
        self.shared._task.cancel()
        await asyncio.gather(self.shared._task, return_exceptions=True)

    async def stop(self) -> None:
        await self.scraper.stop()
        await self.shared.stop()
        await self.store.stop()


@pytest.fixture
async def replica() -> AsyncIterator[Replica]:
    r = Replica()
    await r.start()
    yield r
    await r.stop()


@pytest.fixture
async def processes(prefix: str, replica: Replica) -> AsyncIterator[list[Process]]:
    procs = []
    for _ in range(2):
        store = RedisStore(SHARED_URL, key_prefix=hash_tag(prefix), refresh_interval=TICK)
        shared = SharedState(SHARED_URL, FleetState(store), key_prefix=prefix, interval=LEASE_TICK)
        scraper = MetricsScraper(store, interval=TICK, timeout=0.2, owns=shared.owns)
        await store.start()
        shared.set_endpoints([replica.address])
        await shared.start()
        scraper.set_endpoints({replica.address: "pool"})
        await scraper.start()
        procs.append(Process(store, shared, scraper))
    yield procs
    for p in procs:
        await p.stop()


async def owner_and_follower(procs: list[Process], address: str) -> tuple[Process, Process]:
    """Both processes can report the endpoint ready before either holds its lease (until then
    each scrapes it as a lone epp would), so wait for the lease to settle. One endpoint over two
    members: the first in id order has a share of one, the other none. Whoever held the lease
    first may be the other one, alone for a tick, and hands it over on its next tick: waiting
    for any single holder could return that one, which a busy machine made likelier."""
    owner = min(procs, key=lambda p: p.shared.me)
    await eventually(lambda: owner.shared.leases.owned() == frozenset({address}), what="owner")
    return owner, next(p for p in procs if p is not owner)


async def test_the_group_scrapes_each_endpoint_once_per_interval(
    processes: list[Process], replica: Replica
) -> None:
    address = replica.address
    await eventually(lambda: all(p.ready(address) for p in processes), what="both ready")
    start, started = replica.scrapes, time.monotonic()
    await asyncio.sleep(1.0)
    rate = (replica.scrapes - start) / (time.monotonic() - started)
    # One scraper at ~1/TICK = 50 per second; two would be ~100.
    assert rate < 1.35 / TICK, f"{rate:.0f} scrapes/s"
    states = [p.store.snapshot().get(address) for p in processes]
    assert all(s is not None and s.metrics.running == 3 for s in states)


async def test_a_follower_never_flaps_and_sees_the_owner_verdict(
    processes: list[Process], replica: Replica
) -> None:
    address = replica.address
    await eventually(lambda: all(p.ready(address) for p in processes), what="both ready")
    owner, follower = await owner_and_follower(processes, address)

    # The follower cannot reach the replica (a partition). Before leases it scraped anyway and
    # its failures flipped its view to unready between merges of the owner's fresher state.
    async def unreachable(endpoint: Any, _session: object) -> None:
        follower.scraper._failed(endpoint, "error", "partitioned")
        await follower.scraper._publish(endpoint)

    follower.scraper._scrape = unreachable  # type: ignore[method-assign]
    seen = set()
    for _ in range(100):
        seen.add(follower.ready(address))
        await asyncio.sleep(TICK / 2)
    assert seen == {True}

    # The replica dies: the owner's failures (scraped_at stands still) must win everywhere.
    await replica.stop()
    await eventually(lambda: follower.ready(address) is False, what="unready at follower")
    assert owner.ready(address) is False


async def test_a_new_owner_continues_the_failure_count(
    processes: list[Process], replica: Replica
) -> None:
    address = replica.address
    await eventually(lambda: all(p.ready(address) for p in processes), what="both ready")
    owner, follower = await owner_and_follower(processes, address)
    await replica.stop()
    await eventually(lambda: follower.ready(address) is False, what="unready")
    failures = follower.store.snapshot().get(address).failures  # type: ignore[union-attr]
    await owner.crash()
    await eventually(lambda: follower.shared.owns(address), what="takeover")
    # The follower's scraper adopted the state: counting goes on, unready stays unready.
    await eventually(
        lambda: follower.store.snapshot().get(address).failures > failures + 2,  # type: ignore[union-attr]
        what="failures counted by the new owner",
    )
    assert follower.ready(address) is False
    await replica.start(replica.port)
    await eventually(lambda: follower.ready(address) is True, what="ready again")
