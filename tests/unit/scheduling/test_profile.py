"""The plugins together, configured from YAML and driven through the router."""

from __future__ import annotations

import json
from typing import Any

import pytest

from epp.config import ConfigError, parse_config
from epp.request import InferenceRequest, RequestPolicy, parse_request, session_key
from epp.router import Router
from epp.scheduling import build_profile
from epp.scheduling.scorers.session import SESSIONS
from epp.state import EndpointMetrics, EndpointState
from epp.state.fleet import FleetState
from tests.unit.scheduling.common import text

E = {n: f"10.0.0.{n}:8000" for n in range(1, 6)}
ROOMY = {"num_gpu_blocks": 10_001, "block_size": 16, "kv_usage": 0.1}

CONFIG: dict[str, Any] = {
    "models": {"base": {"pools": ["gpu"]}, "ad": {"pools": ["gpu"], "lora": True}},
    "pools": {
        "gpu": {
            "endpoints": [E[1], E[2], E[3], E[4], {"address": E[5], "weight": 2.0}],
        }
    },
    "request": {"session_header": "x-conversation"},
    "routing": {"explain": True},
    "scheduling": {
        "plugins": [
            {"name": "prefix", "type": "prefix-cache-scorer", "parameters": {"max_blocks": 512}},
            {"name": "headroom", "type": "kv-headroom-filter"},
            {
                "name": "session",
                "type": "session-affinity-scorer",
                "parameters": {"ttl_seconds": 60},
            },
        ],
        "profile": "cache-aware",
        "profiles": {
            "cache-aware": [
                {"plugin": "ready-endpoint-filter"},
                {"plugin": "lora-filter"},
                {"plugin": "headroom"},
                {"plugin": "prefix", "weight": 3},
                {"plugin": "session", "weight": 2},
                {"plugin": "lora-affinity-scorer", "weight": 1},
                {"plugin": "capacity-scorer", "weight": 1},
                {"plugin": "queue-scorer", "weight": 2},
                {"plugin": "kv-cache-utilization-scorer", "weight": 2},
                {"plugin": "max-score-picker"},
            ]
        },
    },
}


async def router_with(metrics: dict[str, dict[str, Any]]) -> Router:
    fleet = FleetState()
    for address, values in metrics.items():
        ready = values.pop("ready", True)
        state = EndpointState(address, "gpu", ready, EndpointMetrics(**values), 1.0)
        await fleet.store.put_endpoint(state)
    return Router(parse_config(CONFIG), fleet)


def completion(model: str, prompt: str) -> InferenceRequest:
    body = json.dumps({"model": model, "prompt": prompt}).encode()
    return parse_request("/v1/completions", {}, body, RequestPolicy())


def chat(model: str, turns: list[str], session: str | None = None) -> InferenceRequest:
    messages = [{"role": "system", "content": text("You are a helpful assistant.", 2000)}]
    messages += [{"role": "user", "content": turn} for turn in turns]
    body = json.dumps({"model": model, "messages": messages}).encode()
    headers = {"x-conversation": session} if session else {}
    return parse_request("/v1/chat/completions", headers, body, RequestPolicy("x-conversation"))


def route(router: Router, request: InferenceRequest) -> list[str]:
    decision, ticket = router.route(request)
    router.finish(ticket)
    return [e.address for e in decision.endpoints]


def survivors(router: Router, request: InferenceRequest) -> set[str]:
    """Endpoints that passed every filter (the ones the explanation scores)."""
    decision, ticket = router.route(request)
    router.finish(ticket)
    assert decision.scores is not None
    return set(decision.scores)


