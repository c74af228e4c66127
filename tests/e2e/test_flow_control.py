"""Flow control through the real Envoy: held requests, dispatch on completion, a client that
leaves, capacity (429), TTL (503) and untrusted priority headers."""

from __future__ import annotations

import http.client
from pathlib import Path

from epp.devstack import Stack
from tests.e2e.client import Reply, completion, metric_values
from tests.e2e.conftest import make_stack
from tests.e2e.fleet import completion_in_background, epp_metric, wait_until
from tests.e2e.test_routing import set_fault

TTL = 3.0


def _queued(stack: Stack) -> dict[str, float]:
    """Held requests by label text (non-zero only)."""
    samples = epp_metric(stack, 0, "inference_extension_flow_control_queue_size")
    return {labels: v for labels, v in samples.items() if v}


def _replica_requests(stack: Stack) -> float:
    """Requests the replicas finished (their prompt-length histograms' counts)."""
    return sum(
        sum(metric_values(f"http://{a}/metrics", "vllm:request_prompt_tokens_count").values())
        for a in stack.replica_addresses
    )


def test_flow_control_holds_dispatches_and_refuses(tmp_path: Path) -> None:
    stack = make_stack(
        tmp_path,
        "buffered",
        "memory",
        replicas=2,
        config_extra={
            # One request in flight per replica is "full"; the queue holds two for TTL seconds.
            "admission": {"mode": "queue", "max_requests": 1, "capacity": 2, "ttl": TTL},
            # No trusted source: the identity headers clients send are stripped (the default).
            "request": {"objectives": {"critical": 10}},
        },
    )
    with stack:
        stack.start()
        for address in stack.replica_addresses:
            set_fault(address, hang=True)
        fills: list[Reply] = []
        fill_threads = [completion_in_background(stack.url, fills, f"fill {i}") for i in range(2)]
        wait_until(
            lambda: sum(epp_metric(stack, 0, "epp_endpoint_picks_total").values()) == 2,
            10,
            "both replicas hold one request",
        )

        # A client that leaves while held: its place frees at once, it never reaches a replica.
        host, port = stack.url.removeprefix("http://").split(":")
        leaver = http.client.HTTPConnection(host, int(port), timeout=30)
        leaver.request(
            "POST",
            "/v1/completions",
            b'{"model":"tiny","prompt":"leaves","max_tokens":2}',
            {"content-type": "application/json"},
        )
        wait_until(lambda: sum(_queued(stack).values()) == 1, 5, "the leaver is held")
        leaver.close()
        wait_until(lambda: not _queued(stack), 5, "the leaver's place is freed")

        # Untrusted priority and objective headers are ignored: held in band 0, default flow.
        held: list[Reply] = []
        completion_in_background(stack.url, held, "claims priority", **{"x-priority": "10"})
        objective = {"x-gateway-inference-objective": "critical"}
        completion_in_background(stack.url, held, "claims objective", **objective)
        wait_until(lambda: sum(_queued(stack).values()) == 2, 5, "two requests held")
        assert all('priority="0"' in labels for labels in _queued(stack)), _queued(stack)

        # The band is full: 429 with Retry-After and the reason, at once.
        refused = completion(stack.url, "one too many")
        assert refused.status == 429, refused.body
        assert refused.headers["x-epp-request-dropped-reason"] == "rejected-saturated"
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert refused.served_by is None

        # The TTL runs out: 503 with Retry-After and the reason.
        wait_until(lambda: len(held) == 2, TTL + 5, "held requests expire")
        for reply in held:
            assert reply.status == 503, reply.body
            assert reply.headers["x-epp-request-dropped-reason"] == "rejected-ttl-expired"
            assert int(reply.headers["retry-after"]) >= 1
            assert reply.served_by is None

        # A held request is dispatched as soon as a replica has room again.
        waiting: list[Reply] = []
        completion_in_background(stack.url, waiting, "waits for room")
        wait_until(lambda: sum(_queued(stack).values()) == 1, 5, "one request held")
        for address in stack.replica_addresses:
            set_fault(address, hang=False)
        wait_until(lambda: len(waiting) == 1, 30, "the held request is served")
        assert waiting[0].status == 200, waiting[0].body
        for thread in fill_threads:
            thread.join(30)
        assert [r.status for r in fills] == [200, 200]
        # Two fills and the dispatched request reached replicas; the leaver never did.
        wait_until(lambda: _replica_requests(stack) >= 3, 5, "replicas count their requests")
        assert _replica_requests(stack) == 3
