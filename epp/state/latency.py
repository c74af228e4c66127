"""Each endpoint's speed, learned online from the responses epp sees: the latency model.

A fleet that mixes GPU generations (or replicas that share a host with something else) serves
the same request at different speeds, and a hand-written description of that drifts. epp sees
every response (:mod:`epp.extproc.response_stream`), so it learns, per endpoint, two linear
models from what each request looked like when it was picked and how long it then took:

- **TTFT** (pick to first token) ``= a + b*U + c*Q + e*D``: ``U`` the request's uncached
  prompt tokens (thousands; the engine's own count from the response's usage when the
  endpoint reports ``prompt_tokens_details.cached_tokens``, else epp's estimate at the
  pick), ``Q`` the uncached prompt tokens of requests sent there earlier still waiting for
  their first token (the prefill queued ahead, thousands; vLLM schedules FCFS), ``D`` the
  requests decoding there (tens; each adds to every engine step). ``1/b`` is the endpoint's
  prefill rate, ``c*Q`` its queueing delay, ``a`` the fixed cost of a request.
- **TPOT** (time per output token) ``= d + f*D``: decode step time as a function of the batch.

Evidence: an observation weighs ``0.5 ** (age / half_life)``, so the model forgets a replica's
past within a few half-lives (a replica that slows down is seen as slow within seconds under
load). Memory is bounded: each model keeps only its weighted sufficient statistics (``X'X``,
``X'y``), which also makes the evidence of several epp processes additive: every process
publishes its own statistics and sums the others' (:meth:`LatencyModel.export`,
:meth:`LatencyModel.apply_remote`, shipped by :mod:`epp.state.shared.sync`). Noise: a sample
whose residual exceeds ``HUBER_K`` times the model's mean absolute residual is down-weighted
(Huber), so a stall or a cold start does not drag the fit. The fit is a ridge regression
towards a prior (the configured capacity weight scales the prior's speed, so hand-set weights
still say what to assume before evidence arrives), with non-negative coefficients (a slope
below zero has no physical meaning; such a term is dropped and the rest refitted).

Nothing here does I/O or reads a clock: callers pass ``now`` (``time.time()``).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from epp.request import LatencyTarget
from epp.state.inflight import Load
from epp.state.latency_fit import ROBUST_AFTER, Stats, dot, fit, relative_weight, standard_error
from epp.state.shared import wire
from epp.state.snapshot import EndpointState

# Feature units: thousands of tokens, tens of requests (keeps the ridge prior's strength
# comparable across coefficients).
TOKENS_UNIT = 1000.0
REQUESTS_UNIT = 10.0
# Residuals beyond HUBER_K mean absolute residuals are down-weighted.
HUBER_K = 3.0
# Prior: a capacity-1 endpoint prefills 10k tokens/s, a request costs 20 ms on its own, a
# decode step 10 ms plus 2 ms per ten sequences.
PRIOR_TTFT = (0.02, 0.1, 0.1, 0.01)
PRIOR_TPOT = (0.01, 0.002)
# Predictions and measurements kept per endpoint for the error report.
ERROR_SAMPLES = 256
# A fit is recomputed at most this often per endpoint (decisions read the cached one).
REFIT_S = 0.05
# Relative capacities are clamped to this range.
CAPACITY_RANGE = (0.05, 20.0)
# Uncached prompt tokens of the reference request capacities compare.
REFERENCE_TOKENS = 2000.0
# A learned capacity within this factor of the median endpoint's (1.0) is noise, not a
# different speed (speeds): equal replicas learn capacities a few percent apart (0.97-1.04
# from 5%-noisy samples in tests/unit/test_latency_model.py; replicas of one speed on the
# heterogeneous benchmark fleet learn prefill rates within about 8% of each other), and
# reading that scatter as speed would make the replica that happened to look fastest the
# favourite for every cold prompt.
SPEED_BAND = 1.25
# ... and its learned time for the reference request must differ from the median endpoint's by
# at least this many standard errors of that time (speeds): on equal replicas past saturation
# the TTFTs are mostly waiting for KV the features do not see, the prefill slope is not
# identified, and the capacities scattered 0.4-20 (clamped) across the fleet within a minute at
# multi-turn 24 req/s (benchmarks/results/learned-latency-history.md); their errors are as wide,
# while a 2x fleet below saturation tells its speeds apart by many standard errors.
SPEED_Z = 2.0


@dataclass(frozen=True, slots=True)
class Basis:
    """What the model saw when a request was picked: its TTFT features and prediction, and
    its latency targets (None: none) with the objective they came with (attainment metrics)."""

    features: tuple[float, ...]
    predicted: float
    target: LatencyTarget | None = None
    objective: str = ""

    def with_uncached(self, tokens: int) -> Basis:
        """The same basis with ``U`` set to ``tokens``: the engine's own uncached count
        (``prompt_tokens - cached_tokens`` of the response's usage), known only at the end of
        the response. epp's estimate at the pick comes from its prefix index, which can count
        history as uncached that the engine still holds; learning from it made equal replicas
        look faster than each other (benchmarks/results/learned-latency-history.md)."""
        features = (self.features[0], tokens / TOKENS_UNIT, *self.features[2:])
        return Basis(features, self.predicted, self.target, self.objective)

    @property
    def prefill_ahead(self) -> int:
        """Prefill tokens ahead of the request's first token as the model saw them at the pick:
        its own uncached prompt plus the prefill queued ahead of it (``U + Q``)."""
        return round((self.features[1] + self.features[2]) * TOKENS_UNIT)


@dataclass(slots=True)
class _Model:
    """One linear model of one endpoint: local evidence, the others' and the current fit."""

    prior: tuple[float, ...]
    local: Stats
    remote: Stats | None = None
    coef: tuple[float, ...] = ()
    fitted_at: float = -math.inf
    dirty: bool = True

    def combined(self, now: float) -> Stats:
        self.local.decay_to(now)
        return self.local if self.remote is None else self.local.plus(self.remote)

    def coefficients(self, now: float) -> tuple[float, ...]:
        if not self.coef or (self.dirty and now - self.fitted_at >= REFIT_S):
            self.coef = fit(self.combined(now), self.prior)
            self.fitted_at = now
            self.dirty = False
        return self.coef

    def observe(self, x: Sequence[float], y: float, now: float) -> None:
        coef = self.coefficients(now)
        residual = y - dot(coef, x)
        stats = self.combined(now)
        weight = relative_weight(stats, y)
        robust = 1.0
        if stats.weight >= ROBUST_AFTER and stats.abs_residual > 0.0:
            limit = HUBER_K * stats.abs_residual
            if abs(residual) > limit:
                weight = robust = limit / abs(residual)
        self.local.decay_to(now)
        self.local.add(x, y, weight, residual, robust)
        self.dirty = True


def queue_and_batch(uncached: float, load: Load, endpoint: EndpointState) -> tuple[float, int]:
    """Prefill tokens queued ahead of a new request on ``endpoint`` and requests decoding there.

    Both are what epp has in flight there (all processes), or the scraped queue when that is
    larger (work other gateways sent): scraped waiting requests count at the mean size of
    epp's own waiting ones (``uncached`` when it has none).
    """
    metrics = endpoint.metrics
    waiting = load.waiting
    queued = float(load.prefill)
    if metrics.waiting:
        scraped = metrics.waiting * (load.prefill / waiting if waiting else uncached)
        if scraped > queued:
            queued = scraped
    decoding = load.requests - waiting
    running = metrics.running - min(metrics.running, waiting)
    return queued, max(decoding, running, 0)


def ttft_features(uncached: float, load: Load, endpoint: EndpointState) -> tuple[float, ...]:
    """The TTFT model's inputs for a request of ``uncached`` prompt tokens on ``endpoint``."""
    queued, decoding = queue_and_batch(uncached, load, endpoint)
    return (1.0, uncached / TOKENS_UNIT, queued / TOKENS_UNIT, decoding / REQUESTS_UNIT)


@dataclass(slots=True)
class EndpointLatency:
    ttft: _Model
    tpot: _Model
    # (predicted, measured) TTFT of recent requests.
    errors: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=ERROR_SAMPLES))
    samples: int = 0
    # The endpoint's last usage reported the engine's cached prompt tokens (vLLM started with
    # --enable-prompt-tokens-details): its TTFT observations wait for the usage (engine_cached).
    engine_cached: bool = False


