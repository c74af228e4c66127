"""The background loop that makes a group of epp processes act as one picker.

Every scrape interval one pipeline (one round trip) renews this process's scrape leases and
group membership (:mod:`epp.state.shared.lease`), publishes its in-flight counts and its
flow-control demand and reads the other members' (:mod:`epp.state.shared.loads`,
:mod:`epp.state.shared.queues`). What picks teach the prefix index and the
session table, and passive health's ejections and readmissions, travel separately, within
milliseconds (:mod:`epp.state.shared.picks`). Endpoint states
themselves are shared by the state store (:class:`~epp.state.redis_store.RedisStore`), which
this loop does not touch.

Redis is an accelerator of agreement, not a dependency of availability: when a tick fails the
process scrapes every endpoint itself, counts only its own in-flight work, keeps its picks in
the outbox and routes on, and flow control orders only its own queue (``epp_flow_control_group``
0), logging once; the first tick that succeeds again takes up leases, republishes counts, ships
the outbox and resumes group-wide flow control (also logged once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterable
from typing import Any

from epp.observability import FLOW_GROUP, SHARED_INFLIGHT, SHARED_MEMBERS
from epp.state.fleet import FleetState
from epp.state.health import Verdict
from epp.state.shared import bounds, wire
from epp.state.shared.client import SOCKET_TIMEOUT, Backoff, open_client
from epp.state.shared.connect import hash_tag
from epp.state.shared.keys import Keys
from epp.state.shared.lease import Leases
from epp.state.shared.loads import encode, total
from epp.state.shared.picks import Channel, PickStream
from epp.state.shared.queues import decode as decode_queue
from epp.state.shared.queues import encode as encode_queue

log = logging.getLogger(__name__)

# A lease outlives this many missed renewals: a dead owner is replaced within about
# LEASE_INTERVALS + 1 intervals, and a process whose tick is late by less keeps its leases.
LEASE_INTERVALS = 3
# In-flight counts are kept longer: dropping a slow process's counts would herd traffic.
LOAD_INTERVALS = 10
# Latency evidence changes slowly (its half-life is 30 s): shared about once a second, kept
# for LATENCY_TTL_S after its process stops renewing it.
LATENCY_PERIOD_S = 1.0
LATENCY_TTL_S = 10.0


class SharedState:
    """Scrape leases, shared in-flight counts and replicated routing memory for one process.

    ``fleet``'s in-flight tracker gets the other processes' counts as ``remote``; its health
    verdicts and every state declared as replicated (:mod:`epp.state.registry`: the prefix
    indexes, the session table) exchange their additions with the other processes.
    """

    def __init__(
        self,
        url: str,
        fleet: FleetState,
        *,
        key_prefix: str = "epp",
        interval: float = 0.05,
        poll_picks: bool = False,
    ) -> None:
        if interval <= 0:
            raise ValueError("interval must be > 0")
        self._client = open_client(url)
        # Unique across restarts and machines; readable in redis-cli.
        self.me = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.keys = Keys(hash_tag(key_prefix))
        self.leases = Leases(self.keys, self.me, LEASE_INTERVALS * interval)
        self._inflight = fleet.inflight
        self._latency = fleet.latency
        self._queues = fleet.queues
        self._queues.set_interval(interval)
        self._ticks = 0
        self._interval = interval
        self._load_ttl_ms = max(1, round(LOAD_INTERVALS * interval * 1000))
        core = [Channel("health", fleet.health, Verdict, bounds.verdicts(fleet.health))]
        states = fleet.states

        def channels() -> list[Channel]:
            # The core's tables, then every replicated state declared so far.
            return core + [
                Channel(tag, state, how.item, how.check) for tag, how, state in states.replicated()
            ]

        self._picks = PickStream(
            self._client,
            self.keys,
            self.me,
            channels,
            poll_interval=interval if poll_picks else None,
            retry_interval=interval,
        )
        self._members: list[str] = []
        # Set by set_interval: cuts the current wait short so a new interval applies at once.
        self._retimed = asyncio.Event()
        self._up: bool | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def interval(self) -> float:
        return self._interval

    def set_interval(self, interval: float) -> None:
        """Follow a new scrape interval (a configuration reload): ticks, lease and load TTLs
        and the pick stream's retries all derive from it."""
        if interval <= 0:
            raise ValueError("interval must be > 0")
        self._interval = interval
        self.leases.set_ttl(LEASE_INTERVALS * interval)
        self._load_ttl_ms = max(1, round(LOAD_INTERVALS * interval * 1000))
        self._queues.set_interval(interval)
        self._picks.set_interval(interval)
        self._retimed.set()

    def owns(self, address: str) -> bool:
        """Whether this process scrapes ``address`` (the scraper asks before each scrape)."""
        return self.leases.owns(address)

    def set_endpoints(self, addresses: Iterable[str]) -> None:
        self.leases.set_endpoints(addresses)

    async def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._run(), name="epp-shared-sync")
            await self._picks.start()

    async def stop(self) -> None:
        self._stopping = True
        await self._picks.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
            if self._up:
                await self._leave()
        await self._client.aclose()

    async def _leave(self) -> None:
        """Free this process's leases and counts now rather than when they expire."""
        try:
            async with asyncio.timeout(SOCKET_TIMEOUT):
                async with self._client.pipeline(transaction=False) as pipe:
                    self.leases.queue_release(pipe)
                    pipe.delete(self.keys.load(self.me))
                    pipe.delete(self.keys.queue(self.me))
                    pipe.delete(self.keys.latency(self.me))
                    await pipe.execute()
        except Exception as exc:  # best effort: the TTLs clean up anyway
            log.debug("could not leave the group cleanly: %s", exc)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff(self._interval)
        next_at = loop.time()
        # The flag, not only the cancellation, ends the loop (redis-py on Python 3.11 can
        # swallow a cancellation; see RedisStore._run).
        while not self._stopping:
            try:
                await self._tick()
            except Exception as exc:  # whatever failed, this tick is lost; the loop survives
                self._set_up(False, exc)
                await backoff.failed()
                next_at = loop.time()
                continue
            self._set_up(True)
            backoff.reset(self._interval)
            next_at = max(next_at + self._interval, loop.time())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(next_at - loop.time()):
                    await self._retimed.wait()
            if self._retimed.is_set():
                self._retimed.clear()
                next_at = loop.time()

    async def _tick(self) -> None:
        others = [m for m in self._members if m != self.me]
        local = self._inflight.local()
        fields = encode(local)
        own = self.keys.load(self.me)
        # Latency evidence every LATENCY_PERIOD_S: written, then the others' read.
        latency = self._ticks % max(1, round(LATENCY_PERIOD_S / self._interval)) == 0
        self._ticks += 1
        async with self._client.pipeline(transaction=False) as pipe:
            # Writes first, then one read per other member and kind: the replies of the reads
            # are the tail of the results, whatever the writes were.
            order = self.leases.queue(pipe)
            if fields:
                pipe.hset(own, mapping=fields)
                pipe.pexpire(own, self._load_ttl_ms)
            # Always written (an empty list too): the others must see a queue that drained.
            rows = encode_queue(self._queues.export(time.monotonic()))
            pipe.set(self.keys.queue(self.me), rows, px=self._load_ttl_ms)
            if latency:
                self._write_latency(pipe)
            for member in others:
                pipe.hgetall(self.keys.load(member))
            for member in others:
                pipe.get(self.keys.queue(member))
            if latency:
                for member in others:
                    pipe.hgetall(self.keys.latency(member))
            # A refused read (a key of the wrong type) is a reply, not an exception: it must
            # not fail the tick, and so drop the group, for one garbage key.
            results = await pipe.execute(raise_on_error=False)
        n = len(others)
        reads = len(results) - n * (3 if latency else 2)
        wire.writes_done(results[:reads])
        self._members = self.leases.apply(order, results[0])
        tail = results[reads:]
        loads = [wire.read("load", r, {}) for r in tail[:n]]
        queues = [wire.read("queue", r, None) for r in tail[n : 2 * n]]
        if latency:
            opened = [wire.open_hash("latency", wire.read("latency", r, {})) for r in tail[2 * n :]]
            self._latency.apply_remote(opened, time.time())
        self._queues.apply(
            {m: decode_queue(raw) for m, raw in zip(others, queues, strict=True)},
            time.monotonic(),
        )
        remote = total(loads)
        self._inflight.remote = remote
        SHARED_MEMBERS.set(len(self._members))
        for address in {*local, *remote}:
            for origin, loads_of in (("local", local), ("remote", remote)):
                load = loads_of.get(address)
                SHARED_INFLIGHT.labels(address, origin).set(load.requests if load else 0)

    def _write_latency(self, pipe: Any) -> None:
        """Write this process's latency evidence (the others' is read with the other reads)."""
        exported = self._latency.export(time.time())
        own = self.keys.latency(self.me)
        if exported:
            pipe.hset(own, mapping=wire.stamp_hash(exported))
            pipe.pexpire(own, round(LATENCY_TTL_S * 1000))

    def _set_up(self, up: bool, exc: Exception | None = None) -> None:
        if not up:
            # Local-only from now on: nothing confirms leases or other processes' counts.
            self.leases.suspend()
            self._inflight.remote = {}
            self._queues.lose()
            self._members = []
            SHARED_MEMBERS.set(1)
        if up == self._up:
            return
        FLOW_GROUP.set(1 if up else 0)
        if up:
            if self._up is False:
                log.info("flow control: ordering dispatch with the group's queues again")
            log.info(
                "%s: %d epp processes share state, this one scrapes %d endpoints",
                "shared state resumed" if self._up is False else "shared state connected",
                len(self._members),
                len(self.leases.owned() or ()),
            )
        else:
            # INFO: the state store has already warned about the outage itself; this line says
            # what it means for scraping and routing.
            log.info(
                "shared state unavailable (%s): scraping every endpoint from this process and "
                "routing on local counts until redis answers",
                str(exc) or type(exc).__name__,
            )
            log.warning(
                "flow control: no view of the other epp processes' queues; priority bands and "
                "fairness shares hold for this process only until redis answers"
            )
        self._up = up
