"""End to end, the residual latency rule (docs/health.md): streamed answers through the real
Envoy are judged against the latency model's prediction for each request, so a healthy fleet
under streamed load ejects nothing, and a replica whose first tokens come 200 ms later than
its model says is ejected within seconds, and returns once the fault is cleared.

Four simulated replicas, one epp, a sequential streaming client, the test settings of
tests/e2e/test_passive_health.py (``latency_samples: 5``, at most one replica ejected).
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator

import pytest

from epp.devstack import Stack
from tests.e2e.fleet import wait_until
from tests.e2e.test_passive_health import HEALTH, circuit, fault, health_stack


@pytest.fixture(scope="module")
def streaming_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from health_stack(tmp_path_factory, "buffered", HEALTH)


class Streams:
    """Sequential streamed completions through Envoy in a background thread until stopped."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Streams:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        host, port = self.stack.url.removeprefix("http://").split(":")
        i = 0
        while not self._stop.is_set():
            i += 1
            body = {"model": self.stack.model, "prompt": f"s {i}", "max_tokens": 4, "stream": True}
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            try:
                conn.request(
                    "POST",
                    "/v1/completions",
                    json.dumps(body),
                    {"content-type": "application/json"},
                )
                resp = conn.getresponse()
                resp.read()
                self.answered += 1
            except OSError:
                pass
            finally:
                conn.close()


def test_a_replica_slower_than_its_model_is_ejected_and_a_healthy_fleet_is_not(
    streaming_stack: Stack,
) -> None:
    stack = streaming_stack
    address = stack.replica_addresses[0]
    with Streams(stack) as streams:
        # Enough streamed answers for every replica's model to be trusted many times over.
        wait_until(lambda: streams.answered >= 200, 60, "warm-up streams")
        assert all(circuit(stack, a) == "closed" for a in stack.replica_addresses)
        fault(address, latency_ms=200)
        # How soon is a wall-clock figure (printed); the wait bounds a miss.
        ejected = wait_until(lambda: circuit(stack, address) != "closed", 10, "ejection")
        fault(address, latency_ms=0)
        back = wait_until(lambda: circuit(stack, address) == "closed", 15, "readmission")
        others = [a for a in stack.replica_addresses if a != address]
        assert all(circuit(stack, a) == "closed" for a in others)
    print(f"\nstreamed latency_ms 200: ejected {ejected:.2f}s after the fault, back {back:.2f}s")
