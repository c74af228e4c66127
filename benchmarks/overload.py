"""Overload: does critical traffic keep its latency while batch traffic floods the fleet?

A critical stream (priority 10) at a fixed rate, half of ``--capacity`` (what the simulated
fleet serves without queueing), plus a batch stream (priority -1) ramping from 0.5x to 3x the
capacity. The two streams enter through different epp processes (two epps sharing Redis, each
behind its own Envoy), on one fleet, for each admission mode: ``off``, ``shed`` (the behaviour
before flow control) and ``queue`` (flow control). Report: docs/overload.md.

    .venv/bin/python -m benchmarks.overload            # about 4 minutes on 2 shared cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

from benchmarks.loadgen import Outcome, Request, poisson_arrivals, run_stage
from benchmarks.routers import FleetStack
from epp.config import load_config
from epp.devstack import envoy_binary, free_port, http_ok
from epp.envoy_config import render

ROOT = Path(__file__).resolve().parents[1]
MODES = ("off", "shed", "queue")
REDIS_URL = "redis://127.0.0.1:6379/0"


def _request(priority: int, prompt: str, max_tokens: int) -> Request:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return Request("/v1/completions", json.dumps(body).encode(), {"x-priority": str(priority)})


def _ramp(start: float, end: float, duration: float, rng: random.Random) -> list[float]:
    """Poisson arrivals whose rate rises linearly from ``start`` to ``end`` per second."""
    out: list[float] = []
    steps = 10
    for i in range(steps):
        rate = start + (end - start) * (i + 0.5) / steps
        out += [i * duration / steps + t for t in poisson_arrivals(rate, duration / steps, rng)]
    return out


def _pinned_envoy(stack: FleetStack, index: int) -> str:
    """An extra Envoy whose ext_proc goes to epp ``index`` only; returns its URL."""
    port, health, _ = stack.epp_ports[index]
    listen, admin = free_port(), free_port()
    path = stack.workdir / f"envoy-epp{index}.yaml"
    path.write_text(
        render(
            load_config(stack.config_path),
            mode=stack.mode,
            listen=f"127.0.0.1:{listen}",
            admin=f"127.0.0.1:{admin}",
            extproc=[f"127.0.0.1:{port}"],
            health=[health],
        )
    )
    stack.spawn(
        f"envoy-epp{index}",
        [envoy_binary(), "-c", str(path), "--log-level", "warn", "--base-id", str(admin)],
    )
    deadline = time.monotonic() + 30
    while not http_ok(f"http://127.0.0.1:{admin}/ready"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"Envoy for epp{index} did not become ready")
        time.sleep(0.1)
    return f"http://127.0.0.1:{listen}"


def _kv_sampler(stack: FleetStack, stop: threading.Event, into: list[float]) -> None:
    import urllib.request

    while not stop.wait(0.5):
        values = []
        for address in stack.replica_addresses:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=2) as resp:
                for line in resp.read().decode().splitlines():
                    if line.startswith("vllm:kv_cache_usage_perc"):
                        values.append(float(line.rsplit(" ", 1)[1]))
        if values:
            into.append(statistics.fmean(values))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _measure(
    critical_url: str, batch_url: str, args: argparse.Namespace, batch: bool
) -> tuple[list[Outcome], list[Outcome]]:
    rng = random.Random(args.seed)
    critical_at = poisson_arrivals(args.capacity / 2, args.duration, rng)
    critical = [_request(10, f"critical {i} " * 20, args.max_tokens) for i in critical_at]
    runs = [
        run_stage(critical_url, critical, critical_at, request_timeout=60, drain_timeout=args.drain)
    ]
    if batch:
        batch_at = _ramp(args.capacity / 2, 3 * args.capacity, args.duration, rng)
        requests = [_request(-1, f"batch {i} " * 20, args.max_tokens) for i in batch_at]
        runs.append(
            run_stage(batch_url, requests, batch_at, request_timeout=60, drain_timeout=args.drain)
        )
    results = await asyncio.gather(*runs)
    return results[0].outcomes, (results[1].outcomes if batch else [])


def _admission(mode: str, args: argparse.Namespace) -> dict[str, object]:
    """``off`` and ``shed`` as before flow control (utilisation thresholds only); ``queue``
    with per-endpoint concurrency limits and a share of them reserved for priority >= 0."""
    if mode != "queue":
        return {"mode": mode}
    return {
        "mode": mode,
        "max_requests": args.max_requests,
        "sheddable_reserve": args.reserve,
        "ttl": args.ttl,
        "bands": {-1: {"capacity": args.batch_capacity, "ttl": args.ttl}},
    }


def _run_mode(mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    stack = FleetStack(
        workdir / mode,
        replicas=args.replicas,
        epp_count=2,
        redis_url=REDIS_URL,
        sim_args=["--profile", "h100", "--time-scale", str(args.time_scale)],
        config_extra={
            "store": {"key_prefix": f"epp-overload-{uuid.uuid4().hex[:8]}"},
            "admission": _admission(mode, args),
        },
    )
    (workdir / mode).mkdir(parents=True)
    with stack:
        stack.start(timeout=60)
        critical_url, batch_url = _pinned_envoy(stack, 0), _pinned_envoy(stack, 1)
        unloaded: list[Outcome] = []
        if mode == "off":
            unloaded, _ = asyncio.run(_measure(critical_url, batch_url, args, batch=False))
        kv: list[float] = []
        stop = threading.Event()
        sampler = threading.Thread(target=_kv_sampler, args=(stack, stop, kv), daemon=True)
        sampler.start()
        critical, batch = asyncio.run(_measure(critical_url, batch_url, args, batch=True))
        stop.set()
        sampler.join(5)
    ttft = [o.ttft for o in critical if o.ok and o.ttft is not None]
    outcomes = Counter(
        "served" if o.ok else (o.error.split(":")[0] if o.error.startswith("HTTP") else "error")
        for o in batch
    )
    return {
        "mode": mode,
        "unloaded_ttft": [o.ttft for o in unloaded if o.ok and o.ttft is not None],
        "critical_p50": _pct(ttft, 0.5),
        "critical_p99": _pct(ttft, 0.99),
        "critical_ok": sum(o.ok for o in critical),
        "critical_sent": len(critical),
        "batch_goodput": outcomes["served"] / args.duration,
        "batch": dict(outcomes),
        "kv_mean": statistics.fmean(kv) if kv else float("nan"),
    }


def _report(results: list[dict[str, object]], args: argparse.Namespace) -> str:
    unloaded = [t for r in results for t in r["unloaded_ttft"]]  # type: ignore[attr-defined]
    base50, base99 = _pct(unloaded, 0.5), _pct(unloaded, 0.99)
    left = args.capacity / 2
    lines = [
        "# Overload: critical latency under a batch flood",
        "",
        f"Generated by `.venv/bin/python -m benchmarks.overload` ({args.replicas} simulated h100 "
        f"replicas at time scale {args.time_scale:g}, {args.duration:g} s per mode). Critical "
        f"(priority 10) at {args.capacity / 2:g}/s through epp 0; batch (priority -1) ramping "
        f"{args.capacity / 2:g} -> {3 * args.capacity:g}/s through epp 1 (two epps sharing "
        f"Redis, each behind its own Envoy). `--capacity {args.capacity:g}` is the rate the "
        "fleet was assumed to serve without queueing (not calibrated in this run). `off` and "
        "`shed` use the utilisation thresholds only (the behaviour before flow control); "
        f"`queue` adds `max_requests: {args.max_requests}` per endpoint with "
        f"`sheddable_reserve: {args.reserve:g}`, queue TTL {args.ttl:g} s.",
        "",
        f"Unloaded critical TTFT: p50 {base50:.3f} s, p99 {base99:.3f} s.",
        "",
        "| admission | critical TTFT p50 | critical TTFT p99 (x unloaded) | critical ok | "
        "batch goodput (/s, % of the capacity left) | mean KV use | batch outcomes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p99 = float(r["critical_p99"])  # type: ignore[arg-type]
        goodput = float(r["batch_goodput"])  # type: ignore[arg-type]
        lines.append(
            f"| {r['mode']} | {float(r['critical_p50']):.3f} s "  # type: ignore[arg-type]
            f"| {p99:.3f} s ({p99 / base99:.1f}x) | {r['critical_ok']}/{r['critical_sent']} "
            f"| {goodput:.2f} ({100 * goodput / left:.0f}%) "
            f"| {100 * float(r['kv_mean']):.1f}% | {r['batch']} |"  # type: ignore[arg-type]
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=float, default=8.0, help="fleet capacity, req/s")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--drain", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-requests", type=int, default=4)
    parser.add_argument("--batch-capacity", type=int, default=64)
    parser.add_argument("--ttl", type=float, default=10.0)
    parser.add_argument("--reserve", type=float, default=0.25, help="sheddable_reserve")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "overload.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="epp-overload-") as tmp:
        results = [_run_mode(mode, args, Path(tmp)) for mode in args.modes]
    report = _report(results, args)
    args.output.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
