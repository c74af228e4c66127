"""Tenant budgets for a whole group of epp processes: one Lua round trip per interval.

The ledger (:class:`~epp.admission.budgets.Budgets`) decides every request locally; this loop,
in the background, ships what it recorded and brings back leases. Per tenant and kind the
group's window is a Redis hash ``{p}:budget:<kind>:<tenant>``: field = bucket index (Redis
time / bucket width), value = amount granted or charged in that bucket. One script per tick,
atomically for all of the process's accounts:

1. records the process in the group's member set (the one scrape leases use) and counts it;
2. applies the charges (spends made without a slice, usage corrections, refunds, returned
   slices) to the buckets of their time, dropping buckets older than the window;
3. grants each account the slice it asks for, never past the limit and at most what is left
   over ``SLICE_SPLIT x members`` (at least one request's worth while that much is left),
   recorded in the current bucket;
4. answers the grants and each window's buckets (by age), from which the ledger computes
   remaining budget, ``Retry-After`` and the reset time.

Redis's clock ages the buckets (the processes' clocks may disagree); the processes send ages,
not times. When a tick fails the ledger turns to local mode (each process admits at most
``limit / processes``), this loop logs it once and sets ``epp_budget_local_mode``; the first tick
that succeeds again ships the charges made meanwhile and leaves local mode (logged too).
``epp_budget_members`` is the process count the last successful tick saw.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from epp.admission.budgets import BUCKETS, SLICE_SPLIT, Budgets
from epp.observability import BUDGET_LOCAL_MODE, BUDGET_MEMBERS, BUDGET_REMAINING, child
from epp.state.shared import wire
from epp.state.shared.client import SOCKET_TIMEOUT, Backoff, open_client
from epp.state.shared.keys import Keys

log = logging.getLogger(__name__)

# KEYS[1]: the member set; KEYS[2..]: one window hash per account.
# ARGV: process id, member TTL (ms), bucket width (ms), buckets, slice split; then per
# account: limit, slice wanted, least worth granting, number of charges, and that many
# (age in ms, amount) pairs.
# Returns {members, {fields malformed, members from the future}, {grant, {age in buckets,
# amount, ...}}, ...}. A field that is not a number is deleted (no process wrote it); members
# later than Redis's clock (plus a second of failover skew) are dropped, as they would shrink
# every share for ever. Buckets past the current one are deleted, uncounted, as before: a
# reload to a longer window leaves such buckets behind legitimately.
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local me, ttl, width, buckets = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local split = tonumber(ARGV[5])
redis.call('ZADD', KEYS[1], now, me)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
local future = redis.call('ZREMRANGEBYSCORE', KEYS[1], '(' .. (now + 1000), '+inf')
redis.call('PEXPIRE', KEYS[1], ttl)
local members = redis.call('ZCARD', KEYS[1])
local malformed = 0
local out = {members, {0, 0}}
local current = math.floor(now / width)
local oldest = current - buckets
local a = 6
for k = 2, #KEYS do
  local limit, want, least = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local n = tonumber(ARGV[a + 3])
  a = a + 4
  for j = 1, n do
    local index = math.floor((now - tonumber(ARGV[a])) / width)
    if index >= oldest then
      redis.call('HINCRBY', KEYS[k], index, ARGV[a + 1])
    end
    a = a + 2
  end
  local fields = redis.call('HGETALL', KEYS[k])
  local total, ages = 0, {}
  for j = 1, #fields, 2 do
    local index, amount = tonumber(fields[j]), tonumber(fields[j + 1])
    if index == nil or amount == nil then
      malformed = malformed + 1
      redis.call('HDEL', KEYS[k], fields[j])
    elseif index < oldest or index > current or amount <= 0 then
      -- Gone from the window; from another bucket width (a reloaded window_seconds); or
      -- refunds of charges Redis lost (a restart): nothing to count.
      redis.call('HDEL', KEYS[k], fields[j])
    else
      total = total + amount
      ages[#ages + 1] = current - index
      ages[#ages + 1] = amount
    end
  end
  local left = limit - total
  local grant = math.min(want, math.max(least, math.floor(left / (split * members))), left)
  grant = math.max(0, grant)
  if grant > 0 then
    redis.call('HINCRBY', KEYS[k], current, grant)
    ages[#ages + 1] = 0
    ages[#ages + 1] = grant
  end
  redis.call('PEXPIRE', KEYS[k], math.ceil(width * (buckets + 2)))
  out[#out + 1] = {grant, ages}
end
out[2] = {malformed, future}
return out
"""


