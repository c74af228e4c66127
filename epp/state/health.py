"""Passive health: endpoints that fail real traffic are ejected, with backoff, and probed back.

A replica whose ``/metrics`` page looks fine can still answer 5xx, reset its connections or
stall; the scrape-based readiness never sees it. epp sees every response on the response path
(:mod:`epp.extproc.response_stream`), so it judges each endpoint from what it served:

- **Failures**: a 5xx (the replica's, or Envoy's for a reset or timeout before the response
  began) and a retry (Envoy moved the request off the picked endpoint: that attempt failed,
  and the 200 the client got came from the fallback). A response cut short after it began is
  no failure: epp cannot tell a client that hung up from a replica that reset
  (:mod:`epp.extproc.passive_health`), and clients must not be able to eject replicas.
  ``consecutive_failures`` in a row, or an error share of at least ``error_rate`` over the
  last ``window_seconds`` with at least ``min_requests`` answers, eject the endpoint.
- **Latency outliers**: with ``latency_rule: residual`` (the default), the median over the
  last ``latency_samples`` streamed responses of TTFT over the latency model's prediction for
  that request on that endpoint (made at the pick; the caller passes the ratio, see
  :mod:`epp.hooks.passive_health`) above ``latency_factor``: a replica is slow only when it is
  slower than its own model says, so cold prefills, queues behind popular prefixes and slower
  GPUs, all predicted, are not outliers. Whole responses (and streamed ones with
  ``latency_rule: pool``) are compared with the pool: the median latency of the last
  ``latency_samples`` samples above ``latency_factor`` times the median of the pool's other
  endpoints (each their own median) and above ``latency_floor_seconds``; comparing with the
  *others* lets a slow endpoint stand out in a pool of two. Under ``pool`` a streamed TTFT
  counts per ``latency_prompt_tokens`` prefill tokens ahead of its first token; every such
  cross-pool comparison still read cache-driven spread as slowness (docs/health.md).

Each endpoint is a circuit: CLOSED (serves), OPEN until its ejection time has passed, then
HALF_OPEN: one trial request at a time may go there (:meth:`HealthTracker.admits`,
:meth:`HealthTracker.picked`); ``trial_successes`` successes in a row close the circuit, a
failure (or a trial as slow as a latency outlier) opens it again for twice as long. The n-th
ejection in a row lasts ``base_ejection_seconds * 2**(n-1)``, at most
``max_ejection_seconds``; an endpoint that stays closed for ``max_ejection_seconds`` starts
again from the base time. At most ``max_ejection_percent`` of a pool is ejected at once, and
never its last endpoint.

What the tracker decides is shared (:meth:`take_recent`/:meth:`apply`, shipped by
:mod:`epp.state.shared.picks`) as verdicts with absolute wall-clock times, so every process of
a group excludes an endpoint any of them ejected; without Redis each process decides alone.
Another process's ejection is under this process's ejection cap like its own: a verdict that
would eject more than ``max_ejection_percent`` of a pool here is not applied.
Nothing here does I/O or reads a clock: callers pass ``now`` (``time.time()``).
"""

from __future__ import annotations

import enum
import itertools
import logging
import statistics
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from epp.observability import EJECTIONS, forget_endpoint_health, set_ejected

log = logging.getLogger(__name__)

