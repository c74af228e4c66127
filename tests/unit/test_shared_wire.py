"""Every kind of Redis payload epp reads refuses what it cannot use: garbage bytes, wrong types,
an unknown schema version are skipped and counted, timestamps from the future are clamped and
counted, and the loops reading them carry on with the good entries."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator

import msgpack
import pytest
from prometheus_client import REGISTRY
from redis.asyncio import Redis

from epp.admission.budget_sync import BudgetSync
from epp.admission.budgets import BUCKETS, BudgetPolicy, Budgets, Charge, Limits
from epp.prefix.approximate import approx_prefix
from epp.request import session_key
from epp.scheduling.scorers.session import SESSIONS
from epp.state.fleet import FleetState
from epp.state.latency import LatencyModel
from epp.state.redis_store import RedisStore
from epp.state.shared import loads, queues, wire
from epp.state.shared.connect import hash_tag
from epp.state.shared.keys import Keys
from epp.state.shared.sync import SharedState
from epp.state.snapshot import EndpointState
from tests.unit.conftest import SHARED_URL, eventually
from tests.unit.test_latency_model import feed

E1, E2, E3, E4, E5 = (f"10.0.7.{i}:8000" for i in range(1, 6))


def rejected(kind: str, reason: str) -> float:
    labels = {"kind": kind, "reason": reason}
    return REGISTRY.get_sample_value("epp_shared_state_rejected_total", labels) or 0.0


@pytest.fixture
async def redis() -> AsyncIterator[Redis]:
    client = Redis.from_url(SHARED_URL)
    yield client
    await client.aclose()


def test_load_hashes() -> None:
    before = {r: rejected("load", r) for r in wire.REASONS}
    out = loads.total(
        [
            {b"_v": b"99", E1.encode(): b"1 2"},  # a version this release does not read
            {
                b"_v": b"1",
                E1.encode(): b"x y",
                E2.encode(): b"-1 5",
                f"prefill|{E2}".encode(): b"3,1",
                b"\xff": b"1 1",
            },
            {E3.encode(): b"2 20"},  # version 0: no version field
        ]
    )
    assert set(out) == {E2, E3}
    assert (out[E2].requests, out[E2].prefill, out[E3].requests) == (0, 3, 2)
    assert rejected("load", "version") - before["version"] == 1
    assert rejected("load", "malformed") - before["malformed"] == 3


def test_queue_rows() -> None:
    before = {r: rejected("queue", r) for r in wire.REASONS}
    assert queues.decode(b"\x00garbage") == []
    assert queues.decode(b'{"rows": []}') == []
    assert queues.decode(b'[99, ["k", 5, "f", 2, 3]]') == []
    rows = queues.decode(b'[1, ["k", 5, "f", -1, 0], ["k", "5", "f", 1, 0], ["k", 5, "f", 2, 3]]')
    assert [(r.key, r.priority, r.flow, r.queued) for r in rows] == [("k", 5, "f", 2)]
    legacy = queues.decode(b'[["k", 5, "f", 2, 3]]')
    assert [(r.key, r.queued, r.dispatched) for r in legacy] == [("k", 2, 3)]
    assert rejected("queue", "malformed") - before["malformed"] == 4
    assert rejected("queue", "version") - before["version"] == 1


def test_latency_evidence_from_the_future_is_clamped() -> None:
    a, b = LatencyModel(), LatencyModel()
    now = feed(a, E1, 5_000, 200, 1000.0, random.Random(1))
    ttft, tpot = json.loads(a.export(now)[E1])
    ttft[0] = tpot[0] = now + 1e6  # as_of: decay would never start
    before = {r: rejected("latency", r) for r in wire.REASONS}
    fields = {E1.encode(): json.dumps([ttft, tpot]).encode(), E2.encode(): b"[1, 2]"}
    b.apply_remote([wire.open_hash("latency", {**fields, b"_v": b"2"})], now)
    b.apply_remote([wire.open_hash("latency", {**fields, b"_v": b"1"})], now)
    assert rejected("latency", "future") - before["future"] == 2
    assert rejected("latency", "malformed") - before["malformed"] == 1
    assert rejected("latency", "version") - before["version"] == 1
    described = b.describe(E1, now + 60)
    assert described is not None
    # Clamped to now: a minute later the evidence has decayed like any other.
    assert 0 < described["evidence"]["ttft"] < json.loads(a.export(now)[E1])[0][1]


async def test_endpoint_states(prefix: str, redis: Redis) -> None:
    store = RedisStore(SHARED_URL, key_prefix=prefix, refresh_interval=0.02)
    now = time.time()
    good = json.loads(store_payload(EndpointState(E5, "pool", True, scraped_at=now)))
    bad = {
        E1: b"\xff\xfe not json",
        E2: json.dumps({**good, "address": E2, "v": 99}).encode(),
        E3: json.dumps({**good, "address": E3, "ready": "yes"}).encode(),
        E4: json.dumps({**good, "address": E4, "scraped_at": now + 1e6}).encode(),
    }
    for address, raw in bad.items():
        await redis.set(f"{prefix}:ep:{address}", raw)
    await redis.set(f"{prefix}:ep:{E5}", json.dumps(good))
    before = {r: rejected("endpoint", r) for r in wire.REASONS}
    await store.retain([E1, E2, E3, E4, E5])
    await store.start()
    try:
        await store.first_sync()
        snapshot = store.snapshot()
        good_state = snapshot.get(E5)
        assert good_state is not None
        assert good_state.ready
        assert [snapshot.get(a) for a in (E1, E2, E3)] == [None, None, None]
        future = snapshot.get(E4)
        assert future is not None
        assert future.scraped_at <= time.time() + wire.SKEW
    finally:
        await store.stop()
    assert rejected("endpoint", "malformed") - before["malformed"] >= 2
    assert rejected("endpoint", "version") - before["version"] >= 1
    assert rejected("endpoint", "future") - before["future"] >= 1


def store_payload(state: EndpointState) -> str:
    from epp.state.redis_store import _encode

    return _encode(state)


async def test_pick_entries(prefix: str, redis: Redis) -> None:
    fleet = FleetState()
    # Declared before the stream is read, as a profile with these scorers does.
    index, sessions = fleet.states.get(approx_prefix()), fleet.states.get(SESSIONS)
    # The verdicts' pool, so a remote ejection has room under the ejection cap.
    fleet.health.configure(fleet.health.config, {e: "pool" for e in (E1, E2, E3, E4, E5)})
    member = SharedState(SHARED_URL, fleet, key_prefix=prefix, interval=0.02)
    now = time.time()
    far = now + 1e6
    session = session_key(b"s1")  # what session tables hold: a digest of the header
    entries = [
        b"\xc1",  # not msgpack
        msgpack.packb({"origin": "x"}),
        msgpack.packb(["x", now, [["prefix", [E1, [1], 100]]], 99]),  # unknown version
        msgpack.packb(["x", now, [["prefix", [E1, "not hashes", 100]], "junk"], 1]),
        msgpack.packb(["x", now, [["health", [E2, "pool", far, 1, "forged"]]], 1]),
        # An ejection streak no process reaches: 2**n of it would overflow the next ejection.
        msgpack.packb(["x", now, [["health", [E3, "pool", now + 5, 10**6, "forged"]]], 1]),
        msgpack.packb(["x", now, [["sessions", [session, E3, far]]], 1]),
        msgpack.packb(["x", now, [["prefix", [E4, [7, 8], 100, "a later field"]]], 1]),
        msgpack.packb(["x", now, [["prefix", [E5, [9], 100]]]]),  # version 0
    ]
    before = {r: rejected("picks", r) for r in wire.REASONS}
    for entry in entries:
        await redis.xadd(Keys(hash_tag(prefix)).picks, {"d": entry})
    await member.start()
    try:
        await eventually(lambda: index.match([9], [E5])[E5] == 1, what="the v0 entry")
        assert index.match([7, 8], [E4])[E4] == 2
        assert index.match([1], [E1])[E1] == 0
        health = fleet.health.state(E2)
        ceiling = time.time() + fleet.health.config.max_ejection_seconds + wire.SKEW
        assert health is not None
        assert 0 < health.until <= ceiling
        assert fleet.health.state(E3) is None
        assert sessions.get(session, time.time()) == E3  # kept, with its expiry clamped
        assert sessions.get(session, time.time() + 2 * 86_400) is None
        assert member._task is not None
        assert not member._task.done()
    finally:
        await member.stop()
    assert rejected("picks", "malformed") - before["malformed"] == 5
    assert rejected("picks", "version") - before["version"] == 1
    assert rejected("picks", "future") - before["future"] == 2


async def test_budget_windows_and_members(prefix: str, redis: Redis) -> None:
    keys = Keys(hash_tag(prefix))
    ledger = Budgets(BudgetPolicy({"evals": Limits(rpm=100)}, window_seconds=30.0))
    sync = BudgetSync(SHARED_URL, ledger, keys, "p0", interval=0.02, member_ttl=0.06)
    assert isinstance(ledger.charge("evals", 1, time.monotonic()), Charge)
    window = keys.budget("requests", "evals")
    (seconds, micros) = await redis.time()
    now_ms = seconds * 1000 + micros // 1000
    future_bucket = int(now_ms // (30.0 / BUCKETS * 1000)) + 1000
    await redis.hset(window, mapping={"garbage": "x", str(future_bucket): "50"})
    await redis.zadd(keys.members, {"from-the-future": now_ms + 10_000_000})
    before = {r: rejected("budget", r) for r in wire.REASONS}
    try:
        await sync.tick()
        await sync.tick()
    finally:
        await sync.stop()
    assert ledger.members == 1  # the future member was not counted
    assert not await redis.hexists(window, "garbage")
    assert rejected("budget", "malformed") - before["malformed"] == 1
    assert rejected("budget", "future") - before["future"] == 1  # the member
    left, _ = ledger.remaining("evals", "requests", time.monotonic())
    assert left >= 98  # the future bucket's 50 were not spent


async def test_lease_members_from_the_future(prefix: str, redis: Redis) -> None:
    fleet = FleetState()
    member = SharedState(SHARED_URL, fleet, key_prefix=prefix, interval=0.02)
    member.set_endpoints([E1, E2])
    keys = Keys(hash_tag(prefix))
    (seconds, _) = await redis.time()
    await redis.zadd(keys.members, {"from-the-future": (seconds + 10_000) * 1000})
    before = rejected("members", "future")
    await member.start()
    try:
        # Alone in the group, this member takes every lease: the phantom does not hold a share.
        await eventually(lambda: member.leases.owned() == frozenset({E1, E2}), what="both leases")
    finally:
        await member.stop()
    assert rejected("members", "future") - before >= 1


async def test_keys_of_the_wrong_type_are_malformed_entries(prefix: str, redis: Redis) -> None:
    """A key holding another type than epp writes fails the read of that key only: counted,
    and the loops stay connected to the group."""
    keys = Keys(hash_tag(prefix))
    await redis.hset(f"{keys.prefix}:ep:{E1}", mapping={"not": "a state"})
    await redis.set(keys.load("ghost"), "not a hash")
    await redis.hset(keys.queue("ghost"), mapping={"not": "a string"})
    await redis.set(keys.latency("ghost"), "not a hash")
    await redis.set(keys.picks, "not a stream")
    before = {
        k: rejected(k, "malformed") for k in ("endpoint", "load", "queue", "latency", "picks")
    }
    store = RedisStore(SHARED_URL, key_prefix=keys.prefix, refresh_interval=0.02)
    await store.retain([E1])
    member = SharedState(SHARED_URL, FleetState(), key_prefix=prefix, interval=0.2)
    await store.start()
    await member.start()
    try:
        await store.first_sync()
        # The ghost is a member while its entry in the member set is fresh (kept so here);
        # latency evidence is read once a second.
        deadline = time.monotonic() + 5.0
        while not all(rejected(k, "malformed") > n for k, n in before.items()):
            late = [k for k, n in before.items() if rejected(k, "malformed") == n]
            assert time.monotonic() < deadline, f"not counted: {late}"
            (seconds, micros) = await redis.time()
            await redis.zadd(keys.members, {"ghost": seconds * 1000 + micros // 1000})
            await asyncio.sleep(0.05)
        assert store._up is True
        assert member._up is True
    finally:
        await member.stop()
        await store.stop()
