"""Request parsing under arbitrary input: a 4xx :class:`RequestError` or a parsed request,
never another exception, whatever the bytes, their nesting or their encoding."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from epp.errors import RequestError
from epp.request import InferenceRequest, RequestPolicy, parse_request
from tests.unit.fuzz.harness import FUZZ, corpus, path_of

POLICY = RequestPolicy(objectives={"premium": 5})
MODELS = ("tiny", "other")
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings")
# Tokens that broke (or could break) JSON readers: non-standard literals, escapes that decode to
# lone surrogates, huge numbers, brackets that open deep nesting.
TOKENS = [
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"1e999",
    b"-0",
    b"1" + b"0" * 5000,
    b'"\\ud800"',
    b'"\\u0000"',
    b"[" * 2000,
    b"{" * 2000,
    b'{"a":' * 2000,
    b"\xff",
    b"\xc3(",
    b"\x00",
    b'"model"',
    b'"tiny"',
    b"null",
    b"true",
    b"[]",
    b"{}",
    b",",
    b":",
    b'"',
    b"\\",
]


def parse(path: str, body: bytes, headers: dict[str, str] | None = None) -> InferenceRequest | None:
    """Parse; a refusal must be a client error with a JSON body, anything else escapes."""
    try:
        return parse_request(path, headers or {}, body, POLICY, MODELS)
    except RequestError as error:
        refusal = error
    assert 400 <= refusal.status < 500, refusal.status
    assert json.loads(refusal.body())["error"]["message"]
    return None


def json_values() -> st.SearchStrategy[object]:
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
        ),
        max_leaves=30,
    )


def request_like() -> st.SearchStrategy[dict[str, object]]:
    """Bodies close to real ones, so the typed field readers run, not only the JSON decoder."""
    content = st.text() | st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio", "x"])})
        | st.dictionaries(st.sampled_from(["type", "text", "image_url", "refusal"]), json_values()),
        max_size=3,
    )
    message = st.fixed_dictionaries(
        {"role": st.text(max_size=6) | st.integers(), "content": content | json_values()}
    )
    return st.fixed_dictionaries(
        {"model": st.sampled_from(["tiny", "other", "nope", ""]) | json_values()},
        optional={
            "prompt": json_values() | st.lists(st.integers(), max_size=5),
            "input": json_values() | st.lists(message, max_size=3),
            "messages": st.lists(message, max_size=4) | json_values(),
            "instructions": json_values(),
            "max_tokens": json_values(),
            "max_completion_tokens": json_values(),
            "max_output_tokens": json_values(),
            "stream": json_values(),
        },
    )


@FUZZ
@given(st.sampled_from(PATHS), st.binary(max_size=2048))
@example("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}')
@example("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}')
@example("/v1/completions", b'{"model": "tiny", "prompt": "x", "model": "other"}')
@example(
    "/v1/chat/completions",
    b'{"model": "tiny", "messages": [{"role": "user", "content": '
    + b"[" * 50_000
    + b"]" * 50_000
    + b"}]}",
)
def test_arbitrary_bytes(path: str, body: bytes) -> None:
    parse(path, body)


@FUZZ
@given(st.sampled_from(PATHS), request_like())
def test_request_shaped_bodies(path: str, data: dict[str, object]) -> None:
    body = json.dumps(data, allow_nan=True).encode()
    request = parse(path, body)
    if request is not None:
        assert request.model in MODELS
        assert request.prompt_tokens() >= 0
        assert request.output_tokens() >= 0
        # What prefix scorers do with the prompt: it must encode.
        request.prompt.encode()


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    """A seed from the corpus with a few byte-level edits: truncation, insertion of a token
    from :data:`TOKENS`, deletion, or a bit flip."""
    name, seed = draw(st.sampled_from(corpus()))
    body = bytearray(seed)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(body)))
        edit = draw(st.sampled_from(["truncate", "insert", "delete", "flip"]))
        if edit == "truncate":
            del body[at:]
        elif edit == "insert":
            body[at:at] = draw(st.sampled_from(TOKENS))
        elif edit == "delete":
            del body[at : at + draw(st.integers(1, 16))]
        elif body:
            body[min(at, len(body) - 1)] ^= 1 << draw(st.integers(0, 7))
    return path_of(name), bytes(body)


@FUZZ
@given(mutated())
def test_mutated_seed_bodies(case: tuple[str, bytes]) -> None:
    path, body = case
    parse(path, body)


@pytest.mark.parametrize(("name", "body"), corpus(), ids=[n for n, _ in corpus()])
def test_seed_corpus(name: str, body: bytes) -> None:
    """Each seed parses or is refused with a 4xx, quickly (no quadratic path). Measured in this
    thread's CPU time: a busy machine delays the parse, it does not make it do more work."""
    started = time.thread_time()
    parse(path_of(name), body)
    assert time.thread_time() - started < 1.0
