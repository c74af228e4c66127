"""OpenAI body parsing: what scheduling sees, and a 400 naming the field for every bad input."""

from __future__ import annotations

import json

import pytest

from epp.errors import RequestError
from epp.request import RequestPolicy, api_for_path, parse_request

POLICY = RequestPolicy(objectives={"critical": 5, "batch": -1})


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
        ("/openai/v1/chat/completions?x=1", "chat"),
        ("/v1/responses", "responses"),
        ("/v1/embeddings/", "embeddings"),
        ("/v1/models", None),
    ],
)
def test_api_by_path_suffix(path: str, api: str | None) -> None:
    assert api_for_path(path) == api


def test_completion_fields() -> None:
    req = parse(
        "/v1/completions",
        {"model": "m", "prompt": "hello", "max_tokens": 7, "stream": True},
        **{"x-request-id": "abc", "x-session-token": "s1", "x-priority": "3"},
    )
    assert (req.model, req.prompt, req.max_tokens, req.stream) == ("m", "hello", 7, True)
    assert (req.request_id, req.session, req.priority) == ("abc", "s1", 3)


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
        ("/v1/unknown", {"model": "m"}, None),
    ],
)
def test_bad_input_is_a_400_naming_the_field(path: str, body: object, param: str | None) -> None:
    error = refused(path, body)
    assert error.status == 400
    assert error.param == param
    payload = json.loads(error.body())
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["message"]


def test_bad_priority_header() -> None:
    assert (
        refused("/v1/completions", {"model": "m", "prompt": "x"}, **{"x-priority": "hi"}).status
        == 400
    )
