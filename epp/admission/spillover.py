"""Spillover: spill-eligible work goes to an overflow pool while its home pool is saturated.

An overflow pool is another region or cluster, reached through its own gateway (an Envoy
cluster of its own, ``overflow-NAME`` in the rendered configuration), never as extra endpoints
of the home pool: epp does not pick the replica there, the overflow's own gateway (and its own
epp) does. epp answers a spilled request with the :data:`~epp.wire.OVERFLOW` header naming the
pool, and the route matching that header sends it to the overflow's cluster.

A request spills when all of these hold (:meth:`Spillover.target`):

- its objective is marked ``spill: true`` (batch, asynchronous work); latency-sensitive
  objectives, and requests that name no objective, never spill;
- its home pool is saturated (as admission sees it for the request's priority);
- an overflow pool of its home pools, in the order they are listed, is not saturated.

How epp knows an overflow pool is saturated: it scrapes the overflow's replicas' ``/metrics``
itself (``overflow.NAME.endpoints``, the same scraper and the same utilisation thresholds as
the home pool: waiting queue, KV use, stale metrics count as full), and counts the requests it
has spilled there and not yet seen finish (shared between epps through the in-flight counts,
like any endpoint's). The overflow is saturated when every scraped replica is full, or when
the spilled requests in flight reach ``max_requests``. An overflow whose metrics epp cannot
read is never used: stale is full.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from epp.admission.saturation import SaturationDetector
from epp.state.inflight import Load
from epp.state.snapshot import EndpointState

# In-flight counts of spilled requests are kept under this pseudo-endpoint per overflow pool.
INFLIGHT_PREFIX = "overflow/"


@dataclass(frozen=True, slots=True)
class OverflowPool:
    """Another region's pool: its gateway (where Envoy sends spilled requests), its replicas
    (scraped to know when it is saturated) and how many spilled requests may be in flight."""

    gateway: tuple[str, ...]
    endpoints: tuple[str, ...]
    max_requests: int = 0


def inflight_key(name: str) -> str:
    """The pseudo-endpoint under which spills to overflow pool ``name`` count in flight."""
    return INFLIGHT_PREFIX + name


@dataclass(frozen=True, slots=True)
class Spillover:
    """The configuration: overflow pools by name, each home pool's overflow pools in order,
    and the objectives that may spill."""

    pools: Mapping[str, OverflowPool] = field(default_factory=dict)
    routes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def endpoints(self) -> dict[str, str]:
        """Every overflow replica to scrape, mapped to its overflow pool's name."""
        return {a: name for name, pool in self.pools.items() for a in pool.endpoints}

    def overflow_for(self, home_pools: Sequence[str]) -> tuple[str, ...]:
        """The overflow pools of these home pools, in order, each once."""
        return tuple(dict.fromkeys(o for p in home_pools for o in self.routes.get(p, ())))

    def saturated(
        self,
        name: str,
        endpoints: Mapping[str, EndpointState],
        detector: SaturationDetector,
        load: Callable[[str], Load],
        now: float,
    ) -> bool:
        """Is overflow pool ``name`` full (every replica over a utilisation threshold or not
        seen lately, or ``max_requests`` of our spills in flight)?"""
        pool = self.pools[name]
        if pool.max_requests and load(inflight_key(name)).requests >= pool.max_requests:
            return True
        replicas = [endpoints.get(a) or EndpointState(a, name) for a in pool.endpoints]
        # Utilisation only: epp does not count work per overflow replica (their gateway picks).
        return detector.saturated(replicas, now)

    def target(
        self,
        candidates: Sequence[str],
        home_saturated: Callable[[], bool],
        overflow_saturated: Callable[[str], bool],
    ) -> str | None:
        """The overflow pool to spill to (``candidates`` in order), or None to stay home.
        The home pool is checked only when there is somewhere to go."""
        if not candidates or not home_saturated():
            return None
        return next((name for name in candidates if not overflow_saturated(name)), None)
