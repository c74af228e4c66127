"""Pieces for end-to-end tests whose fleet changes under load: replicas on loopback addresses
and a client that keeps sending requests through Envoy and records every answer.

Replicas of a discovered pool share one port on distinct loopback addresses (127.0.0.2, .3,
...), as pods or compose containers share a port on distinct IPs; Linux routes all of
127.0.0.0/8 to the loopback interface, so a simulator can bind any of them.
"""

from __future__ import annotations

import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from epp.devstack import Proc, Stack, http_ok
from tests.e2e.client import Reply, completion, metric_values, request


def start_replica(stack: Stack, ip: str, port: int) -> Proc:
    """One simulated vLLM replica on ``ip:port``, ended by ``stack.stop()``."""
    return stack.spawn(
        f"sim-{ip}",
        [
            sys.executable,
            "-m",
            "epp",
            "sim",
            "--host",
            ip,
            "--port",
            str(port),
            "--model",
            stack.model,
            "--time-scale",
            "0.01",
        ],
    )


def wait_until(check: Callable[[], object], timeout: float, what: str) -> float:
    """Seconds until ``check()`` held; AssertionError naming ``what`` after ``timeout``."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - started


def epp_metric(stack: Stack, index: int, name: str) -> dict[str, float]:
    """Samples of one metric of epp ``index``, keyed by their label text."""
    return metric_values(f"http://127.0.0.1:{stack.epp_ports[index][2]}/metrics", name)


def completion_in_background(
    url: str, into: list[Reply], prompt: str, **headers: str
) -> threading.Thread:
    """Send a completion from a thread; its reply is appended to ``into``."""
    thread = threading.Thread(
        target=lambda: into.append(completion(url, prompt, 2, **headers)), daemon=True
    )
    thread.start()
    return thread


def envoy_ready(stack: Stack) -> bool:
    return http_ok(f"http://127.0.0.1:{stack.admin_port}/ready")


def epp_ready_endpoints(stack: Stack, index: int = 0) -> set[str]:
    """Endpoints epp ``index`` currently reports ready (its epp_endpoint_ready gauge)."""
    url = f"http://127.0.0.1:{stack.epp_ports[index][2]}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=0.5) as resp:
            text = resp.read().decode()
    except OSError:
        return set()
    ready = set()
    for line in text.splitlines():
        if line.startswith("epp_endpoint_ready{") and line.endswith(" 1.0"):
            labels = dict(
                part.split("=", 1)
                for part in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            ready.add(labels["endpoint"].strip('"'))
    return ready


@dataclass
class Outcome:
    at: float  # when the answer arrived
    status: int
    served_by: str | None
    started: float


@dataclass
class Load:
    """Sequential requests through Envoy in a background thread until stopped."""

    stack: Stack
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Load:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            started = time.monotonic()
            try:
                reply = request(
                    self.stack.url,
                    "/v1/completions",
                    {"model": self.stack.model, "prompt": f"request {i}", "max_tokens": 2},
                    timeout=10,
                )
                outcome = Outcome(time.monotonic(), reply.status, reply.served_by, started)
            except OSError:
                outcome = Outcome(time.monotonic(), 0, None, started)
            self.outcomes.append(outcome)

    def served_since(self, since: float) -> set[str]:
        return {o.served_by for o in self.outcomes if o.at >= since and o.served_by}

    def served_if_started_after(self, since: float) -> set[str]:
        return {o.served_by for o in self.outcomes if o.started >= since and o.served_by}

    def first_served_by(self, address: str, since: float) -> float | None:
        for o in list(self.outcomes):
            if o.at >= since and o.served_by == address:
                return o.at
        return None

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != 200]
