"""SSE decoding and usage parsing under adversarial chunking (every split, random splits)."""

from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from epp.extproc.sse import SseDecoder
from epp.extproc.usage import carries_token, decode, is_usage_only, usage_of
from epp.lifecycle import Usage


def _chunk(text: str, usage: dict[str, object] | None = None) -> bytes:
    body: dict[str, object] = {"choices": [{"index": 0, "delta": {"content": text}}]}
    if usage is not None:
        body = {"choices": [], "usage": usage}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


USAGE = {
    "prompt_tokens": 17,
    "completion_tokens": 3,
    "total_tokens": 20,
    "prompt_tokens_details": {"cached_tokens": 16},
}
# Multi-byte UTF-8 text, a comment line, CRLF and CR line ends, a multi-line data field.
STREAM = (
    _chunk("héllo 👋")
    + b": keep-alive comment\n\n"
    + b'data: {"choices":[{"index":0,\r\ndata: "text":"x"}]}\r\n\r\n'
    + b'data: {"choices":[{"index":0,"text":"y"}]}\r\r'
    + _chunk("", USAGE)
    + b"data: [DONE]\n\n"
)
EXPECTED = [
    json.dumps({"choices": [{"index": 0, "delta": {"content": "héllo 👋"}}]}),
    "",
    '{"choices":[{"index":0,\n"text":"x"}]}',
    '{"choices":[{"index":0,"text":"y"}]}',
    json.dumps({"choices": [], "usage": USAGE}),
    "[DONE]",
]


def _decode(chunks: list[bytes]) -> tuple[list[str], bytes]:
    decoder = SseDecoder()
    events = [e for c in chunks for e in decoder.feed(c)]
    return [e.data for e in events], b"".join(e.raw for e in events) + decoder.pending()


def test_whole_stream_decodes() -> None:
    data, raw = _decode([STREAM])
    assert data == EXPECTED
    assert raw == STREAM  # raw bytes of the events reproduce the stream exactly


def test_every_single_split_point() -> None:
    for i in range(len(STREAM) + 1):
        assert _decode([STREAM[:i], STREAM[i:]]) == (EXPECTED, STREAM), i


def test_byte_by_byte() -> None:
    assert _decode([STREAM[i : i + 1] for i in range(len(STREAM))]) == (EXPECTED, STREAM)


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=40))
def test_random_splits(cuts: list[int]) -> None:
    points = [0, *sorted(cuts), len(STREAM)]
    chunks = [STREAM[a:b] for a, b in itertools.pairwise(points)]
    assert _decode(chunks) == (EXPECTED, STREAM)


def test_incomplete_event_is_held_until_its_blank_line() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b"data: {}\n") == []
    assert decoder.pending() == b"data: {}\n"
    assert [e.data for e in decoder.feed(b"\n")] == ["{}"]


def test_usage_shapes() -> None:
    assert usage_of(decode(_chunk("", USAGE)[6:])) == Usage(17, 3, 16)
    no_details = {"usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    assert usage_of(no_details) == Usage(5, 2, None)
    responses_api = {
        "type": "response.completed",
        "response": {
            "usage": {
                "input_tokens": 9,
                "output_tokens": 4,
                "input_tokens_details": {"cached_tokens": 0},
            }
        },
    }
    assert usage_of(responses_api) == Usage(9, 4, 0)
    bad: object
    for bad in (None, [], {"usage": None}, {"usage": {"prompt_tokens": True}}, "[DONE]"):
        assert usage_of(bad) is None


def test_token_events() -> None:
    role_only = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    assert not carries_token(role_only)
    assert carries_token({"choices": [{"index": 0, "text": "a"}]})
    assert carries_token({"choices": [{"delta": {"reasoning_content": "hm"}}]})
    assert carries_token({"type": "response.output_text.delta", "delta": "a"})
    assert not carries_token({"choices": [], "usage": USAGE})
    assert is_usage_only({"choices": [], "usage": USAGE})
    assert not is_usage_only({"choices": [{"text": "a"}], "usage": USAGE})


def test_a_chunk_that_is_one_event_decodes_like_a_split_one() -> None:
    # The one-event-a-chunk fast path and the general path agree, data and raw bytes.
    for raw in (b'data: {"a": 1}\n\n', b"data:x\n\n", b"data: a\ndata: b\n\n", b": ping\n\n"):
        whole = SseDecoder().feed(raw)
        split = SseDecoder()
        pieces = split.feed(raw[:3]) + split.feed(raw[3:])
        assert whole == pieces, raw
        assert [e.raw for e in whole] == [raw]
