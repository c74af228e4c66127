"""The response half of the ext_proc state machine: timings, usage, usage stripping, moves."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
from prometheus_client import REGISTRY

from epp._proto import core_pb2, ext_proc_pb2, processing_mode_pb2
from epp.extproc.response_stream import ResponseObserver
from epp.extproc.responses import CONTINUE_RESPONSE_BODY
from epp.extproc.stream import StreamHandler
from epp.lifecycle import Usage
from epp.prefix.approximate import ApproximatePrefixIndex, approx_prefix
from epp.request import session_key
from epp.scheduling.scorers.session import SESSIONS
from epp.state.fleet import FleetState
from epp.state.latency import Basis
from epp.state.moves import PickRecord, Recording, move_pick
from epp.wire import SERVED
from tests.unit.test_stream import body_msg, headers_msg, make_router

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
A, B = "127.0.0.1:8001", "127.0.0.1:8002"


def sse(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def token(text: str) -> bytes:
    return sse({"choices": [{"index": 0, "delta": {"content": text}}]})


ROLE = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
USAGE = {"prompt_tokens": 7, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 3}}
USAGE_CHUNK = sse({"choices": [], "usage": USAGE})
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {":status": "200", "content-type": "text/event-stream", SERVED: B}


def test_timings_follow_token_events_not_chunks() -> None:
    observer = ResponseObserver(started=10.0)
    observer.on_headers(SSE_HEADERS)
    stream = ROLE + token("a") + token("b") + token("cd") + USAGE_CHUNK + DONE
    # The first token event is split across two chunks: it counts when it completes (10.5).
    cut = len(ROLE) + 5
    assert observer.on_body(stream[:cut], 10.2) is None
    observer.on_body(stream[cut : len(ROLE) + len(token("a"))], 10.5)
    rest = stream[len(ROLE) + len(token("a")) :]
    observer.on_body(rest[: len(token("b"))], 10.6)
    observer.on_body(rest[len(token("b")) :], 10.8, end=True)
    outcome = observer.finish(11.0, complete=True)
    assert outcome.served == B
    assert outcome.status == 200
    assert outcome.streamed
    assert outcome.usage == Usage(7, 4, 3)
    assert outcome.ttft == 0.5
    assert outcome.itl == pytest.approx([0.1, 0.2])
    # First to last token event (0.3 s) over completion_tokens - 1 = 3.
    assert abs((outcome.tpot or 0) - 0.1) < 1e-9
    assert outcome.seconds == 1.0


def test_json_body_usage_read_at_the_end() -> None:
    body = json.dumps({"choices": [{"text": "hi"}], "usage": USAGE}).encode()
    observer = ResponseObserver(started=0.0)
    observer.on_headers({":status": "200", "content-type": "application/json"})
    for i in range(0, len(body), 7):
        observer.on_body(body[i : i + 7], 0.1)
    outcome = observer.finish(0.3, complete=True)
    assert outcome.usage == Usage(7, 4, 3)
    assert outcome.ttft is None
    assert not outcome.streamed


def test_a_body_is_complete_at_its_content_length() -> None:
    """Full duplex may end the stream before Envoy's end-of-stream message: the declared
    length tells epp the response is whole."""
    body = json.dumps({"choices": [{"text": "hi"}], "usage": USAGE}).encode()
    observer = ResponseObserver(started=0.0)
    headers = {":status": "200", "content-type": "application/json"}
    observer.on_headers({**headers, "content-length": str(len(body))})
    observer.on_body(body[:10], 0.1)
    assert not observer.body_complete
    observer.on_body(body[10:], 0.2)
    assert observer.body_complete
    assert observer.finish(0.2, complete=True).usage == Usage(7, 4, 3)


def test_strip_removes_only_the_usage_chunk_whatever_the_chunking() -> None:
    stream = ROLE + token("a") + USAGE_CHUNK + DONE
    for size in (1, 3, 17, len(stream)):
        observer = ResponseObserver(started=0.0, strip_usage=True)
        observer.on_headers(SSE_HEADERS)
        out = b""
        for i in range(0, len(stream), size):
            chunk = stream[i : i + size]
            forward = observer.on_body(chunk, 0.1, end=i + size >= len(stream))
            out += chunk if forward is None else forward
        assert out == ROLE + token("a") + DONE, size
        assert observer.finish(0.2, complete=True).usage == Usage(7, 4, 3)


def _response_headers(values: dict[str, str], eos: bool = False) -> ext_proc_pb2.ProcessingRequest:
    return ext_proc_pb2.ProcessingRequest(
        response_headers=ext_proc_pb2.HttpHeaders(
            headers=core_pb2.HeaderMap(
                headers=[
                    core_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()
                ]
            ),
            end_of_stream=eos,
        )
    )


def _response_body(data: bytes, eos: bool = False) -> ext_proc_pb2.ProcessingRequest:
    return ext_proc_pb2.ProcessingRequest(
        response_body=ext_proc_pb2.HttpBody(body=data, end_of_stream=eos)
    )


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_retry_moves_the_accounting_and_metrics_follow_the_served_endpoint() -> None:
    router = await make_router()
    fleet = router.fleet
    now = [100.0]
    handler = StreamHandler(router, clock=lambda: now[0])
    body = json.dumps(
        {"model": "tiny", "prompt": "a shared system prompt " * 20, "max_tokens": 4, "stream": True}
    ).encode()
    handler.handle(headers_msg(extra={"x-session-token": "s1"}))
    handler.handle(body_msg(body))
    picked = handler.ticket.endpoint if handler.ticket else None
    assert picked == B  # 8001 has the longer queue
    handler.settle()  # as the servicer does once the answer is out: the post-pick hooks run
    sessions = fleet.states.get(SESSIONS)
    assert sessions.get(session_key(b"s1"), time.time()) == B  # the session scorer bound it
    assert fleet.inflight.load(B).requests == 1
    moved_before = _sample("epp_requests_moved_total")
    tokens_before = _sample("epp_tokens_total", model="tiny", objective="", kind="completion")

    # Envoy retried: A answered.
    now[0] = 100.05
    handler.handle(_response_headers({**SSE_HEADERS, SERVED: A}))
    assert (fleet.inflight.load(A).requests, fleet.inflight.load(B).requests) == (1, 0)
    assert sessions.get(session_key(b"s1"), time.time()) == A
    assert _sample("epp_requests_moved_total") == moved_before + 1
    now[0] = 100.2
    assert handler.handle(_response_body(ROLE + token("x"))) == (CONTINUE_RESPONSE_BODY,)
    now[0] = 100.3
    handler.handle(_response_body(USAGE_CHUNK + DONE, eos=True))
    # What the response showed is recorded after its last answer went out (settle), timed at
    # its end.
    assert _sample("epp_tokens_total", model="tiny", objective="", kind="completion") == (
        tokens_before
    )
    now[0] = 100.9
    handler.settle()
    assert _sample("epp_tokens_total", model="tiny", objective="", kind="completion") == (
        tokens_before + 4
    )
    handler.close()  # the servicer's finally: idempotent
    assert handler.ticket is not None
    assert handler.ticket.endpoint == A
    router.finish(handler.ticket)
    assert (fleet.inflight.load(A).requests, fleet.inflight.load(B).requests) == (0, 0)


async def test_served_endpoint_from_gie_metadata() -> None:
    """A GIE gateway reports the served endpoint as envoy.lb metadata, not as our header."""
    router = await make_router()
    handler = StreamHandler(router)
    handler.handle(headers_msg())
    handler.handle(body_msg(json.dumps({"model": "tiny", "prompt": "p", "max_tokens": 2}).encode()))
    assert handler.ticket is not None
    assert handler.ticket.endpoint == B
    msg = _response_headers({":status": "200", "content-type": "application/json"})
    lb = msg.metadata_context.filter_metadata["envoy.lb"]
    lb.fields["x-gateway-destination-endpoint-served"].string_value = A
    handler.handle(msg)
    assert handler.ticket.endpoint == A
    router.finish(handler.ticket)


async def test_full_duplex_response_is_echoed() -> None:
    router = await make_router()
    handler = StreamHandler(router)
    handler.handle(headers_msg(mode=FULL_DUPLEX))
    msg = body_msg(json.dumps({"model": "tiny", "prompt": "p", "max_tokens": 2}).encode())
    msg.protocol_config.response_body_mode = FULL_DUPLEX
    handler.handle(msg)
    handler.handle(_response_headers({":status": "200", "content-type": "application/json"}))
    (echo,) = handler.handle(_response_body(b'{"usage": null}', eos=True))
    streamed = echo.response_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (b'{"usage": null}', True)


def test_prefix_insertion_moves_only_what_the_pick_added() -> None:
    fleet = FleetState()
    index = fleet.states.get(approx_prefix())
    index.insert(A, [1, 2], 100)  # A already cached the head of the chain
    with Recording(fleet.states) as learned:
        index.insert(A, [1, 2, 3, 4], 100)  # the pick's insertion
    record = PickRecord(fleet.inflight.add(A, 10), learned)
    moved = move_pick(fleet, record, B, 0.0)
    assert index.match([1, 2, 3, 4], [A, B]) == {A: 2, B: 4}
    assert moved.endpoint == B
    assert fleet.inflight.load(B).tokens == 10
    assert fleet.inflight.load(A).requests == 0
    # Moving back and forth keeps exactly one ticket's worth of work.
    move_pick(fleet, moved, A, 0.0)
    assert (fleet.inflight.load(A).requests, fleet.inflight.load(B).requests) == (1, 0)
    assert isinstance(index, ApproximatePrefixIndex)


async def test_first_token_ends_the_prefill_and_teaches_the_latency_model() -> None:
    """Until its first token a request's uncached prompt is prefill queued on its endpoint;
    the first token takes it out of that queue, and the time from the pick is a TTFT sample
    for the endpoint's latency model (the decode that follows, a TPOT sample)."""
    router = await make_router()
    fleet = router.fleet
    now = [100.0]
    handler = StreamHandler(router, clock=lambda: now[0])
    body = json.dumps({"model": "tiny", "prompt": "x" * 800, "max_tokens": 4, "stream": True})
    handler.handle(headers_msg())
    handler.handle(body_msg(body.encode()))
    assert handler.ticket is not None
    endpoint = handler.ticket.endpoint
    load = fleet.inflight.load(endpoint)
    assert (load.waiting, load.decoding) == (1, 0)
    assert load.prefill > 150  # the whole prompt is uncached (~200 tokens)
    handler.handle(_response_headers({**SSE_HEADERS, SERVED: endpoint}))
    now[0] = 100.25
    handler.handle(_response_body(ROLE))
    assert fleet.inflight.load(endpoint).waiting == 1  # the role chunk is not a token
    handler.handle(_response_body(token("a")))
    load = fleet.inflight.load(endpoint)
    assert (load.prefill, load.waiting, load.decoding) == (0, 0, 1)
    assert fleet.latency.errors(endpoint)[-1][1] == pytest.approx(0.25)
    now[0] = 100.55
    handler.handle(_response_body(token("b") + token("c") + token("d")))
    handler.handle(_response_body(USAGE_CHUNK + DONE, eos=True))
    handler.settle()  # the servicer's, once the answer is out
    described = fleet.latency.describe(endpoint, time.time())
    assert described is not None
    assert described["ttft_samples"] == 1
    assert described["evidence"]["tpot"] > 0
    router.finish(handler.ticket)
    assert fleet.inflight.load(endpoint) == type(load)()


