"""Scrape each endpoint once per interval for a whole group of epp processes.

Without coordination every epp process polls every vLLM replica: N processes cost each replica
N times the API-server CPU of rendering its page and give N slightly different views
that race each other in Redis. Instead each endpoint has a lease, a Redis string holding the id
of the one process that scrapes it (``SET NX PX``, renewed every interval); the others read
the owner's observations from Redis through the state store.

One Lua script per process per interval does all the lease work atomically and in one round
trip: it records the process in the group's member set (pruning members silent for longer than
a lease TTL), renews the leases the process holds, and takes free ones, walking the endpoints
in an order of its own (rendezvous hashing of process id and address, so processes reach for
different endpoints first) and stopping at its fair share: ``endpoints // members``, plus one
for the first ``endpoints % members`` members in id order, so shares add up to the endpoint
count exactly (7 over 3 is 3, 2, 2, never 3, 3, 1). A process that holds more than its share (it
was alone when another joined) releases its least preferred leases so the newcomer can take
them on its next tick.

Walking every endpoint's lease in every process every interval would cost Redis endpoints x
processes reads per interval (1,000 endpoints and 20 processes at 50 ms: 400,000 a second). A
tick only walks them all when something may have changed: the process holds less than its
share, the group's members changed, or the endpoint list did (and on the first tick). Otherwise
it passes only the leases it holds, renews them and learns the member set, so in a settled group
a tick costs Redis about two operations per endpoint held, endpoints x 2 per interval for the
whole group whatever its size. A lease lost meanwhile (it expired and another process took it)
leaves the process below its share, so its next tick walks them all again.

If an owner dies its leases expire after the TTL (3 intervals) and the survivors take them on
their next tick (the dead owner leaves the member set when they do, so they walk every lease);
an owner that stops cleanly frees them at once. While Redis is unreachable nothing is known to
be scraped by someone else, so the process scrapes every endpoint itself, as a lone epp would.
Before the first answer it scrapes nothing (for a few milliseconds), so a starting group does
not publish a burst of duplicate observations.

One observer per endpoint also means one view of it: two processes that disagree (one cannot
reach a replica the other can) no longer overwrite each other's states, which made the replica
flap between ready and unready. The price: an owner cut off from a replica marks it unready for
the whole group until the replica answers again or the lease moves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import xxhash

from epp.observability import SHARED_LEASES
from epp.state.shared import wire
from epp.state.shared.keys import Keys

log = logging.getLogger(__name__)

# KEYS[1]: the member set; KEYS[2..]: lease keys, this process's most preferred first: every
# endpoint's, or on a quiet tick only those it holds (see Leases.queue). ARGV[1]: process id;
# ARGV[2]: lease TTL in ms; ARGV[3]: the number of endpoints (shares are of all of them,
# whatever keys were passed). Returns {member ids, indices of leases held,
# members dropped for a time in the future}. Redis's clock, not the processes', ages the
# members: their clocks may disagree. A member later than that clock (plus a second of failover
# skew) was not written by this script and would shrink every share for ever: dropped.
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me, ttl = ARGV[1], tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, me)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
local future = redis.call('ZREMRANGEBYSCORE', KEYS[1], '(' .. (now + 1000), '+inf')
redis.call('PEXPIRE', KEYS[1], ttl)
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
local sorted = {unpack(members)}
table.sort(sorted)
local rank = 0
for i, m in ipairs(sorted) do
  if m == me then rank = i - 1 end
end
local n = tonumber(ARGV[3]) or (#KEYS - 1)
local share = math.floor(n / #members) + ((rank < n % #members) and 1 or 0)
local held, free = {}, {}
for i = 2, #KEYS do
  local owner = redis.call('GET', KEYS[i])
  if owner == me then
    if #held < share then
      redis.call('PEXPIRE', KEYS[i], ttl)
      held[#held + 1] = i - 1
    else
      redis.call('DEL', KEYS[i])
    end
  elseif not owner then
    free[#free + 1] = i
  end
end
for _, i in ipairs(free) do
  if #held >= share then break end
  if redis.call('SET', KEYS[i], me, 'NX', 'PX', ttl) then
    held[#held + 1] = i - 1
  end
end
return {members, held, future}
"""
# Same keys; leaves the group and frees the leases still held (a clean shutdown).
_RELEASE = """
redis.call('ZREM', KEYS[1], ARGV[1])
for i = 2, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then redis.call('DEL', KEYS[i]) end
end
"""


