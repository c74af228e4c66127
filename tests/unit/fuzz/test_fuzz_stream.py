"""The ext_proc stream state machine under any message order: every message gets an answer
or none, no exception escapes, buffers stay bounded and every pick is released.

Envoy's real message orders are a small subset of what is generated here (repeated headers,
body before headers, chunks after end of stream, trailers anywhere, response messages before
the request ended, the body mode switching mid-stream): a confused or hostile peer, or an
Envoy bug such as the repeated end-of-stream chunk, must cost at most that stream.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from hypothesis import example, given
from hypothesis import strategies as st

from epp._proto import core_pb2, ext_proc_pb2, processing_mode_pb2
from epp.extproc.responses import MAX_CHUNK
from epp.extproc.stream import StreamHandler
from epp.router import Router
from tests.unit.fuzz.harness import FUZZ, LIMIT, corpus, make_router, path_of

Message = ext_proc_pb2.ProcessingRequest
MODES = (
    processing_mode_pb2.ProcessingMode.BUFFERED,
    processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
    processing_mode_pb2.ProcessingMode.STREAMED,
)
ROUTER = make_router()
BODY = json.dumps({"model": "tiny", "prompt": "hello", "stream": True}).encode()


def headers(path: str, extra: dict[str, str], eos: bool, response: bool = False) -> Message:
    values = {":path": path, ":method": "POST", "content-type": "application/json", **extra}
    block = ext_proc_pb2.HttpHeaders(
        headers=core_pb2.HeaderMap(
            headers=[core_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
        ),
        end_of_stream=eos,
    )
    return Message(response_headers=block) if response else Message(request_headers=block)


def body(data: bytes, eos: bool, response: bool = False) -> Message:
    chunk = ext_proc_pb2.HttpBody(body=data, end_of_stream=eos)
    return Message(response_body=chunk) if response else Message(request_body=chunk)


SSE = b'data: {"choices":[{"text":"x"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
header_values = st.dictionaries(
    st.sampled_from(["content-length", "content-type", "x-priority", "x-request-id", ":status"]),
    st.sampled_from(
        ["", "0", "-1", "12", "99999999999999999999", "application/json", "text/plain", "x"]
    ),
    max_size=3,
)


@st.composite
def message(draw: st.DrawFn) -> Message:
    kind = draw(
        st.sampled_from(
            [
                "headers",
                "body",
                "body",
                "body",
                "trailers",
                "rheaders",
                "rbody",
                "rtrailers",
                "empty",
            ]
        )
    )
    if kind == "headers":
        path = draw(
            st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/x", ""])
        )
        msg = headers(path, draw(header_values), draw(st.booleans()))
    elif kind == "body":
        data = draw(st.sampled_from([b"", BODY, BODY[:9], BODY[9:], b"{", b"x" * 40_000, b"\xff"]))
        msg = body(data, draw(st.booleans()))
    elif kind == "trailers":
        msg = Message(request_trailers=ext_proc_pb2.HttpTrailers())
    elif kind == "rheaders":
        msg = headers(
            "",
            {":status": draw(st.sampled_from(["200", "500", "x"]))},
            draw(st.booleans()),
            response=True,
        )
    elif kind == "rbody":
        msg = body(
            draw(st.sampled_from([b"", SSE, SSE[:20], b"data: [DONE]\n\n", b"\xff{"])),
            draw(st.booleans()),
            response=True,
        )
    elif kind == "rtrailers":
        msg = Message(response_trailers=ext_proc_pb2.HttpTrailers())
    else:
        msg = Message()
    if draw(st.integers(0, 5)) == 0:
        msg.protocol_config.request_body_mode = draw(st.sampled_from(MODES))
        msg.protocol_config.response_body_mode = draw(st.sampled_from(MODES))
    return msg


def run_stream(router: Router, messages: list[Message]) -> StreamHandler:
    """Feed one stream's messages as the servicer does, then end the stream as it does."""
    handler = StreamHandler(router)
    try:
        for msg in messages:
            answers = handler.handle(msg)
            if handler.pending is not None:
                answers = handler.resume()
            for answer in answers:
                assert isinstance(answer, ext_proc_pb2.ProcessingResponse)
                assert answer.WhichOneof("response") is not None
                for chunk in _streamed(answer):
                    assert len(chunk) <= MAX_CHUNK
            # Buffers are bounded by the body limit plus one chunk, however the stream goes.
            assert sum(map(len, handler._body)) <= LIMIT + 40_000
    finally:
        handler.close()
        if handler.ticket is not None:
            router.finish(handler.ticket)
    return handler


def _streamed(answer: ext_proc_pb2.ProcessingResponse) -> list[bytes]:
    arm = answer.WhichOneof("response")
    if arm not in ("request_body", "response_body"):
        return []
    mutation = getattr(answer, arm).response.body_mutation
    return [mutation.streamed_response.body] if mutation.HasField("streamed_response") else []


def all_released(router: Router) -> bool:
    return all(
        load.requests == 0 and load.tokens == 0 for load in router.fleet.inflight.local().values()
    )


def full_duplex(msg: Message) -> Message:
    msg.protocol_config.request_body_mode = MODES[1]
    msg.protocol_config.response_body_mode = MODES[1]
    return msg


@FUZZ
@given(st.lists(message(), max_size=12))
@example(
    [headers("/v1/completions", {}, False), body(BODY, True), body(b"", True), body(b"", True)]
)
@example([full_duplex(headers("/v1/completions", {}, False)), body(BODY, True), body(BODY, True)])
@example([body(BODY, True), headers("/v1/completions", {}, True)])
@example(
    [headers("/v1/completions", {}, False)] + [body(b"x" * 40_000, False)] * 4 + [body(b"", True)]
)
@example(
    [
        headers("/v1/completions", {}, False),
        body(BODY, True),
        body(SSE, False, True),
        headers("", {":status": "200"}, False, True),
    ]
)
@example([headers("/v1/completions", {"content-length": "99999999999999999999"}, False)])
def test_any_message_order(messages: list[Message]) -> None:
    run_stream(ROUTER, messages)
    assert all_released(ROUTER), "a stream's pick outlived the stream"


def stream_of(
    path: str, data: bytes, split: Callable[[bytes], list[bytes]], mode: int
) -> list[Message]:
    start = headers(path, {}, False)
    start.protocol_config.request_body_mode = mode
    start.protocol_config.response_body_mode = mode
    chunks = split(data)
    return [start, *(body(c, i == len(chunks) - 1) for i, c in enumerate(chunks))]


@FUZZ
@given(st.sampled_from(corpus()), st.integers(1, 4096), st.sampled_from(MODES[:2]), st.booleans())
def test_corpus_bodies_in_any_chunking(
    seed: tuple[str, bytes], size: int, mode: int, truncated: bool
) -> None:
    """Every seed, cut into chunks of any size, in both modes; ``truncated`` streams end
    without an end of stream (the client went away): no answer is owed, nothing leaks."""
    name, data = seed
    messages = stream_of(
        path_of(name),
        data,
        lambda d: [d[i : i + size] for i in range(0, len(d), size)] or [b""],
        mode,
    )
    if truncated:
        messages[-1].request_body.end_of_stream = False
    run_stream(ROUTER, messages)
    assert all_released(ROUTER)
