"""Keep requests off replicas whose KV cache their in-flight work is about to fill.

A vLLM replica admits a request when its prompt fits, not when its whole output will: requests
grow by a block every ``block_size`` output tokens, and when the cache runs out the engine stops
admitting and preempts the newest running request (recomputing it later). A replica that serves
a popular prefix or adapter from cache keeps winning on cache affinity until that happens, and
the requests sent to it then wait for memory while other replicas have room.

The scorer projects each endpoint's KV demand once this request is added: the tokens epp has in
flight there (uncached prompt plus requested output, the same count the load scorer uses) or the
scraped KV usage, whichever is larger, plus this request's own uncached prompt and output. It
scores 1 up to ``start`` of the endpoint's cache and falls linearly to 0 when the cache is full,
so it changes nothing on replicas with room (unlike ``kv-cache-utilization-scorer``, whose
``1 - usage`` also pushes work off replicas that are busy only because they serve a cached
prefix) and acts only where the engine would soon have to queue or preempt. Endpoints whose
cache geometry is not known yet score 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epp.request import InferenceRequest
from epp.scheduling.data import Input
from epp.scheduling.framework import Cycle, Scorer, register
from epp.scheduling.kv_demand import kv_held
from epp.scheduling.params import Params, param
from epp.scheduling.prefix_data import CACHED_TOKENS
from epp.state.snapshot import EndpointState


@dataclass(frozen=True, slots=True)
class KvPressureParams(Params):
    """``start``: the share of an endpoint's KV cache the projected demand may reach before
    the score falls. ``protect_tokens``: when set, an endpoint keeps score 1 if every endpoint
    with room caches more than this many fewer of the request's prompt tokens: escaping the
    pressure would recompute (and store twice) a long cached history, which costs more than
    waiting for memory."""

    start: float = param(0.8, ge=0, lt=1)
    protect_tokens: int | None = param(None, ge=0)


@register("kv-pressure-scorer")
class KvPressureScorer(Scorer):
    """Cached tokens are an optional input: without a prefix producer in the profile every
    endpoint counts the whole prompt as uncached, and ``protect_tokens`` protects nothing."""

    params_type = KvPressureParams
    consumes = (Input(CACHED_TOKENS, required=False),)

    def __init__(self, params: KvPressureParams = KvPressureParams()) -> None:
        self.start = params.start
        self.protect_tokens = params.protect_tokens

    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        cached = cycle.get(CACHED_TOKENS) or {}
        scores = self._pressure(request, candidates, cycle, cached)
        if self.protect_tokens is None:
            return scores
        roomy = [
            cached.get(c.address, 0) for c, s in zip(candidates, scores, strict=True) if s == 1
        ]
        elsewhere = max(roomy, default=0)
        return [
            1.0 if cached.get(c.address, 0) - elsewhere > self.protect_tokens else s
            for c, s in zip(candidates, scores, strict=True)
        ]

    def _pressure(
        self,
        request: InferenceRequest,
        candidates: Sequence[EndpointState],
        cycle: Cycle,
        cached: Mapping[str, int],
    ) -> list[float]:
        scores = []
        for c in candidates:
            room = kv_held(c, cycle)
            if room is None:
                scores.append(1.0)
                continue
            held, capacity = room
            full = (held + request.expected_tokens(cached.get(c.address, 0))) / capacity
            scores.append(min(1.0, max(0.0, (1.0 - full) / (1.0 - self.start))))
        return scores
