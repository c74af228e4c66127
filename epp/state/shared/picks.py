"""What each epp process learns from its picks, replayed by the others through a Redis stream.

A prefix-aware picker remembers which endpoint probably caches which prompt blocks
(:class:`~epp.prefix.approximate.ApproximatePrefixIndex`) and where each session went
(:class:`~epp.state.sessions.SessionTable`), learned from its own routing. With several epp
processes behind one gateway each would learn only from the requests it happened to handle, and
the requests of one prefix group would scatter over replicas. So each process ships what its
picks added to those tables to the stream ``{p}:picks`` (``XADD ... MAXLEN ~ 1024``), and every
other process applies it to its own tables.

The tables keep their local additions in a bounded "recent" buffer (``take_recent()``) and
accept other processes' with ``apply()``, which does not record them again; this module only
moves items. The request path does no I/O: the shipper collects every ``linger`` (5 ms) and
sends what accumulated in one pipeline; readers wait in ``XREAD BLOCK``, so an addition reaches
the other processes a few milliseconds after the pick, well within a scrape interval. With
``poll_interval`` both sides work once per interval instead (for Redis proxies that do not
support blocking commands); an addition then takes up to two intervals.

A starting process reads the stream from its beginning, so its tables start warm with the
group's last 1024 entries (1k to 32k additions). While Redis is unreachable additions wait (the
newest ``backlog`` of them) and are sent when it returns.

Each entry holds one field ``d``: msgpack ``[origin id, wall time shipped, [[channel, item],
...], schema version]`` with what one process collected in one linger (at most 32 items), an
item being the table's tuple (e.g. ``Insertion``) as a list. The version comes last, where
readers of the unversioned encoding (which read the first three elements) ignore it. Readers
check every entry and item (:mod:`epp.state.shared.wire`): one they cannot use is skipped and
counted, and each channel bounds what its items may hold (:mod:`epp.state.shared.bounds`: an
ejection's end, a binding's expiry). Batching matters: redis-py parses replies in pure Python, so
one command and one entry per item would make every decision markedly dearer in CPU; batching
cuts that to a fraction (benchmarks/multi_epp.py). Memory: MAXLEN entries
of at most 32 items of at most 256 block hashes, ~75 MB in the worst case, a few MB for ordinary
prompts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from epp.observability import SHARED_PICK_DELAY, SHARED_PICKS, SHARED_PICKS_PENDING
from epp.state.shared import wire
from epp.state.shared.client import Backoff
from epp.state.shared.keys import Keys

log = logging.getLogger(__name__)

# Entries per XREAD; a longer backlog (a fresh process replaying history) takes several reads.
_READ_COUNT = 512
# XREAD BLOCK timeout: bounds how long stop() waits if a cancellation is swallowed (redis-py
# on Python 3.11); must stay below the socket timeout.
_BLOCK_MS = 200
# Items per stream entry: one XADD (and one entry for readers to parse) carries everything
# collected in one linger, up to this many. Bounds an entry at ~75 KB (256-block prompts).
_ENTRY_ITEMS = 32
# The stream outlives its writers by this much, then goes: a group stopped for an hour restarts
# cold anyway (engines evict, sessions expire), and Redis keeps nothing forever.
_STREAM_TTL_MS = 3_600_000
# How often a shipping process renews that TTL.
_RENEW_S = 60.0


class Replicated(Protocol):
    """A table whose local additions are shipped and whose ``apply`` takes the others'."""

    def take_recent(self) -> list[Any]: ...

    def recent_count(self) -> int: ...

    def apply(self, batch: Iterable[Any]) -> None: ...


@dataclass(frozen=True, slots=True)
class Channel:
    """One replicated table: its tag in stream entries and how to rebuild its items.

    ``item`` is the NamedTuple shipped; ``check`` takes one whose field types are right and
    the wall time now, and returns it within the table's bounds or raises ``wire.Malformed``.
    """

    tag: str
    table: Replicated
    item: type
    check: Callable[[Any, float], Any] = lambda item, _now: item


