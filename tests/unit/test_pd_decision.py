"""Prefill/decode disaggregation per request: the decode replica first, then the threshold on
its uncached prompt tokens, then the prefill replica, named in the answer's header; client
copies of that header never reach a replica."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import REGISTRY

from epp._proto import ext_proc_pb2
from epp.config import ConfigError, parse_config
from epp.extproc.stream import StreamHandler
from epp.observability import DISAGG_DECISIONS
from epp.router import Router
from epp.state import EndpointState
from epp.state.fleet import FleetState
from epp.state.memory import MemoryStore
from tests.unit.test_stream import BUFFERED, FULL_DUPLEX, body_msg, headers_msg

PREFILL = ("10.0.0.1:8000", "10.0.0.2:8000")
DECODE = ("10.0.0.3:8000", "10.0.0.4:8000")
HEADER = "x-prefiller-host-port"


def pd_config(threshold: int = 100, **decider: Any) -> dict[str, Any]:
    endpoints = [{"address": a, "role": "prefill"} for a in PREFILL] + [
        {"address": a, "role": "decode"} for a in DECODE
    ]
    return {
        "models": {"tiny": {"pools": ["main"]}},
        "pools": {"main": {"endpoints": endpoints}},
        "routing": {"fallbacks": 1, "explain": True},
        "scheduling": {
            "profile": "pd",
            "profiles": {
                "pd": [
                    {"plugin": "decode-filter"},
                    {"plugin": "prefix-cache-scorer", "weight": 2},
                    {"plugin": "queue-scorer", "weight": 1},
                    {"plugin": "max-score-picker"},
                    {
                        "plugin": "prefix-based-pd-decider",
                        "parameters": {"non_cached_tokens": threshold, **decider},
                    },
                ],
                "prefill": [
                    {"plugin": "prefill-filter"},
                    {"plugin": "prefix-cache-scorer", "weight": 2},
                    {"plugin": "queue-scorer", "weight": 1},
                    {"plugin": "max-score-picker"},
                ],
            },
        },
    }


async def pd_router(config: dict[str, Any]) -> Router:
    store = MemoryStore()
    for address in (*PREFILL, *DECODE):
        await store.put_endpoint(EndpointState(address, "main", True, scraped_at=1.0))
    return Router(parse_config(config), FleetState(store))


def route(
    router: Router, prompt: str, mode: int = BUFFERED, extra: dict[str, str] | None = None
) -> dict[str, str]:
    """The request headers epp sets and removes, as ``{name: value}`` (removed: ``"-"``)."""
    handler = StreamHandler(router)
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4}).encode()
    answers = [*handler.handle(headers_msg(mode=mode, extra=extra))]
    answers += handler.handle(body_msg(body))
    answer: ext_proc_pb2.ProcessingResponse = next(
        a for a in answers if a.HasField("request_body") or a.request_headers.HasField("response")
    )
    arm = "request_body" if answer.HasField("request_body") else "request_headers"
    mutation = getattr(answer, arm).response.header_mutation
    seen = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    seen.update((h, "-") for h in mutation.remove_headers)
    handler.settle()
    return seen


def counted(kind: str) -> float:
    list(DISAGG_DECISIONS.collect())  # folds the tallies into the counter
    value = REGISTRY.get_sample_value(
        "llm_d_inference_scheduler_disagg_decision_total", {"decision_type": kind}
    )
    return value or 0.0


@pytest.mark.parametrize("mode", [BUFFERED, FULL_DUPLEX])
async def test_long_uncached_prompts_are_disaggregated_short_ones_are_not(mode: int) -> None:
    router = await pd_router(pd_config(threshold=100))
    split, local = counted("prefill-decode"), counted("decode-only")
    long = route(router, "x " * 2000, mode)
    assert long["x-gateway-destination-endpoint"].split(",")[0] in DECODE
    assert all(a in DECODE for a in long["x-gateway-destination-endpoint"].split(","))
    assert long[HEADER] in PREFILL
    # The decode replica loads the KV: no prefill work counted there.
    decode = long["x-gateway-destination-endpoint"].split(",")[0]
    assert router.fleet.inflight.load(decode).prefill == 0
    short = route(router, "hi", mode)
    assert short["x-gateway-destination-endpoint"].split(",")[0] in DECODE
    assert HEADER not in short
    assert sum(router.fleet.inflight.load(a).prefill for a in DECODE) > 0
    assert counted("prefill-decode") == split + 1
    assert counted("decode-only") == local + 1


async def test_cached_prefix_on_the_decode_replica_keeps_it_local() -> None:
    router = await pd_router(pd_config(threshold=100))
    prompt = "a shared system prompt " * 200
    first = route(router, prompt)
    assert HEADER in first
    # The same prompt again: the decode replica now caches it, nothing left to move.
    again = route(router, prompt + " and a question")
    assert (
        again["x-gateway-destination-endpoint"].split(",")[0]
        == (first["x-gateway-destination-endpoint"].split(",")[0])
    )
    assert HEADER not in again
    explained = list(router.decisions.values())[-1]["disaggregation"]
    assert explained["decision_type"] == "decode-only"
    assert explained["uncached_tokens"] < 100


async def test_client_copies_of_the_header_are_removed_or_overwritten() -> None:
    router = await pd_router(pd_config(threshold=100))
    forged = {HEADER: "6.6.6.6:80", "x-gateway-prefill-endpoints": "6.6.6.6:80"}
    short = route(router, "hi", extra=forged)
    assert short[HEADER] == "-"
    assert short["x-gateway-prefill-endpoints"] == "-"
    long = route(router, "y " * 2000, extra=forged)
    assert long[HEADER] in PREFILL  # set (overwriting), and not also removed
    assert long["x-gateway-prefill-endpoints"] == "-"


async def test_gateway_header_name_and_zero_threshold() -> None:
    router = await pd_router(pd_config(threshold=0, header="x-gateway-prefill-endpoints"))
    seen = route(router, "hi")
    assert seen["x-gateway-prefill-endpoints"] in PREFILL
    assert HEADER not in seen


async def test_no_prefill_replica_serves_decode_only() -> None:
    config = pd_config(threshold=0)
    config["pools"]["main"]["endpoints"] = list(DECODE)
    router = await pd_router(config)
    seen = route(router, "x " * 2000)
    assert HEADER not in seen
    assert seen["x-gateway-destination-endpoint"].split(",")[0] in DECODE


def test_decider_must_name_another_profile_without_a_decider() -> None:
    config = pd_config()
    config["scheduling"]["profiles"]["pd"][-1]["parameters"]["prefill_profile"] = "nope"
    with pytest.raises(ConfigError, match="prefill_profile must name another profile"):
        parse_config(config)
    config = pd_config(header="x-other")
    with pytest.raises(ConfigError, match="x-prefiller-host-port"):
        parse_config(config)
