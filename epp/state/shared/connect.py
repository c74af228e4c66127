"""One URL names the Redis deployment epp shares state through: standalone, Sentinel or Cluster.

The flavour rides in the URL scheme, so ``store.redis_url`` and ``epp serve --redis-url`` are
the whole configuration and no extra key can contradict the URL:

- ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS), ``unix:///path``: one server.
- ``redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]`` and
  ``rediss+sentinel://``: ask the Sentinels for the master of ``service_name`` and follow it
  across failovers. The credentials are the data servers'; ``?sentinel_password=`` authenticates
  to the Sentinels when they require it. TLS options apply to Sentinels and servers alike.
- ``redis+cluster://[user:password@]host:port[,host:port...]`` and ``rediss+cluster://``: any
  reachable nodes seed the slot map of a Redis Cluster.

Query parameters are redis-py's connection options (``?ssl_ca_certs=/ca.pem&socket_timeout=2``)
and win over the defaults passed by the caller.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.sentinel import Sentinel

Client = Redis | RedisCluster

FLAVOURS = ("standalone", "sentinel", "cluster")
# Every scheme epp accepts, for configuration validation.
SCHEMES = (
    "redis://",
    "rediss://",
    "unix://",
    "redis+sentinel://",
    "rediss+sentinel://",
    "redis+cluster://",
    "rediss+cluster://",
)


def flavour(url: str) -> str:
    """``standalone``, ``sentinel`` or ``cluster``, from the URL scheme."""
    scheme = url.partition("://")[0]
    suffix = scheme.partition("+")[2]
    return suffix if suffix in FLAVOURS else "standalone"


def hash_tag(prefix: str) -> str:
    """``prefix`` as a Redis Cluster hash tag (``epp`` -> ``{epp}``), unless it has one.

    Every key epp writes starts with this, so all of them live in one slot: multi-key commands
    (MGET, the lease script) and pipelines stay valid on a Cluster, and standalone and Cluster
    deployments use the same key names. epp's Redis traffic is small (a few commands per
    process per scrape interval), so one shard carrying it all is not a bottleneck.
    """
    open_at = prefix.find("{")
    if open_at >= 0 and prefix.find("}", open_at + 2) > open_at:
        return prefix
    return f"{{{prefix}}}"


def connect(url: str, **defaults: Any) -> Client:
    """A client for ``url`` (nothing connects until the first command).

    ``defaults`` are connection options (timeouts, ``retry``) the URL's query may override.
    Raises ValueError for a malformed URL, so a bad one is a configuration error at start.
    """
    kind = flavour(url)
    if kind == "standalone":
        return Redis.from_url(url, **defaults)
    hosts, options, path = _split(url)
    if kind == "cluster":
        if path.strip("/"):
            raise ValueError("a redis+cluster:// URL takes no path (Cluster has only db 0)")
        nodes = [ClusterNode(host, port) for host, port in hosts]
        return RedisCluster(startup_nodes=nodes, **{**defaults, **options})
    service, _, db = path.strip("/").partition("/")
    if not service:
        raise ValueError("a redis+sentinel:// URL needs the service name as its path")
    if db:
        options["db"] = int(db)
    sentinel_password = options.pop("sentinel_password", None)
    options = {**defaults, **options}
    # Sentinels get the same timeouts and TLS settings, but their own password (if any).
    sentinel_options = {k: v for k, v in options.items() if k.startswith(("socket_", "ssl"))}
    if sentinel_password is not None:
        sentinel_options["password"] = sentinel_password
    sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_options, **options)
    client = sentinel.master_for(service, redis_class=_SentinelMaster)
    client.sentinel = sentinel
    return client


def _split(url: str) -> tuple[list[tuple[str, int]], dict[str, Any], str]:
    """Hosts, connection options and path of a multi-host URL."""
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    hosts = []
    for item in hostlist.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"Redis URL host must be 'host:port', got {item!r}")
        hosts.append((host.strip("[]"), int(port)))
    # redis-py parses credentials and query options (unknown ones, like sentinel_password, are
    # kept as strings); hand it the URL with one host and no path.
    base = parts.scheme.partition("+")[0]
    first = hostlist.split(",")[0]
    netloc = f"{userinfo}@{first}" if userinfo else first
    options: dict[str, Any] = dict(parse_url(urlunsplit((base, netloc, "", parts.query, ""))))
    options.pop("host", None)
    options.pop("port", None)
    if options.pop("connection_class", None) is SSLConnection:
        options["ssl"] = True
    return hosts, options, parts.path


class _SentinelMaster(Redis):
    """The master's client; closing it also closes the connections to the Sentinels."""

    sentinel: Sentinel

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        await self.sentinel.aclose()
