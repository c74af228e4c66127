"""Turn one response's :class:`~epp.extproc.response_stream.Outcome` into metrics."""

from __future__ import annotations

from epp import observability as m
from epp.extproc.response_stream import Outcome


def record(outcome: Outcome, model: str, objective: str) -> None:
    labels = (model, model)
    if outcome.served is not None:
        m.RESPONSES.labels(outcome.served, m.response_code(outcome.status)).inc()
    if outcome.status >= 400:
        m.OBJECTIVE_ERRORS.labels(*labels, str(outcome.status)).inc()
        m.RESULTS.labels("upstream_5xx" if outcome.status >= 500 else "upstream_4xx").inc()
        return
    if not outcome.complete:
        m.OBJECTIVE_ERRORS.labels(*labels, "incomplete").inc()
        m.RESULTS.labels("incomplete").inc()
        return
    m.RESULTS.labels("ok").inc()
    m.REQUEST_DURATION.labels(*labels).observe(outcome.seconds)
    if outcome.ttft is not None:
        m.TTFT.labels(*labels).observe(outcome.ttft)
    if outcome.tpot is not None:
        m.TPOT.labels(*labels).observe(outcome.tpot)
    if outcome.itl:
        itl = m.ITL.labels(*labels)
        for gap in outcome.itl:
            itl.observe(gap)
    usage = outcome.usage
    if usage is None:
        return
    m.INPUT_TOKENS.labels(*labels).observe(usage.prompt)
    m.OUTPUT_TOKENS.labels(*labels).observe(usage.completion)
    m.TOKENS.labels(model, objective, "prompt").inc(usage.prompt)
    m.TOKENS.labels(model, objective, "completion").inc(usage.completion)
    if usage.completion:
        m.NORMALIZED_TPOT.labels(*labels).observe(outcome.seconds / usage.completion)
    if usage.cached is not None:
        m.CACHED_TOKENS.labels(*labels).observe(usage.cached)
        m.TOKENS.labels(model, objective, "cached").inc(usage.cached)