class BudgetSync:
    """Leases and charges of one process's budget ledger, every ``interval`` seconds."""

    def __init__(
        self,
        url: str,
        ledger: Budgets,
        keys: Keys,
        me: str,
        *,
        interval: float = 0.05,
        member_ttl: float = 0.15,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = open_client(url)
        self._ledger = ledger
        ledger.grouped = True  # keep what is charged for the group's window
        self._keys = keys
        self._me = me
        self._clock = clock
        self.set_interval(interval, member_ttl)
        self._up: bool | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def set_interval(self, interval: float, member_ttl: float) -> None:
        """Follow a new sync interval (the scrape interval, on reload)."""
        self._interval = interval
        self._member_ttl_ms = max(1, round(member_ttl * 1000))

    async def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._run(), name="epp-budget-sync")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._client.aclose()

    async def _run(self) -> None:
        backoff = Backoff(self._interval)
        while not self._stopping:
            if not self._ledger.policy.enabled:
                await asyncio.sleep(self._interval)
                continue
            try:
                await self.tick()
            except Exception as exc:  # this tick is lost; local mode until one succeeds
                self._set_up(False, exc)
                await backoff.failed()
                continue
            self._set_up(True)
            backoff.reset(self._interval)
            await asyncio.sleep(self._interval)

    async def tick(self) -> None:
        """One round trip: ship charges, take slices, read the group's windows."""
        ledger = self._ledger
        now = self._clock()
        asks = ledger.asks(now)
        width = ledger.policy.window_seconds / BUCKETS * 1000
        keys = [self._keys.members, *(self._keys.budget(a.kind, a.tenant) for a in asks)]
        argv: list[Any] = [self._me, self._member_ttl_ms, width, BUCKETS, SLICE_SPLIT]
        for ask in asks:
            argv += [ask.limit, ask.want, ask.least, len(ask.charges)]
            for ago, amount in ask.charges:
                argv += [max(0, round(ago * 1000)), amount]
        try:
            async with asyncio.timeout(SOCKET_TIMEOUT):
                reply = await self._client.eval(_SCRIPT, len(keys), *keys, *argv)
        except BaseException:
            ledger.failed(asks, now)
            raise
        ledger.members = max(1, int(reply[0]))
        BUDGET_MEMBERS.set(ledger.members)
        ledger.shared = True
        for reason, n in zip((wire.MALFORMED, wire.FUTURE), reply[1], strict=True):
            if n:
                wire.reject("budget", reason, f"{n} deleted from the group's windows", int(n))
        for ask, (grant, flat) in zip(asks, reply[2:], strict=True):
            ledger.granted(ask, int(grant), _ages(flat), now)
        self._export(now)

    def _export(self, now: float) -> None:
        ledger = self._ledger
        policy = ledger.policy
        for tenant, kind in list(ledger.accounts()):
            if policy.limits(tenant).of(kind):
                left, _ = ledger.remaining(tenant, kind, now)
                child(BUDGET_REMAINING, policy.label(tenant), kind).set(left)

    def _set_up(self, up: bool, exc: BaseException | None = None) -> None:
        if not up:
            self._ledger.shared = False
        if up == self._up:
            return
        BUDGET_LOCAL_MODE.set(0 if up else 1)
        if up:
            if self._up is False:
                log.warning(
                    "tenant budgets: shared again through redis (%d epp processes)",
                    self._ledger.members,
                )
        else:
            log.warning(
                "tenant budgets: redis unreachable (%s): local mode, each tenant limited to "
                "limit / %d processes in this one until redis answers",
                str(exc) or type(exc).__name__,
                self._ledger.members,
            )
        self._up = up


def _ages(flat: Sequence[Any]) -> list[tuple[int, float]]:
    """``[age, amount, age, amount, ...]`` merged by age."""
    merged: defaultdict[int, float] = defaultdict(float)
    for i in range(0, len(flat) - 1, 2):
        merged[int(flat[i])] += float(flat[i + 1])
    return sorted(merged.items())
