"""request.engine_priority through the real Envoy, in both body modes: the replica receives the
objective's priority as vLLM's body field (negated), whatever the client sent, in the same
rewritten body as the usage option; a simulated vLLM run with `--scheduling-policy priority`
serves the rewritten requests."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from epp.devstack import Stack
from tests.e2e.client import request
from tests.e2e.conftest import make_stack
from tests.e2e.replica import TrickleReplica

OBJECTIVE = "x-gateway-inference-objective"


@dataclass
class Fleet:
    stack: Stack
    replica: TrickleReplica

    def chat(self, objective: str | None, model: str = "trickle", **extra: Any) -> bytes:
        """POST a chat request; the response body (already checked to be a 200)."""
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
        headers = {OBJECTIVE: objective} if objective else {}
        reply = request(self.stack.url, "/v1/chat/completions", body, headers)
        assert reply.status == 200, reply.body
        return reply.body


@pytest.fixture(
    scope="module",
    params=[pytest.param("buffered", id="buffered"), pytest.param("full-duplex", id="fullduplex")],
)
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    mode = request.param
    replica = TrickleReplica()
    replica.start()
    stack = make_stack(
        tmp_path_factory.mktemp(f"engine-priority-{mode}"),
        mode,
        "memory",
        replicas=1,
        config_extra={
            "routing": {"inject_stream_usage": True},
            "request": {
                "objectives": {"critical": 10, "batch": -1},
                "engine_priority": True,
                "trusted_headers": True,  # the objective header stands for a gateway in front
            },
            "admission": {"mode": "off"},
            "models": {"trickle": {"pools": ["trickle"]}},
            "pools": {"trickle": {"endpoints": [replica.address]}},
        },
        sim_args=["--time-scale", "0.05", "--scheduling-policy", "priority"],
    )
    try:
        stack.start()
        admin = f"http://127.0.0.1:{stack.epp_ports[0][2]}/debug/endpoints"
        everyone = {*stack.replica_addresses, replica.address}
        deadline = time.monotonic() + 15
        while True:
            with urllib.request.urlopen(admin, timeout=2) as resp:
                endpoints = json.loads(resp.read())
            if all(endpoints.get(a, {}).get("ready") for a in everyone):
                break
            assert time.monotonic() < deadline, "endpoints never became ready in epp"
            time.sleep(0.05)
        yield Fleet(stack, replica)
    finally:
        stack.stop()
        replica.stop()


def test_the_replica_receives_the_objectives_priority_negated(fleet: Fleet) -> None:
    fleet.chat("critical")
    fleet.chat("batch", priority=-1000)  # the client's own priority is overwritten
    fleet.chat(None, priority=-1000)  # the default objective: vLLM's default, no field
    critical, batch, default = fleet.replica.received[-3:]
    assert critical["priority"] == -10
    assert batch["priority"] == 1
    assert "priority" not in default
    assert default["messages"] == [{"role": "user", "content": "hi"}]


def test_priority_and_the_usage_option_ride_one_rewrite(fleet: Fleet) -> None:
    body = fleet.chat("critical", stream=True)
    sent = fleet.replica.received[-1]
    assert sent["priority"] == -10
    assert sent["stream_options"] == {"include_usage": True}
    # The usage chunk epp asked for is the gateway's, not the client's.
    assert b'"usage"' not in body
    assert body.endswith(b"data: [DONE]\n\n")


def test_a_priority_scheduling_vllm_serves_the_rewritten_requests(fleet: Fleet) -> None:
    for objective in ("critical", "batch", None):
        reply = json.loads(fleet.chat(objective, model="tiny", max_tokens=3, priority=5))
        assert reply["usage"]["completion_tokens"] == 3