class PickStream:
    """Shipper and reader of one process's replicated tables."""

    # Started streams, for the pending gauge: one per process in production, several in tests.
    _live: set[PickStream] = set()

    def __init__(
        self,
        client: Any,
        keys: Keys,
        me: str,
        channels: Callable[[], Iterable[Channel]],
        *,
        maxlen: int = 1024,
        backlog: int = 4096,
        linger: float = 0.005,
        poll_interval: float | None = None,
        retry_interval: float = 0.05,
    ) -> None:
        self._client = client
        self._key = keys.picks
        self._me = me
        # Asked at every collection and read: a reload can add a state (a new parameter set).
        self._channels = channels
        self._maxlen = maxlen
        self._backlog = backlog
        # Items ([channel tag, item]) not yet in Redis, oldest first.
        self._pending: deque[list[Any]] = deque()
        self._linger = poll_interval if poll_interval is not None else linger
        self._poll = poll_interval
        self._retry = retry_interval
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._started_at = 0.0
        self._apply_failed = False
        # When the stream's TTL is renewed next (at once: the first shipment sets it).
        self._renew_at = 0.0

    def set_interval(self, interval: float) -> None:
        """Follow a new scrape interval: retry backoff starts there, polling runs at it."""
        self._retry = interval
        if self._poll is not None:
            self._poll = self._linger = interval

    def pending(self) -> int:
        """Local additions not yet known to be in Redis: in the tables' recent buffers, or
        collected and waiting for a shipment to succeed (one under way included: others may
        read an entry before its pipeline's reply gets here). Zero after a reply means that
        reply's pick reached Redis (the pick is recorded before the answer goes to Envoy)."""
        return len(self._pending) + sum(c.table.recent_count() for c in self._channels())

    async def start(self) -> None:
        if not self._tasks:
            PickStream._live.add(self)
            self._stopping = False
            self._started_at = time.time()
            self._tasks = [
                asyncio.create_task(self._ship_loop(), name="epp-picks-ship"),
                asyncio.create_task(self._read_loop(), name="epp-picks-read"),
            ]

    async def stop(self) -> None:
        # The flag ends the loops even if redis-py swallows the cancellation (see redis_store).
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        PickStream._live.discard(self)

    async def _ship_loop(self) -> None:
        backoff = Backoff(self._retry)
        while not self._stopping:
            await asyncio.sleep(self._linger)
            self._collect()
            if not self._pending:
                continue
            try:
                await self._ship()
            except Exception as exc:  # any failure: keep the entries, retry later
                log.debug("cannot ship picks: %s", exc)
                await backoff.failed()
                continue
            backoff.reset(self._retry)

    def _collect(self) -> None:
        for channel in self._channels():
            self._pending.extend([channel.tag, list(item)] for item in channel.table.take_recent())
        overflow = len(self._pending) - self._backlog
        if overflow > 0:  # Redis has been away for a while: the oldest matter least
            SHARED_PICKS.labels("dropped").inc(overflow)
            for _ in range(overflow):
                self._pending.popleft()

    async def _ship(self) -> None:
        items = list(self._pending)
        now = time.time()
        async with self._client.pipeline(transaction=False) as pipe:
            for start in range(0, len(items), _ENTRY_ITEMS):
                chunk = items[start : start + _ENTRY_ITEMS]
                entry = msgpack.packb([self._me, now, chunk, wire.VERSION])
                pipe.xadd(self._key, {"d": entry}, maxlen=self._maxlen, approximate=True)
            # The stream's lifetime is renewed once in a while, not with every shipment (one
            # command more per shipment, i.e. per few requests, for an hour-long TTL).
            renew = time.monotonic() >= self._renew_at
            if renew:
                pipe.pexpire(self._key, _STREAM_TTL_MS)
            await pipe.execute()
        if renew:
            self._renew_at = time.monotonic() + _RENEW_S
        # Only now: a failed pipeline leaves them pending, in order.
        for _ in items:
            self._pending.popleft()
        SHARED_PICKS.labels("sent").inc(len(items))

    async def _read_loop(self) -> None:
        # From the beginning: a fresh process replays what the stream holds to warm up.
        last: bytes | str = "0-0"
        backoff = Backoff(self._retry)
        block = None if self._poll is not None else _BLOCK_MS
        while not self._stopping:
            try:
                reply = await self._client.xread({self._key: last}, count=_READ_COUNT, block=block)
            except Exception as exc:  # Redis down or failing over: retry with backoff
                if wire.wrong_type(exc):  # the stream's name holds nothing epp wrote
                    wire.reject("picks", wire.MALFORMED, exc)
                log.debug("cannot read picks: %s", exc)
                await backoff.failed()
                continue
            backoff.reset(self._retry)
            entries = reply[0][1] if reply else []
            if entries:
                last = entries[-1][0]
                self._apply(fields for _id, fields in entries)
            if self._poll is not None and len(entries) < _READ_COUNT:
                await asyncio.sleep(self._poll)
            elif entries and len(entries) < _READ_COUNT:
                # The first entry after a quiet spell is read at once (XREAD BLOCK); under load
                # the next read waits one linger so that it takes what every other process
                # shipped meanwhile: a reader's reads are bounded by 1 / linger a second
                # instead of following the group's shipments one by one, so the group's reads
                # per request stop growing with the number of processes as load grows.
                await asyncio.sleep(self._linger)

    def _apply(self, entries: Iterable[dict[bytes, bytes]]) -> None:
        batches: dict[str, list[Any]] = {}
        channels = {c.tag: c for c in self._channels()}
        now = time.time()
        for fields in entries:
            try:
                origin, shipped, items = _open(fields, now)
            except (KeyError, ValueError, TypeError, msgpack.UnpackException) as exc:
                SHARED_PICKS.labels("rejected").inc()
                wire.refused("picks", exc)
                continue
            if origin == self._me:
                continue
            for item in items:
                try:
                    tag, value = _item(channels, item, now)
                except wire.Malformed as exc:
                    SHARED_PICKS.labels("rejected").inc()
                    wire.refused("picks", exc)
                    continue
                if value is not None:  # else a table this process does not keep
                    batches.setdefault(tag, []).append(value)
            if shipped >= self._started_at:  # replayed history would skew the histogram
                SHARED_PICK_DELAY.observe(max(0.0, now - shipped))
        for tag, batch in batches.items():
            try:
                channels[tag].table.apply(batch)
            except Exception:
                # A bug in a table must not stop sharing; say so once, with the traceback.
                SHARED_PICKS.labels("rejected").inc(len(batch))
                if not self._apply_failed:
                    log.exception("cannot apply %s entries from other epp processes", tag)
                    self._apply_failed = True
                continue
            SHARED_PICKS.labels("applied").inc(len(batch))


