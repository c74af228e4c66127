"""End-to-end: real Envoy + epp + simulated vLLM, buffered and full-duplex, memory and Redis."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from epp.devstack import Stack
from tests.e2e.client import completion, metric_values, request
from tests.e2e.conftest import VARIANTS, make_stack


def picks(stack: Stack, index: int = 0) -> Counter[str]:
    """epp's own count of first-choice picks per endpoint."""
    url = f"http://127.0.0.1:{stack.epp_ports[index][2]}/metrics"
    out: Counter[str] = Counter()
    for labels, value in metric_values(url, "epp_endpoint_picks_total").items():
        address = labels.split('endpoint="', 1)[1].split('"', 1)[0]
        out[address] += int(value)
    return out


def set_fault(address: str, **faults: object) -> None:
    reply = request(f"http://{address}", "/admin/faults", dict(faults))
    assert reply.status == 200, reply.body


def wait_until_refused(address: str, timeout: float = 5.0) -> float:
    """When the replica stops accepting connections (the moment it is really gone)."""
    host, port = address.split(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=0.2).close()
        except OSError:
            return time.monotonic()
        time.sleep(0.01)
    raise AssertionError(f"{address} still accepts connections")


def test_requests_land_on_the_replica_epp_chose(stack: Stack) -> None:
    before = picks(stack)
    served: Counter[str] = Counter()
    for i in range(30):
        reply = completion(stack.url, f"request {i}: tell me about routing")
        assert reply.status == 200, reply.body
        assert reply.json()["choices"][0]["text"]
        served[reply.served_by or "?"] += 1
    chosen = picks(stack) - before
    assert served == chosen
    assert set(served) <= set(stack.replica_addresses)
    assert len(served) >= 2, "load should spread over idle replicas"


def test_chat_and_streaming_are_routed(stack: Stack) -> None:
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reply = request(stack.url, "/v1/chat/completions", chat)
    assert reply.status == 200
    assert reply.served_by in stack.replica_addresses
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert reply.body.rstrip().endswith(b"data: [DONE]")


def test_get_models_lists_every_model(stack: Stack) -> None:
    reply = request(stack.url, "/v1/models")
    assert reply.status == 200
    assert sorted(m["id"] for m in reply.json()["data"]) == ["ghost", "tiny"]


BAD_INPUTS = [
    pytest.param(b"{not json", 400, "not valid JSON", id="malformed-json"),
    pytest.param(b'{"prompt": "x"}', 400, "Missing required field 'model'", id="missing-model"),
    pytest.param(
        b'{"model": 7, "prompt": "x"}', 400, "must be a non-empty string", id="model-type"
    ),
    pytest.param(
        b'{"model": "tiny", "prompt": "x", "max_tokens": "9"}', 400, "max_tokens", id="field-type"
    ),
    pytest.param(
        b'{"model": "nope", "prompt": "x"}',
        404,
        "Available models: ghost, tiny",
        id="unknown-model",
    ),
    pytest.param(
        b'{"model": "ghost", "prompt": "x"}', 503, "0 of 1 endpoints are ready", id="no-endpoint"
    ),
    # Oversized bodies: tests/e2e/test_hostile_input.py, with a client that reads while it
    # sends (epp answers 413 from Content-Length, and http.client, writing all first, can see
    # the connection reset instead).
]


@pytest.mark.parametrize(("body", "status", "needle"), BAD_INPUTS)
def test_bad_input_gets_status_and_openai_error(
    stack: Stack, body: bytes, status: int, needle: str
) -> None:
    reply = request(stack.url, "/v1/completions", body)
    assert reply.status == status, reply.body[:300]
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert needle in error["message"]
    assert error["type"]
    assert reply.served_by is None, "a refused request must never reach a replica"


def test_two_megabyte_prompt(stack: Stack) -> None:
    words = " ".join(f"w{i % 997}" for i in range(400_000))[: 2 * 1024 * 1024]
    reply = completion(stack.url, words, max_tokens=1)
    assert reply.status == 200, reply.body[:300]
    assert reply.served_by in stack.replica_addresses
    assert reply.json()["usage"]["prompt_tokens"] > 100_000