# Samples kept per endpoint and window (outcomes and latencies); older ones age out anyway.
_WINDOW_LIMIT = 512
# Verdicts kept for shipping while Redis is away; the newest matter most.
_RECENT_LIMIT = 1024


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """The ``health`` section: when an endpoint is ejected and for how long."""

    enabled: bool = True
    consecutive_failures: int = 5
    error_rate: float = 0.25
    window_seconds: float = 10.0
    min_requests: int = 10
    latency_factor: float = 3.0
    latency_floor_seconds: float = 0.05
    latency_samples: int = 10
    # A streamed TTFT with more prefill tokens than this ahead of it at the pick (its uncached
    # prompt plus the prefill queued ahead) is scaled to this many (TTFT x
    # latency_prompt_tokens / ahead) before the comparison; less work ahead counts as
    # measured, the TTFT being mostly per-request cost. 0: never scaled.
    latency_prompt_tokens: int = 512
    # How a streamed TTFT is judged (LATENCY_RULES): "residual" against the latency model's
    # prediction for that request on that endpoint; "pool" (scaled as above) against the
    # pool's other endpoints; "off": not at all. A whole response's time is compared with the
    # pool's under "residual" and "pool" (the model predicts first tokens).
    latency_rule: str = "residual"
    base_ejection_seconds: float = 5.0
    max_ejection_seconds: float = 60.0
    max_ejection_percent: float = 50.0
    # Successful trials in a row that close a half-open circuit: with one, a replica failing
    # half its requests would be readmitted after every other ejection.
    trial_successes: int = 3
    # Trials start at most this often: with requests of a few milliseconds "one at a time"
    # alone would be most of the traffic.
    trial_interval_seconds: float = 0.5
    # A half-open trial whose answer never came is given up after this long.
    trial_timeout_seconds: float = 30.0


LATENCY_RULES = ("residual", "pool", "off")


