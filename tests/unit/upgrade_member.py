"""One epp process of a rolling-upgrade test, run as ``python -m tests.unit.upgrade_member``.

With ``--legacy`` it writes and reads shared state the way epp did before payloads carried a
schema version (version 0): the encoders and decoders below are that release's, kept here as a
fixture and installed over the current ones in this process only.

The member shares state through a real Redis the way ``epp serve`` does (a state store and
the shared-state loop), under load: it ships ``--picks`` prefix insertions in bursts, binds
sessions, holds in-flight requests and queued demand, and publishes its endpoint's state. Then
it waits until it has everything the member named ``--other`` shared the same way, prints one
JSON line saying what it saw, and stops when its standard input closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgpack
from prometheus_client import REGISTRY

from epp.prefix.approximate import approx_prefix
from epp.request import session_key
from epp.scheduling.scorers import session
from epp.state import redis_store
from epp.state.fleet import FleetState
from epp.state.group_queues import Row
from epp.state.inflight import Load
from epp.state.shared import picks, sync, wire
from epp.state.snapshot import EndpointState

BURST = 50
SESSIONS = 200
HELD = 3
POOL = "pool"
PRIORITY = 5


def endpoint(tag: str) -> str:
    return f"10.9.9.{ord(tag[0]) % 250}:8000"


def hashes(tag: str, count: int) -> range:
    """The prefix hashes member ``tag`` inserts: disjoint per member."""
    start = (ord(tag[0]) % 250 + 1) * 10_000_000
    return range(start, start + count)


# -- version 0: the unversioned encoding, as the release before versions wrote and read it ----


def _legacy_state_encode(state: EndpointState) -> str:
    return json.dumps(
        {
            "address": state.address,
            "pool": state.pool,
            "ready": state.ready,
            "scraped_at": state.scraped_at,
            "failures": state.failures,
            "metrics": {"waiting": state.metrics.waiting, "running": state.metrics.running},
        }
    )


def _legacy_state_decode(raw: bytes, now: float | None = None) -> EndpointState:
    data: dict[str, Any] = json.loads(raw)
    fields = data["metrics"]
    values = {name: fields[name] for name in ("waiting", "running") if name in fields}
    return EndpointState(
        address=str(data["address"]),
        pool=str(data["pool"]),
        ready=bool(data["ready"]),
        metrics=redis_store.EndpointMetrics(**values),
        scraped_at=float(data["scraped_at"]),
        failures=int(data["failures"]),
    )


def _legacy_queue_encode(rows: Sequence[Row]) -> str:
    return json.dumps([[r.key, r.priority, r.flow, r.queued, r.dispatched] for r in rows])


def _legacy_queue_decode(raw: bytes | None) -> list[Row]:
    items = json.loads(raw) if raw is not None else []
    rows = []
    for item in items if isinstance(items, list) else ():
        try:
            key, priority, flow, queued, dispatched = item
            rows.append(Row(str(key), int(priority), str(flow), int(queued), int(dispatched)))
        except (TypeError, ValueError):
            continue
    return rows


def _legacy_total(hashes: Sequence[Mapping[bytes, bytes]]) -> dict[str, Load]:
    out: dict[str, Load] = {}
    for fields in hashes:
        for raw_address, raw_value in fields.items():
            name = raw_address.decode()
            prefill = name.startswith("prefill|")
            try:
                first, second = (int(v) for v in raw_value.split(b"," if prefill else None))
            except ValueError:
                continue
            load = out.setdefault(name.removeprefix("prefill|"), Load())
            if prefill:
                load.prefill += first
                load.waiting += second
            else:
                load.requests += first
                load.tokens += second
    return out


async def _legacy_ship(self: picks.PickStream) -> None:
    items = list(self._pending)
    async with self._client.pipeline(transaction=False) as pipe:
        for start in range(0, len(items), 32):
            entry = msgpack.packb([self._me, time.time(), items[start : start + 32]])
            pipe.xadd(self._key, {"d": entry}, maxlen=self._maxlen, approximate=True)
        await pipe.execute()
    for _ in items:
        self._pending.popleft()


def _legacy_apply(self: picks.PickStream, entries: Iterable[dict[bytes, bytes]]) -> None:
    batches: dict[str, list[Any]] = {}
    channels = {c.tag: c for c in self._channels()}
    for fields in entries:
        try:
            origin, _shipped, items = msgpack.unpackb(fields[b"d"])[:3]
            if origin == self._me:
                continue
            for tag, raw in items:
                channel = channels.get(tag)
                if channel is not None:
                    batches.setdefault(tag, []).append(channel.item(*raw))
        except (KeyError, ValueError, TypeError, msgpack.UnpackException):
            LEGACY_UNREADABLE.append(fields)
    for tag, batch in batches.items():
        channels[tag].table.apply(batch)


# Entries the legacy reader could not read (the version-0 reader only skipped them).
LEGACY_UNREADABLE: list[object] = []


def install_legacy() -> None:
    """Make this process write and read version 0, as the release before versions did."""
    redis_store._encode = _legacy_state_encode  # type: ignore[assignment]
    redis_store._decode = _legacy_state_decode
    sync.encode_queue = _legacy_queue_encode
    sync.decode_queue = _legacy_queue_decode
    sync.total = _legacy_total
    wire.stamp_hash = dict  # type: ignore[assignment]
    wire.open_hash = lambda kind, fields: fields
    picks.PickStream._ship = _legacy_ship  # type: ignore[method-assign]
    picks.PickStream._apply = _legacy_apply  # type: ignore[method-assign]


# -- the member -------------------------------------------------------------------------------


def _rejected() -> float:
    return sum(
        REGISTRY.get_sample_value("epp_shared_state_rejected_total", {"kind": k, "reason": r})
        or 0.0
        for k in wire.KINDS
        for r in wire.REASONS
    )


async def _share(fleet: FleetState, store: redis_store.RedisStore, me: str, count: int) -> None:
    """What this member shares, under load: bursts of insertions while the rest stays held."""
    mine = endpoint(me)
    now = time.time()
    await store.put_endpoint(EndpointState(mine, POOL, True, scraped_at=now))
    for _ in range(HELD):
        fleet.inflight.add(mine, 10)
    fleet.queues.queued(POOL, PRIORITY, me, 2, time.monotonic())
    for i in range(SESSIONS):
        fleet.states.get(session.SESSIONS).bind(
            session_key(f"{me}-s{i}".encode()), mine, now, 600.0
        )
    todo = list(hashes(me, count))
    for start in range(0, len(todo), BURST):
        for h in todo[start : start + BURST]:
            fleet.states.get(approx_prefix()).insert(mine, [h], 10 * count)
        await asyncio.sleep(0.005)


def _seen(
    fleet: FleetState, store: redis_store.RedisStore, other: str, count: int
) -> dict[str, Any]:
    theirs = endpoint(other)
    matched = fleet.states.get(approx_prefix()).match
    state = store.snapshot().get(theirs)
    return {
        "prefix": sum(matched([h], [theirs])[theirs] for h in hashes(other, count)),
        "sessions": sum(
            fleet.states.get(session.SESSIONS).get(
                session_key(f"{other}-s{i}".encode()), time.time()
            )
            == theirs
            for i in range(SESSIONS)
        ),
        "load": fleet.inflight.load(theirs).requests,
        "queue": fleet.queues.waiting(POOL, PRIORITY, time.monotonic()),
        "state": state is not None and state.ready,
    }


def complete(seen: Mapping[str, Any], count: int) -> bool:
    expected = {"prefix": count, "sessions": SESSIONS, "load": HELD, "queue": True, "state": True}
    return {k: seen.get(k) for k in expected} == expected


async def main(args: argparse.Namespace) -> None:
    if args.legacy:
        install_legacy()
    fleet = FleetState()
    # Declared before the stream is read, as a profile with these scorers does.
    fleet.states.get(approx_prefix())
    fleet.states.get(session.SESSIONS)
    store = redis_store.RedisStore(args.url, key_prefix=args.prefix, refresh_interval=0.02)
    member = sync.SharedState(args.url, fleet, key_prefix=args.prefix, interval=0.02)
    addresses = [endpoint(args.me), endpoint(args.other)]
    member.set_endpoints(addresses)
    await store.retain(addresses)
    await store.start()
    await member.start()
    await _share(fleet, store, args.me, args.picks)
    deadline = time.monotonic() + args.within
    seen = _seen(fleet, store, args.other, args.picks)
    while not complete(seen, args.picks) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        seen = _seen(fleet, store, args.other, args.picks)
    seen["rejected"] = _rejected() + len(LEGACY_UNREADABLE)
    print(json.dumps(seen), flush=True)
    # Stay in the group (keys renewed) until the test has both reports.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await member.stop()
    await store.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--me", required=True)
    parser.add_argument("--other", required=True)
    parser.add_argument("--picks", type=int, default=2000)
    parser.add_argument("--within", type=float, default=30.0)
    parser.add_argument("--legacy", action="store_true")
    asyncio.run(main(parser.parse_args()))
