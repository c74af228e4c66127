"""In-flight counts and routing memory (prefix index, sessions) shared through a real Redis."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from redis.asyncio import Redis

from epp.prefix.approximate import APPROX_PREFIX, ApproximatePrefixIndex, approx_prefix
from epp.prefix.hashing import BlockHasher
from epp.request import session_key
from epp.scheduling.scorers.session import SESSIONS
from epp.state.fleet import FleetState
from epp.state.inflight import Load
from epp.state.latency import Basis
from epp.state.sessions import SessionTable
from epp.state.shared.sync import LOAD_INTERVALS, SharedState
from tests.helpers import redis_servers
from tests.unit.conftest import SHARED_URL, eventually

TICK = 0.02
E1, E2, E3 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"

Member = tuple[FleetState, SharedState]
Group = Callable[..., Awaitable[Member]]

# Session keys as requests carry them (digests of the header).
S, TIMED, OLD = (session_key(raw) for raw in (b"s", b"timed", b"old"))


def index(fleet: FleetState) -> ApproximatePrefixIndex:
    return fleet.states.get(approx_prefix())


def sessions(fleet: FleetState) -> SessionTable:
    return fleet.states.get(SESSIONS)


@pytest.fixture
async def group(prefix: str) -> AsyncIterator[Group]:
    members: list[SharedState] = []

    async def start(url: str = SHARED_URL, poll: bool = False, interval: float = TICK) -> Member:
        fleet = FleetState()
        # Declared before the stream is read, as a profile with these scorers does.
        index(fleet)
        sessions(fleet)
        member = SharedState(url, fleet, key_prefix=prefix, interval=interval, poll_picks=poll)
        member.set_endpoints([E1, E2, E3])
        await member.start()
        members.append(member)
        return fleet, member

    yield start
    for member in members:
        await member.stop()


async def test_each_process_sees_the_others_in_flight_work(group: Group) -> None:
    (fa, _), (fb, _) = await group(), await group()
    # Two requests waiting for their first token (90 and 40 uncached prompt tokens).
    ta = [fa.inflight.add(E1, 100, 90), fa.inflight.add(E1, 50, 40)]
    fb.inflight.add(E2, 10)
    await eventually(lambda: fb.inflight.load(E1) == Load(2, 150, 130, 2), what="a's load at b")
    await eventually(lambda: fa.inflight.load(E2) == Load(1, 10, 0, 1), what="b's load at a")
    assert fa.inflight.load(E1) == Load(2, 150, 130, 2), "own work must not be counted twice"
    # The first one's first token: its prefill leaves the shared queue, its decode stays.
    ta[0] = fa.inflight.prefilled(ta[0])
    await eventually(lambda: fb.inflight.load(E1) == Load(2, 150, 40, 1), what="prefilled at b")
    for ticket in ta:
        fa.inflight.release(ticket)
    await eventually(lambda: fb.inflight.load(E1) == Load(0, 0), what="released at b")


async def test_a_dead_process_counts_expire_with_its_ttl(group: Group) -> None:
    (fa, a), (fb, _) = await group(), await group()
    fa.inflight.add(E1, 100)
    await eventually(lambda: fb.inflight.load(E1).requests == 1)
    a._stopping = True  # crash: no clean leave, the hash must expire by itself
    assert a._task is not None
    a._task.cancel()
    await asyncio.gather(a._task, return_exceptions=True)
    # The hash's TTL ends it, read from Redis instead of timing the wait (which a busy machine
    # stretches); -2: it has expired already, -1 (no TTL) would leave the count for ever.
    client = Redis.from_url(SHARED_URL)
    try:
        ttl_ms = await client.pttl(a.keys.load(a.me))
    finally:
        await client.aclose()
    assert ttl_ms == -2 or 0 < ttl_ms <= LOAD_INTERVALS * TICK * 1000, ttl_ms
    await eventually(lambda: fb.inflight.load(E1).requests == 0, what="expiry")


async def test_prefix_insertions_are_pushed_to_the_other_processes(
    group: Group,
) -> None:
    # Ticks an hour apart: what arrives was pushed (readers replay the stream from its start,
    # so no reader has to be waiting yet); a wall-clock bound on the wait would race the box.
    (fa, _), (fb, _), (fc, _) = [await group(interval=3600.0) for _ in range(3)]
    index(fa).insert(E1, [11, 12, 13], 1000)
    await eventually(lambda: index(fb).match([11, 12, 13], [E1]) == {E1: 3})
    await eventually(lambda: index(fc).match([11, 12, 13], [E1]) == {E1: 3})
    assert index(fb).take_recent() == [], "applied insertions must not be shipped again"


async def test_an_index_replicates_only_to_members_using_its_parameters(group: Group) -> None:
    small = approx_prefix(BlockHasher(block_chars=32))
    (fa, _), (fb, _), (fc, _) = [await group() for _ in range(3)]
    for fleet in (fa, fc):
        fleet.states.get(small)
    fa.states.get(small).insert(E1, [31, 32], 1000)
    index(fa).insert(E1, [41], 1000)  # shipped after the small index's item
    await eventually(lambda: fc.states.get(small).match([31, 32], [E1]) == {E1: 2})
    await eventually(lambda: index(fb).match([41], [E1]) == {E1: 1})
    # b uses the default parameters only: it skipped the other set's item, kept no index for
    # it, and its default index holds nothing of it.
    assert fb.states.named(APPROX_PREFIX) == [index(fb)]
    assert index(fb).match([31, 32], [E1]) == {E1: 0}
    assert index(fc).match([31, 32], [E1]) == {E1: 0}


async def test_polling_mode_moves_insertions_too(group: Group) -> None:
    (fa, _), (fb, _) = await group(poll=True), await group(poll=True)
    index(fa).insert(E2, [21, 22], 1000)
    await eventually(lambda: index(fb).match([21, 22], [E2]) == {E2: 2})


async def test_sessions_follow_the_latest_binding_and_own_entries_are_skipped(
    group: Group,
) -> None:
    (fa, _), (fb, _) = await group(), await group()
    now = time.time()
    sessions(fa).bind(S, E1, now, 60)
    sessions(fa).bind(S, E2, now, 60)  # rebinding before the first one comes back
    await eventually(lambda: sessions(fb).get(S, time.time()) == E2)
    await asyncio.sleep(3 * TICK)
    # Had a's own entries been applied to it, the older E1 binding could have won.
    assert sessions(fa).get(S, time.time()) == E2
    # The absolute expiry travels: a binding ends at the same moment everywhere, however late
    # it arrived (at least the shipper's linger late). Read at chosen instants, not by waiting
    # for a short binding to lapse, which a slow delivery could outrun.
    bound = time.time()
    sessions(fa).bind(TIMED, E3, bound, 60)
    await eventually(lambda: sessions(fb).get(TIMED, bound) == E3)
    assert sessions(fb).get(TIMED, bound + 59.999) == E3
    assert sessions(fb).get(TIMED, bound + 60.001) is None


async def test_a_late_process_starts_with_the_group_history(group: Group) -> None:
    (fa, _), _ = await group(), await group()
    index(fa).insert(E3, [31, 32], 1000)
    sessions(fa).bind(OLD, E3, time.time(), 60)
    await eventually(lambda: pending() == 0, what="shipped")
    fc, _ = await group()
    await eventually(lambda: index(fc).match([31, 32], [E3]) == {E3: 2}, what="replay")
    assert sessions(fc).get(OLD, time.time()) == E3


def pending() -> float | None:
    """``epp_shared_picks_pending`` (every started member of the group)."""
    return REGISTRY.get_sample_value("epp_shared_picks_pending")


async def test_picks_made_while_redis_is_down_arrive_after_it_returns(
    tmp_path: Path, group: Group
) -> None:
    if not redis_servers.available():
        pytest.skip("redis-server not installed")
    server = redis_servers.RedisServer(tmp_path).start()
    try:
        (fa, a), (fb, _) = await group(server.url), await group(server.url)
        index(fa).insert(E1, [1, 2], 1000)
        await eventually(lambda: index(fb).match([1, 2], [E1]) == {E1: 2})
        # b can apply an entry before a has read the pipeline's reply that takes it off a's
        # pending count: zero follows, it need not have come yet.
        await eventually(lambda: pending() == 0, what="nothing pending")

        server.kill()
        await eventually(lambda: a.leases.owned() is None, what="a notices the outage")
        index(fa).insert(E2, [3, 4], 1000)  # routing goes on, the insertion waits
        fa.inflight.add(E3, 7)
        await asyncio.sleep(0.2)
        assert index(fb).match([3, 4], [E2]) == {E2: 0}
        assert pending() == 1, "the insertion waiting for Redis"

        server.start()  # empty
        await eventually(lambda: index(fb).match([3, 4], [E2]) == {E2: 2}, within=5.0)
        await eventually(lambda: pending() == 0, what="nothing pending after the outage")
        await eventually(lambda: fb.inflight.load(E3).requests == 1, within=5.0)
    finally:
        server.stop()


async def test_latency_evidence_is_summed_across_processes(group: Group) -> None:
    (fa, _), (fb, _) = await group(), await group()
    features = (1.0, 2.0, 0.0, 0.0)
    for i in range(20):
        fa.latency.observe_ttft(E1, Basis(features, 0.2), 0.5, time.time() - 1 + i / 100)
    ours = fa.latency.describe(E1, time.time())
    assert ours is not None

    def shared() -> bool:
        theirs = fb.latency.describe(E1, time.time())
        return theirs is not None and theirs["evidence"]["ttft"] > 15

    await eventually(shared, what="a's latency evidence at b")
    theirs = fb.latency.describe(E1, time.time())
    assert theirs is not None
    # The same evidence, decayed a little longer.
    rate = ours["prefill_tokens_per_second"]
    assert theirs["prefill_tokens_per_second"] == pytest.approx(rate, rel=0.01)
    assert theirs["ttft_samples"] == 0, "b learned nothing itself: the evidence is a's"


async def test_ticks_that_share_latency_evidence_share_everything_else_too(
    group: Group, caplog: pytest.LogCaptureFixture
) -> None:
    """The latency writes' replies once took the place of the in-flight reads: every tick
    that shared latency evidence failed, and the process fell back to local counts."""
    caplog.set_level(logging.INFO, logger="epp.state.shared.sync")
    (fa, a), (fb, _) = await group(), await group()
    features = (1.0, 2.0, 0.0, 0.0)
    for i in range(20):
        fa.latency.observe_ttft(E1, Basis(features, 0.2), 0.5, time.time() - 1 + i / 100)
        fb.latency.observe_ttft(E2, Basis(features, 0.2), 0.5, time.time() - 1 + i / 100)
    fa.inflight.add(E3, 7)
    await eventually(lambda: fb.inflight.load(E3).requests == 1, what="a's load at b")
    # Several latency periods: the loads stay shared and no tick fails.
    ticks = a._ticks
    await eventually(lambda: a._ticks >= ticks + 2 * round(1.0 / TICK) + 1, within=10)
    assert not [r for r in caplog.records if "unavailable" in r.message]
    assert fb.inflight.load(E3).requests == 1
    assert fb.latency.describe(E1, time.time()) is not None
