"""A hostile client against epp's state: how much do epp, Redis and /metrics grow?

One epp (Redis store), two simulated replicas, the real Envoy. The configuration trusts the
identity headers (``request.trusted_headers: true``, as behind a gateway that sets them), gives
every tenant a budget and holds requests in flow control (two in flight per replica, eight
clients), the setting where client-chosen ids reach the most state. After a
warm-up, three attacks of ``--count`` requests each, every request with values never seen
before:

- ``sessions-48k``: a 48 KiB ``x-session-token`` (refused with 400: over the 1 KiB cap);
- ``sessions-1k``: a 1 KiB ``x-session-token`` (the largest accepted: kept as a digest);
- ``identities``: a fresh fairness id, priority and objective.

After each: epp's resident memory (VmRSS), the Redis memory of the stack's keys (``MEMORY
USAGE`` summed over its prefix, so other users of the server do not count), and the number of
series on epp's ``/metrics``. Report: docs/security.md.

    .venv/bin/python -m benchmarks.hostile_state --count 10000
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis

from epp.devstack import Stack

REDIS_URL = os.environ.get("EPP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
THREADS = 8
# The first answer of each non-200 status seen, for the report.
SAMPLES: dict[int, str] = {}
Headers = Callable[[int], dict[str, str]]


def _sessions(size: int) -> Headers:
    def headers(i: int) -> dict[str, str]:
        tag = f"{uuid.uuid4().hex}-{i}-"
        return {"x-session-token": (tag * (size // len(tag) + 1))[:size]}

    return headers


def _identities(i: int) -> dict[str, str]:
    return {
        "x-gateway-inference-fairness-id": f"tenant-{uuid.uuid4().hex}",
        "x-priority": str(i - 5000),
        "x-gateway-inference-objective": f"objective-{uuid.uuid4().hex}",
    }


ATTACKS: dict[str, Headers] = {
    "sessions-48k": _sessions(48 * 1024),
    "sessions-1k": _sessions(1024),
    "identities": _identities,
}


def _send(stack: Stack, indices: range, headers: Headers) -> Counter[int]:
    """POST one completion per index on one keep-alive connection; statuses counted."""
    host, port = stack.url.removeprefix("http://").split(":")
    body = json.dumps({"model": stack.model, "prompt": "hello", "max_tokens": 1})
    statuses: Counter[int] = Counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        for i in indices:
            try:
                conn.request(
                    "POST",
                    "/v1/completions",
                    body,
                    {"content-type": "application/json", **headers(i)},
                )
                resp = conn.getresponse()
                answer = resp.read()
                statuses[resp.status] += 1
                if resp.status != 200 and resp.status not in SAMPLES:
                    SAMPLES[resp.status] = answer[:300].decode(errors="replace")
            except (OSError, http.client.HTTPException):
                statuses[0] += 1
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
    finally:
        conn.close()
    return statuses


def _attack(stack: Stack, count: int, headers: Headers) -> Counter[int]:
    step = -(-count // THREADS)
    chunks = [range(s, min(s + step, count)) for s in range(0, count, step)]
    total: Counter[int] = Counter()
    with ThreadPoolExecutor(THREADS) as pool:
        for statuses in pool.map(lambda r: _send(stack, r, headers), chunks):
            total.update(statuses)
    return total


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _redis_kib(client: redis.Redis, prefix: str) -> tuple[int, float]:
    keys = list(client.scan_iter(match=f"*{prefix}*", count=1000))
    used = sum(client.memory_usage(k) or 0 for k in keys)
    return len(keys), used / 1024


def _series(stack: Stack) -> int:
    url = f"127.0.0.1:{stack.epp_ports[0][2]}"
    conn = http.client.HTTPConnection(url, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def measure(stack: Stack, client: redis.Redis, prefix: str) -> dict[str, Any]:
    keys, kib = _redis_kib(client, prefix)
    return {
        "epp_rss_mib": round(_rss_mib(stack.procs["epp0"].popen.pid), 1),
        "redis_keys": keys,
        "redis_kib": round(kib, 1),
        "metrics_series": _series(stack),
    }


def run(count: int, attacks: list[str]) -> list[dict[str, Any]]:
    prefix = f"epp-hostile-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(REDIS_URL)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(
            Path(tmp),
            replicas=2,
            redis_url=REDIS_URL,
            sim_args=["--time-scale", "0.01"],
            config_extra={
                "store": {"key_prefix": prefix},
                "request": {"trusted_headers": True, "objectives": {"gold": 5}},
                "budgets": {"default": {"rpm": 100_000_000}},
                # Two requests per replica: the eight clients keep a few held in flow control,
                # whose queue-size series name priority and fairness id.
                "admission": {"mode": "queue", "max_requests": 2},
            },
        )
        try:
            stack.start()
            warm = _attack(stack, 500, lambda i: {"x-session-token": f"warm-{i % 50}"})
            rows.append({"stage": "warm-up (500 requests)", **measure(stack, client, prefix)})
            print(rows[-1], dict(warm), flush=True)
            for name in attacks:
                statuses = _attack(stack, count, ATTACKS[name])
                row = {
                    "stage": f"{name} x {count}",
                    **measure(stack, client, prefix),
                    "statuses": dict(sorted(statuses.items())),
                }
                rows.append(row)
                print(row, flush=True)
            print("answers other than 200:", SAMPLES, flush=True)
        finally:
            stack.stop()
            for key in client.scan_iter(match=f"*{prefix}*", count=1000):
                client.delete(key)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10_000, help="requests per attack")
    parser.add_argument("--attacks", nargs="*", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    rows = run(args.count, args.attacks)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
