"""The ext_proc per-stream state machine, driven with real protobuf messages."""

from __future__ import annotations

import json

import pytest

from epp._proto import core_pb2, ext_proc_pb2, processing_mode_pb2
from epp.config import parse_config
from epp.extproc import responses
from epp.extproc.responses import MAX_CHUNK
from epp.extproc.stream import StreamHandler
from epp.prefix.approximate import approx_prefix
from epp.router import Router
from epp.state import EndpointMetrics, EndpointState
from epp.state.fleet import FleetState
from epp.state.memory import MemoryStore

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


async def make_router(ready: tuple[str, ...] = ("127.0.0.1:8001", "127.0.0.1:8002")) -> Router:
    config = parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}, "other": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]}},
            "routing": {"fallbacks": 1, "max_body_bytes": 1000},
        }
    )
    store = MemoryStore()
    for i, addr in enumerate(("127.0.0.1:8001", "127.0.0.1:8002")):
        # 8001 has the longer queue, so 8002 must win.
        metrics = EndpointMetrics(waiting=10 - 10 * i)
        await store.put_endpoint(EndpointState(addr, "main", addr in ready, metrics, 1.0))
    return Router(config, FleetState(store))


def headers_msg(
    path: str = "/v1/completions",
    method: str = "POST",
    eos: bool = False,
    mode: int = BUFFERED,
    extra: dict[str, str] | None = None,
    subset: list[str] | None = None,
) -> ext_proc_pb2.ProcessingRequest:
    values = {":path": path, ":method": method, "content-type": "application/json", **(extra or {})}
    msg = ext_proc_pb2.ProcessingRequest(
        request_headers=ext_proc_pb2.HttpHeaders(
            headers=core_pb2.HeaderMap(
                headers=[
                    core_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()
                ]
            ),
            end_of_stream=eos,
        )
    )
    msg.protocol_config.request_body_mode = mode
    if subset is not None:
        hint = msg.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        hint.fields["x-gateway-destination-endpoint-subset"].list_value.extend(subset)
    return msg


def body_msg(data: bytes, eos: bool = True) -> ext_proc_pb2.ProcessingRequest:
    return ext_proc_pb2.ProcessingRequest(
        request_body=ext_proc_pb2.HttpBody(body=data, end_of_stream=eos)
    )


BODY = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}).encode()


def destination(resp: ext_proc_pb2.ProcessingResponse, arm: str) -> tuple[str, str]:
    common = getattr(resp, arm).response
    header = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    meta = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert common.clear_route_cache
    return header["x-gateway-destination-endpoint"], meta[
        "x-gateway-destination-endpoint"
    ].string_value


async def test_buffered_routes_in_body_response() -> None:
    handler = StreamHandler(await make_router())
    (first,) = handler.handle(headers_msg(extra={"x-gateway-destination-endpoint": "6.6.6.6:1"}))
    assert first.WhichOneof("response") == "request_headers"
    (answer,) = handler.handle(body_msg(BODY))
    header, meta = destination(answer, "request_body")
    assert header == meta == "127.0.0.1:8002,127.0.0.1:8001"
    assert not answer.request_body.response.HasField("body_mutation")


async def test_full_duplex_holds_headers_then_streams_body_back_in_chunks() -> None:
    router = await make_router()
    router.config = parse_config(  # allow a large body for this test
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]}},
        }
    )
    handler = StreamHandler(router)
    assert handler.handle(headers_msg(mode=FULL_DUPLEX)) == ()
    prompt = "x" * 150_000
    big = json.dumps({"model": "tiny", "prompt": prompt}).encode()
    assert handler.handle(body_msg(big[:100_000], eos=False)) == ()
    answers = handler.handle(body_msg(big[100_000:], eos=True))
    header, meta = destination(answers[0], "request_headers")
    assert header == meta
    assert header.startswith("127.0.0.1:8002")
    sets = {
        h.header.key: h.header.raw_value
        for h in answers[0].request_headers.response.header_mutation.set_headers
    }
    assert sets["content-length"] == str(len(big)).encode()
    chunks = [a.request_body.response.body_mutation.streamed_response for a in answers[1:]]
    assert all(len(c.body) <= MAX_CHUNK for c in chunks)
    assert b"".join(c.body for c in chunks) == big
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]
    # A repeated end-of-stream chunk (Envoy bug around 1 MB) is ignored.
    assert handler.handle(body_msg(b"", eos=True)) == ()


async def test_full_duplex_streams_the_body_back_as_it_arrived() -> None:
    # Chunks at or under the limit go back as they came (no re-slicing), the last one ending
    # the stream; only a chunk over the limit is split.
    handler = StreamHandler(await make_router())
    handler.handle(headers_msg(mode=FULL_DUPLEX))
    body = json.dumps({"model": "tiny", "prompt": "abcdefgh" * 100}).encode()
    parts = [body[:7], body[7:300], body[300:]]
    for part in parts[:-1]:
        assert handler.handle(body_msg(part, eos=False)) == ()
    answers = handler.handle(body_msg(parts[-1], eos=True))
    chunks = [a.request_body.response.body_mutation.streamed_response for a in answers[1:]]
    assert [c.body for c in chunks] == parts
    assert [c.end_of_stream for c in chunks] == [False, False, True]