async def test_lora_and_headroom_filters_narrow_the_candidates() -> None:
    router = await router_with(
        {
            E[1]: {**ROOMY, "running_loras": {"ad"}, "waiting_loras": {"ad"}, "max_loras": 2},
            E[2]: {**ROOMY, "running_loras": {"p", "q"}, "max_loras": 2},  # no slot for "ad"
            E[3]: {"num_gpu_blocks": 1001, "block_size": 16, "kv_usage": 0.99},  # 10 free blocks
            E[4]: {**ROOMY, "ready": False},
            E[5]: {**ROOMY, "max_loras": 2},
        }
    )
    long_prompt = chat("ad", [text("question", 4000)])  # ~1500 tokens: 94 blocks
    assert survivors(router, long_prompt) == {E[1], E[5]}
    short = completion("ad", "Say hi.")
    assert survivors(router, short) == {E[1], E[3], E[5]}
    assert survivors(router, completion("base", "Say hi.")) == {E[1], E[2], E[3], E[5]}


async def test_a_conversation_stays_on_one_endpoint_and_moves_when_it_goes_down() -> None:
    router = await router_with({E[n]: dict(ROOMY) for n in range(1, 6)})
    turns = [text(f"turn {i}", 300) for i in range(6)]
    first = route(router, chat("base", turns[:1], session="conv-1"))[0]
    for n in range(2, 7):
        assert route(router, chat("base", turns[:n], session="conv-1"))[0] == first
    assert router.fleet.states.get(SESSIONS).get(session_key(b"conv-1"), 0.0) == first

    # The endpoint goes down: the conversation moves once, then sticks to its new home.
    await router.fleet.store.put_endpoint(
        EndpointState(first, "gpu", False, EndpointMetrics(**ROOMY), 1.0)
    )
    moved = route(router, chat("base", turns, session="conv-1"))[0]
    assert moved != first
    more = [*turns, text("later", 300)]
    assert route(router, chat("base", more, session="conv-1"))[0] == moved


async def test_prefix_affinity_outweighs_a_short_queue_but_not_a_long_one() -> None:
    router = await router_with({E[n]: dict(ROOMY) for n in range(1, 6)})
    home = route(router, chat("base", ["first"]))[0]
    # Another endpoint empties its queue: the cached prefix still wins (3 x ~1.0 > 2 x 1.0).
    await router.fleet.store.put_endpoint(
        EndpointState(home, "gpu", True, EndpointMetrics(**{**ROOMY, "waiting": 1}), 1.0)
    )
    assert route(router, chat("base", ["second"]))[0] == home
    # Its KV cache fills up as well: load wins over the cache.
    busy = {**ROOMY, "waiting": 8, "kv_usage": 0.97}
    await router.fleet.store.put_endpoint(
        EndpointState(home, "gpu", True, EndpointMetrics(**busy), 1.0)
    )
    assert route(router, chat("base", ["third"]))[0] != home


def test_gie_names_and_alias_are_accepted() -> None:
    for name in ("prefix-cache-scorer", "approx-prefix-cache-scorer"):
        profile = {"p": [{"plugin": name, "weight": 3}, {"plugin": "max-score-picker"}]}
        config = parse_config({**CONFIG, "scheduling": {"profile": "p", "profiles": profile}})
        built = build_profile(config.scheduling.selected)
        assert type(built.scorers[0][0]).__name__ == "PrefixCacheScorer"
        assert built.post_pick == [built.scorers[0][0]]
        assert built.producers == [built.scorers[0][0]]


@pytest.mark.parametrize(
    ("plugin", "parameters", "message"),
    [
        ("prefix-cache-scorer", {"block_chars": 0}, "block_chars"),
        ("prefix-cache-scorer", {"lru_capacity": -1}, "lru_capacity"),
        ("kv-headroom-filter", {"blocks": 3}, r"p\[0\]\.parameters\.blocks: must not be set"),
        ("session-affinity-scorer", {"ttl_seconds": 0}, "ttl_seconds"),
    ],
)
def test_bad_parameters_are_config_errors(
    plugin: str, parameters: dict[str, Any], message: str
) -> None:
    entries = [{"plugin": plugin, "parameters": parameters}, {"plugin": "max-score-picker"}]
    scheduling = {"profile": "p", "profiles": {"p": entries}}
    with pytest.raises(ConfigError, match=message):
        parse_config({**CONFIG, "scheduling": scheduling})
