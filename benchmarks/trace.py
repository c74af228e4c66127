"""Per-stage traces for finding out why a stage went wrong (``--trace``).

A stage's summary row says *that* something happened (a TTFT p99 of 18 s, a throughput halved by
a few late requests); the trace says where: each replica's queue over time, so a replica that
kept a queue while the others idled stands out, and each request's send time, first token and
end. Written as JSON lines next to the stage's logs; a short summary is printed with the stage.

Replica gauges are polled from the replicas' own ``/metrics`` on the load generator's event
loop, so the poll runs at the same time as the stage it watches and shares its clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.loadgen import StageRun

GAUGES = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv",
    # Counters (prompt tokens): their last values give each replica's own prefix hit rate, so
    # a replica that thrashes its cache while the others keep theirs stands out.
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
}
_SAMPLE = re.compile(r"^((?:vllm|sglang):[a-z_]+)(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


def sum_samples(page: str, names: Iterable[str]) -> dict[str, float]:
    """The named metrics of a Prometheus text page, each summed over its label sets."""
    values = dict.fromkeys(names, 0.0)
    for name, value in _SAMPLE.findall(page):
        if name in values:
            values[name] += float(value)
    return values


@dataclass(frozen=True, slots=True)
class Sample:
    """One replica's gauges at one moment (seconds from the stage's first send)."""

    at: float
    replica: str
    waiting: float
    running: float
    kv: float
    queries: float
    hits: float


async def traced(
    stage: Awaitable[StageRun],
    addresses: Sequence[str],
    keys: Sequence[str],
    path: Path,
    interval: float = 0.25,
) -> tuple[StageRun, str]:
    """Run ``stage`` while polling every replica's gauges; write the trace to ``path`` and
    return the stage's result with a one-line summary. ``keys`` name the requests in send
    order (the unit a router should keep together: group, conversation, adapter)."""
    loop = asyncio.get_running_loop()
    polled: list[tuple[float, str, dict[str, float]]] = []
    done = asyncio.Event()

    async def poll() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while not done.is_set():
                at = loop.time()
                for address in addresses:
                    try:
                        async with session.get(f"http://{address}/metrics") as resp:
                            polled.append((at, address, sum_samples(await resp.text(), GAUGES)))
                    except (aiohttp.ClientError, TimeoutError):
                        continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), interval)

    poller = asyncio.create_task(poll())
    try:
        run = await stage
    finally:
        done.set()
        await poller
    origin = min((o.started for o in run.outcomes), default=0.0)
    samples = [
        Sample(round(at - origin, 3), address, *(values[name] for name in GAUGES))
        for at, address, values in polled
    ]
    requests = [
        {
            "key": key,
            "sent": round(o.started - origin, 3),
            "ttft": o.ttft,
            "finished": round(o.finished - origin, 3),
            "output_tokens": o.output_tokens,
            "error": o.error,
        }
        for key, o in zip(keys, run.outcomes, strict=True)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for sample in samples:
            out.write(json.dumps({"replica_sample": asdict(sample)}) + "\n")
        for request in requests:
            out.write(json.dumps({"request": request}) + "\n")
    return run, summary(samples, requests, path)


def summary(samples: Sequence[Sample], requests: Sequence[dict[str, Any]], path: Path) -> str:
    """Each replica's longest waiting queue and prefix hit rate (the counters' growth over the
    stage, in prompt tokens), and the request that waited longest for a token."""
    peaks: dict[str, float] = {}
    first: dict[str, Sample] = {}
    last: dict[str, Sample] = {}
    for s in samples:
        peaks[s.replica] = max(peaks.get(s.replica, 0.0), s.waiting)
        first.setdefault(s.replica, s)
        last[s.replica] = s
    queues = " ".join(f"{peaks[r]:g}" for r in sorted(peaks)) or "-"
    rates = []
    for replica in sorted(last):
        queried = last[replica].queries - first[replica].queries
        hit = last[replica].hits - first[replica].hits
        rates.append(f"{100 * hit / queried:.0f}%/{queried / 1000:.0f}k" if queried else "-")
    answered = [r for r in requests if r["ttft"] is not None]
    worst = "no request answered"
    if answered:
        slowest = max(answered, key=lambda r: r["ttft"])
        worst = (
            f"slowest first token {slowest['ttft']:.2f}s "
            f"(sent at {slowest['sent']:.2f}s, {slowest['key']})"
        )
    return (
        f"      trace: peak waiting per replica {queues}; prefix hits/tokens queried per "
        f"replica {' '.join(rates) or '-'}; {worst}; {path}"
    )
