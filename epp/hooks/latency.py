"""Response hook: the latency model learns each replica's TTFT and TPOT from its responses
(docs/learned-latency.md)."""

from __future__ import annotations

import time

from epp.lifecycle import Finished
from epp.observability import LATENCY_TARGETS
from epp.state.fleet import FleetState
from epp.state.moves import PickRecord


class LatencyLearning:
    """Learns at the first token (:meth:`first_token`, called by the stream as it passes) and
    when the response is done (:meth:`finished`: the TPOT, and a TTFT held for the engine's
    cached-token count); counts latency targets met and missed."""

    name = "latency-learning"

    def __init__(self, fleet: FleetState) -> None:
        self._fleet = fleet

    def finished(self, done: Finished) -> None:
        outcome, pick = done.outcome, done.pick
        if pick is None:
            return
        served = outcome.served is not None and outcome.complete and outcome.status < 400
        if served and outcome.tpot is not None:
            self.decoded(pick, outcome.tpot)
        if done.spilled:
            return
        # Learns with the engine's cached tokens a TTFT held for them (first_token).
        usage = outcome.usage
        if usage is None:
            self.responded(pick)
        else:
            self.responded(pick, usage.prompt, usage.cached)

    def first_token(self, pick: PickRecord, at: float, usage_expected: bool = False) -> None:
        """The response of ``pick`` delivered its first token at ``at`` (the clock of
        ``pick.picked_at``): its prefill is no longer queued, and the latency model learns how
        long it took. With ``usage_expected`` (the response will end with usage) and an
        endpoint that reports its engine's cached tokens, the TTFT is held in
        ``pick.ttft_held`` and learned by :meth:`responded` with the engine's uncached count;
        otherwise at once, with epp's estimate."""
        ticket = pick.ticket
        if not ticket.waiting:
            return
        inflight = self._fleet.inflight
        pick.ticket = inflight.prefilled(ticket)
        pick.decoding = inflight.load(ticket.endpoint).decoding
        basis = ticket.basis
        if basis is not None:
            seconds = at - pick.picked_at
            latency = self._fleet.latency
            if usage_expected and latency.engine_cached(ticket.endpoint):
                pick.ttft_held = seconds
            else:
                latency.observe_ttft(ticket.endpoint, basis, seconds, time.time())
            target = basis.target
            if target is not None and target.ttft is not None:
                met = "met" if seconds <= target.ttft else "missed"
                LATENCY_TARGETS.add((basis.objective, "ttft", met))

    def responded(
        self, pick: PickRecord, prompt: int | None = None, cached: int | None = None
    ) -> None:
        """The response of ``pick`` ended (or its stream closed) with usage of ``prompt``
        prompt tokens, ``cached`` of them cached by the engine (None: no usage seen, no cached
        count reported). The latency model learns whether the endpoint reports the
        engine's cached tokens, and a TTFT :meth:`first_token` held is observed now: ``U`` the
        engine's ``prompt - cached`` when both are known, else epp's estimate at the pick (a
        response cut short still teaches its TTFT)."""
        endpoint = pick.ticket.endpoint
        latency = self._fleet.latency
        if prompt is not None:
            latency.saw_usage(endpoint, cached is not None)
        seconds = pick.ttft_held
        basis = pick.ticket.basis
        if seconds is None or basis is None:
            return
        pick.ttft_held = None
        if prompt is not None and cached is not None:
            basis = basis.with_uncached(max(0, prompt - cached))
        latency.observe_ttft(endpoint, basis, seconds, time.time())

    def decoded(self, pick: PickRecord, tpot: float) -> None:
        """The response of ``pick`` finished decoding at ``tpot`` seconds per token."""
        basis = pick.ticket.basis
        if basis is None:
            return
        target = basis.target
        if target is not None and target.tpot is not None:
            met = "met" if tpot <= target.tpot else "missed"
            LATENCY_TARGETS.add((basis.objective, "tpot", met))
        if not pick.decoding:
            return
        endpoint = pick.ticket.endpoint
        batch = (pick.decoding + self._fleet.inflight.load(endpoint).decoding) / 2
        self._fleet.latency.observe_tpot(endpoint, batch, tpot, time.time())
