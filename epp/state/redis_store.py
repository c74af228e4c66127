"""State store shared through Redis by several epp processes.

Redis is an accelerator of agreement, not a dependency of availability: every call the picker
and the sources make is served from the local copy-on-write snapshot, and one background task
talks to Redis. Each tick it sends a single pipeline (one round trip) that reads every endpoint
this process knows (one ``GET`` each), then writes the states put since the last tick
(``SET {prefix}:ep:{address} <json> PX ttl``); a remote state replaces the local one only if it
was scraped more recently (or, for the same scrape, has counted more failed polls since: a
failing endpoint's ``scraped_at`` stands still), so processes converge on the freshest
observation of each endpoint.
A change of readiness is written at once instead of at the next tick. With scrape leases
(:mod:`epp.state.shared.lease`) one process observes each endpoint, so the others only read.

Each value is ``{"v": <schema version>, "address": ..., "metrics": {...}, ...}``, checked on
read (:mod:`epp.state.shared.wire`): an unreadable one is skipped and counted, and a
``scraped_at`` later than now is taken as now, so a future-dated state cannot stay the freshest
for ever.

When Redis is unreachable the store keeps serving local state, logs one warning, reports
``epp_state_store_up 0`` and retries with capped, jittered exponential backoff; when Redis answers
again it logs once and pushes the whole local state, since Redis may have restarted empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from epp.observability import STORE_UP
from epp.state.local import LocalSnapshot
from epp.state.shared import wire
from epp.state.shared.client import Backoff, open_client
from epp.state.snapshot import EndpointMetrics, EndpointState, Snapshot
from epp.state.store import StateStore

log = logging.getLogger(__name__)

# Derived from the dataclass so a new metric field is shipped without touching this module; set
# fields (adapter names) travel as sorted JSON lists.
_METRIC_FIELDS = tuple(f.name for f in dataclasses.fields(EndpointMetrics))
_SET_FIELDS = frozenset(
    f.name for f in dataclasses.fields(EndpointMetrics) if f.default == frozenset()
)
_METRIC_HINTS = typing.get_type_hints(EndpointMetrics)


class RedisStore(StateStore):
    """Local snapshot plus a background sync of endpoint states with Redis.

    ``url`` is a redis-py URL: ``redis://[user:password@]host:port/db`` or ``rediss://`` for
    TLS (certificate options as query parameters, e.g. ``?ssl_ca_certs=/path/ca.pem``), or a
    Sentinel or Cluster URL (:mod:`epp.state.shared.connect`).
    """

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "epp",
        refresh_interval: float = 0.05,
        ttl: float = 5.0,
    ) -> None:
        if refresh_interval <= 0 or ttl <= 0:
            raise ValueError("refresh_interval and ttl must be > 0")
        # Parsing the URL here makes a malformed one a configuration error; nothing connects yet.
        self._redis = open_client(url)
        self._where = _redact(url)
        self._prefix = key_prefix
        self._interval = refresh_interval
        self._ttl_ms = max(1, round(ttl * 1000))
        self._local = LocalSnapshot()
        # Endpoints this process cares about: read from Redis each tick.
        self._known: set[str] = set()
        # Latest state per endpoint put since the last successful write.
        self._pending: dict[str, EndpointState] = {}
        # None until the first attempt, so the first outcome is logged either way.
        self._up: bool | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # Set when an endpoint's readiness changes: written at once, not on the next tick.
        self._urgent = asyncio.Event()
        # Set after the first tick that read the known endpoints from Redis (see first_sync).
        self._synced = asyncio.Event()

    async def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._run(), name="epp-redis-sync")

    async def stop(self) -> None:
        if self._task is not None:
            self._stopping = True
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._up = None
        await self._redis.aclose()

    def snapshot(self) -> Snapshot:
        return self._local.current

    async def first_sync(self) -> None:
        await self._synced.wait()

    def set_refresh_interval(self, interval: float) -> None:
        if interval <= 0:
            raise ValueError("refresh_interval must be > 0")
        self._interval = interval
        # Wake the loop: it syncs now and waits the new interval from there.
        self._urgent.set()

    @property
    def refresh_interval(self) -> float:
        return self._interval

    async def put_endpoint(self, state: EndpointState) -> None:
        self._known.add(state.address)
        previous = self._local.current.get(state.address)
        if self._local.update((state,)):
            self._pending[state.address] = state
            if previous is not None and previous.ready != state.ready:
                # The other processes read every tick; writing now rather than at our next tick
                # takes a crashed replica out of their rotation up to a tick sooner.
                self._urgent.set()

    async def retain(self, addresses: Iterable[str]) -> None:
        # Also how endpoints become known before this process has scraped them: a fresh process
        # picks up other processes' states for its configured endpoints on its first tick.
        # Removed endpoints' keys are left to expire: other processes may still use them.
        self._known = set(addresses)
        self._local.retain(self._known)
        self._pending = {a: s for a, s in self._pending.items() if a in self._known}

    def _key(self, address: str) -> str:
        return f"{self._prefix}:ep:{address}"

    async def _run(self) -> None:
        backoff = Backoff(self._interval)
        # The flag, not only the cancellation, ends the loop: redis-py sends commands under
        # asyncio.wait_for, which on Python 3.11 swallows a cancellation that arrives as the
        # send completes (CPython gh-86296), and the loop would then run on after stop().
        while not self._stopping:
            try:
                await self._sync()
            # Whatever went wrong (connection, timeout, auth, a server error), the tick failed;
            # the loop must survive it.
            except Exception as exc:
                self._set_up(False, exc)
                await backoff.failed()
                continue
            self._set_up(True)
            backoff.reset(self._interval)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval):
                    await self._urgent.wait()
            self._urgent.clear()

    async def _sync(self) -> None:
        if self._up is not True:
            # First contact or back after an outage: Redis may be empty, push everything.
            for address, state in self._local.current.endpoints.items():
                self._pending.setdefault(address, state)
        batch, self._pending = self._pending, {}
        # A state nobody has observed yet (an endpoint just added: never scraped, no failure)
        # says nothing; written, it would overwrite another process's real observation, and a
        # restarted epp made the whole group see its endpoints unready for a tick.
        batch = {a: st for a, st in batch.items() if st.scraped_at > 0.0 or st.failures > 0}
        addresses = list(self._known)
        try:
            if not batch and not addresses:
                await self._redis.ping()  # nothing to do, but STORE_UP must still tell the truth
                return
            async with self._redis.pipeline(transaction=False) as pipe:
                # Reads before writes: a write replaces whatever another process wrote since our
                # last tick, and a process that writes every tick (an owner counting failures)
                # would otherwise only ever read its own state back and never a newer one.
                # One GET per key rather than MGET (and no PING above): Redis Cluster pipelines
                # refuse multi-key and keyless commands. Still one round trip.
                for address in addresses:
                    pipe.get(self._key(address))
                for state in batch.values():
                    pipe.set(self._key(state.address), _encode(state), px=self._ttl_ms)
                # Reads refused (a key of the wrong type) come back as replies, see _merge.
                results = await pipe.execute(raise_on_error=False)
            wire.writes_done(results[len(addresses) :])
        except BaseException:
            # Not written: queue again, unless a newer state was put or the endpoint was dropped
            # while we waited.
            for address, state in batch.items():
                if address in self._known:
                    self._pending.setdefault(address, state)
            raise
        if addresses:
            reads = [wire.read("endpoint", r, None) for r in results[: len(addresses)]]
            self._merge(addresses, reads, batch)
            self._synced.set()

    def _merge(
        self,
        addresses: Sequence[str],
        raws: Sequence[bytes | None],
        written: Mapping[str, EndpointState],
    ) -> None:
        """Take the states read for ``addresses`` that are newer than ours; ``written``: the
        states this tick wrote after reading them."""
        # Compared against the snapshot as it is now, after the await: puts and retains that
        # happened during the round trip win over what Redis said before them.
        current = self._local.current.endpoints
        newer: list[EndpointState] = []
        now = time.time()
        for address, raw in zip(addresses, raws, strict=True):
            if raw is None or address not in self._known:
                continue
            try:
                state = _decode(raw, now)
                if state.address != address:
                    raise wire.Malformed(f"the state of {state.address!r} under {address!r}")
            except (ValueError, TypeError, KeyError) as exc:
                wire.refused("endpoint", exc)
                continue
            local = current.get(address)
            if local is None or _order(state) > _order(local):
                newer.append(state)
            elif _order(state) < _order(local) and written.get(address) != local:
                # Another process overwrote our fresher observation (writes are last-writer-wins,
                # not newest-wins): write ours back, so Redis converges even if we do not scrape
                # this endpoint again soon. Unless this tick wrote it after the read.
                self._pending.setdefault(address, local)
        self._local.update(newer)

    def _set_up(self, up: bool, exc: Exception | None = None) -> None:
        if up == self._up:
            return
        if up:
            if self._up is None:
                log.info("state store connected to redis at %s", self._where)
            else:
                log.info("redis at %s is reachable again; local state pushed", self._where)
        else:
            log.warning(
                "redis at %s is unreachable (%s); serving local state, retrying in the background",
                self._where,
                str(exc) or type(exc).__name__,
            )
        STORE_UP.set(1 if up else 0)
        self._up = up


def _order(state: EndpointState) -> tuple[float, int]:
    """Which of two observations of one endpoint is newer: failed polls since count too."""
    return (state.scraped_at, state.failures)


def _encode(state: EndpointState) -> str:
    metrics = {
        name: sorted(value) if name in _SET_FIELDS else value
        for name in _METRIC_FIELDS
        if (value := getattr(state.metrics, name)) is not None
    }
    return json.dumps(
        {
            "v": wire.VERSION,
            "address": state.address,
            "pool": state.pool,
            "ready": state.ready,
            "scraped_at": state.scraped_at,
            "failures": state.failures,
            "metrics": metrics,
        },
        separators=(",", ":"),
    )


def _decode(raw: bytes, now: float) -> EndpointState:
    """One state read from Redis, every field checked; ``scraped_at`` at most ``now``."""
    data: Any = json.loads(raw)
    if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict):
        raise wire.Malformed(f"an endpoint state must be an object with metrics: {raw!r:.80}")
    wire.check_version(data.get("v", 0))  # absent: written before versions existed
    # Unknown metric fields are ignored and missing ones take their defaults, so processes of
    # neighbouring versions can share one Redis during a rolling upgrade.
    fields = data["metrics"]
    values: dict[str, Any] = {
        name: wire.typed(_METRIC_HINTS[name], fields[name], name)
        for name in _METRIC_FIELDS
        if name in fields
    }
    return EndpointState(
        address=typing.cast(str, wire.typed(str, data["address"], "address")),
        pool=typing.cast(str, wire.typed(str, data["pool"], "pool")),
        ready=typing.cast(bool, wire.typed(bool, data["ready"], "ready")),
        metrics=EndpointMetrics(**values),
        scraped_at=wire.clamp("endpoint", wire.number(data["scraped_at"], "scraped_at"), now),
        failures=wire.count(data["failures"], "failures"),
    )


def _redact(url: str) -> str:
    """The URL without credentials, for log lines."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path}"
