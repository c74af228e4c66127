"""Send a session's requests back to the endpoint its previous request went to.

A multi-turn conversation's next request repeats the previous turns, whose KV blocks sit on the
replica that served them. The prefix scorer finds that too, but only for prompts it could hash
the same way; a session id (header ``request.session_header``, llm-d's ``x-session-token``) names
the conversation directly, whatever the prompt looks like (tools, images, token ids).

Stickiness must not outlive its benefit: a binding expires ``ttl_seconds`` after the session's
last request, and it is ignored (then replaced by wherever this request goes) when its endpoint
is no longer a candidate (unready or filtered out) or is overloaded: ``max_waiting`` requests
queued or ``max_kv_usage`` of its KV cache in use, where waiting behind others would cost more
than the cache saves.

The bindings live in the fleet state (:data:`SESSIONS`), so a reload keeps them; the one a pick
made moves with a retry to the endpoint that served, and with Redis every epp process of the
group replays the others' (:class:`~epp.state.shared.sessions.SharedSessionTable`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.request import InferenceRequest
from epp.scheduling.framework import Cycle, PostPick, Scorer, register
from epp.scheduling.params import Params, param
from epp.state.registry import Replication, StateKey
from epp.state.shared.bounds import binding
from epp.state.shared.sessions import Binding, SharedSessionTable
from epp.state.snapshot import EndpointState

# No parameter changes what a binding means (the TTL is applied when binding). The tag
# ``sessions`` is the pick-stream channel of every release: a rolling upgrade shares sessions.
# Without Redis nobody takes the bindings kept for shipping: the table holds only the newest
# few thousand of them (as the prefix index does its insertions).
SESSIONS = StateKey(
    "sessions", SharedSessionTable, moves=True, replicated=Replication(Binding, binding)
)


@dataclass(frozen=True, slots=True)
class SessionParams(Params):
    ttl_seconds: float = param(300.0, gt=0)
    max_waiting: int = param(5, ge=1)
    max_kv_usage: float = param(0.95, gt=0, le=1)


@register("session-affinity-scorer")
class SessionAffinityScorer(Scorer, PostPick):
    """1.0 for the session's current endpoint, 0.0 elsewhere (and everywhere without a session)."""

    params_type = SessionParams
    states = (SESSIONS,)

    def __init__(self, params: SessionParams = SessionParams()) -> None:
        self.ttl = params.ttl_seconds
        self.max_waiting = params.max_waiting
        self.max_kv_usage = params.max_kv_usage

    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        bound = None
        if request.session is not None:
            bound = cycle.fleet.states.get(SESSIONS).get(request.session, cycle.now)
        return [1.0 if c.address == bound and self._usable(c) else 0.0 for c in candidates]

    def on_pick(self, request: InferenceRequest, endpoint: EndpointState, cycle: Cycle) -> None:
        if request.session is not None:
            sessions = cycle.fleet.states.get(SESSIONS)
            sessions.bind(request.session, endpoint.address, cycle.now, self.ttl)

    def _usable(self, endpoint: EndpointState) -> bool:
        metrics = endpoint.metrics
        return metrics.waiting < self.max_waiting and metrics.kv_usage < self.max_kv_usage
