"""Scrape leases and group membership against a real Redis.

Several :class:`SharedState` objects in one event loop stand for several epp processes (each
has its own client and id). Tests use the server at 127.0.0.1:6379 under a random key prefix;
the outage test starts its own ``redis-server``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio
from prometheus_client import REGISTRY

from epp.state.fleet import FleetState
from epp.state.shared.sync import LEASE_INTERVALS, SharedState
from tests.helpers import redis_servers
from tests.unit.conftest import SHARED_URL, eventually

TICK = 0.02
ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(7)]

Group = Callable[..., Awaitable[SharedState]]


@pytest.fixture
async def group(prefix: str) -> AsyncIterator[Group]:
    """Start members of one group; all are stopped at the end."""
    members: list[SharedState] = []

    async def start(url: str = SHARED_URL, interval: float = TICK) -> SharedState:
        member = SharedState(url, FleetState(), key_prefix=prefix, interval=interval)
        member.set_endpoints(ENDPOINTS)
        await member.start()
        members.append(member)
        return member

    yield start
    for member in members:
        await member.stop()


def owners(members: list[SharedState]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {e: [] for e in ENDPOINTS}
    for m in members:
        for e in m.leases.owned() or ():
            out[e].append(m.me)
    return out


def exactly_one_owner_each(members: list[SharedState]) -> bool:
    """Every member holds confirmed leases and every endpoint has one owner."""
    return all(m.leases.owned() is not None for m in members) and all(
        len(o) == 1 for o in owners(members).values()
    )


def shares(members: list[SharedState]) -> list[int]:
    return sorted(len(m.leases.owned() or ()) for m in members)


async def test_a_lone_process_holds_every_lease(group: Group) -> None:
    a = await group()
    await eventually(lambda: a.leases.owned() == frozenset(ENDPOINTS), what="all leases")
    assert all(a.owns(e) for e in ENDPOINTS)


async def test_leases_spread_to_fair_shares_and_never_overlap(group: Group) -> None:
    # A lease survives a tick late by up to two intervals. At the default interval (50 ms) a
    # busy machine's scheduling delays reach that and leases move; at 0.5 s they cannot.
    interval = 0.5
    members = [await group(interval=interval)]
    await eventually(lambda: exactly_one_owner_each(members))
    # 7 endpoints over n processes: shares differ by at most one and add up to 7.
    for expected in ([3, 4], [2, 2, 3]):
        members.append(await group(interval=interval))
        await eventually(
            lambda want=expected: exactly_one_owner_each(members) and shares(members) == want,
            what=f"shares {expected}",
        )
    # Stable: nothing moves over the next three ticks of every member once shared out.
    before = owners(members)
    ticks = [m._ticks for m in members]
    await eventually(
        lambda: all(m._ticks >= t + 3 for m, t in zip(members, ticks, strict=True)),
        within=30 * interval,
        what="three more ticks each",
    )
    assert owners(members) == before


async def test_a_dead_owner_is_replaced_within_about_three_intervals(group: Group) -> None:
    interval = 0.2  # long enough that a loaded machine's scheduling delays stay a small part
    a, b = await group(interval=interval), await group(interval=interval)
    await eventually(lambda: exactly_one_owner_each([a, b]) and bool(a.leases.owned()))
    # A crash: the loop stops without leaving the group (as if the process was SIGKILLed).
    a._stopping = True
    assert a._task is not None
    a._task.cancel()
    await asyncio.gather(a._task, return_exceptions=True)
    # Its leases end with their TTL (3 intervals; b takes them on its next tick), read from
    # Redis rather than timed: a busy machine stretches the wait. -2: expired already.
    client = redis.asyncio.Redis.from_url(SHARED_URL)
    try:
        ttls = [await client.pttl(a.keys.lease(e)) for e in a.leases.owned() or ()]
    finally:
        await client.aclose()
    assert ttls, "a held leases"
    assert all(t == -2 or 0 < t <= LEASE_INTERVALS * interval * 1000 for t in ttls), ttls
    await eventually(lambda: b.leases.owned() == frozenset(ENDPOINTS), what="takeover")


async def test_a_clean_stop_hands_leases_over_at_once(group: Group) -> None:
    # Leases of 3 x 0.5 s: had the stop left them to expire, they would still name ``a`` when
    # it returns, however slowly a loaded machine runs this test up to there.
    a, b = await group(interval=0.5), await group(interval=0.5)
    await eventually(lambda: exactly_one_owner_each([a, b]) and bool(a.leases.owned()))
    await a.stop()
    client = redis.asyncio.Redis.from_url(SHARED_URL)
    try:
        holders = await client.mget([a.keys.lease(e) for e in ENDPOINTS])
    finally:
        await client.aclose()
    assert a.me.encode() not in holders, holders
    await eventually(lambda: b.leases.owned() == frozenset(ENDPOINTS), what="handover")


async def test_before_the_first_answer_nothing_is_owned(prefix: str) -> None:
    member = SharedState(SHARED_URL, FleetState(), key_prefix=prefix, interval=TICK)
    member.set_endpoints(ENDPOINTS)
    assert not any(member.owns(e) for e in ENDPOINTS)
    await member.stop()


def _gauge(name: str) -> float | None:
    return REGISTRY.get_sample_value(name)


async def test_redis_outage_scrapes_everything_logs_once_and_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, group: Group
) -> None:
    if not redis_servers.available():
        pytest.skip("redis-server not installed")
    caplog.set_level(logging.INFO, logger="epp.state.shared.sync")
    server = redis_servers.RedisServer(tmp_path).start()
    try:
        a, b = await group(server.url), await group(server.url)
        await eventually(lambda: exactly_one_owner_each([a, b]) and bool(a.leases.owned()))

        server.kill()
        # Both fall back to scraping everything themselves.
        await eventually(lambda: a.leases.owned() is None and b.leases.owned() is None)
        assert all(a.owns(e) and b.owns(e) for e in ENDPOINTS)
        assert _gauge("epp_shared_leases") == len(ENDPOINTS)
        await asyncio.sleep(0.5)  # many failed retries: still one warning per process

        server.start()  # empty: the leases are gone and are taken afresh
        await eventually(
            lambda: exactly_one_owner_each([a, b]) and bool(a.leases.owned()),
            within=5.0,
            what="leases after restart",
        )
    finally:
        server.stop()
    messages = [r.getMessage() for r in caplog.records]
    # Once per process and outage, however many retries failed.
    assert len([m for m in messages if "scraping every endpoint" in m]) == 2, messages
    assert len([m for m in messages if "resumed" in m]) == 2, messages


class _Script:
    """Stands for a pipeline: records the keys the lease script was queued with."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def eval(self, _script: str, count: int, *args: object) -> None:
        self.keys = [str(a) for a in args[:count]]


async def test_a_settled_group_walks_only_the_leases_each_holds(group: Group) -> None:
    # Walking every lease in every process costs Redis endpoints x processes reads a tick;
    # once shares are settled a tick passes only the member set and the leases held.
    interval = 0.5
    members = [await group(interval=interval), await group(interval=interval)]
    await eventually(lambda: exactly_one_owner_each(members) and shares(members) == [3, 4])
    ticks = [m._ticks for m in members]
    await eventually(
        lambda: all(m._ticks >= t + 2 for m, t in zip(members, ticks, strict=True)),
        within=30 * interval,
        what="two more ticks each",
    )
    for member in members:
        script = _Script()
        order = member.leases.queue(script)
        assert set(order) == member.leases.owned()
        assert script.keys == [member.keys.members, *(member.keys.lease(e) for e in order)]
    # A new endpoint list is walked whole on the next tick.
    members[0].set_endpoints([*ENDPOINTS, "10.0.0.99:8000"])
    script = _Script()
    assert len(members[0].leases.queue(script)) == len(ENDPOINTS) + 1
