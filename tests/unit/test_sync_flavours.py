"""The shared keys on every Redis flavour epp supports: AUTH + TLS, Sentinel (with a failover)
and a three-master Cluster. Each test starts its own ``redis-server`` processes."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from epp.devstack import free_port
from epp.prefix.approximate import approx_prefix
from epp.request import session_key
from epp.scheduling.scorers.session import SESSIONS
from epp.state.fleet import FleetState
from epp.state.redis_store import RedisStore
from epp.state.shared.connect import connect, hash_tag
from epp.state.shared.sync import SharedState
from epp.state.snapshot import EndpointState
from tests.helpers import redis_servers
from tests.unit.conftest import eventually

TICK = 0.02
ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(4)]

pytestmark = pytest.mark.skipif(not redis_servers.available(), reason="redis-server not installed")


class Member:
    """One process's shared pieces: endpoint-state store, fleet, sync loop."""

    def __init__(self, url: str) -> None:
        self.store = RedisStore(url, key_prefix=hash_tag("epp"), refresh_interval=TICK)
        self.fleet = FleetState(self.store)
        # Declared before the stream is read, as a profile with these scorers does.
        self.fleet.states.get(approx_prefix())
        self.fleet.states.get(SESSIONS)
        self.shared = SharedState(url, self.fleet, key_prefix="epp", interval=TICK)

    async def start(self) -> Member:
        await self.store.start()
        await self.store.retain(ENDPOINTS)
        self.shared.set_endpoints(ENDPOINTS)
        await self.shared.start()
        return self

    async def stop(self) -> None:
        await self.shared.stop()
        await self.store.stop()


@pytest.fixture
async def members() -> AsyncIterator[Callable[[str], Member]]:
    made: list[Member] = []

    def make(url: str) -> Member:
        member = Member(url)
        made.append(member)
        return member

    yield make
    for member in made:
        await member.stop()


async def exercise(a: Member, b: Member, tag: int) -> None:
    """Everything the group shares works between ``a`` and ``b``."""

    def spread() -> bool:
        owned = [m.shared.leases.owned() for m in (a, b)]
        return all(o is not None and len(o) == 2 for o in owned) and set().union(*owned) == set(
            ENDPOINTS
        )

    await eventually(spread, what="leases spread 2 + 2")
    index, sessions = b.fleet.states.get(approx_prefix()), b.fleet.states.get(SESSIONS)
    session = session_key(f"s{tag}".encode())
    a.fleet.states.get(approx_prefix()).insert(ENDPOINTS[0], [tag, tag + 1], 100)
    a.fleet.states.get(SESSIONS).bind(session, ENDPOINTS[1], time.time(), 60)
    ticket = a.fleet.inflight.add(ENDPOINTS[2], 5)
    state = EndpointState(ENDPOINTS[3], "pool", True, scraped_at=time.time())
    await a.store.put_endpoint(state)
    await eventually(
        lambda: index.match([tag, tag + 1], [ENDPOINTS[0]])[ENDPOINTS[0]] == 2,
        what="prefix insertion",
    )
    await eventually(lambda: sessions.get(session, time.time()) == ENDPOINTS[1], what="session")
    await eventually(lambda: b.fleet.inflight.load(ENDPOINTS[2]).requests == 1, what="load")
    await eventually(lambda: b.store.snapshot().get(ENDPOINTS[3]) == state, what="state")
    a.fleet.inflight.release(ticket)


def on_master(member: Member, port: int) -> bool:
    """Every connection ``member`` holds open (store and sync loop) points at ``port``."""
    # The pools' connection lists are redis-py internals; epp's follower reads the same ones.
    pools = [member.store._redis.connection_pool, member.shared._client.connection_pool]
    ports = [
        connection.port
        for pool in pools
        for connection in (*pool._available_connections, *pool._in_use_connections)
        if connection.is_connected
    ]
    return bool(ports) and all(p == port for p in ports)


@pytest.fixture
def tls_auth_redis(tmp_path: Path) -> Iterator[tuple[redis_servers.RedisServer, Path]]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    try:
        subprocess.run(
            [
                *("openssl", "req", "-x509", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"),
                *("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
                *("-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key)),
                *("-out", str(cert)),
            ],
            check=True,
            capture_output=True,
        )
    except FileNotFoundError:
        pytest.skip("openssl not installed")
    port = free_port()
    server = redis_servers.RedisServer(
        tmp_path / "redis",
        *("--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no"),
        *("--tls-cert-file", str(cert), "--tls-key-file", str(key)),
        *("--tls-ca-cert-file", str(cert), "--requirepass", "s3cret"),
        port=port,
    )
    # RedisServer passes --port itself; the later --port 0 wins and disables plain TCP.
    server.start()
    yield server, cert
    server.stop()


async def test_tls_and_auth(tls_auth_redis, members) -> None:
    server, cert = tls_auth_redis
    url = f"rediss://:s3cret@127.0.0.1:{server.port}/0?ssl_ca_certs={cert}"
    a, b = await members(url).start(), await members(url).start()
    await exercise(a, b, 100)


async def test_sentinel_and_a_failover(tmp_path: Path, members) -> None:
    setup = await asyncio.to_thread(redis_servers.SentinelSetup(tmp_path).start)
    try:
        a, b = await members(setup.url).start(), await members(setup.url).start()
        await exercise(a, b, 200)
        port = await asyncio.to_thread(setup.failover)
        # The old master stays a writable master until the Sentinel reconfigures it, seconds
        # later, so nothing forces ``a`` off it; ``c`` starts now and connects to the new one.
        # They agree again only if ``a`` follows the Sentinel by itself (FOLLOW_INTERVAL).
        await b.stop()
        c = await members(setup.url).start()
        # What ``a`` writes before it follows lands on the old master and is lost when that
        # one turns replica (Redis replicates asynchronously; docs/active-active.md), so the
        # exercise starts once ``a`` is on the new master: without following it never is.
        await eventually(lambda: on_master(a, port), what="a following the new master")
        await exercise(a, c, 300)
    finally:
        await asyncio.to_thread(setup.stop)


async def test_cluster_keeps_every_key_in_one_slot(tmp_path: Path, members) -> None:
    cluster = await asyncio.to_thread(redis_servers.ClusterSetup(tmp_path).start)
    client = connect(cluster.url)
    try:
        # First: a cluster client's first command reads the command table (~0.4 s of CPU
        # without hiredis), which would starve the members' ticks and expire their leases.
        await client.ping()
        a, b = await members(cluster.url).start(), await members(cluster.url).start()
        await exercise(a, b, 400)
        keys = [k async for k in client.scan_iter(match="{epp}:*")]
        assert {k.split(b":")[1] for k in keys} >= {b"ep", b"lease", b"members", b"load"}
        assert b"{epp}:picks" in keys
        assert len({await client.cluster_keyslot(k) for k in keys}) == 1
    finally:
        await client.aclose()
        await asyncio.to_thread(cluster.stop)