class Leases:
    """Which endpoints this process scrapes; the sync loop runs :meth:`queue` every interval."""

    def __init__(self, keys: Keys, me: str, ttl: float) -> None:
        self._keys = keys
        self._me = me
        self._ttl_ms = max(1, round(ttl * 1000))
        self._order: list[str] = []
        # Whether the next tick walks every endpoint's lease (see the module docstring), and
        # the member set it last saw.
        self._walk = True
        self._members: frozenset[str] = frozenset()
        # None: scrape everything (no confirmed leases: Redis down). Empty until the first
        # answer (see the module docstring).
        self._owned: frozenset[str] | None = frozenset()

    def set_ttl(self, ttl: float) -> None:
        """A new lease lifetime (the scrape interval changed); renewals from now on use it."""
        self._ttl_ms = max(1, round(ttl * 1000))

    def set_endpoints(self, addresses: Iterable[str]) -> None:
        """The endpoints to hold leases for (configuration changes take effect next tick)."""
        order = sorted(
            set(addresses), key=lambda a: xxhash.xxh64_intdigest(f"{self._me}|{a}".encode())
        )
        if order != self._order:
            self._order = order
            self._walk = True

    def owns(self, address: str) -> bool:
        """Whether this process should scrape ``address`` now. Never touches the network."""
        return self._owned is None or address in self._owned

    def owned(self) -> frozenset[str] | None:
        """The endpoints held, or None while scraping all of them."""
        return self._owned

    def queue(self, pipe: Any) -> Sequence[str]:
        """Add the lease script to ``pipe``; returns the endpoint order :meth:`apply` needs:
        every endpoint, or on a quiet tick the ones held."""
        owned = self._owned
        order = self._order
        if not self._walk and owned is not None:
            order = [a for a in order if a in owned]
        keys = [self._keys.members, *(self._keys.lease(a) for a in order)]
        pipe.eval(_SCRIPT, len(keys), *keys, self._me, self._ttl_ms, len(self._order))
        return order

    def queue_release(self, pipe: Any) -> None:
        """Add leaving the group to ``pipe``: the others take the leases on their next tick
        instead of waiting for them to expire."""
        keys = [self._keys.members, *(self._keys.lease(a) for a in self._order)]
        pipe.eval(_RELEASE, len(keys), *keys, self._me)

    def apply(self, order: Sequence[str], reply: Sequence[Any]) -> list[str]:
        """Record the script's answer; returns the group's member ids."""
        members, held, future = reply
        if future:
            wire.reject("members", wire.FUTURE, f"{future} members dated in the future", future)
        owned = frozenset(order[int(i) - 1] for i in held)
        if owned != self._owned:
            log.debug("scraping %d of %d endpoints: %s", len(owned), len(order), sorted(owned))
        self._owned = owned
        SHARED_LEASES.set(len(owned))
        ids = [m.decode() if isinstance(m, bytes) else str(m) for m in members]
        group = frozenset(ids)
        self._walk = group != self._members or len(owned) < self._share(sorted(group))
        self._members = group
        return ids

    def _share(self, members: Sequence[str]) -> int:
        """This process's fair share of the endpoints among ``members`` (sorted), as the
        script computes it."""
        if self._me not in members:
            return len(self._order)
        n, rank = len(self._order), members.index(self._me)
        return n // len(members) + (1 if rank < n % len(members) else 0)

    def suspend(self) -> None:
        """Redis did not answer: scrape every endpoint until it does."""
        self._owned = None
        self._walk = True
        SHARED_LEASES.set(len(self._order))
