"""RedisStore against real Redis servers on 127.0.0.1.

Sharing tests use the server at 127.0.0.1:6379 with a random key prefix per test; outage and TLS
tests start their own ``redis-server`` on a free port.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from redis.asyncio import Redis

from epp.devstack import free_port
from epp.state.redis_store import RedisStore
from epp.state.snapshot import EndpointMetrics, EndpointState
from tests.unit.conftest import SHARED_URL, eventually

TICK = 0.02
ADDRESS = "10.0.0.1:8000"


def _state(scraped_at: float, running: int, *, ready: bool = True) -> EndpointState:
    return EndpointState(
        address=ADDRESS,
        pool="pool",
        ready=ready,
        metrics=EndpointMetrics(
            running=running,
            kv_usage=0.5,
            block_size=16,
            running_loras=frozenset({"b", "a"}),
        ),
        scraped_at=scraped_at,
    )


def _running(store: RedisStore) -> int | None:
    state = store.snapshot().get(ADDRESS)
    return None if state is None else state.metrics.running


def _store_up() -> float | None:
    return REGISTRY.get_sample_value("epp_state_store_up")


async def _get(url: str, key: str) -> bytes | None:
    """Read a key over a fresh connection (a pooled one may predate a server restart)."""
    client = Redis.from_url(url)
    try:
        return await client.get(key)
    finally:
        await client.aclose()


async def _written(url: str, key: str) -> bytes:
    """The key's value once the store has written it: the write rides a later tick, and a
    loaded machine (or a TLS handshake) can delay it by several, so poll rather than guess."""
    for _ in range(250):
        raw = await _get(url, key)
        if raw is not None:
            return raw
        await asyncio.sleep(TICK)
    raise AssertionError(f"{key} not written after 250 ticks")


@pytest.fixture
async def stores(prefix: str) -> AsyncIterator[Callable[[], RedisStore]]:
    started: list[RedisStore] = []

    def make() -> RedisStore:
        store = RedisStore(SHARED_URL, key_prefix=prefix, refresh_interval=TICK)
        started.append(store)
        return store

    yield make
    for store in started:
        await store.stop()


async def test_two_processes_converge_on_the_newer_state(stores) -> None:
    a, b = stores(), stores()
    await a.start()
    await b.start()
    now = time.time()

    await a.put_endpoint(_state(now, running=5))
    await b.retain([ADDRESS])  # configured in b, not scraped there yet
    await eventually(lambda: _running(b) == 5, what="b learns a's state")
    assert b.snapshot().get(ADDRESS) == a.snapshot().get(ADDRESS)

    await b.put_endpoint(_state(now + 1, running=7))
    await eventually(lambda: _running(a) == 7, what="a adopts b's newer state")

    # A late, older observation in a must not spread, and must not stay in a once redis has
    # the newer one back.
    await a.put_endpoint(_state(now - 10, running=1))
    assert _running(a) == 1  # local first
    await eventually(lambda: _running(a) == 7, what="a converges back to the newest state")
    await asyncio.sleep(5 * TICK)
    assert _running(b) == 7
    assert a.snapshot().get(ADDRESS) == b.snapshot().get(ADDRESS)


async def test_a_tick_reads_the_others_states_before_its_own_writes_replace_them(
    stores, prefix: str
) -> None:
    """When a scrape lease moves, the new holder's failures may continue from an observation
    older than the previous holder's last one, and it writes every tick while they go on.
    Writes are last-writer-wins: had its tick read after writing, it would only ever read back
    its own state, and the previous holder (which writes its newer one back each time it reads
    the older) would keep its own view, ready, while the new holder counts the endpoint down.
    Ticks are driven one by one here (the stores are not started)."""
    previous, new = stores(), stores()
    now = time.time()
    last = _state(now, running=5)
    await previous.put_endpoint(last)
    await previous._sync()
    failing = dataclasses.replace(_state(now - 1, running=3), failures=1)
    await new.put_endpoint(failing)
    await new._sync()
    assert new.snapshot().get(ADDRESS) == last  # the newer observation, for its scraper to adopt
    # Its older write landed after that read; the previous holder reads it and writes back.
    await previous._sync()
    await previous._sync()
    assert await _get_running(prefix) == 5
    assert previous.snapshot().get(ADDRESS) == last


async def test_a_restarted_process_reads_the_group_first_and_never_writes_unobserved_state(
    stores, prefix: str
) -> None:
    """A restarted epp publishes its endpoints as "known, never scraped" before its first
    scrape; that state must not overwrite what the group observed, and ``first_sync`` must
    return only once the group's states are in the local snapshot."""
    a = stores()
    await a.start()
    await a.put_endpoint(_state(time.time(), running=5))
    async with asyncio.timeout(2.0):
        await a.first_sync()  # a's state written and read back
    assert await _get_running(prefix) == 5

    restarted = stores()
    await restarted.start()
    # What the scraper publishes for a fresh endpoint: unready, no observation.
    await restarted.put_endpoint(EndpointState(address=ADDRESS, pool="pool"))
    async with asyncio.timeout(2.0):
        await restarted.first_sync()
    state = restarted.snapshot().get(ADDRESS)
    assert state is not None
    assert (state.ready, state.metrics.running) == (True, 5)
    await asyncio.sleep(5 * TICK)
    assert await _get_running(prefix) == 5  # never overwritten by the unobserved state
    assert _running(a) == 5


