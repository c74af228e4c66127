"""End-to-end with SGLang replicas: real Envoy + epp + ``epp sim --engine sglang``.

The pool says ``engine: sglang``; the replicas serve only SGLang's metric names and publish
SGLang-shaped KV events, so every number epp shows about them was read through the SGLang
parser and decoder.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from epp.devstack import Stack, free_port_run
from tests.e2e.client import Reply, completion, metric_values, request
from tests.e2e.conftest import make_stack
from tests.e2e.fleet import wait_until

REPLICAS = 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    kv_base = free_port_run(REPLICAS)
    s = make_stack(
        tmp_path_factory.mktemp("sglang"),
        "buffered",
        "memory",
        replicas=REPLICAS,
        # Queues must stay queued while the test looks: no shedding in front of them.
        config_extra={"admission": {"mode": "off"}},
        sim_args=[
            *("--engine", "sglang", "--time-scale", "0.01", "--block-size", "16"),
            *("--kv-events-endpoint", f"tcp://*:{kv_base}"),
        ],
    )
    s.config_extra["pools"] = {
        "main": {
            "engine": "sglang",
            "endpoints": [
                {"address": address, "kv_events": f"tcp://127.0.0.1:{kv_base + i}"}
                for i, address in enumerate(s.replica_addresses)
            ],
        }
    }
    s.start()
    try:
        wait_until(
            lambda: all(e["ready"] for e in endpoints(s).values()), 15, "SGLang replicas ready"
        )
        yield s
    finally:
        s.stop()


def endpoints(stack: Stack) -> dict[str, Any]:
    url = f"http://127.0.0.1:{stack.epp_ports[0][2]}/debug/endpoints"
    with urllib.request.urlopen(url, timeout=2) as resp:
        data: dict[str, Any] = json.loads(resp.read())
    return data


def set_fault(address: str, **faults: object) -> None:
    reply = request(f"http://{address}", "/admin/faults", dict(faults))
    assert reply.status == 200, reply.body


def test_requests_are_routed_to_sglang_replicas(stack: Stack) -> None:
    served = set()
    for i in range(12):
        reply = completion(stack.url, f"request {i}: a question for SGLang")
        assert reply.status == 200, reply.body
        assert reply.json()["choices"][0]["text"]
        served.add(reply.served_by)
    assert served <= set(stack.replica_addresses)
    assert len(served) >= 2, "load should spread over idle replicas"


def test_queues_read_from_sglang_metrics_reach_epps_endpoint_state(stack: Stack) -> None:
    for address in stack.replica_addresses:
        set_fault(address, hang=True)
    replies: list[Reply] = []
    threads = [
        threading.Thread(
            target=lambda i=i: replies.append(completion(stack.url, f"queued {i}")), daemon=True
        )
        for i in range(6)
    ]
    try:
        for t in threads:
            t.start()
        # sglang:num_queue_reqs of each replica, as epp scraped and parsed it.
        wait_until(
            lambda: sum(e["metrics"]["waiting"] for e in endpoints(stack).values()) == 6,
            15,
            "six queued requests in epp's endpoint state",
        )
    finally:
        for address in stack.replica_addresses:
            set_fault(address, hang=False)
        for t in threads:
            t.join(30)
    assert [r.status for r in replies] == [200] * 6
    wait_until(
        lambda: all(e["metrics"]["waiting"] == 0 for e in endpoints(stack).values()),
        15,
        "queues drained",
    )


def test_prefix_counters_and_kv_events_come_through(stack: Stack) -> None:
    prompt = "a long shared system prompt for the SGLang pool " * 8
    for _ in range(3):
        assert completion(stack.url, prompt).status == 200
    # sglang:prompt_tokens_total / cached_tokens_total, summed over the pool.
    wait_until(
        lambda: sum(e["metrics"]["prefix_cache_hits"] for e in endpoints(stack).values()) > 0,
        15,
        "cached prompt tokens in epp's endpoint state",
    )
    state = endpoints(stack)
    queries = sum(e["metrics"]["prefix_cache_queries"] for e in state.values())
    hits = sum(e["metrics"]["prefix_cache_hits"] for e in state.values())
    assert queries > hits > 0
    # SGLang-shaped events (one BlockStored per page, signed hashes) were indexed.
    url = f"http://127.0.0.1:{stack.epp_ports[0][2]}/metrics"
    deadline = time.monotonic() + 15
    while sum(metric_values(url, "epp_kv_index_blocks").values()) == 0:
        assert time.monotonic() < deadline, "no KV blocks indexed from SGLang's events"
        time.sleep(0.05)
    resets = metric_values(url, "epp_kv_index_resets_total")
    assert not any(v for labels, v in resets.items() if 'reason="malformed"' in labels)