def immediate(resp: ext_proc_pb2.ProcessingResponse) -> tuple[int, dict[str, object]]:
    assert resp.WhichOneof("response") == "immediate_response"
    return resp.immediate_response.status.code, json.loads(resp.immediate_response.body)


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{oops", 400, "not valid JSON"),
        (b'{"prompt": "x"}', 400, "model"),
        (b'{"model": "nope", "prompt": "x"}', 404, "Available models: other, tiny"),
        (b'{"model": "tiny", "prompt": "' + b"x" * 2000 + b'"}', 413, "exceeds the limit"),
    ],
)
async def test_bad_requests_get_immediate_json_errors(
    body: bytes, status: int, needle: str
) -> None:
    handler = StreamHandler(await make_router())
    handler.handle(headers_msg())
    (answer,) = handler.handle(body_msg(body))
    code, payload = immediate(answer)
    assert code == status
    assert needle in payload["error"]["message"]


async def test_no_ready_endpoint_is_503() -> None:
    handler = StreamHandler(await make_router(ready=()))
    handler.handle(headers_msg())
    code, payload = immediate(handler.handle(body_msg(BODY))[0])
    assert code == 503
    assert "0 of 2 endpoints are ready" in payload["error"]["message"]


async def test_subset_hint_restricts_candidates() -> None:
    handler = StreamHandler(await make_router())
    handler.handle(headers_msg(subset=["127.0.0.1:8001"]))
    header, _ = destination(handler.handle(body_msg(BODY))[0], "request_body")
    assert header == "127.0.0.1:8001"
    handler = StreamHandler(await make_router())
    handler.handle(headers_msg(subset=["10.9.9.9:1"]))
    assert immediate(handler.handle(body_msg(BODY))[0])[0] == 503


async def test_get_models_is_answered_by_epp() -> None:
    handler = StreamHandler(await make_router())
    (answer,) = handler.handle(headers_msg("/v1/models", "GET", eos=True))
    code, payload = immediate(answer)
    assert code == 200
    assert [m["id"] for m in payload["data"]] == ["other", "tiny"]  # type: ignore[index]
    (answer,) = StreamHandler(await make_router()).handle(headers_msg("/health", "GET", eos=True))
    assert immediate(answer)[0] == 404


@pytest.mark.parametrize(
    ("extra", "path", "status"),
    [
        ({"content-length": "5000"}, "/v1/completions", 413),
        ({"content-type": "text/plain"}, "/v1/completions", 415),
        ({}, "/admin", 404),
    ],
)
@pytest.mark.parametrize("mode", [BUFFERED, FULL_DUPLEX])
async def test_headers_alone_refuse_before_the_body(
    extra: dict[str, str], path: str, status: int, mode: int
) -> None:
    handler = StreamHandler(await make_router())
    (answer,) = handler.handle(headers_msg(path, extra=extra, mode=mode))
    assert immediate(answer)[0] == status
    # The body that follows anyway is not buffered or answered.
    assert handler.handle(body_msg(b"x" * 500, eos=False)) == ()
    assert handler._body == []


async def test_pick_counts_in_flight_until_finished() -> None:
    router = await make_router()
    handler = StreamHandler(router)
    handler.handle(headers_msg())
    handler.handle(body_msg(BODY))
    assert handler.ticket is not None
    load = router.fleet.inflight.load("127.0.0.1:8002")
    assert (load.requests, load.tokens) == (1, len("hello") // 4 + 1 + 4)
    router.finish(handler.ticket)
    assert router.fleet.inflight.load("127.0.0.1:8002").requests == 0


async def test_a_profile_with_preparation_holds_the_request_until_resumed() -> None:
    """With a precise prefix scorer the servicer awaits Router.prepare between parsing and
    routing; the answer (and, in full duplex with trailers, the trailers answer after it)
    comes from resume()."""
    router = await make_router()
    router.config = parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]}},
            "scheduling": {
                "profile": "p",
                "profiles": {
                    "p": [
                        {"plugin": "precise-prefix-cache-scorer"},
                        {"plugin": "queue-scorer"},
                        {"plugin": "max-score-picker"},
                    ]
                },
            },
        }
    )
    assert router.generation.needs_preparation
    handler = StreamHandler(router)
    handler.handle(headers_msg(mode=FULL_DUPLEX))
    assert handler.handle(body_msg(BODY, eos=False)) == ()
    assert handler.handle(trailers_msg()) == ()
    assert handler.pending is not None
    assert handler.pending.request.model == "tiny"
    await router.prepare(handler.pending.request)
    answers = handler.resume()
    header, _ = destination(answers[0], "request_headers")
    assert header.startswith("127.0.0.1:8002")
    assert answers[-1].WhichOneof("response") == "request_trailers"
    assert handler.pending is None
    assert handler.resume() == ()