async def test_passive_health_times_a_first_token_per_prefill_tokens_ahead() -> None:
    """The prefill ahead of a request's first token reaches passive health: its own uncached
    prompt plus the uncached prompts still waiting on that endpoint when it was picked. With
    ``latency_prompt_tokens`` 64, a second request picked behind the first (both ~200-token
    prompts cached nowhere, one ready endpoint) and answered 0.4 s later is a sample of
    0.4 x 64 / (both prompts); the first, retried elsewhere (what was ahead there unknown),
    counts as measured."""
    router = await make_router(ready=(B,))
    fleet = router.fleet
    pool = replace(fleet.health.config, latency_prompt_tokens=64, latency_rule="pool")
    fleet.health.configure(pool, (A, B))
    now = [100.0]

    def picked(text: str) -> StreamHandler:
        handler = StreamHandler(router, clock=lambda: now[0])
        body = json.dumps({"model": "tiny", "prompt": text * 800, "max_tokens": 2, "stream": True})
        handler.handle(headers_msg())
        handler.handle(body_msg(body.encode()))
        assert handler.ticket is not None
        assert handler.ticket.endpoint == B
        return handler

    def answered(handler: StreamHandler, served: str) -> float:
        handler.handle(_response_headers({**SSE_HEADERS, SERVED: served}))
        now[0] += 0.4
        handler.handle(_response_body(ROLE + token("a")))
        handler.handle(_response_body(USAGE_CHUNK + DONE, eos=True))
        handler.settle()
        state = fleet.health.state(served)
        assert state is not None
        assert handler.ticket is not None
        router.finish(handler.ticket)
        return state.latencies[-1][1]

    first, second = picked("x"), picked("y")
    assert first.ticket is not None
    assert second.ticket is not None
    assert first.ticket.prefill > 150
    assert second.ticket.prefill > 150
    ahead = first.ticket.prefill + second.ticket.prefill
    assert answered(second, B) == pytest.approx(0.4 * 64 / ahead)
    assert answered(first, A) == pytest.approx(0.8)  # its first token came 0.8 s after its pick