def _item(channels: Mapping[str, Channel], item: object, now: float) -> tuple[str, Any]:
    """One ``[tag, fields]`` item checked and rebuilt; None for a table not kept here (another
    release's, or a parameter set this process does not use)."""
    if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str):
        raise wire.Malformed(f"an item must be [channel, fields], got {item!r:.80}")
    tag, raw = item
    channel = channels.get(tag)
    if channel is None:
        return tag, None
    return tag, channel.check(wire.record(channel.item, raw), now)


def _open(fields: Mapping[bytes, bytes], now: float) -> tuple[str, float, list[Any]]:
    """An entry's origin, shipping time (at most now) and items, its framing checked."""
    entry = msgpack.unpackb(fields[b"d"])
    if not isinstance(entry, list) or len(entry) < 3:
        raise wire.Malformed(
            f"an entry must be [origin, shipped, items, version], got {entry!r:.80}"
        )
    if len(entry) > 3:
        wire.check_version(entry[3])
    origin, shipped, items = entry[:3]
    if not isinstance(origin, str) or not isinstance(items, list):
        raise wire.Malformed(f"bad origin or items in {entry!r:.80}")
    return origin, wire.clamp("picks", wire.number(shipped, "shipped"), now), items


# Read at scrape time: the request path only appends to the recent buffers, as before.
SHARED_PICKS_PENDING.set_function(lambda: sum(s.pending() for s in PickStream._live))
