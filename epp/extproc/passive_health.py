"""What one response tells passive health (:mod:`epp.state.health`) about its endpoint.

- A status >= 500 is a failure (``5xx``): the replica's own, or Envoy's for an upstream reset
  or timeout (503, 504) on the attempt that answered.
- A response that ended before it was complete is a failure (``incomplete``): an upstream that
  reset mid-stream. A client that hangs up mid-response looks the same to epp; the error-rate
  window and the consecutive count need several such in a row or a large share to eject.
- A retry is a failure of the endpoint epp picked (``retried``): the client's answer came from
  the fallback, and the failed attempt is otherwise invisible to epp.
- Anything else is a success; when it is complete and below 400 its latency (time to first
  token when streamed, the whole response otherwise) feeds the latency-outlier check.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from epp.extproc.response_stream import Outcome
from epp.state.health import HealthTracker, pool_of


def judge(
    tracker: HealthTracker,
    pools: Mapping[str, Collection[str]],
    endpoint: str,
    outcome: Outcome,
    now: float,
) -> None:
    """Record ``outcome`` as an answer of ``endpoint`` (the one that served)."""
    pool, members = pool_of(endpoint, pools)
    if outcome.status >= 500:
        tracker.observe(endpoint, pool, members, True, None, now, "5xx")
    elif not outcome.complete:
        tracker.observe(endpoint, pool, members, True, None, now, "incomplete")
    else:
        latency = None
        if outcome.status < 400:
            latency = outcome.ttft if outcome.streamed else outcome.seconds
        tracker.observe(endpoint, pool, members, False, latency, now)


def judge_retry(
    tracker: HealthTracker, pools: Mapping[str, Collection[str]], picked: str, now: float
) -> None:
    """Envoy retried the request away from ``picked``: that attempt failed."""
    pool, members = pool_of(picked, pools)
    tracker.observe(picked, pool, members, True, None, now, "retried")