def trailers_msg() -> ext_proc_pb2.ProcessingRequest:
    return ext_proc_pb2.ProcessingRequest(request_trailers=ext_proc_pb2.HttpTrailers())


async def test_post_pick_bookkeeping_waits_for_settle() -> None:
    # The prefix index learns the pick only once settle() runs (the servicer calls it after
    # sending the answer), and what it learned is the pick's, to move after a retry.
    router = await make_router()
    handler = StreamHandler(router)
    handler.handle(headers_msg())
    body = json.dumps({"model": "tiny", "prompt": "p" * 300, "max_tokens": 4}).encode()
    (answer,) = handler.handle(body_msg(body))
    picked, _ = destination(answer, "request_body")
    endpoint = picked.split(",")[0]
    assert router.fleet.states.get(approx_prefix()).size(endpoint) == 0
    assert handler.context.pick is not None
    assert handler.context.pick.learned == []
    handler.settle()
    assert router.fleet.states.get(approx_prefix()).size(endpoint) > 0
    assert [item.endpoint for item in handler.context.pick.learned] == [endpoint]
    handler.settle()  # idempotent
    assert len(handler.context.pick.learned) == 1


async def test_plain_buffered_answers_are_shared_and_match_a_fresh_build() -> None:
    """A routing answer without scores or a rewritten body is built once per destination list
    and headers to remove; scores or a new body always get an answer of their own."""
    first = responses.route_in_body("127.0.0.1:8002,127.0.0.1:8001", ["x-epp-explain"])
    again = responses.route_in_body("127.0.0.1:8002,127.0.0.1:8001", ("x-epp-explain",))
    assert again is first
    fresh = responses._route_in_body(
        "127.0.0.1:8002,127.0.0.1:8001", ["x-epp-explain"], None, None, None
    )
    assert first == fresh
    assert destination(first, "request_body") == ("127.0.0.1:8002,127.0.0.1:8001",) * 2
    other = responses.route_in_body("127.0.0.1:8001,127.0.0.1:8002", ["x-epp-explain"])
    assert destination(other, "request_body")[0] == "127.0.0.1:8001,127.0.0.1:8002"
    scored = responses.route_in_body("127.0.0.1:8002", [], scores='{"a":1}')
    assert scored is not responses.route_in_body("127.0.0.1:8002", [], scores='{"a":1}')
    rewritten = responses.route_in_body("127.0.0.1:8002", [], body=b"{}")
    assert rewritten.request_body.response.body_mutation.body == b"{}"


@pytest.mark.parametrize("size", [0, 5, MAX_CHUNK, 2 * MAX_CHUNK + 7])
@pytest.mark.parametrize("end", [True, False])
@pytest.mark.parametrize("response", [True, False])
def test_echoed_chunks_equal_the_messages_built_by_constructors(
    size: int, end: bool, response: bool
) -> None:
    """Filled through their field paths (no nested copies), the echoes are the messages the
    nested constructors build, byte for byte."""
    body = bytes(range(256)) * (size // 256) + bytes(size % 256)
    expected = []
    last = max(size - 1, 0) // MAX_CHUNK * MAX_CHUNK
    for offset in range(0, last + 1, MAX_CHUNK):
        chunk = ext_proc_pb2.StreamedBodyResponse(
            body=body[offset : offset + MAX_CHUNK], end_of_stream=end and offset == last
        )
        answer = ext_proc_pb2.BodyResponse(
            response=ext_proc_pb2.CommonResponse(
                body_mutation=ext_proc_pb2.BodyMutation(streamed_response=chunk)
            )
        )
        kind = "response_body" if response else "request_body"
        expected.append(ext_proc_pb2.ProcessingResponse(**{kind: answer}))
    built = list(responses.body_chunks(body, end, response))
    assert built == expected
    assert [a.SerializeToString() for a in built] == [a.SerializeToString() for a in expected]
    replaced = ext_proc_pb2.ProcessingResponse(
        response_body=ext_proc_pb2.BodyResponse(
            response=ext_proc_pb2.CommonResponse(body_mutation=ext_proc_pb2.BodyMutation(body=body))
        )
    )
    assert responses.replace_response_body(body) == replaced


def test_full_duplex_answers_copy_a_shared_one_and_add_the_length() -> None:
    first = responses.route_in_headers("127.0.0.1:8002", ["x-epp-explain"], 10)
    second = responses.route_in_headers("127.0.0.1:8002", ["x-epp-explain"], 20)
    built = responses._route_in_headers("127.0.0.1:8002", ["x-epp-explain"], 10, None, None)
    assert first == built
    assert first is not second
    lengths = [
        [h.header.raw_value for h in a.request_headers.response.header_mutation.set_headers]
        for a in (first, second)
    ]
    assert lengths == [[b"127.0.0.1:8002", b"10"], [b"127.0.0.1:8002", b"20"]]
    # The shared answer itself never carries a length.
    assert responses.route_in_headers("127.0.0.1:8002", ["x-epp-explain"], None) == (
        responses._route_in_headers("127.0.0.1:8002", ["x-epp-explain"], None, None, None)
    )
