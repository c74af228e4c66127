"""One URL names the Redis deployment epp shares state through: standalone, Sentinel or Cluster.

The flavour rides in the URL scheme, so ``store.redis_url`` and ``epp serve --redis-url`` are
the whole configuration and no extra key can contradict the URL:

- ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS), ``unix:///path``: one server.
- ``redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]`` and
  ``rediss+sentinel://``: ask the Sentinels for the master of ``service_name`` and follow it
  across failovers (every connection moves within FOLLOW_INTERVAL of the switch). The
  credentials are the data servers'; ``?sentinel_password=`` authenticates to the Sentinels
  when they require it. TLS options apply to Sentinels and servers alike.
- ``redis+cluster://[user:password@]host:port[,host:port...]`` and ``rediss+cluster://``: any
  reachable nodes seed the slot map of a Redis Cluster.

Query parameters are redis-py's connection options (``?ssl_ca_certs=/ca.pem&socket_timeout=2``)
and win over the defaults passed by the caller.

Credentials and TLS enter through the URL alone: the userinfo authenticates (an ACL user, or
``:password`` for the default user) and ``rediss`` with ``ssl_ca_certs`` (``ssl_certfile`` and
``ssl_keyfile`` for a client certificate) verifies the server. :func:`with_credentials` puts a
username and password read from elsewhere (``store.redis_password_file``) into a URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit, urlunsplit

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import Connection, SSLConnection, parse_url
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

log = logging.getLogger(__name__)

Client = Redis | RedisCluster

# A Sentinel client in use asks this often whether the master moved: the bound on how long a
# process keeps talking to the old master after a failover.
FOLLOW_INTERVAL = 0.5

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


def has_password(url: str) -> bool:
    """Whether ``url`` authenticates: a password in its userinfo or its query."""
    parts = urlsplit(url)
    return bool(parts.password) or "password" in parse_qs(parts.query)


def with_credentials(url: str, username: str, password: str) -> str:
    """``url`` authenticating as ``username`` (empty: Redis' ``default`` user) with
    ``password``, percent-encoded, in place of any userinfo it had."""
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]
    userinfo = f"{quote(username, safe='')}:{quote(password, safe='')}"
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{hosts}"))


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
    # redis-py leaves Sentinel's constructor and master_for unannotated.
    sentinels = Sentinel(hosts, sentinel_kwargs=sentinel_options, **options)  # type: ignore[no-untyped-call]
    client: _SentinelMaster = sentinels.master_for(
        service, redis_class=_SentinelMaster, connection_pool_class=_FollowingPool
    )
    client.sentinels = sentinels
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

    # Not ``sentinel``: that name is Redis' SENTINEL command.
    sentinels: Sentinel

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        await self.sentinels.aclose()


class _FollowingConnection(SentinelManagedConnection):
    """A Sentinel connection that asks the Sentinels whenever it reconnects.

    redis-py 8 reconnects a connection dropped in the middle of a command (its retry) with
    ``connect_check_health``, which skips the Sentinel lookup of ``connect`` and dials the
    address the connection had: the old master after a failover.
    """

    async def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
        if not self.is_connected:
            await self.connect()  # type: ignore[no-untyped-call]
        await super().send_packed_command(*args, **kwargs)


class _FollowingSSLConnection(_FollowingConnection, SSLConnection):
    pass


class _FollowingPool(SentinelConnectionPool):
    """A Sentinel pool whose connections all move to a new master within FOLLOW_INTERVAL.

    redis-py asks the Sentinels only when it opens a connection, and then closes only the idle
    ones: a busy connection (a blocking XREAD) and every connection of a pool that opens none
    keep talking to the old master. After a ``SENTINEL FAILOVER`` the old master stays a
    writable master until the Sentinel reconfigures it, seconds later, so processes that
    opened a connection meanwhile write to the new master while the others read the old one:
    the group splits and picks stop travelling. So while the pool is used it asks the
    Sentinels every FOLLOW_INTERVAL, in the background (no command waits for a Sentinel), and
    closes every connection, busy ones too, that points elsewhere; their commands retry on
    the new master.
    """

    # redis-py leaves the base class unannotated.
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        ssl = kwargs.pop("ssl", False)
        kwargs["connection_class"] = _FollowingSSLConnection if ssl else _FollowingConnection
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._asked_at = -math.inf
        self._asking: asyncio.Task[None] | None = None

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        now = time.monotonic()
        if now - self._asked_at >= FOLLOW_INTERVAL and (
            self._asking is None or self._asking.done()
        ):
            self._asked_at = now
            self._asking = asyncio.create_task(self._follow(), name="epp-sentinel-follow")
        return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]

    async def _follow(self) -> None:
        try:
            master = await self.get_master_address()  # type: ignore[no-untyped-call]
        except Exception as exc:  # Sentinels unreachable: keep the connections we have
            log.debug("cannot ask the sentinels for the master: %s", exc)
            return
        stale = [
            connection
            for connection in (*self._available_connections, *self._in_use_connections)
            if isinstance(connection, Connection)  # always: Sentinel connections are TCP
            and connection.is_connected
            and (connection.host, connection.port) != tuple(master)
        ]
        if stale:
            log.info("redis master moved to %s:%s, reconnecting", *master)
            await asyncio.gather(*(c.disconnect() for c in stale), return_exceptions=True)

    async def aclose(self) -> None:
        if self._asking is not None:
            self._asking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._asking
        await super().aclose()
