"""The canary benchmark's workload and its two set-ups."""

from __future__ import annotations

import json

from benchmarks.canary import SPLIT, CanaryChats, CanaryRouter
from benchmarks.routers import Fleet
from benchmarks.workloads import MultiTurn


def test_the_canary_workload_asks_for_the_split_name_and_keeps_its_sessions() -> None:
    chats = CanaryChats(MultiTurn(conversations=3))
    items = [item for item, _ in zip(chats.stream(), range(12), strict=False)]
    assert {json.loads(item.request.body)["model"] for item in items} == {"chat"}
    assert all(item.request.headers["x-session-token"] == item.key for item in items)
    assert chats.loras() == (list(SPLIT), 2)


def test_both_set_ups_are_valid_epp_configurations_that_differ_in_stickiness() -> None:
    fleet = Fleet(1, "h100", 1.0, 16, 2)
    sticky, per_request = CanaryRouter(True), CanaryRouter(False)
    assert sticky.unavailable() is None
    assert per_request.unavailable() is None
    chat = [
        r.config_extra(fleet, ["127.0.0.1:1"], None)["models"]["chat"]
        for r in (sticky, per_request)
    ]
    assert [c["rewrite_sticky"] for c in chat] == [True, False]
    assert chat[0]["rewrite"] == [
        {"model": "chat-v1", "weight": 90},
        {"model": "chat-v2", "weight": 10},
    ]
