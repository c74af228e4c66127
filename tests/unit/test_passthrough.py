"""Pass-through paths (``routing.passthrough``): paths that are no inference API reach a ready
replica of the named pool, routed at the headers with the body unread; all others stay 404."""

from __future__ import annotations

import json

import pytest

from epp.config import ConfigError, RoutingConfig, parse_config
from epp.extproc.responses import CONTINUE_REQUEST_BODY
from epp.extproc.stream import StreamHandler
from epp.router import Router
from epp.state import EndpointState
from epp.state.fleet import FleetState
from epp.state.memory import MemoryStore
from tests.unit.test_stream import BUFFERED, FULL_DUPLEX, body_msg, destination, headers_msg

ENDPOINTS = ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]


def _config(passthrough: object) -> dict[str, object]:
    return {
        "models": {"tiny": {"pools": ["main"]}},
        "pools": {"main": {"endpoints": ENDPOINTS}, "aux": {"endpoints": ["127.0.0.1:9001"]}},
        "routing": {"passthrough": passthrough},
    }


async def _router(ready: tuple[str, ...] = tuple(ENDPOINTS)) -> Router:
    config = parse_config(_config({"/tokenize": "main", "/version": "main"}))
    store = MemoryStore()
    for addr in ENDPOINTS:
        await store.put_endpoint(EndpointState(addr, "main", addr in ready))
    return Router(config, FleetState(store))


def test_config_maps_prefixes_to_pools_longest_first() -> None:
    routing = parse_config(_config({"/tokenize": "main", "/tokenize/v2": "aux"})).routing
    assert routing.passthrough_pool("/tokenize") == "main"
    assert routing.passthrough_pool("/tokenize?x=1") == "main"
    assert routing.passthrough_pool("/tokenize/v2/a") == "aux"
    # A prefix is a path segment, not a string prefix.
    assert routing.passthrough_pool("/tokenizer") is None
    assert routing.passthrough_pool("/v1/secrets") is None
    assert RoutingConfig().passthrough_pool("/tokenize") is None


@pytest.mark.parametrize(
    ("passthrough", "problem"),
    [
        ({"tokenize": "main"}, "path prefix starting with '/'"),
        ({"/v1/chat/completions": "main"}, "inference API path"),
        ({"/tokenize": "nope"}, "must name a pool"),
        ({"/tokenize": 3}, "must name a pool"),
    ],
)
def test_bad_passthrough_is_refused_at_load(passthrough: object, problem: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(_config(passthrough))
    assert problem in str(refused.value)


@pytest.mark.parametrize("mode", [BUFFERED, FULL_DUPLEX])
async def test_routed_at_the_headers_body_let_through(mode: int) -> None:
    router = await _router()
    handler = StreamHandler(router)
    (answer,) = handler.handle(headers_msg("/tokenize", mode=mode))
    header, meta = destination(answer, "request_headers")
    assert header == meta
    assert header in ENDPOINTS
    assert handler.ticket is not None
    assert router.fleet.inflight.load(header).requests == 1
    body = json.dumps({"model": "tiny", "prompt": "hello"}).encode()
    answers = handler.handle(body_msg(body))
    if mode == BUFFERED:
        assert answers == (CONTINUE_REQUEST_BODY,)
    else:
        (echo,) = answers
        streamed = echo.request_body.response.body_mutation.streamed_response
        assert (streamed.body, streamed.end_of_stream) == (body, True)


async def test_idle_replicas_share_the_requests_and_busy_ones_are_avoided() -> None:
    router = await _router()
    picks = []
    for _ in range(6):
        handler = StreamHandler(router)
        (answer,) = handler.handle(headers_msg("/version", method="GET", eos=True))
        picks.append(destination(answer, "request_headers")[0])
        assert handler.ticket is not None
        router.finish(handler.ticket)
    assert sorted(set(picks)) == ENDPOINTS
    # Two requests held open on two replicas: the third goes to the idle one.
    held = []
    for _ in range(2):
        handler = StreamHandler(router)
        handler.handle(headers_msg("/version", method="GET", eos=True))
        assert handler.ticket is not None
        held.append(handler.ticket.endpoint)
    (answer,) = StreamHandler(router).handle(headers_msg("/version", method="GET", eos=True))
    assert destination(answer, "request_headers")[0] not in held


async def test_no_ready_replica_is_a_503_json_and_unlisted_paths_stay_404() -> None:
    router = await _router(ready=())
    (refused,) = StreamHandler(router).handle(headers_msg("/tokenize"))
    assert refused.immediate_response.status.code == 503
    error = json.loads(refused.immediate_response.body)["error"]
    assert error["code"] == "no_ready_endpoint"
    assert "/tokenize" in error["message"]
    (unknown,) = StreamHandler(await _router()).handle(headers_msg("/v1/secrets"))
    assert unknown.immediate_response.status.code == 404
    assert "routing.passthrough" in json.loads(unknown.immediate_response.body)["error"]["message"]
