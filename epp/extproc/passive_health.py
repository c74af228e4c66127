"""What one response tells passive health (:mod:`epp.state.health`) about its endpoint.

- A status >= 500 is a failure (``5xx``): the replica's own, or Envoy's for an upstream reset
  or timeout (503, 504) on the attempt that answered.
- A response that ended before it was complete is a failure (``incomplete``): an upstream that
  reset mid-stream. A client that hangs up mid-response looks the same to epp; the error-rate
  window and the consecutive count need several such in a row or a large share to eject.
- A retry is a failure of the endpoint epp picked (``retried``): the client's answer came from
  the fallback, and the failed attempt is otherwise invisible to epp.
- Anything else is a success; when it is complete and below 400 its latency (time to first
  token when streamed, the whole response otherwise) feeds the latency-outlier check. A TTFT
  is first scaled to ``latency_prompt_tokens`` uncached prompt tokens when the request had more
  (:func:`latency_sample`), so that prefilling a prompt no replica cached does not look like a
  slow replica next to ones serving cache hits.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from epp.extproc.response_stream import Outcome
from epp.state.health import HealthTracker, pool_of


def latency_sample(outcome: Outcome, uncached: int | None, prompt_tokens: int) -> float | None:
    """The latency ``outcome`` contributes: its TTFT when streamed, scaled down to
    ``prompt_tokens`` (0: never) when the request had ``uncached`` > ``prompt_tokens`` uncached
    prompt tokens; the whole response otherwise (None: no TTFT was seen).

    Only the TTFT is scaled: it is the prefill of the uncached prompt plus the queue ahead of
    it, while a whole response's time is mostly decoding, which the prompt does not set.
    """
    if not outcome.streamed:
        return outcome.seconds
    ttft = outcome.ttft
    if ttft is None or not prompt_tokens or uncached is None or uncached <= prompt_tokens:
        return ttft
    return ttft * prompt_tokens / uncached


def judge(
    tracker: HealthTracker,
    pools: Mapping[str, Collection[str]],
    endpoint: str,
    outcome: Outcome,
    now: float,
    uncached: int | None = None,
) -> None:
    """Record ``outcome`` as an answer of ``endpoint`` (the one that served); ``uncached``:
    the request's uncached prompt tokens on ``endpoint`` as counted at the pick (None:
    unknown, e.g. a fallback served it)."""
    pool, members = pool_of(endpoint, pools)
    if outcome.status >= 500:
        tracker.observe(endpoint, pool, members, True, None, now, "5xx")
    elif not outcome.complete:
        tracker.observe(endpoint, pool, members, True, None, now, "incomplete")
    else:
        latency = None
        if outcome.status < 400:
            latency = latency_sample(outcome, uncached, tracker.config.latency_prompt_tokens)
        tracker.observe(endpoint, pool, members, False, latency, now)


def judge_retry(
    tracker: HealthTracker, pools: Mapping[str, Collection[str]], picked: str, now: float
) -> None:
    """Envoy retried the request away from ``picked``: that attempt failed."""
    pool, members = pool_of(picked, pools)
    tracker.observe(picked, pool, members, True, None, now, "retried")
