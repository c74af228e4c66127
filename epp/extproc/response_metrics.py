"""Turn one response's :class:`~epp.extproc.response_stream.Outcome` into metrics."""

from __future__ import annotations

from epp import observability as m
from epp.extproc.response_stream import Outcome


def record(outcome: Outcome, model: str, objective: str) -> None:
    labels = (model, model)
    if outcome.served is not None:
        m.child(m.RESPONSES, outcome.served, m.response_code(outcome.status)).inc()
    if outcome.status >= 400:
        m.child(m.OBJECTIVE_ERRORS, *labels, str(outcome.status)).inc()
        m.child(m.RESULTS, "upstream_5xx" if outcome.status >= 500 else "upstream_4xx").inc()
        return
    if not outcome.complete:
        m.child(m.OBJECTIVE_ERRORS, *labels, "incomplete").inc()
        m.child(m.RESULTS, "incomplete").inc()
        return
    m.child(m.RESULTS, "ok").inc()
    m.child(m.REQUEST_DURATION, *labels).observe(outcome.seconds)
    if outcome.ttft is not None:
        m.child(m.TTFT, *labels).observe(outcome.ttft)
    if outcome.tpot is not None:
        m.child(m.TPOT, *labels).observe(outcome.tpot)
    if outcome.itl:
        itl = m.child(m.ITL, *labels)
        for gap in outcome.itl:
            itl.observe(gap)
    usage = outcome.usage
    if usage is None:
        return
    m.child(m.INPUT_TOKENS, *labels).observe(usage.prompt)
    m.child(m.OUTPUT_TOKENS, *labels).observe(usage.completion)
    m.child(m.TOKENS, model, objective, "prompt").inc(usage.prompt)
    m.child(m.TOKENS, model, objective, "completion").inc(usage.completion)
    if usage.completion:
        m.child(m.NORMALIZED_TPOT, *labels).observe(outcome.seconds / usage.completion)
    if usage.cached is not None:
        m.child(m.CACHED_TOKENS, *labels).observe(usage.cached)
        m.child(m.TOKENS, model, objective, "cached").inc(usage.cached)