def test_long_queue_gets_no_traffic_and_client_header_is_ignored(stack: Stack) -> None:
    busy = stack.replica_addresses[0]
    set_fault(busy, hang=True)
    # A real queue: requests sent straight to the paused replica wait in its engine.
    threads = [
        threading.Thread(target=completion, args=(f"http://{busy}", f"queued {i}"), daemon=True)
        for i in range(8)
    ]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            waiting = metric_values(f"http://{busy}/metrics", "vllm:num_requests_waiting")
            if sum(waiting.values()) >= 4:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the paused replica never reported a queue")
        time.sleep(0.3)  # a few scrape intervals for epp to see it
        served = Counter(completion(stack.url, f"after queue {i}").served_by for i in range(20))
        assert busy not in served
        assert sum(served.values()) == 20
        spoofed = Counter(
            completion(
                stack.url, f"spoof {i}", **{"x-gateway-destination-endpoint": busy}
            ).served_by
            for i in range(10)
        )
        assert busy not in spoofed
    finally:
        set_fault(busy, hang=False)
        for t in threads:
            t.join(30)


@pytest.mark.parametrize("variant", VARIANTS)
def test_stopped_replica_stops_receiving_within_one_second(
    variant: tuple[str, str], tmp_path: Path
) -> None:
    mode, store = variant
    stack = make_stack(tmp_path, mode, store)
    with stack:
        stack.start()
        dead = stack.replica_addresses[1]
        set_fault(dead, crash=True)
        crashed = wait_until_refused(dead)
        failures, after_one_second = 0, None
        while time.monotonic() - crashed < 2.0:
            if after_one_second is None and time.monotonic() - crashed >= 1.0:
                after_one_second = picks(stack)[dead]
            reply = completion(stack.url, f"during failover {time.monotonic()}")
            failures += reply.status != 200
            assert reply.served_by != dead
        assert picks(stack)[dead] == after_one_second, "epp still picked the dead replica"
        # With one fallback and Envoy's retry, no request is lost while epp notices.
        assert failures == 0


def test_explain_mode_returns_scores_to_the_client(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, "buffered", "memory", config_extra={"routing": {"explain": True}})
    with stack:
        stack.start()
        reply = completion(stack.url, "why here?", **{"x-request-id": "explain-me"})
        assert reply.status == 200
        scores = json.loads(reply.headers["x-epp-scores"])
        assert set(scores) == set(stack.replica_addresses)
        best = max(scores, key=lambda a: scores[a]["total"])
        assert scores[reply.served_by]["total"] == scores[best]["total"]
        why = request(f"http://127.0.0.1:{stack.epp_ports[0][2]}", "/debug/decisions/explain-me")
        assert why.json()["endpoints"][0] == reply.served_by


def test_no_scores_header_without_explain(stack: Stack) -> None:
    reply = completion(stack.url, "quiet")
    assert reply.status == 200
    assert "x-epp-scores" not in reply.headers


def test_sheddable_requests_get_429_when_every_replica_is_saturated(tmp_path: Path) -> None:
    stack = make_stack(
        tmp_path,
        "buffered",
        "memory",
        # x-priority stands for a gateway in front that sets it.
        config_extra={"admission": {"queue_threshold": 1}, "request": {"trusted_headers": True}},
    )
    with stack:
        stack.start()
        for address in stack.replica_addresses:
            set_fault(address, hang=True)
        queued = [
            threading.Thread(target=completion, args=(f"http://{a}", "fill"), daemon=True)
            for a in stack.replica_addresses
        ]
        for t in queued:
            t.start()
        try:
            time.sleep(0.5)  # let epp scrape the queues
            shed = completion(stack.url, "low priority", **{"x-priority": "-1"})
            assert shed.status == 429
            assert shed.json()["error"]["code"] == "overloaded"
            assert shed.served_by is None
            kept: list[int] = []
            normal = threading.Thread(
                target=lambda: kept.append(completion(stack.url, "normal priority").status)
            )
            normal.start()
            time.sleep(0.3)
        finally:
            for address in stack.replica_addresses:
                set_fault(address, hang=False)
        normal.join(30)
        assert kept == [200], "priority >= 0 must queue, never be shed"