class Circuit(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class Verdict(NamedTuple):
    """A shared decision: ``until`` > 0 ejects ``endpoint`` until then, 0 readmits it."""

    endpoint: str
    pool: str
    until: float
    ejections: int
    reason: str


@dataclass(slots=True)
class EndpointHealth:
    """What the tracker knows about one endpoint."""

    pool: str
    consecutive: int = 0
    # (time, failed) per answer and (time, seconds) per latency sample, oldest first.
    outcomes: deque[tuple[float, bool]] = field(default_factory=lambda: deque(maxlen=_WINDOW_LIMIT))
    latencies: deque[tuple[float, float]] = field(
        default_factory=lambda: deque(maxlen=_WINDOW_LIMIT)
    )
    # (time, measured / expected) per streamed TTFT the latency model predicted.
    residuals: deque[tuple[float, float]] = field(
        default_factory=lambda: deque(maxlen=_WINDOW_LIMIT)
    )
    # Ejections in a row (the backoff exponent), when the circuit opens until, why.
    ejections: int = 0
    until: float = 0.0
    reason: str = ""
    closed_at: float = 0.0
    # The trial in flight (when it started), and when the last one started.
    trial_at: float | None = None
    last_trial: float = 0.0
    trials_passed: int = 0

    def circuit(self, now: float) -> Circuit:
        if self.until == 0.0:
            return Circuit.CLOSED
        return Circuit.OPEN if now < self.until else Circuit.HALF_OPEN

    def expire(self, now: float, window: float) -> None:
        horizon = now - window
        while self.outcomes and self.outcomes[0][0] < horizon:
            self.outcomes.popleft()
        for samples in (self.latencies, self.residuals):
            while samples and samples[0][0] < horizon:
                samples.popleft()

    def median_latency(self, count: int) -> float | None:
        """The median of the last ``count`` latency samples, None with fewer."""
        return _recent_median(self.latencies, count)

    def median_residual(self, count: int) -> float | None:
        """The median of the last ``count`` residual samples, None with fewer."""
        return _recent_median(self.residuals, count)


def _recent_median(window: deque[tuple[float, float]], count: int) -> float | None:
    """The median of the last ``count`` samples of ``window``, None with fewer: the latest
    ones, so a replica that just turned slow stands out after ``count // 2 + 1`` samples,
    however many fast ones the time window holds."""
    if len(window) < count:
        return None
    # From the newest end: a copy of the whole window per answer costs more than the median.
    # statistics.median's own arithmetic, without its call overhead (once per answer).
    samples = sorted([s for _, s in itertools.islice(reversed(window), count)])
    middle = count // 2
    if count % 2:
        return samples[middle]
    return (samples[middle - 1] + samples[middle]) / 2


class HealthTracker:
    """Every endpoint's circuit; lives in :class:`~epp.state.fleet.FleetState`."""

    def __init__(self, config: HealthConfig | None = None) -> None:
        # Replaced on every configuration reload (:meth:`configure`).
        self.config = config or HealthConfig()
        self._endpoints: dict[str, EndpointHealth] = {}
        self._recent: deque[Verdict] = deque(maxlen=_RECENT_LIMIT)
        # Each pool's endpoints, for the ejection cap of verdicts from other processes (which
        # name the pool only); from :meth:`configure` when it is given the pool of each.
        self._pools: dict[str, tuple[str, ...]] = {}

    def state(self, endpoint: str) -> EndpointHealth | None:
        return self._endpoints.get(endpoint)

    def configure(self, config: HealthConfig, endpoints: Iterable[str] | Mapping[str, str]) -> None:
        """Apply a (re)loaded ``health`` section and forget endpoints that left (their state
        and metric series); with ``enabled: false`` every circuit closes. ``endpoints``: the
        addresses, or each address's pool."""
        self.config = config
        keep = set(endpoints)
        # Without each address's pool, the endpoints count as one pool.
        owner = endpoints if isinstance(endpoints, Mapping) else dict.fromkeys(keep, "")
        pools: dict[str, list[str]] = {}
        for address, pool in owner.items():
            pools.setdefault(pool, []).append(address)
        self._pools = {pool: tuple(sorted(members)) for pool, members in pools.items()}
        for endpoint in list(self._endpoints):
            if endpoint not in keep or not config.enabled:
                health = self._endpoints.pop(endpoint)
                forget_endpoint_health(health.pool, endpoint)

    def admits(self, endpoint: str, now: float) -> bool:
        """Whether ``endpoint`` may be picked now: closed, or half-open with no trial out and
        none started within ``trial_interval_seconds``."""
        health = self._endpoints.get(endpoint)
        if health is None or health.until == 0.0:
            return True
        if now < health.until or now - health.last_trial < self.config.trial_interval_seconds:
            return False
        trial = health.trial_at
        return trial is None or now - trial > self.config.trial_timeout_seconds

    def inconclusive(self, endpoint: str, now: float) -> None:
        """An answer of ``endpoint`` that says nothing about it (cut short after it began):
        a half-open trial it was frees the way for the next trial, nothing else changes."""
        health = self._endpoints.get(endpoint)
        if health is not None and health.circuit(now) is Circuit.HALF_OPEN:
            health.trial_at = None

    def picked(self, endpoint: str, now: float) -> None:
        """A request went to ``endpoint``: if its circuit is half-open, that is the trial."""
        health = self._endpoints.get(endpoint)
        if health is not None and health.circuit(now) is Circuit.HALF_OPEN:
            health.trial_at = health.last_trial = now

    def observe(
        self,
        endpoint: str,
        pool: str,
        members: Collection[str],
        failed: bool,
        latency: float | None,
        now: float,
        reason: str = "",
        residual: bool = False,
    ) -> None:
        """One answer of ``endpoint`` (of ``pool``, whose endpoints are ``members``):
        ``failed`` with ``reason`` (``5xx``, ``retried``), else its ``latency`` when known: in
        seconds, or with ``residual`` as measured over expected (judged against
        ``latency_factor`` alone, not against the pool)."""
        config = self.config
        if not config.enabled:
            return
        health = self._endpoints.get(endpoint)
        if health is None:
            health = self._endpoints[endpoint] = EndpointHealth(pool)
        health.pool = pool
        circuit = health.circuit(now)
        if circuit is Circuit.OPEN:
            return  # answers to picks made before the ejection: already judged
        if circuit is Circuit.HALF_OPEN:
            slow = latency is not None and self._outlier(endpoint, latency, residual, members, now)
            if not failed and slow:
                failed, reason = True, "latency"
            if failed:
                self._eject(health, endpoint, members, now, config, f"trial-{reason}", True)
                return
            health.trial_at = None  # the next trial may go
            health.trials_passed += 1
            if health.trials_passed >= config.trial_successes:
                self._close(health, endpoint, now)
            return
        if health.ejections and now - health.closed_at > config.max_ejection_seconds:
            health.ejections = 0  # long healthy: the next ejection starts from the base time
        if failed and health.ejections:
            # Probation: back from an ejection less than max_ejection_seconds ago, one failure
            # sends it out again (its trials passed, but a replica failing a share of its
            # requests passes a few in a row often enough).
            self._eject(health, endpoint, members, now, config, "probation", False)
            return
        health.expire(now, config.window_seconds)
        health.outcomes.append((now, failed))
        health.consecutive = health.consecutive + 1 if failed else 0
        if failed:
            failures = sum(1 for _, f in health.outcomes if f)
            if health.consecutive >= config.consecutive_failures:
                self._eject(health, endpoint, members, now, config, "consecutive", False)
            elif len(
                health.outcomes
            ) >= config.min_requests and failures >= config.error_rate * len(health.outcomes):
                self._eject(health, endpoint, members, now, config, "error-rate", False)
            return
        if latency is not None:
            self._sample(health, endpoint, members, latency, residual, now)

    def _sample(
        self,
        health: EndpointHealth,
        endpoint: str,
        members: Collection[str],
        latency: float,
        residual: bool,
        now: float,
    ) -> None:
        """A latency sample of a closed circuit: ejects when the median of the last
        ``latency_samples`` of its kind is an outlier."""
        count = self.config.latency_samples
        if residual:
            health.residuals.append((now, latency))
            median = health.median_residual(count)
        else:
            health.latencies.append((now, latency))
            median = health.median_latency(count)
        if median is not None and self._outlier(endpoint, median, residual, members, now):
            self._eject(health, endpoint, members, now, self.config, "latency", False)

    def _outlier(
        self, endpoint: str, latency: float, residual: bool, members: Collection[str], now: float
    ) -> bool:
        """Whether ``latency`` is slow: a residual above ``latency_factor``, else a latency
        slow against the pool (:meth:`_slow`)."""
        if residual:
            return latency > self.config.latency_factor
        return self._slow(endpoint, latency, members, now)

    def _slow(self, endpoint: str, latency: float, members: Collection[str], now: float) -> bool:
        """Whether ``latency`` is an outlier against the median of the pool's other closed
        endpoints (each their own window median)."""
        config = self.config
        if latency < config.latency_floor_seconds:
            return False
        others = []
        for other in members:
            state = self._endpoints.get(other)
            if other == endpoint or state is None or state.circuit(now) is not Circuit.CLOSED:
                continue
            state.expire(now, config.window_seconds)
            median = state.median_latency(config.latency_samples)
            if median is not None:
                others.append(median)
        return bool(others) and latency > config.latency_factor * statistics.median(others)

    def _eject(
        self,
        health: EndpointHealth,
        endpoint: str,
        members: Collection[str],
        now: float,
        config: HealthConfig,
        reason: str,
        again: bool,
    ) -> None:
        # A re-ejection after a failed trial keeps its place in the pool's share.
        if not again and not self._room(endpoint, health.pool, members, config):
            return
        health.ejections += 1
        seconds = min(
            config.base_ejection_seconds * 2 ** (health.ejections - 1),
            config.max_ejection_seconds,
        )
        health.until = now + seconds
        health.reason = reason
        health.trial_at = None
        health.trials_passed = 0
        health.consecutive = 0
        health.outcomes.clear()
        health.latencies.clear()
        health.residuals.clear()
        EJECTIONS.labels(health.pool, endpoint, reason).inc()
        set_ejected(health.pool, endpoint, True)
        self._recent.append(Verdict(endpoint, health.pool, health.until, health.ejections, reason))
        log.warning(
            "endpoint %s (pool %s) ejected for %.1fs (%s, ejection %d in a row)",
            endpoint,
            health.pool,
            seconds,
            reason,
            health.ejections,
        )

    def _room(
        self, endpoint: str, pool: str, members: Collection[str], config: HealthConfig
    ) -> bool:
        """Whether the pool's ejection cap leaves room for one more (never its last one)."""
        ejected = sum(
            1
            for m in members
            if m != endpoint and (s := self._endpoints.get(m)) is not None and s.until != 0.0
        )
        cap = min(int(len(members) * config.max_ejection_percent / 100), len(members) - 1)
        if ejected < cap:
            return True
        log.info(
            "endpoint %s (pool %s) would be ejected, but %d of %d endpoints already are "
            "(health.max_ejection_percent %g)",
            endpoint,
            pool,
            ejected,
            len(members),
            config.max_ejection_percent,
        )
        return False

    def _close(self, health: EndpointHealth, endpoint: str, now: float) -> None:
        health.until = 0.0
        health.trial_at = None
        health.closed_at = now
        health.consecutive = 0
        set_ejected(health.pool, endpoint, False)
        self._recent.append(Verdict(endpoint, health.pool, 0.0, health.ejections, ""))
        log.info(
            "endpoint %s (pool %s) back in rotation after a successful trial", endpoint, health.pool
        )

    def ejected(self, pool: str) -> list[str]:
        return [e for e, s in self._endpoints.items() if s.pool == pool and s.until != 0.0]

    def describe(self, endpoint: str, now: float) -> dict[str, object]:
        """The endpoint's circuit for ``/debug/endpoints``."""
        health = self._endpoints.get(endpoint)
        if health is None:
            return {"circuit": Circuit.CLOSED.value, "ejections": 0}
        view: dict[str, object] = {
            "circuit": health.circuit(now).value,
            "ejections": health.ejections,
            "consecutive_failures": health.consecutive,
        }
        if health.until:
            view["reason"] = health.reason
            view["ejected_for_seconds"] = round(max(0.0, health.until - now), 3)
        return view

    # Sharing (epp.state.shared.picks): this process's verdicts out, the others' in.

    def recent_count(self) -> int:
        """Additions made here and not yet taken by :meth:`take_recent`."""
        return len(self._recent)

    def take_recent(self) -> list[Verdict]:
        batch = list(self._recent)
        self._recent.clear()
        return batch

    def apply(self, batch: Iterable[Verdict]) -> None:
        """Other processes' verdicts: a later ejection wins, within the ejection cap; a
        readmission closes."""
        if not self.config.enabled:
            return
        for endpoint, pool, until, ejections, reason in batch:
            health = self._endpoints.get(endpoint)
            if until > 0.0 and (health is None or health.until == 0.0):
                # A new ejection here: only with room under the cap, as a local one.
                members = self._pools.get(pool) or self._pools.get("") or (endpoint,)
                if not self._room(endpoint, pool, members, self.config):
                    continue
            if health is None:
                health = self._endpoints[endpoint] = EndpointHealth(pool)
            if until > 0.0:
                if until > health.until:
                    health.until = until
                    health.reason = reason
                    health.ejections = max(health.ejections, ejections)
                    health.trial_at = None
                    health.trials_passed = 0
                    health.outcomes.clear()
                    health.latencies.clear()
                    health.residuals.clear()
                    set_ejected(pool, endpoint, True)
            elif health.until != 0.0:
                health.closed_at = health.until  # at least that long ago: probation starts
                health.until = 0.0
                health.trial_at = None
                health.consecutive = 0
                set_ejected(pool, endpoint, False)


def pool_of(endpoint: str, pools: Mapping[str, Collection[str]]) -> tuple[str, Collection[str]]:
    """The pool holding ``endpoint`` and its members (``('', (endpoint,))`` if none does)."""
    for name, members in pools.items():
        if endpoint in members:
            return name, members
    return "", (endpoint,)