async def test_passive_health_judges_a_first_token_against_its_prediction_at_the_pick() -> None:
    """The residual rule end to end: once the latency model has evidence for the endpoint, a
    streamed answer's sample is its TTFT over what the model predicted at the pick."""
    router = await make_router(ready=(B,))
    fleet = router.fleet
    basis = Basis((1.0, 0.2, 0.0, 0.0), 0.0)
    for _ in range(12):  # 0.1 s for a 200-token prompt: the model trusts its fit from now on
        fleet.latency.observe_ttft(B, basis, 0.1, time.time())
    now = [100.0]
    handler = StreamHandler(router, clock=lambda: now[0])
    body = json.dumps({"model": "tiny", "prompt": "x" * 800, "max_tokens": 2, "stream": True})
    handler.handle(headers_msg())
    handler.handle(body_msg(body.encode()))
    ticket = handler.ticket
    assert ticket is not None
    assert ticket.basis is not None
    predicted = ticket.basis.predicted
    handler.handle(_response_headers(SSE_HEADERS))
    now[0] += 0.4
    handler.handle(_response_body(ROLE + token("a")))
    handler.handle(_response_body(USAGE_CHUNK + DONE, eos=True))
    handler.settle()
    router.finish(ticket)
    state = fleet.health.state(B)
    assert state is not None
    assert list(state.latencies) == []
    assert [r for _, r in state.residuals] == [pytest.approx(0.4 / max(predicted, 0.05))]
