"""End-to-end learned latency: two epp processes sharing state through Redis learn, from real
streamed responses through Envoy, that one simulated replica is four times slower than the
other, without any weight configured; each process sees the other's evidence."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from epp.devstack import Stack
from tests.e2e.client import request
from tests.e2e.conftest import make_stack
from tests.e2e.fleet import wait_until
from tests.e2e.test_passive_health import endpoints_of


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = make_stack(
        tmp_path_factory.mktemp("learned"),
        "buffered",
        "redis",
        replicas=2,
        epp_count=2,
        sim_args=["--speed", "1,0.25"],
    )
    s.start()
    try:
        yield s
    finally:
        s.stop()


def latency(stack: Stack, index: int) -> dict[str, Any]:
    data = endpoints_of(f"http://127.0.0.1:{stack.epp_ports[index][2]}")
    return {address: e.get("latency") or {} for address, e in data.items()}


def test_both_processes_learn_which_replica_is_slow(stack: Stack) -> None:
    fast, slow = stack.replica_addresses
    rng = random.Random(7)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    for _ in range(40):
        # Distinct ~1,500-token prompts: no prefix affinity, every prefill is cold.
        prompt = " ".join(rng.choice(words) for _ in range(1500))
        reply = request(
            stack.url,
            "/v1/completions",
            {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True},
        )
        assert reply.status == 200, reply.body[:200]

    def learned(index: int) -> bool:
        seen = latency(stack, index)
        fast_capacity = seen.get(fast, {}).get("capacity")
        slow_capacity = seen.get(slow, {}).get("capacity")
        return bool(fast_capacity and slow_capacity and fast_capacity > 2 * slow_capacity)

    wait_until(lambda: learned(0) and learned(1), 10, "both epps to learn the speeds")
    views = [latency(stack, index) for index in (0, 1)]
    own = [v[fast]["ttft_samples"] + v[slow]["ttft_samples"] for v in views]
    assert sum(own) == 40, "every first token is learned once, by the process that routed it"
    # The process that routed fewer requests holds more evidence than its own samples: the
    # other's, read from Redis.
    fewer = own.index(min(own))
    evidence = views[fewer][fast]["evidence"]["ttft"] + views[fewer][slow]["evidence"]["ttft"]
    assert evidence > own[fewer] + 5
    for seen in views:
        assert seen[fast]["prefill_tokens_per_second"] > 2 * seen[slow]["prefill_tokens_per_second"]
