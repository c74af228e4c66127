"""Turn one response's :class:`~epp.lifecycle.Outcome` into metrics."""

from __future__ import annotations

from epp import observability as m
from epp.lifecycle import Finished, Outcome


class ResponseMetrics:
    """Response hook: the GIE/llm-d response metrics (docs/metrics.md)."""

    name = "metrics"

    def finished(self, done: Finished) -> None:
        record(done.outcome, done.request.model, done.objective, done.context.requested_label())


def record(outcome: Outcome, model: str, objective: str, requested: str | None = None) -> None:
    """``model``: what served (the target of a rewrite); ``requested``: the model_name label,
    what the client asked for (default ``model``)."""
    # Tallied (epp.tallied): each is a dict update, folded into the series when scraped.
    requested = model if requested is None else requested
    labels = (requested, model)
    if outcome.served is not None:
        m.RESPONSES.add((outcome.served, m.response_code(outcome.status)))
    if outcome.status >= 400:
        m.OBJECTIVE_ERRORS.add((*labels, str(outcome.status)))
        m.RESULTS.add(("upstream_5xx" if outcome.status >= 500 else "upstream_4xx",))
        return
    if not outcome.complete:
        m.OBJECTIVE_ERRORS.add((*labels, "incomplete"))
        m.RESULTS.add(("incomplete",))
        return
    m.RESULTS.add(("ok",))
    m.REQUEST_DURATION.add(labels, outcome.seconds)
    if outcome.ttft is not None:
        m.TTFT.add(labels, outcome.ttft)
    if outcome.tpot is not None:
        m.TPOT.add(labels, outcome.tpot)
    for gap in outcome.itl:
        m.ITL.add(labels, gap)
    usage = outcome.usage
    if usage is None:
        return
    m.INPUT_TOKENS.add(labels, usage.prompt)
    m.OUTPUT_TOKENS.add(labels, usage.completion)
    m.TOKENS.add((model, objective, "prompt"), usage.prompt)
    m.TOKENS.add((model, objective, "completion"), usage.completion)
    if usage.completion:
        m.NORMALIZED_TPOT.add(labels, outcome.seconds / usage.completion)
    if usage.cached is not None:
        m.CACHED_TOKENS.add(labels, usage.cached)
        m.TOKENS.add((model, objective, "cached"), usage.cached)
