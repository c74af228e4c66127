"""epp against a Redis that authenticates an ACL user and serves TLS only, configured the way
the shipped manifests do it: the password from a file, the CA from the URL, and the ACL rules
docker-compose.yml and deploy/kubernetes/ give the ``epp`` user. Each test starts its own
``redis-server`` (built with TLS, as Debian's is) and a CA made by the test."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.exceptions

from epp.config import parse_config
from epp.devstack import free_port
from epp.state.shared.connect import connect
from tests.helpers import redis_servers
from tests.helpers.certs import Ca
from tests.unit.test_sync_flavours import Member, exercise

pytestmark = pytest.mark.skipif(not redis_servers.available(), reason="redis-server not installed")

# What the shipped Redis grants epp: its own keys (every key epp writes starts with the hash
# tag {epp}), every command but the dangerous ones (FLUSHALL, CONFIG, KEYS, DEBUG, ...).
SHIPPED_ACL = "~{epp}* +@all -@dangerous"
PASSWORD = "pw-from-a-file"


@pytest.fixture
def redis_tls_acl(tmp_path: Path) -> Iterator[tuple[redis_servers.RedisServer, Path]]:
    ca = Ca.create(tmp_path, "redis")
    leaf = ca.issue("server", ["127.0.0.1", "localhost"])
    port = free_port()
    server = redis_servers.RedisServer(
        tmp_path / "redis",
        # The later --port 0 wins over the helper's own --port: no plaintext listener.
        *("--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no"),
        *("--tls-cert-file", str(leaf.cert), "--tls-key-file", str(leaf.key)),
        *("--tls-ca-cert-file", str(ca.path)),
        *("--user", "default", "off"),
        *("--user", "epp", "on", f">{PASSWORD}", *SHIPPED_ACL.split()),
        port=port,
    )
    server.start()
    yield server, ca.path
    server.stop()


@pytest.fixture
async def started() -> AsyncIterator[list[Member]]:
    members: list[Member] = []
    yield members
    for member in members:
        await member.stop()


def store_url(tmp_path: Path, port: int, ca: Path, password: str) -> str:
    """``store.redis_url`` as the configuration loader builds it from the shipped keys."""
    password_file = tmp_path / "redis-password"
    password_file.write_text(password + "\n")
    config = parse_config(
        {
            "models": {"m": {"pools": ["p"]}},
            "pools": {"p": {"endpoints": ["10.0.0.1:8000"]}},
            "store": {
                "backend": "redis",
                "redis_url": f"rediss://localhost:{port}/0?ssl_ca_certs={ca}",
                "redis_username": "epp",
                "redis_password_file": str(password_file),
            },
        }
    )
    return config.store.redis_url


async def test_epp_shares_state_as_the_acl_user_over_tls(
    tmp_path: Path,
    redis_tls_acl: tuple[redis_servers.RedisServer, Path],
    started: list[Member],
) -> None:
    server, ca = redis_tls_acl
    url = store_url(tmp_path, server.port, ca, PASSWORD)
    a, b = Member(url), Member(url)
    started += [a, b]
    await a.start()
    await b.start()
    await exercise(a, b, 500)


async def test_wrong_password_no_password_and_unverified_server_are_refused(
    tmp_path: Path, redis_tls_acl: tuple[redis_servers.RedisServer, Path]
) -> None:
    server, ca = redis_tls_acl
    attempts: list[tuple[str, type[Exception]]] = [
        (store_url(tmp_path, server.port, ca, "wrong"), redis.exceptions.AuthenticationError),
        # The default user is off: no password, no access.
        (
            f"rediss://localhost:{server.port}/0?ssl_ca_certs={ca}",
            redis.exceptions.AuthenticationError,
        ),
        # TLS verifies the server against the system's CAs unless the URL names ours.
        (f"rediss://epp:{PASSWORD}@localhost:{server.port}/0", redis.exceptions.ConnectionError),
    ]
    for url, error in attempts:
        client = connect(url, socket_timeout=2, socket_connect_timeout=2)
        try:
            with pytest.raises(error) as info:
                await client.set("{epp}:probe", "1")
            if "ssl_ca_certs" not in url:
                assert isinstance(info.value.__context__, ssl.SSLCertVerificationError) or (
                    "certificate verify failed" in str(info.value)
                )
        finally:
            await client.aclose()


async def test_the_acl_user_reaches_only_epps_keys(
    tmp_path: Path, redis_tls_acl: tuple[redis_servers.RedisServer, Path]
) -> None:
    server, ca = redis_tls_acl
    client = connect(store_url(tmp_path, server.port, ca, PASSWORD))
    try:
        assert await client.set("{epp}:probe", "1")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await client.set("other-app:key", "1")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await client.flushall()
    finally:
        await client.aclose()
