"""Nothing lost when flow control holds requests and something fails: an epp killed with held
requests fails only those (none reaches a replica, every other request is served once), and an
epp that stops answering has its held requests released by Envoy at its timeout, never held
silently. (A held client that disconnects: tests/e2e/test_flow_control.py.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from epp.devstack import Stack
from epp.envoy_config import QUEUE_TIMEOUT_MARGIN_MS
from tests.e2e.client import Reply, metric_values
from tests.e2e.conftest import make_stack
from tests.e2e.fleet import completion_in_background, epp_metric, wait_until
from tests.e2e.test_routing import set_fault

HELD = "inference_extension_flow_control_queue_size"


def _held(stack: Stack, index: int) -> float:
    return sum(epp_metric(stack, index, HELD).values())


def _running(address: str) -> float:
    """Requests a (hung) replica has, waiting or running."""
    url = f"http://{address}/metrics"
    return sum(
        sum(metric_values(url, f"vllm:num_requests_{state}").values())
        for state in ("waiting", "running")
    )


def _inflight_seen(stack: Stack, index: int, endpoint: str) -> float:
    """Requests in flight on ``endpoint`` (its own and the group's), as epp ``index`` sees."""
    samples = epp_metric(stack, index, "epp_endpoint_inflight_requests")
    return sum(v for labels, v in samples.items() if f'endpoint="{endpoint}"' in labels)


def _served_by_replicas(addresses: list[str]) -> float:
    return sum(
        sum(metric_values(f"http://{a}/metrics", "vllm:request_prompt_tokens_count").values())
        for a in addresses
    )


def test_killed_epp_fails_only_its_held_requests(tmp_path: Path) -> None:
    stack = make_stack(
        tmp_path,
        "buffered",
        "redis",  # in-flight counts shared, so both epps see the replicas full
        replicas=2,
        epp_count=2,
        config_extra={"admission": {"mode": "queue", "max_requests": 1, "ttl": 60}},
    )
    with stack:
        stack.start()
        replicas = stack.replica_addresses
        for address in replicas:
            set_fault(address, hang=True)
        # Fill every replica (two epps may briefly place two fills on one replica before
        # their shared counts meet: send fills until each replica holds one).
        fills: list[Reply] = []
        while not all(_running(a) for a in replicas):
            sent = len(fills) + sum(_running(a) for a in replicas)
            assert sent < 6, "fills do not spread over the replicas"
            completion_in_background(stack.url, fills, f"fill {sent}")
            wait_until(lambda n=sent: sum(_running(a) for a in replicas) > n, 10, "fill lands")
        filled = sum(_running(a) for a in replicas)
        # Both epps must see every replica full (the in-flight counts sync through Redis),
        # or an epp that has not heard of the other's fills yet routes instead of holding.
        for index in (0, 1):
            wait_until(
                lambda i=index: all(_inflight_seen(stack, i, a) >= 1 for a in replicas),
                10,
                f"epp{index} sees every replica full",
            )
        # Four requests held by each epp (each through an Envoy pinned to it).
        held: list[Reply] = []
        for index in (0, 1):
            url = stack.pinned_envoy(index)
            for i in range(4):
                completion_in_background(url, held, f"held {index}.{i}")
                wait_until(lambda n=i, e=index: _held(stack, e) == n + 1, 10, f"held {index}.{i}")
        on_killed = on_survivor = 4

        stack.procs["epp1"].kill()
        # The killed epp's held requests fail at once, with a JSON error from Envoy ...
        wait_until(lambda: len(held) == on_killed, 10, "the killed epp's held requests fail")
        for reply in held:
            assert reply.status == 503, reply.body
            assert reply.json()["error"]["code"] == "upstream_unavailable"
        # ... and the survivor's are still held, not failed.
        assert _held(stack, 0) == on_survivor
        assert len(held) == on_killed

        for address in stack.replica_addresses:
            set_fault(address, hang=False)
        wait_until(lambda: len(held) == 8 and len(fills) == filled, 30, "all answered")
        served = [r for r in held if r.status == 200]
        assert len(served) == on_survivor
        assert all(r.status == 200 for r in fills), [r.status for r in fills]
        # Nothing the killed epp held reached a replica; everything else did, once.
        wait_until(
            lambda: _served_by_replicas(replicas) >= filled + on_survivor,
            5,
            "replicas count their requests",
        )
        assert _served_by_replicas(replicas) == filled + on_survivor


def test_held_request_of_a_hung_epp_is_released_at_envoys_timeout(tmp_path: Path) -> None:
    ttl = 2.0
    stack = make_stack(
        tmp_path,
        "buffered",
        "memory",
        replicas=1,
        config_extra={"admission": {"mode": "queue", "max_requests": 1, "ttl": ttl}},
    )
    with stack:
        stack.start()
        (replica,) = stack.replica_addresses
        set_fault(replica, hang=True)
        fills: list[Reply] = []
        completion_in_background(stack.url, fills, "fill")
        wait_until(
            lambda: sum(epp_metric(stack, 0, "epp_endpoint_picks_total").values()) == 1,
            10,
            "the replica holds one request",
        )
        held: list[Reply] = []
        completion_in_background(stack.url, held, "held while epp hangs")
        wait_until(lambda: _held(stack, 0) == 1, 10, "one request held")
        epp = stack.procs["epp0"].popen.pid
        os.kill(epp, signal.SIGSTOP)  # epp stops answering: its own TTL can never fire
        stopped = time.monotonic()
        try:
            timeout = ttl + QUEUE_TIMEOUT_MARGIN_MS / 1000
            wait_until(lambda: held, timeout + 5, "Envoy releases the held request")
        finally:
            os.kill(epp, signal.SIGCONT)
        elapsed = time.monotonic() - stopped
        # Released by Envoy's message timeout (TTL + margin), not by epp, and with a JSON error.
        assert elapsed >= timeout - 1.0, elapsed
        assert held[0].status == 503, held[0].body
        assert held[0].json()["error"]["code"] == "upstream_unavailable"
        set_fault(replica, hang=False)
        wait_until(lambda: fills, 30, "the fill completes")
        assert fills[0].status == 200, fills[0].body
