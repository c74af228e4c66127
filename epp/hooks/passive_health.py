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
  token when streamed, the whole response otherwise) feeds the latency-outlier check. A TTFT
  is first scaled to ``latency_prompt_tokens`` prefill tokens when more were ahead of the first
  token at the pick (:func:`latency_sample`): the request's own uncached prompt plus the
  prefill queued ahead of it. So prefilling a prompt no replica cached does not look like a
  slow replica next to ones serving cache hits, and neither does a replica whose queue is
  longer because it holds the popular prefixes: both are work, not slowness.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping

from epp.lifecycle import Finished, Outcome
from epp.state.health import HealthTracker, pool_of

Pools = Callable[[], Mapping[str, Collection[str]]]


class PassiveHealth:
    """Response hook: judge the endpoint that served (:func:`judge`); ``pools`` gives the
    current pool membership (discovery changes it under running streams)."""

    name = "passive-health"

    def __init__(self, tracker: HealthTracker, pools: Pools) -> None:
        self._tracker = tracker
        self._pools = pools

    def finished(self, done: Finished) -> None:
        pick = done.pick
        endpoint = done.outcome.served or (pick.endpoint if pick is not None else None)
        if endpoint is None or done.spilled:
            return
        # A retry moved the pick to the served endpoint without its count (move_pick).
        ahead = pick.prefill_ahead if pick is not None else None
        judge(self._tracker, self._pools(), endpoint, done.outcome, time.time(), ahead)


def latency_sample(outcome: Outcome, ahead: int | None, prompt_tokens: int) -> float | None:
    """The latency ``outcome`` contributes: its TTFT when streamed, scaled down to
    ``prompt_tokens`` (0: never) when ``ahead`` > ``prompt_tokens`` prefill tokens were ahead
    of its first token at the pick; the whole response otherwise (None: no TTFT was seen).

    Only the TTFT is scaled: it is the prefill of the uncached prompt plus the queue ahead of
    it, while a whole response's time is mostly decoding, which the prompt does not set. The
    queue counts as well as the prompt: scaling by the prompt alone divided the queueing delay
    of cold requests and not that of cache hits, so past saturation the replicas serving hits
    looked slow and were ejected (docs/health.md).
    """
    if not outcome.streamed:
        return outcome.seconds
    ttft = outcome.ttft
    if ttft is None or not prompt_tokens or ahead is None or ahead <= prompt_tokens:
        return ttft
    return ttft * prompt_tokens / ahead


def judge(
    tracker: HealthTracker,
    pools: Mapping[str, Collection[str]],
    endpoint: str,
    outcome: Outcome,
    now: float,
    ahead: int | None = None,
) -> None:
    """Record ``outcome`` as an answer of ``endpoint`` (the one that served); ``ahead``: the
    prefill tokens ahead of its first token on ``endpoint`` as counted at the pick (None:
    unknown, e.g. a fallback served it)."""
    pool, members = pool_of(endpoint, pools)
    if outcome.status >= 500:
        tracker.observe(endpoint, pool, members, True, None, now, "5xx")
    elif not outcome.complete:
        tracker.inconclusive(endpoint, now)
    else:
        latency = None
        if outcome.status < 400:
            latency = latency_sample(outcome, ahead, tracker.config.latency_prompt_tokens)
        tracker.observe(endpoint, pool, members, False, latency, now)


def judge_retry(
    tracker: HealthTracker, pools: Mapping[str, Collection[str]], picked: str, now: float
) -> None:
    """Envoy retried the request away from ``picked``: that attempt failed."""
    pool, members = pool_of(picked, pools)
    tracker.observe(picked, pool, members, True, None, now, "retried")
