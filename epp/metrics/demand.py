"""Autoscaling signals per pool: arrival rate, service rate per replica, desired replicas.

    desired = ceil(arrival_rate / (service_rate_per_replica * target_utilisation))
    service_rate_per_replica = replica_concurrency / mean_request_seconds

Little's law: a pool receiving ``arrival_rate`` requests per second that each take
``mean_request_seconds`` holds ``arrival_rate * mean_request_seconds`` requests at once; a
replica serves ``replica_concurrency`` of them at a time without queueing, and should run at
``target_utilisation`` of that. The arrival rate moves as soon as the offered load does, before
a queue forms at the engines, so the signal leads queue length and TTFT (docs/autoscaling.md).

The service time of a streamed response is its time after the first token (the replica's
decode work); the time before it is mostly queueing, which grows exactly when the pool is short
of replicas and would otherwise inflate the estimate. It leaves prefill out, so prompt-heavy
traffic reads a little low; buffered responses count whole.

Rates are exponentially decayed event counts (time constant ``window_seconds``): an arrival adds
1, and ``count / window`` is the rate; the mean request time is a decayed mean of completed
requests' durations. Updating costs one ``exp`` per event; reading happens at scrape time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

# A pool whose decayed arrival count is below this is idle: desired 0 (the autoscaler's minimum
# applies). One request keeps a pool active for window * ln 2 (21 s at the default window).
IDLE_BELOW = 0.5


@dataclass(frozen=True, slots=True)
class DemandPolicy:
    """The ``autoscaling`` config section."""

    # 0.8 left no lead over TTFT on benchmarks/autoscale.py's ramp; 0.7 led by 16 s.
    target_utilisation: float = 0.7
    # Requests one replica runs at once at full speed (vLLM's batch at the latency you want).
    replica_concurrency: int = 8
    window_seconds: float = 30.0


class _Decayed:
    """A sum whose past contributions decay by ``exp(-age / window)``."""

    __slots__ = ("at", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.at = 0.0

    def add(self, amount: float, now: float, window: float) -> None:
        self.add_decayed(amount, now, self.factor(now, window))

    def add_decayed(self, amount: float, now: float, factor: float) -> None:
        """Add ``amount`` at ``now``, the past having decayed by ``factor`` (from
        :meth:`factor`: sums updated at the same instants share one)."""
        self.value = self.value * factor + amount
        self.at = now

    def factor(self, now: float, window: float) -> float:
        """How much of the sum is left at ``now``."""
        return math.exp(-max(0.0, now - self.at) / window)

    def read(self, now: float, window: float) -> float:
        if self.value == 0.0:
            return 0.0
        return self.value * self.factor(now, window)


class _Pool:
    __slots__ = ("arrivals", "busy", "completions")

    def __init__(self) -> None:
        self.arrivals = _Decayed()
        self.completions = _Decayed()
        self.busy = _Decayed()  # decayed sum of completed requests' seconds


@dataclass(frozen=True, slots=True)
class Signal:
    """One pool's signals as of a scrape."""

    arrival_rate: float
    service_rate_per_replica: float | None  # None until a request of the pool completed
    desired_replicas: int


class PoolDemand:
    """Arrivals and completions per pool, fed by the router and the response path."""

    def __init__(self, policy: DemandPolicy | None = None) -> None:
        self.policy = policy or DemandPolicy()
        self._pools: dict[str, _Pool] = {}

    def arrived(self, pool: str, weight: float = 1.0, now: float | None = None) -> None:
        """A request for ``pool`` arrived (routed there, or waiting for it: refused because
        none of its endpoints is ready). A model served by several pools gives each a share."""
        now = time.monotonic() if now is None else now
        self._pool(pool).arrivals.add(weight, now, self.policy.window_seconds)

    def completed(self, pool: str, seconds: float, now: float | None = None) -> None:
        """A request of ``pool`` completed after ``seconds`` of service."""
        now = time.monotonic() if now is None else now
        state = self._pool(pool)
        # Both sums are only ever updated together, so they decay by the same factor: one exp.
        factor = state.completions.factor(now, self.policy.window_seconds)
        state.completions.add_decayed(1.0, now, factor)
        state.busy.add_decayed(seconds, now, factor)

    def forget(self, keep: set[str]) -> None:
        """Drop pools no longer configured (bounded label sets)."""
        for name in set(self._pools) - keep:
            del self._pools[name]

    def signal(self, pool: str, ready: int, now: float | None = None) -> Signal:
        now = time.monotonic() if now is None else now
        policy = self.policy
        state = self._pools.get(pool)
        if state is None:
            return Signal(0.0, None, 0)
        window = policy.window_seconds
        recent = state.arrivals.read(now, window)
        arrival_rate = recent / window
        completions = state.completions.read(now, window)
        service_rate: float | None = None
        if completions > 0.0:
            mean_seconds = state.busy.read(now, window) / completions
            service_rate = policy.replica_concurrency / max(mean_seconds, 1e-6)
        if recent < IDLE_BELOW:
            return Signal(arrival_rate, service_rate, 0)
        if service_rate is None:
            # Nothing measured yet: keep the pool as it is (at least one replica, below).
            desired = ready
        else:
            desired = math.ceil(arrival_rate / (service_rate * policy.target_utilisation))
        # Scale from zero: requests are waiting for a pool with no ready replica.
        return Signal(arrival_rate, service_rate, max(desired, 1))

    def _pool(self, name: str) -> _Pool:
        state = self._pools.get(name)
        if state is None:
            state = self._pools[name] = _Pool()
        return state
