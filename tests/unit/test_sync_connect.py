"""Redis URLs: flavour by scheme, hash-tagged prefixes, clients built without connecting."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis, RedisCluster

from epp.config import ConfigError, parse_config
from epp.state.shared.connect import connect, flavour, hash_tag


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("redis://h:1/0", "standalone"),
        ("rediss://h:1/0", "standalone"),
        ("unix:///tmp/r.sock", "standalone"),
        ("redis+sentinel://h:1,h:2/svc", "sentinel"),
        ("rediss+sentinel://h:1/svc", "sentinel"),
        ("redis+cluster://h:1,h:2", "cluster"),
        ("rediss+cluster://h:1", "cluster"),
    ],
)
def test_flavour_comes_from_the_scheme(url: str, kind: str) -> None:
    assert flavour(url) == kind


@pytest.mark.parametrize(
    ("prefix", "tagged"),
    [("epp", "{epp}"), ("{epp}", "{epp}"), ("a{b}c", "a{b}c"), ("a{}b", "{a{}b}")],
)
def test_hash_tag_keeps_an_existing_tag(prefix: str, tagged: str) -> None:
    # "{}" is not a tag for Redis Cluster (empty), so it gets wrapped.
    assert hash_tag(prefix) == tagged


async def test_sentinel_url_carries_service_db_credentials_and_tls() -> None:
    url = (
        "rediss+sentinel://user:pw@10.0.0.1:26379,10.0.0.2:26380/mymaster/2"
        "?ssl_ca_certs=/ca.pem&sentinel_password=spw"
    )
    client = connect(url, socket_timeout=0.5)
    try:
        sentinel = client.sentinels  # type: ignore[attr-defined]
        pools = [s.connection_pool.connection_kwargs for s in sentinel.sentinels]
        hosts = [(kwargs["host"], kwargs["port"]) for kwargs in pools]
        assert hosts == [("10.0.0.1", 26379), ("10.0.0.2", 26380)]
        assert sentinel.sentinel_kwargs["password"] == "spw"
        assert sentinel.sentinel_kwargs["ssl"] is True
        assert sentinel.sentinel_kwargs["socket_timeout"] == 0.5
        master = client.connection_pool.connection_kwargs
        assert (master["username"], master["password"], master["db"]) == ("user", "pw", 2)
        assert master["ssl_ca_certs"] == "/ca.pem"
        assert client.connection_pool.service_name == "mymaster"
    finally:
        await client.aclose()


async def test_cluster_url_seeds_every_listed_node() -> None:
    client = connect("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001")
    try:
        assert isinstance(client, RedisCluster)
        seeds = sorted(client.nodes_manager.startup_nodes)
        assert seeds == ["10.0.0.1:7000", "10.0.0.2:7001"]
    finally:
        await client.aclose()


def test_standalone_url_is_plain_redis() -> None:
    assert isinstance(connect("redis://127.0.0.1:6379/0"), Redis)


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("redis+sentinel://h:1", "service name"),
        ("redis+cluster://h:1/3", "no path"),
        ("redis+cluster://h", "host:port"),
    ],
)
def test_malformed_urls_are_rejected(url: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        connect(url)


def test_config_accepts_sentinel_and_cluster_urls() -> None:
    base = {"models": {"m": {"pools": ["p"]}}, "pools": {"p": {"endpoints": ["127.0.0.1:1"]}}}
    for url in ("redis+sentinel://h:26379/svc", "rediss+cluster://h:7000"):
        config = parse_config({**base, "store": {"backend": "redis", "redis_url": url}})
        assert config.store.redis_url == url
    with pytest.raises(ConfigError, match="redis_url"):
        parse_config({**base, "store": {"redis_url": "http://h:1"}})
