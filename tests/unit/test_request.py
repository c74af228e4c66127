"""OpenAI body parsing: what scheduling sees, and a 400 naming the field for every bad input."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import epp.request.decode as decode_module
from epp.errors import RequestError
from epp.request import (
    TEXT_PART_SEPARATOR,
    ChatMessage,
    ContentPart,
    RequestPolicy,
    api_for_path,
    check_headers,
    hashing_text,
    parse_request,
    session_key,
)

# Headers set by a trusted gateway (request.trusted_headers): what parsing makes of them.
POLICY = RequestPolicy(objectives={"critical": 5, "batch": -1}, trusted_headers=True)


def parse(path: str, body: object, **headers: str):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(path, headers, raw, POLICY)


def refused(path: str, body: object, **headers: str) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(path, body, **headers)
    return info.value


@pytest.mark.parametrize(
    ("path", "api"),
    [
        ("/v1/completions", "completions"),
        ("/v1/chat/completions", "chat"),
        ("/v1/chat/completions?x=1", "chat"),
        ("/v1/responses", "responses"),
        ("/v1/embeddings", "embeddings"),
        ("/v1/models", None),
        # Matched exactly: a path that merely ends like an API is not one.
        ("/openai/v1/chat/completions", None),
        ("/v1/../admin/../v1/chat/completions", None),
        ("/v1//completions", None),
        ("/v1/chat%2Fcompletions", None),
        ("/v1/embeddings/", None),
        ("/admin/v1/completions", None),
    ],
)
def test_api_by_exact_path(path: str, api: str | None) -> None:
    assert api_for_path(path) == api


def test_completion_fields() -> None:
    req = parse(
        "/v1/completions",
        {"model": "m", "prompt": "hello", "max_tokens": 7, "stream": True},
        **{"x-request-id": "abc", "x-session-token": "s1", "x-priority": "3"},
    )
    assert (req.model, req.prompt, req.max_tokens, req.stream) == ("m", "hello", 7, True)
    assert (req.request_id, req.session, req.priority) == ("abc", session_key(b"s1"), 3)


def test_token_prompts_are_kept_as_ids() -> None:
    assert parse("/v1/completions", {"model": "m", "prompt": [1, 2, 3]}).prompt_token_ids == (
        1,
        2,
        3,
    )
    assert parse("/v1/completions", {"model": "m", "prompt": [[1], [2]]}).prompt_token_ids == (1, 2)


def test_chat_later_turn_extends_earlier_turn_text() -> None:
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    second = [
        *first,
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ]
    a = parse("/v1/chat/completions", {"model": "m", "messages": first}).prompt
    b = parse("/v1/chat/completions", {"model": "m", "messages": second}).prompt
    assert b.startswith(a)
    assert len(b) > len(a)


def test_chat_content_parts_and_max_completion_tokens() -> None:
    req = parse(
        "/v1/chat/completions",
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}],
            "max_completion_tokens": 9,
            "max_tokens": 3,
        },
    )
    assert "abc" in req.prompt
    assert req.max_tokens == 9


def test_responses_and_embeddings() -> None:
    req = parse(
        "/v1/responses",
        {"model": "m", "input": "q", "instructions": "sys", "max_output_tokens": 4},
    )
    assert req.prompt.index("sys") < req.prompt.index("q")
    assert req.max_tokens == 4
    assert parse("/v1/embeddings", {"model": "e", "input": ["a", "b"]}).prompt == "a\nb"


def test_objective_header_maps_to_priority() -> None:
    headers = {"x-gateway-inference-objective": "batch"}
    assert parse("/v1/completions", {"model": "m", "prompt": "x"}, **headers).priority == -1


def test_request_id_generated_when_absent() -> None:
    a = parse("/v1/completions", {"model": "m", "prompt": "x"}).request_id
    b = parse("/v1/completions", {"model": "m", "prompt": "x"}).request_id
    assert a
    assert b
    assert a != b


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", b"\xff\xfe", None),
        ("/v1/completions", [1, 2], None),
        ("/v1/completions", {"prompt": "x"}, "model"),
        ("/v1/completions", {"model": 3, "prompt": "x"}, "model"),
        ("/v1/completions", {"model": "", "prompt": "x"}, "model"),
        ("/v1/completions", {"model": "m"}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": {"a": 1}}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": ["hi"]}, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"content": 5}]}, "messages"),
        ("/v1/responses", {"model": "m", "input": 5}, "input"),
        # Found by CI's long fuzz run: an unhashable part type crashed the parser.
        (
            "/v1/responses",
            {"model": "m", "input": [{"role": "", "content": [{"type": []}]}]},
            "input",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": [{"type": {"a": 1}}]}]},
            "messages",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(path: str, body: object, param: str | None) -> None:
    error = refused(path, body)
    assert error.status == 400
    assert error.param == param
    payload = json.loads(error.body())
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["message"]


def test_a_path_that_is_no_inference_api_is_404() -> None:
    error = refused("/v1/unknown", {"model": "m"})
    assert error.status == 404
    assert error.code == "unknown_url"
    assert "POST /v1/unknown" in error.message


DEEP = 100_000


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"model": "m", "prompt": "x", "t": NaN}', "'NaN' is not a JSON number"),
        (b'{"model": "m", "prompt": "x", "t": -Infinity}', "'-Infinity' is not a JSON number"),
        (b'{"model": "m", "prompt": "x", "t": 1e999}', "out of range"),
        (b'{"model": "m", "prompt": "x", "n": 1' + b"0" * 5000 + b"}", "not valid JSON"),
        (b'{"model": "m", "prompt": "x", "model": "n"}', "duplicate key 'model'"),
        (b'{"model": "m", "prompt": [{"a": 1, "a": 2}]}', "duplicate key 'a'"),
        # Duplicates the fast decoder's quote count must not miss: spaced keys, quotes in
        # strings, and \u0022 escapes that yield quotes without a '"' in the text.
        (b'{"model" : "m", "prompt": "x", "model" :"n"}', "duplicate key 'model'"),
        (b'{"model": "m", "prompt": "say \\"hi\\"", "prompt": "y"}', "duplicate key 'prompt'"),
        (b'{"model": "m", "a": 1, "a": 2, "prompt": "\\u0022\\u0022"}', "duplicate key 'a'"),
        (b'{"model": "m", "prompt": "x", "m": {"k": [], "k": null}}', "duplicate key 'k'"),
        (b'{"model": "m", "prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", "too deeply"),
        (b'{"x": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}", "too deeply"),
        (b'{"model": "m", "prompt": "a\\ud800b"}', "lone UTF-16 surrogate"),
        (b'{"model": "m", "prompt": "\xff"}', "not valid JSON"),
        (b"[1]", "got an array"),
        (b'"m"', "got a string"),
        (b"null", "got null"),
        (b"7", "got a number"),
    ],
)
def test_bodies_json_leaves_undefined_are_400(body: bytes, needle: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_request("/v1/completions", {}, body, POLICY)
    assert info.value.status == 400
    assert needle in info.value.message


def test_a_surrogate_pair_is_one_character() -> None:
    request = parse_request(
        "/v1/completions", {}, b'{"model": "m", "prompt": "\\ud83d\\ude00"}', POLICY
    )
    assert request.prompt == "\U0001f600"


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({":path": "/v1/completions", "content-type": "application/json"}, None),
        (
            {":path": "/v1/chat/completions", "content-type": "application/json; charset=utf-8"},
            None,
        ),
        ({":path": "/v1/completions", "content-type": "application/vnd.api+json"}, None),
        ({":path": "/v1/completions"}, None),
        ({":path": "/v1/completions", "content-length": "1000"}, None),
        ({":path": "/v1/completions", "content-length": "1001"}, 413),
        ({":path": "/v1/completions", "content-type": "text/plain"}, 415),
        ({":path": "/v1/completions", "content-type": "application/x-www-form-urlencoded"}, 415),
        ({":path": "/v2/secrets"}, 404),
    ],
)
def test_headers_alone_can_refuse(headers: dict[str, str], status: int | None) -> None:
    error = check_headers(headers, max_body_bytes=1000)
    assert (None if error is None else error.status) == status


def test_bad_priority_header() -> None:
    assert (
        refused("/v1/completions", {"model": "m", "prompt": "x"}, **{"x-priority": "hi"}).status
        == 400
    )


def test_chat_messages_stay_structured() -> None:
    content = [
        {"type": "text", "text": "look"},
        {"type": "text"},
        {"type": "image_url", "image_url": {"url": "https://x/a.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}},
        "plain",
    ]
    req = parse(
        "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": content}]}
    )
    (message,) = req.messages
    assert message == ChatMessage(
        "user",
        (
            ContentPart("text", "look"),
            ContentPart("image", "https://x/a.png"),
            ContentPart("other", '{"data": "AAA", "format": "wav"}'),
            ContentPart("text", "plain"),
        ),
    )
    assert not message.text_only
    assert message.text() == "look\nplain"
    assert req.prompt == hashing_text(req.messages)


def test_text_parts_join_with_one_separator_in_hashing_and_template_input() -> None:
    message = ChatMessage(
        "user", (ContentPart("text", "a"), ContentPart("text", ""), ContentPart("text", "b"))
    )
    assert message.text() == f"a{TEXT_PART_SEPARATOR}b"
    assert message.template_content(as_parts=False) == message.text()
    # Templates that iterate over parts see every text part, the empty one included (as vLLM).
    assert message.template_content(as_parts=True) == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": ""},
        {"type": "text", "text": "b"},
    ]
    assert message.text() in hashing_text([message])


def test_non_string_text_part_is_a_400() -> None:
    with pytest.raises(RequestError) as info:
        parse(
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            },
        )
    assert info.value.status == 400


@pytest.mark.parametrize(
    "body",
    [
        {"model": "nope"},
        {"model": "nope", "prompt": {"not": "a prompt"}},
        {"model": "nope", "prompt": "x", "max_tokens": "many"},
    ],
)
def test_an_unknown_model_is_404_before_the_rest_of_the_body_is_checked(
    body: dict[str, object],
) -> None:
    with pytest.raises(RequestError) as info:
        parse_request("/v1/completions", {}, json.dumps(body).encode(), POLICY, ["tiny"])
    assert (info.value.status, info.value.code) == (404, "model_not_found")
    assert "tiny" in info.value.message
    # A known model with the same body is refused for the body itself.
    known_body = json.dumps({**body, "model": "tiny"}).encode()
    with pytest.raises(RequestError) as known:
        parse_request("/v1/completions", {}, known_body, POLICY, ["tiny"])
    assert known.value.status == 400


# JSON documents as (kind, content) trees whose objects may repeat a key, written with or
# without spaces and with quotes escaped as \" or \u0022: what the fast decoder must get right.
_KEYS = st.sampled_from(["a", "b", 'q"', "c\\", "model"]) | st.text(max_size=3)
_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from('ab"\\\n é:'), max_size=6)
)
_TREES = st.recursive(
    _LEAVES,
    lambda inner: (
        st.tuples(st.just("list"), st.lists(inner, max_size=4))
        | st.tuples(st.just("object"), st.lists(st.tuples(_KEYS, inner), max_size=4))
    ),
    max_leaves=16,
)


def _write(tree: object, colon: str, u0022: bool) -> str:
    if isinstance(tree, tuple) and tree[0] == "list":
        return "[" + ",".join(_write(v, colon, u0022) for v in tree[1]) + "]"
    if isinstance(tree, tuple):
        pairs = (_write(k, colon, u0022) + colon + _write(v, colon, u0022) for k, v in tree[1])
        return "{" + ",".join(pairs) + "}"
    text = json.dumps(tree, ensure_ascii=False)
    return text.replace('\\"', "\\u0022") if u0022 and isinstance(tree, str) else text


@given(
    st.lists(st.tuples(_KEYS, _TREES), max_size=5),
    st.sampled_from([":", " : ", ":\n"]),
    st.booleans(),
)
def test_the_fast_decode_answers_only_as_the_strict_one_does(
    pairs: list[tuple[str, object]], colon: str, u0022: bool
) -> None:
    body = _write(("object", pairs), colon, u0022).encode()
    fast = decode_module._decode_fast(body)
    if fast is not None:
        assert fast == decode_module._decode_strict(body)
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        assert fast is None  # a duplicate is never accepted


def test_the_fast_decode_takes_ordinary_bodies() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "say \\"hi\\": now"}]}'
    assert decode_module._decode_fast(body) == json.loads(body)