class LatencyModel:
    """Every endpoint's learned TTFT and TPOT models; lives in
    :class:`~epp.state.fleet.FleetState`."""

    def __init__(self) -> None:
        self._endpoints: dict[str, EndpointLatency] = {}
        # Configured capacity weights: they scale each endpoint's prior.
        self._weights: Mapping[str, float] = {}
        self._capacities: dict[str, float] = {}
        self._capacities_at = -math.inf
        self._speeds: dict[str, float] = {}

    def configure(self, weights: Mapping[str, float], endpoints: Iterable[str]) -> None:
        """Apply configured weights; forget endpoints that left."""
        self._weights = dict(weights)
        keep = set(endpoints)
        for address in list(self._endpoints):
            if address not in keep:
                del self._endpoints[address]
        for address, state in self._endpoints.items():
            state.ttft.prior, state.tpot.prior = self._priors(address)
            state.ttft.dirty = state.tpot.dirty = True
            state.ttft.coef = state.tpot.coef = ()

    def _priors(self, address: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
        w = self._weights.get(address, 1.0)
        a, b, c, e = PRIOR_TTFT
        d, f = PRIOR_TPOT
        return (a, b / w, c / w, e / w), (d / w, f / w)

    def _get(self, address: str) -> EndpointLatency:
        state = self._endpoints.get(address)
        if state is None:
            ttft, tpot = self._priors(address)
            state = self._endpoints[address] = EndpointLatency(
                _Model(ttft, Stats(len(ttft))), _Model(tpot, Stats(len(tpot)))
            )
        return state

    def predict(
        self, uncached: float, load: Load, endpoint: EndpointState, now: float
    ) -> tuple[float, float]:
        """This request's (TTFT, TPOT) on ``endpoint``: the scorer's per-candidate call, so
        written out rather than through :func:`ttft_features` (decision time)."""
        address = endpoint.address
        state = self._endpoints.get(address) or self._get(address)
        a, b, c, e = state.ttft.coefficients(now)
        d, f = state.tpot.coefficients(now)
        queued, decoding = queue_and_batch(uncached, load, endpoint)
        ttft = a + (b * uncached + c * queued) / TOKENS_UNIT + e * decoding / REQUESTS_UNIT
        return ttft, d + f * (decoding + 1) / REQUESTS_UNIT

    def predict_ttft(self, address: str, features: Sequence[float], now: float) -> float:
        return dot(self._get(address).ttft.coefficients(now), features)

    def predict_tpot(self, address: str, decoding: float, now: float) -> float:
        coef = self._get(address).tpot.coefficients(now)
        return dot(coef, (1.0, decoding / REQUESTS_UNIT))

    def observe_ttft(self, address: str, basis: Basis, seconds: float, now: float) -> None:
        """A request picked with ``basis`` got its first token ``seconds`` after the pick."""
        if not (0.0 < seconds < 3600.0):
            return
        state = self._get(address)
        state.errors.append((basis.predicted, seconds))
        state.samples += 1
        state.ttft.observe(basis.features, seconds, now)
        self._capacities_at = -math.inf

    def trusted(self, address: str, now: float) -> bool:
        """Whether ``address``'s TTFT model has evidence enough (``ROBUST_AFTER`` observations'
        weight, local and shared) for its predictions to judge the endpoint by (passive
        health's residual rule): before that they are mostly the prior."""
        state = self._endpoints.get(address)
        return state is not None and state.ttft.combined(now).weight >= ROBUST_AFTER

    def engine_cached(self, address: str) -> bool:
        """Whether ``address`` reports its engine's cached prompt tokens in usage: then a TTFT
        observation is worth holding until the response's usage arrives. Learned from the
        responses (:meth:`saw_usage`), so an engine without the option is observed at the
        first token as before."""
        state = self._endpoints.get(address)
        return state is not None and state.engine_cached

    def saw_usage(self, address: str, cached_reported: bool) -> None:
        """A response of ``address`` carried usage, with the engine's cached tokens or not."""
        state = self._endpoints.get(address)
        if state is None:
            if not cached_reported:
                return
            state = self._get(address)
        state.engine_cached = cached_reported

    def observe_tpot(self, address: str, decoding: float, tpot: float, now: float) -> None:
        """A response decoded at ``tpot`` seconds per token with ``decoding`` requests in the
        batch (its own included)."""
        if not (0.0 < tpot < 60.0):
            return
        self._get(address).tpot.observe((1.0, decoding / REQUESTS_UNIT), tpot, now)

    def capacities(self, now: float) -> Mapping[str, float]:
        """Each endpoint's speed relative to the median endpoint, from its learned time for a
        reference request (``REFERENCE_TOKENS`` uncached, nothing queued): 2.0 for one twice
        as fast. Only endpoints with evidence: an observation within the last half-life
        (one cold prefill moves the prefill rate most of the way from the prior, and the fleet's
        first seconds are when cold prefills are placed); recomputed at most every
        ``REFIT_S``."""
        self._refresh(now)
        return self._capacities

    def speeds(self, now: float) -> Mapping[str, float]:
        """The learned capacities that differ from the median endpoint's beyond noise: outside
        ``1 / SPEED_BAND .. SPEED_BAND`` with ``SPEED_Z`` standard errors of the endpoint's
        reference time to spare. The compute speeds the TTFT estimate divides prefill work by
        when no weight is configured. Equal replicas get none (all count as 1.0), so their
        picks are what they were without a model."""
        self._refresh(now)
        return self._speeds

    def _refresh(self, now: float) -> None:
        if now - self._capacities_at < REFIT_S:
            return
        reference = (1.0, REFERENCE_TOKENS / TOKENS_UNIT, 0.0, 0.0)
        times: dict[str, tuple[float, float]] = {}
        for address, state in self._endpoints.items():
            stats = state.ttft.combined(now)
            if stats.count >= 0.5:
                coef = state.ttft.coefficients(now)
                seconds = dot(coef, reference)
                times[address] = (seconds, standard_error(stats, coef, reference))
        capacities: dict[str, float] = {}
        speeds: dict[str, float] = {}
        if len(times) >= 2:
            middle = statistics.median(seconds for seconds, _ in times.values())
            low, high = CAPACITY_RANGE
            for address, (seconds, error) in times.items():
                capacity = min(high, max(low, middle / seconds)) if seconds > 0 else high
                capacities[address] = capacity
                outside = not 1 / SPEED_BAND < capacity < SPEED_BAND
                if outside and abs(seconds - middle) >= SPEED_Z * error:
                    speeds[address] = capacity
        self._capacities = capacities
        self._speeds = speeds
        self._capacities_at = now

    def describe(self, address: str, now: float) -> dict[str, Any] | None:
        """What ``/debug/endpoints`` shows: the fitted rates, the evidence, the error."""
        state = self._endpoints.get(address)
        if state is None:
            return None
        a, b, c, e = state.ttft.coefficients(now)
        d, f = state.tpot.coefficients(now)
        errors = [abs(p - m) / m for p, m in state.errors]
        return {
            "prefill_tokens_per_second": round(TOKENS_UNIT / b) if b > 0 else None,
            "queue_seconds_per_1k_tokens": round(c, 5),
            "request_overhead_seconds": round(a, 5),
            "ttft_seconds_per_10_decoding": round(e, 5),
            "tpot_seconds": round(d, 5),
            "tpot_seconds_per_10_decoding": round(f, 5),
            "evidence": {
                "ttft": round(state.ttft.combined(now).weight, 2),
                "tpot": round(state.tpot.combined(now).weight, 2),
            },
            "ttft_samples": state.samples,
            "ttft_median_abs_error": round(statistics.median(errors), 4) if errors else None,
            "uncached_from": "engine" if state.engine_cached else "estimate",
            "capacity": self.capacities(now).get(address),
            "speed": self.speeds(now).get(address),
        }

    def errors(self, address: str) -> list[tuple[float, float]]:
        """Recent (predicted, measured) TTFT pairs of ``address``."""
        state = self._endpoints.get(address)
        return list(state.errors) if state is not None else []

    def export(self, now: float) -> dict[str, str]:
        """This process's own evidence per endpoint, for the other processes."""
        out = {}
        for address, state in self._endpoints.items():
            state.ttft.local.decay_to(now)
            state.tpot.local.decay_to(now)
            if state.ttft.local.weight or state.tpot.local.weight:
                out[address] = json.dumps(
                    [state.ttft.local.encode(), state.tpot.local.encode()], separators=(",", ":")
                )
        return out

    def apply_remote(self, exports: Sequence[Mapping[bytes, bytes]], now: float) -> None:
        """Replace the other processes' evidence with their latest exports (summed);
        unreadable entries count as nothing (and are counted as refused); evidence dated
        after ``now`` is taken as of ``now``."""
        merged: dict[str, tuple[Stats | None, Stats | None]] = {}
        for fields in exports:
            for raw_address, raw in fields.items():
                try:
                    ttft_raw, tpot_raw = json.loads(raw)
                    ttft = Stats.decode(len(PRIOR_TTFT), ttft_raw)
                    tpot = Stats.decode(len(PRIOR_TPOT), tpot_raw)
                except (ValueError, TypeError) as exc:
                    wire.refused("latency", exc)
                    continue
                # Evidence dated in the future would never decay.
                ttft.as_of = wire.clamp("latency", ttft.as_of, now)
                tpot.as_of = wire.clamp("latency", tpot.as_of, now)
                address = raw_address.decode()
                old_ttft, old_tpot = merged.get(address, (None, None))
                merged[address] = (
                    ttft if old_ttft is None else old_ttft.plus(ttft),
                    tpot if old_tpot is None else old_tpot.plus(tpot),
                )
        for address, state in self._endpoints.items():
            ttft_remote, tpot_remote = merged.pop(address, (None, None))
            state.ttft.remote, state.tpot.remote = ttft_remote, tpot_remote
            state.ttft.dirty = state.tpot.dirty = True
        for address, (ttft_remote, tpot_remote) in merged.items():
            state = self._get(address)
            state.ttft.remote, state.tpot.remote = ttft_remote, tpot_remote
        self._capacities_at = -math.inf
