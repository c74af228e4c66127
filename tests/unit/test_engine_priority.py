"""request.engine_priority: the objective's priority written into the forwarded body as vLLM's
`priority` (negated: vLLM serves lower values first), in both body modes, in the one rewrite
that also carries the usage option; client copies overwritten."""

from __future__ import annotations

import json
from typing import Any

import pytest

from epp.config import ConfigError, parse_config
from epp.extproc import stream
from epp.extproc.stream import StreamHandler
from epp.request import InferenceRequest, set_engine_priority
from epp.router import Router
from epp.state import EndpointMetrics, EndpointState
from epp.state.fleet import FleetState
from epp.state.memory import MemoryStore
from tests.unit.test_stream import BUFFERED, FULL_DUPLEX, body_msg, headers_msg

ENDPOINT = "127.0.0.1:8001"


def request(priority: int) -> InferenceRequest:
    return InferenceRequest("id", "/v1/completions", "completions", "tiny", "hi", priority=priority)


@pytest.mark.parametrize(
    ("priority", "body", "changed", "after"),
    [
        (2, {}, True, {"priority": -2}),
        (-1, {}, True, {"priority": 1}),
        (0, {}, False, {}),  # vLLM's default: no field needed
        (3, {"priority": -3}, False, {"priority": -3}),
        (3, {"priority": -100}, True, {"priority": -3}),  # a client's own copy is overwritten
        (0, {"priority": -100}, True, {}),
        (-1, {"priority": True}, True, {"priority": 1}),  # True == 1, but not an integer
        (0, {"priority": 0.0}, True, {}),
    ],
)
def test_set_engine_priority(
    priority: int, body: dict[str, Any], changed: bool, after: dict[str, Any]
) -> None:
    data = {"model": "tiny", **body}
    assert set_engine_priority(request(priority), data) is changed
    assert data == {"model": "tiny", **after}


async def make_router(**extra: Any) -> Router:
    config = parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": [ENDPOINT]}},
            "request": {
                "objectives": {"critical": 10, "batch": -1},
                "engine_priority": True,
                "trusted_headers": True,  # the objective header is set by a gateway in front
            },
            # The endpoint's metrics are never scraped here: no shedding of batch for that.
            "admission": {"mode": "off"},
            **extra,
        }
    )
    store = MemoryStore()
    await store.put_endpoint(EndpointState(ENDPOINT, "main", True, EndpointMetrics(), 1.0))
    return Router(config, FleetState(store))


def forwarded(router: Router, mode: int, body: dict[str, Any], objective: str) -> dict[str, Any]:
    """The body epp forwards upstream for a request of this objective."""
    handler = StreamHandler(router)
    raw = json.dumps(body).encode()
    handler.handle(
        headers_msg(
            mode=mode, extra={"x-gateway-inference-objective": objective} if objective else {}
        )
    )
    answers = handler.handle(body_msg(raw))
    if mode == FULL_DUPLEX:
        sent = b"".join(
            a.request_body.response.body_mutation.streamed_response.body for a in answers[1:]
        )
    else:
        mutation = answers[0].request_body.response.body_mutation
        sent = mutation.body if mutation.HasField("body") else raw
    result: dict[str, Any] = json.loads(sent)
    return result


@pytest.mark.parametrize("mode", [BUFFERED, FULL_DUPLEX], ids=["buffered", "fullduplex"])
async def test_the_objectives_priority_reaches_the_engine_negated(mode: int) -> None:
    router = await make_router()
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    assert forwarded(router, mode, body, "critical")["priority"] == -10
    assert forwarded(router, mode, body, "batch")["priority"] == 1
    # The default objective (priority 0) is vLLM's default: the body goes as it came.
    assert forwarded(router, mode, body, "") == body
    # A client's own priority never reaches the engine.
    assert forwarded(router, mode, {**body, "priority": -1000}, "batch")["priority"] == 1
    assert "priority" not in forwarded(router, mode, {**body, "priority": -1000}, "")


@pytest.mark.parametrize("mode", [BUFFERED, FULL_DUPLEX], ids=["buffered", "fullduplex"])
async def test_one_rewrite_carries_priority_and_the_usage_option(mode: int) -> None:
    router = await make_router(routing={"inject_stream_usage": True})
    body = {"model": "tiny", "prompt": "hello", "stream": True, "stream_options": {"x": 1}}
    sent = forwarded(router, mode, body, "critical")
    assert sent == {**body, "priority": -10, "stream_options": {"x": 1, "include_usage": True}}


async def test_off_by_default_the_clients_body_passes_unchanged() -> None:
    router = await make_router(request={"objectives": {"critical": 10}})
    body = {"model": "tiny", "prompt": "hello", "priority": 7}
    assert forwarded(router, BUFFERED, body, "critical") == body


async def test_a_body_too_deep_to_rewrite_is_refused_rather_than_forwarded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A body parsed near the recursion limit cannot be written back (whether it can depends on
    the stack depth at hand, so the serialiser's RecursionError is forced here): with a
    priority to set, forwarding it as it is would hand the engine the client's own priority."""
    router = await make_router()
    handler = StreamHandler(router)
    handler.handle(headers_msg(extra={"x-gateway-inference-objective": "critical"}))

    dumps = json.dumps

    def too_deep(data: Any, **kwargs: Any) -> str:
        if isinstance(data, dict) and "model" in data:  # the request body, not the error's
            raise RecursionError
        return dumps(data, **kwargs)

    monkeypatch.setattr(stream.json, "dumps", too_deep)
    (answer,) = handler.handle(body_msg(b'{"model":"tiny","prompt":"x","priority":-99}'))
    immediate = answer.immediate_response
    assert immediate.status.code == 400
    assert b"too deeply" in immediate.body


def test_engine_priority_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError, match=r"request\.engine_priority"):
        parse_config(
            {
                "models": {"tiny": {"pools": ["main"]}},
                "pools": {"main": {"endpoints": [ENDPOINT]}},
                "request": {"engine_priority": "yes"},
            }
        )