async def _get_running(prefix: str) -> int | None:
    raw = await _get(SHARED_URL, f"{prefix}:ep:{ADDRESS}")
    return None if raw is None else int(json.loads(raw)["metrics"]["running"])


async def test_states_are_written_as_compact_json_with_ttl(prefix: str) -> None:
    store = RedisStore(SHARED_URL, key_prefix=prefix, refresh_interval=TICK, ttl=2.0)
    await store.start()
    client = Redis.from_url(SHARED_URL)
    try:
        state = _state(time.time(), running=4)
        await store.put_endpoint(state)
        key = f"{prefix}:ep:{ADDRESS}"
        raw: bytes | None = None
        deadline = time.monotonic() + 2.0
        while raw is None and time.monotonic() < deadline:
            raw = await client.get(key)
            await asyncio.sleep(0.005)
        assert raw is not None
        assert b" " not in raw
        data = json.loads(raw)
        assert data["metrics"]["running"] == 4
        assert data["metrics"]["running_loras"] == ["a", "b"]
        assert data["scraped_at"] == state.scraped_at
        assert 0 < await client.pttl(key) <= 2000
    finally:
        await client.aclose()
        await store.stop()


async def test_retain_forgets_endpoints_and_stops_reading_them(stores) -> None:
    a, b = stores(), stores()
    await a.start()
    await b.start()
    await a.put_endpoint(_state(time.time(), running=2))
    await b.retain([ADDRESS])
    await eventually(lambda: _running(b) == 2, what="b learns the endpoint")

    await b.retain([])
    assert b.snapshot().get(ADDRESS) is None
    await a.put_endpoint(_state(time.time() + 1, running=3))
    await asyncio.sleep(5 * TICK)
    assert b.snapshot().get(ADDRESS) is None


async def test_unreachable_redis_at_start_is_not_an_error(caplog) -> None:
    caplog.set_level(logging.INFO, logger="epp.state.redis_store")
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", refresh_interval=TICK)
    await store.start()
    try:
        state = _state(time.time(), running=1)
        await store.put_endpoint(state)
        assert store.snapshot().get(ADDRESS) == state
        await eventually(lambda: _store_up() == 0.0, what="STORE_UP 0")
        await asyncio.sleep(0.3)  # several failed retries
    finally:
        await store.stop()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1


class RedisServer:
    """A private redis-server process that a test can stop and restart on the same port."""

    def __init__(self, port: int, *args: str) -> None:
        self.port = port
        self._args = args
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                *self._args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 5.0
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self._proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.01)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(5)
            self._proc = None


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    port = free_port()
    server = RedisServer(port, "--port", str(port), "--requirepass", "s3cret")
    server.start()
    yield server
    server.stop()


async def test_outage_keeps_local_state_and_resyncs_after_restart(own_redis, caplog) -> None:
    caplog.set_level(logging.INFO, logger="epp.state.redis_store")
    url = f"redis://:s3cret@127.0.0.1:{own_redis.port}/0"  # AUTH from the URL
    store = RedisStore(url, key_prefix="t", refresh_interval=TICK)
    other = dataclasses.replace(_state(time.time(), running=4), address="10.0.0.2:8000")
    await store.start()
    try:
        await store.put_endpoint(_state(time.time(), running=1))
        await store.put_endpoint(other)
        await eventually(lambda: _store_up() == 1.0, what="STORE_UP 1")
        assert json.loads(await _written(url, f"t:ep:{ADDRESS}"))["metrics"]["running"] == 1

        own_redis.stop()
        await eventually(lambda: _store_up() == 0.0, what="STORE_UP 0")
        latest = _state(time.time(), running=9)
        await store.put_endpoint(latest)  # never raises, lands locally at once
        assert store.snapshot().get(ADDRESS) == latest
        await asyncio.sleep(0.3)  # several failed retries while down

        own_redis.start()  # empty: nothing was saved
        await eventually(lambda: _store_up() == 1.0, what="STORE_UP back to 1")
        raw = await _get(url, f"t:ep:{ADDRESS}")
        assert raw is not None, "the state put during the outage was not written"
        assert json.loads(raw)["metrics"]["running"] == 9
        # Written before the outage and not put since: only the resync brings it back.
        raw = await _get(url, "t:ep:10.0.0.2:8000")
        assert raw is not None, "local state was not pushed back after the restart"
        assert json.loads(raw)["metrics"]["running"] == 4
    finally:
        await store.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(warnings) == 1
    assert "unreachable" in warnings[0]
    assert len([m for m in infos if "reachable again" in m]) == 1
    assert all("s3cret" not in m for m in warnings + infos)


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[RedisServer, Path]]:
    if shutil.which("redis-server") is None or shutil.which("openssl") is None:
        pytest.skip("redis-server or openssl not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"),
            *("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    server = RedisServer(
        port,
        *("--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no"),
        *(
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
        ),
    )
    server.start()
    yield server, cert
    server.stop()


async def test_tls_url_with_verified_certificate(tls_redis) -> None:
    server, cert = tls_redis
    url = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={cert}"
    store = RedisStore(url, key_prefix="t", refresh_interval=TICK)
    await store.start()
    try:
        await store.put_endpoint(_state(time.time(), running=6))
        raw = await _written(url, f"t:ep:{ADDRESS}")
        assert json.loads(raw)["metrics"]["running"] == 6
    finally:
        await store.stop()
