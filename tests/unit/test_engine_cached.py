"""The latency model learns TTFT against the engine's uncached prompt tokens when the
response's usage reports them (``prompt_tokens_details.cached_tokens``, vLLM's
``--enable-prompt-tokens-details``), and against epp's estimate at the pick otherwise."""

from __future__ import annotations

import json
from typing import Any

import pytest

from epp.extproc.stream import StreamHandler
from epp.router import Router
from epp.state.latency import TOKENS_UNIT, Basis, LatencyModel
from epp.wire import SERVED
from tests.unit.test_response_stream import (
    DONE,
    ROLE,
    SSE_HEADERS,
    _response_body,
    _response_headers,
    sse,
    token,
)
from tests.unit.test_stream import body_msg, headers_msg, make_router

ONLY = "127.0.0.1:8002"
Observed = list[tuple[str, float, float]]


def recording(router: Router, monkeypatch: pytest.MonkeyPatch) -> Observed:
    """Every TTFT observation as (endpoint, U in tokens, seconds)."""
    calls: Observed = []
    latency = router.fleet.latency
    observe = latency.observe_ttft

    def spy(address: str, basis: Basis, seconds: float, now: float) -> None:
        calls.append((address, basis.features[1] * TOKENS_UNIT, seconds))
        observe(address, basis, seconds, now)

    monkeypatch.setattr(latency, "observe_ttft", spy)
    return calls


def usage_chunk(prompt: int, cached: int | None) -> bytes:
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": 2}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return sse({"choices": [], "usage": usage})


class Exchange:
    """One streamed request through a :class:`StreamHandler` with a hand-driven clock."""

    def __init__(self, router: Router, text: str = "x", include_usage: bool = True) -> None:
        self.now = [100.0]
        self.handler = StreamHandler(router, clock=lambda: self.now[0])
        request: dict[str, Any] = {
            "model": "tiny",
            "prompt": text * 800,
            "max_tokens": 2,
            "stream": True,
        }
        if include_usage:
            request["stream_options"] = {"include_usage": True}
        self.handler.handle(headers_msg())
        self.handler.handle(body_msg(json.dumps(request).encode()))
        assert self.handler.ticket is not None
        self.endpoint = self.handler.ticket.endpoint
        self.estimate = self.handler.ticket.prefill  # epp's uncached count at the pick

    def first_token(self, seconds: float = 0.3) -> None:
        self.handler.handle(_response_headers({**SSE_HEADERS, SERVED: self.endpoint}))
        self.now[0] += seconds
        self.handler.handle(_response_body(ROLE + token("a")))

    def end(self, usage: bytes = b"") -> None:
        self.now[0] += 0.1
        self.handler.handle(_response_body(token("b") + usage + DONE, eos=True))
        self.handler.settle()


async def test_the_engines_cached_tokens_replace_the_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """epp's index counts the second request's whole ~200-token prompt as uncached (a prompt it
    never routed); the engine says it held 190 of them: the TTFT is learned against 10
    uncached tokens, once the usage arrives."""
    router = await make_router(ready=(ONLY,))
    observed = recording(router, monkeypatch)
    first = Exchange(router)
    assert first.estimate > 150
    first.first_token()
    # Nothing known of the endpoint yet: observed at the first token with the estimate.
    assert observed == [(first.endpoint, pytest.approx(first.estimate), pytest.approx(0.3))]
    first.end(usage_chunk(200, 190))
    assert router.fleet.latency.engine_cached(first.endpoint)
    described = router.fleet.latency.describe(first.endpoint, 0.0)
    assert described is not None
    assert described["uncached_from"] == "engine"
    second = Exchange(router, "y")
    assert second.estimate > 150
    second.first_token(0.25)
    assert len(observed) == 1  # held for the usage
    second.end(usage_chunk(200, 190))
    assert observed[1] == (second.endpoint, pytest.approx(10.0), pytest.approx(0.25))


async def test_without_cached_tokens_the_estimate_is_learned_at_the_first_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine started without --enable-prompt-tokens-details: usage without details, so
    every TTFT is observed at its first token with epp's estimate, as before."""
    router = await make_router(ready=(ONLY,))
    observed = recording(router, monkeypatch)
    for _ in range(2):
        exchange = Exchange(router)
        exchange.first_token()
        assert observed[-1] == (
            exchange.endpoint,
            pytest.approx(exchange.estimate),
            pytest.approx(0.3),
        )
        exchange.end(usage_chunk(200, None))
        assert not router.fleet.latency.engine_cached(exchange.endpoint)
    assert len(observed) == 2


async def test_a_stream_without_usage_or_cut_short_keeps_the_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Even on an endpoint known to report cached tokens, a response that will not end with
    usage is observed at once; a held TTFT whose stream closes before the usage still counts,
    with the estimate."""
    router = await make_router(ready=(ONLY,))
    observed = recording(router, monkeypatch)
    warm = Exchange(router)
    warm.first_token()
    warm.end(usage_chunk(200, 190))
    plain = Exchange(router, "y", include_usage=False)
    plain.first_token(0.2)
    assert observed[-1] == (plain.endpoint, pytest.approx(plain.estimate), pytest.approx(0.2))
    plain.end()
    cut = Exchange(router, "z")
    cut.first_token(0.4)
    assert len(observed) == 2
    cut.handler.close()  # the stream closed before the usage chunk
    assert observed[-1] == (cut.endpoint, pytest.approx(cut.estimate), pytest.approx(0.4))
    assert len(observed) == 3


def test_latency_model_learns_which_endpoints_report_cached_tokens() -> None:
    model = LatencyModel()
    assert not model.engine_cached("a")
    model.saw_usage("a", False)
    assert not model.engine_cached("a")
    model.saw_usage("a", True)
    assert model.engine_cached("a")
    model.saw_usage("a", False)  # restarted without the option
    assert not model.engine_cached("a")
    model.saw_usage("a", True)
    model.configure({}, ())  # the endpoint left
    assert not model.engine_cached("a")


def test_basis_with_the_engines_uncached_count_keeps_the_rest() -> None:
    basis = Basis((1.0, 0.2, 0.5, 0.3), 0.4)
    assert basis.with_uncached(10) == Basis((1.0, 0.01, 0.5, 0.3), 0.4)
