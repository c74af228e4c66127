"""What one response tells passive health (:mod:`epp.state.health`) about its endpoint.

- A status >= 500 is a failure (``5xx``): the replica's own, or Envoy's for an upstream reset
  or timeout (503, 504) on the attempt that answered.
- A response that ended before it was complete says nothing about the replica: a client that
  hangs up mid-response and an upstream that resets mid-stream end the ext_proc stream the
  same way (Envoy half-closes or cancels it; which one follows timing, not the cause), and
  counted as failures, any client could eject healthy replicas by abandoning streams. A reset
  before the response began is Envoy's 503 (a ``5xx`` failure); a replica that crashes fails
  its scrapes and its next requests. A half-open trial that ends so is no verdict: the next
  trial may go.
- A retry is a failure of the endpoint epp picked (``retried``): the client's answer came from
  the fallback, and the failed attempt is otherwise invisible to epp.
- Anything else is a success; when it is complete and below 400 its latency (time to first
  token when streamed, the whole response otherwise) feeds the latency-outlier check
  (:func:`latency_sample`). With ``latency_rule: residual`` (the default) a TTFT counts as
  its ratio to what the latency model predicted for that request on that endpoint at the
  pick (its uncached prompt, the prefill queued ahead, the endpoint's learned speed): a cold
  prefill, a queue behind the popular prefixes and a slower GPU are all expected, and only
  a replica slower than its own model says is slow. No prediction yet (the model has too
  little evidence for the endpoint) or none at all (a fallback served it): no sample. With
  ``latency_rule: pool`` a TTFT is scaled to ``latency_prompt_tokens`` prefill tokens when
  more were ahead of the first token at the pick and compared with the pool's other
  endpoints; every such rule read ordinary cache-driven spread as slowness (docs/health.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping

from epp.lifecycle import Finished, Outcome
from epp.state.health import HealthConfig, HealthTracker, pool_of
from epp.state.latency import LatencyModel

Pools = Callable[[], Mapping[str, Collection[str]]]


class PassiveHealth:
    """Response hook: judge the endpoint that served (:func:`judge`); ``pools`` gives the
    current pool membership (discovery changes it under running streams); ``latency`` the
    learned model whose predictions the residual rule compares TTFTs with."""

    name = "passive-health"

    def __init__(self, tracker: HealthTracker, pools: Pools, latency: LatencyModel) -> None:
        self._tracker = tracker
        self._pools = pools
        self._latency = latency

    def finished(self, done: Finished) -> None:
        pick = done.pick
        endpoint = done.outcome.served or (pick.endpoint if pick is not None else None)
        if endpoint is None or done.spilled:
            return
        now = time.time()
        # A retry moved the pick to the served endpoint without its count or basis (move_pick).
        ahead = pick.prefill_ahead if pick is not None else None
        basis = pick.ticket.basis if pick is not None else None
        expected = None
        if basis is not None and self._latency.trusted(endpoint, now):
            expected = basis.predicted
        judge(self._tracker, self._pools(), endpoint, done.outcome, now, ahead, expected)


def latency_sample(
    outcome: Outcome, ahead: int | None, expected: float | None, config: HealthConfig
) -> tuple[float | None, bool]:
    """The latency ``outcome`` contributes, and whether it is a residual (measured over
    expected) rather than seconds; None: no sample.

    Streamed, the sample is its TTFT: with ``latency_rule: residual``, over ``expected`` (the
    model's prediction at the pick; no sample without one), floored at
    ``latency_floor_seconds`` so that a few milliseconds over a tiny prediction are no
    outlier; with ``pool``, scaled down to ``latency_prompt_tokens`` (0: never) when ``ahead``
    > that many prefill tokens were ahead of its first token at the pick. The queue counts as
    well as the prompt there: scaling by the prompt alone divided the queueing delay of cold
    requests and not that of cache hits, so past saturation the replicas serving hits looked
    slow and were ejected (docs/health.md). A whole response's time is never scaled (mostly
    decoding, which the prompt does not set) and is compared with the pool's.
    """
    rule = config.latency_rule
    if rule == "off":
        return None, False
    if not outcome.streamed:
        return outcome.seconds, False
    ttft = outcome.ttft
    if ttft is None:
        return None, False
    if rule == "residual":
        if expected is None:
            return None, False
        return ttft / max(expected, config.latency_floor_seconds), True
    prompt_tokens = config.latency_prompt_tokens
    if not prompt_tokens or ahead is None or ahead <= prompt_tokens:
        return ttft, False
    return ttft * prompt_tokens / ahead, False


def judge(
    tracker: HealthTracker,
    pools: Mapping[str, Collection[str]],
    endpoint: str,
    outcome: Outcome,
    now: float,
    ahead: int | None = None,
    expected: float | None = None,
) -> None:
    """Record ``outcome`` as an answer of ``endpoint`` (the one that served); ``ahead``: the
    prefill tokens ahead of its first token on ``endpoint`` as counted at the pick (None:
    unknown, e.g. a fallback served it); ``expected``: the latency model's TTFT for it there
    (None: no trusted prediction)."""
    pool, members = pool_of(endpoint, pools)
    if outcome.status >= 500:
        tracker.observe(endpoint, pool, members, True, None, now, "5xx")
    elif not outcome.complete:
        tracker.inconclusive(endpoint, now)
    else:
        latency, residual = None, False
        if outcome.status < 400:
            latency, residual = latency_sample(outcome, ahead, expected, tracker.config)
        tracker.observe(endpoint, pool, members, False, latency, now, residual=residual)


def judge_retry(
    tracker: HealthTracker, pools: Mapping[str, Collection[str]], picked: str, now: float
) -> None:
    """Envoy retried the request away from ``picked``: that attempt failed."""
    pool, members = pool_of(picked, pools)
    tracker.observe(picked, pool, members, True, None, now, "retried")
