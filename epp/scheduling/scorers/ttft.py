"""Estimate each endpoint's time to first token for this request and prefer the fastest.

A request's first token waits for the prefill work queued ahead of it and then for its own
prefill, which covers only the prompt tokens the endpoint has not cached. Both are in tokens, so
the estimate is ``(prefill ahead + uncached prompt tokens) / capacity``: cache affinity and load
are traded in one unit instead of through hand-tuned weights between separate scorers (Dynamo's
KV router costs workers the same way). Cached tokens come from the prefix producers' per-endpoint
matches (:data:`~epp.scheduling.prefix_data.CACHED_TOKENS`: precise when available, else
approximate), an optional input: in a profile without a prefix producer every endpoint is
assumed cold.

Prefill ahead is what matters, not all outstanding work: a replica decoding twenty requests whose
prompts were cache hits starts a new prompt almost at once (a decode step costs a few ms), while
one that has just been sent three cold 2,000-token prompts is busy for a while. epp does not see
a request's first token, so it models each endpoint's prefill queue as a fluid: each pick adds
the request's uncached prompt tokens, and the queue drains at ``prefill_tokens_per_second`` times
the endpoint's capacity weight. The scraped waiting queue (requests the engine has not started,
including ones other gateways sent) is a floor under that estimate. The model is per process:
with several epp processes each counts its own picks, and the scraped queue covers the rest.
The queue lives in the fleet state (:data:`PREFILL_BACKLOG`), so a configuration reload does
not forget it.

A request that does not fit in an endpoint's KV cache waits too: vLLM admits it when its prompt
fits, and as outputs grow the engine preempts its newest requests and recomputes them later.
The tokens by which the endpoint's projected KV demand (what it holds plus this request's
uncached prompt and output, :func:`~epp.scheduling.kv_demand.kv_held`) exceeds its cache
count as ``kv_wait_factor`` (default 1) prefill tokens each. Putting memory in the same unit as
cache affinity is the point: a chat whose 3,000-token history is cached stays home while the
overflow there costs less than recomputing the history elsewhere, and a short request leaves a
replica a hot prefix has filled (a fraction-of-cache penalty cannot tell the two apart).

Prefill work is divided by the endpoint's compute speed: its configured capacity weight, else
(``learned_speed``, on by default) the speed the latency model learned from its responses
when that differs from the fleet's median beyond noise
(:meth:`~epp.state.latency.LatencyModel.speeds`). On a fleet mixing GPU
generations a prompt cached nowhere then goes to an idle fast replica rather than an idle slow
one, which the token count alone cannot tell apart; equal replicas mostly learn no speed. Only this
estimate, compute, is scaled: load and cache scorers keep counting tokens, because a fast
replica's KV cache is no larger than a slow one's (docs/learned-latency.md).

Score: ``(best + slack) / (estimate + slack)``, so the fastest endpoint scores 1 and one twice
as slow about 0.5; ``slack`` (a few blocks of work) keeps tiny differences from dominating.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epp.request import InferenceRequest
from epp.scheduling.data import Input
from epp.scheduling.framework import Cycle, PostPick, Scorer, register
from epp.scheduling.kv_demand import kv_held
from epp.scheduling.params import Params, param
from epp.scheduling.prefix_data import CACHED_TOKENS
from epp.state.backlog import PrefillBacklog
from epp.state.registry import StateKey
from epp.state.snapshot import EndpointState

# Unkeyed: entries count prompt tokens, and the drain rate (a parameter) is applied on reading.
# Not moved on a retry: an estimate that drains within seconds (epp.state.moves).
PREFILL_BACKLOG = StateKey("prefill-backlog", PrefillBacklog)


@dataclass(frozen=True, slots=True)
class TtftParams(Params):
    """``prefill_tokens_per_second``: a capacity-1 replica's prefill speed (an 8B model on one
    H100 computes roughly 10-20k prompt tokens/s). Too high underestimates queues, too low
    spreads prefixes more than needed; within 2x of the truth either way changes little.
    ``kv_wait_factor``: prefill tokens one token of KV overflow costs (0 turns the term off).
    The overflow frees as running requests finish, over their remaining decode time, so the
    factor is roughly that time times the prefill rate over the cache's size: about 1 for a
    cache a few seconds of decoding fills. ``queue_weight``: how much queued work counts
    against an endpoint relative to this request's own prefill. ``tokens_per_request``: the
    size of a scraped waiting request; ``slack_tokens``: the score's slack.
    ``learned_speed``: divide by the learned speed where no weight is configured (true, the
    default; false: every unweighted endpoint counts as capacity 1). Equal replicas mostly
    learn no speed (:meth:`~epp.state.latency.LatencyModel.speeds`; docs/learned-latency.md)."""

    tokens_per_request: int = param(512, ge=1)
    slack_tokens: int = param(64, ge=1)
    queue_weight: float = param(1.0, ge=0)
    prefill_tokens_per_second: float = param(10_000.0, gt=0)
    kv_wait_factor: float = param(1.0, ge=0)
    learned_speed: bool = param(True)


@register("ttft-scorer")
class TtftScorer(Scorer, PostPick):
    params_type = TtftParams
    consumes = (Input(CACHED_TOKENS, required=False),)
    states = (PREFILL_BACKLOG,)

    def __init__(self, params: TtftParams = TtftParams()) -> None:
        self.tokens_per_request = params.tokens_per_request
        self.slack = params.slack_tokens
        self.queue_weight = params.queue_weight
        self.prefill_rate = params.prefill_tokens_per_second
        self.kv_wait_factor = params.kv_wait_factor
        self.learned_speed = params.learned_speed

    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        prompt = request.prompt_tokens()
        output = request.output_tokens()
        cached = cycle.get(CACHED_TOKENS) or {}
        learned = self.learned_speeds(cycle)
        backlog = cycle.fleet.states.get(PREFILL_BACKLOG)  # once: a lookup per candidate adds up
        estimates = []
        for c in candidates:
            uncached = max(0, prompt - cached.get(c.address, 0))
            capacity = speed(c.address, cycle, learned)
            queued = max(
                self._drained(backlog.get(c.address), capacity, cycle.now),
                c.metrics.waiting * self.tokens_per_request,
            )
            estimate = self.queue_weight * queued + uncached
            if self.kv_wait_factor:
                room = kv_held(c, cycle)
                if room is not None:
                    held, size = room
                    estimate += self.kv_wait_factor * max(0.0, held + uncached + output - size)
            estimates.append(estimate / capacity)
        best = min(estimates)
        return [(best + self.slack) / (e + self.slack) for e in estimates]

    def on_pick(self, request: InferenceRequest, endpoint: EndpointState, cycle: Cycle) -> None:
        address = endpoint.address
        cached = cycle.get(CACHED_TOKENS) or {}
        uncached = max(0, request.prompt_tokens() - cached.get(address, 0))
        backlog = cycle.fleet.states.get(PREFILL_BACKLOG)
        backlog.set(address, self.backlog(address, cycle) + uncached, cycle.now)

    def backlog(self, address: str, cycle: Cycle) -> float:
        """Prefill tokens still ahead on ``address`` by the fluid model (0 when drained): they
        drain at ``prefill_tokens_per_second`` times the endpoint's speed."""
        entry = cycle.fleet.states.get(PREFILL_BACKLOG).get(address)
        capacity = speed(address, cycle, self.learned_speeds(cycle))
        return self._drained(entry, capacity, cycle.now)

    def _drained(self, entry: tuple[float, float] | None, capacity: float, now: float) -> float:
        """What is left at ``now`` of a backlog ``entry`` on an endpoint of speed ``capacity``."""
        if entry is None:
            return 0.0
        tokens, as_of = entry
        drained = self.prefill_rate * capacity * (now - as_of)
        return max(0.0, tokens - drained)

    def learned_speeds(self, cycle: Cycle) -> Mapping[str, float]:
        return cycle.fleet.latency.speeds(cycle.now) if self.learned_speed else {}


def speed(address: str, cycle: Cycle, learned: Mapping[str, float]) -> float:
    """``address``'s compute speed relative to a capacity-1 replica: its configured weight
    (an override), else its learned speed (``learned``: only the endpoints that differ from
    the median beyond noise), else 1."""
    configured = cycle.weights.get(address)
    return configured if configured is not None else learned.get(address, 1.0)
