"""Explaining decisions: scores in envoy.lb metadata and the /debug views on the metrics port."""

from __future__ import annotations

import json

from aiohttp.test_utils import TestClient, TestServer

from epp.admin import build_app
from epp.config import parse_config
from epp.extproc.stream import StreamHandler
from epp.state import EndpointState
from tests.unit.test_stream import BODY, body_msg, headers_msg, make_router


async def explaining_router():  # type: ignore[no-untyped-def]
    router = await make_router()
    router.config = parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]}},
            "routing": {"explain": True},
        }
    )
    return router


async def test_scores_ride_in_metadata_and_are_kept_by_request_id() -> None:
    router = await explaining_router()
    handler = StreamHandler(router)
    handler.handle(headers_msg(extra={"x-request-id": "why-1"}))
    (answer,) = handler.handle(body_msg(BODY))
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    scores = json.loads(lb["x-epp-scores"].string_value)
    assert set(scores) == {"127.0.0.1:8001", "127.0.0.1:8002"}
    assert scores["127.0.0.1:8002"]["total"] > scores["127.0.0.1:8001"]["total"]
    assert router.decisions["why-1"]["endpoints"][0] == "127.0.0.1:8002"


async def test_no_scores_when_not_explaining() -> None:
    router = await make_router()
    handler = StreamHandler(router)
    handler.handle(headers_msg())
    (answer,) = handler.handle(body_msg(BODY))
    assert "x-epp-scores" not in answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert not router.decisions


async def test_debug_views() -> None:
    router = await explaining_router()
    handler = StreamHandler(router)
    handler.handle(headers_msg(extra={"x-request-id": "why-2"}))
    handler.handle(body_msg(BODY))
    async with TestClient(TestServer(build_app(router))) as client:
        found = await (await client.get("/debug/decisions/why-2")).json()
        assert found["scores"]["127.0.0.1:8002"]["inflight-load-scorer"] == 3.0  # weight x 1
        missing = await client.get("/debug/decisions/nope")
        assert missing.status == 404
        endpoints = await (await client.get("/debug/endpoints")).json()
        assert endpoints["127.0.0.1:8002"]["in_flight"]["requests"] == 1
        assert endpoints["127.0.0.1:8001"]["metrics"]["waiting"] == 10
        metrics = await (await client.get("/metrics")).text()
        assert "epp_endpoint_picks_total" in metrics


async def test_debug_endpoints_is_strict_json_for_an_endpoint_never_scraped() -> None:
    """Python's json writes ``Infinity`` for the age of an endpoint never scraped, which no
    strict parser (jq, browsers, Go) accepts: it must be null."""
    router = await make_router()
    await router.fleet.store.put_endpoint(EndpointState("127.0.0.1:8003", "main", False))
    async with TestClient(TestServer(build_app(router))) as client:
        text = await (await client.get("/debug/endpoints")).text()

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in /debug/endpoints: {text}")

    endpoints = json.loads(text, parse_constant=refuse)
    assert endpoints["127.0.0.1:8003"]["age_seconds"] is None
    assert endpoints["127.0.0.1:8001"]["age_seconds"] > 0
