"""Fairness and priority across epp processes: do shares and bands hold for the whole group?

Simulated replicas behind the real Envoy, flow control in ``queue`` mode with a concurrency
limit per replica (``--slots`` in flight each), so the pool is saturated throughout: every
client is closed-loop (it sends its next request when the last one is answered) and there are
many more clients than slots.

- Fairness: two tenants (fairness ids) in one band offering 10:1 load (``--light`` clients
  against ten times as many heavy ones). With one epp both enter through it; with two epps
  (sharing Redis, each behind its own Envoy) the heavy tenant's clients are split over both
  and the light tenant reaches only epp 0. Two-epp rows run with ``admission.scope: local``
  (each epp orders its own queue: the behaviour before) and ``group`` (dispatch ordered over
  both epps' queues). Reported: requests served per tenant in the measurement window, and how
  often both tenants had work waiting (sampled from the epps' queue gauges).
- Priority: critical clients (priority 10) enter through epp 0, batch clients (priority -1)
  through epp 1; reported: how long critical requests were held by epp 0 and their latency,
  with ``local`` and ``group``.

    .venv/bin/python -m benchmarks.fairness --duration 60   # about 8 minutes on 2 shared cores

Report: docs/fairness.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.overload import _pct
from benchmarks.routers import FleetStack

ROOT = Path(__file__).resolve().parents[1]
REDIS_URL = "redis://127.0.0.1:6379/0"
QUEUE_SIZE = "inference_extension_flow_control_queue_size"
QUEUE_WAIT = "inference_extension_flow_control_request_queue_duration_seconds"


@dataclass(frozen=True, slots=True)
class Done:
    """One answered request: who sent it, through which epp, when it ended, its status."""

    tenant: str
    epp: int
    started: float
    finished: float
    status: int


async def _client(
    session: aiohttp.ClientSession,
    url: str,
    tenant: str,
    epp: int,
    headers: dict[str, str],
    until: float,
    args: argparse.Namespace,
    out: list[Done],
) -> None:
    """Closed loop: one request at a time until ``until`` (event-loop time)."""
    loop = asyncio.get_running_loop()
    n = 0
    while loop.time() < until:
        n += 1
        # Streamed, as inference clients do: epp then follows the response to its end, and the
        # request counts in flight (against max_requests) until the last token.
        body = {
            "model": "tiny",
            "prompt": f"{tenant} {n} " + "hello " * 20,
            "max_tokens": args.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = loop.time()
        try:
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
                await resp.read()
                status = resp.status
        except aiohttp.ClientError:
            status = 0
        out.append(Done(tenant, epp, started, loop.time(), status))
        if status != 200:
            await asyncio.sleep(0.05)  # a refusal: do not spin


async def _load(
    clients: list[tuple[str, str, int, dict[str, str]]], seconds: float, args: argparse.Namespace
) -> tuple[list[Done], float]:
    """Run every (url, tenant, epp, headers) client for ``seconds``; returns what ended and
    the event-loop time the load started."""
    out: list[Done] = []
    loop = asyncio.get_running_loop()
    start = loop.time()
    timeout = aiohttp.ClientTimeout(total=args.ttl + 30)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        await asyncio.gather(
            *(
                _client(session, url, tenant, epp, headers, start + seconds, args, out)
                for url, tenant, epp, headers in clients
            )
        )
    return out, start


def _metrics(stack: FleetStack, index: int) -> list[str]:
    port = stack.epp_ports[index][2]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        lines: list[str] = resp.read().decode().splitlines()
    return lines


def _sample_waiting(stack: FleetStack, until: float, into: list[dict[str, float]]) -> None:
    """Every 0.5 s until ``until`` (monotonic): requests held per fairness id, all epps."""
    while time.monotonic() < until:
        held: Counter[str] = Counter()
        for index in range(stack.epp_count):
            for line in _metrics(stack, index):
                if line.startswith(QUEUE_SIZE + "{"):
                    flow = line.split('fairness_id="', 1)[1].split('"', 1)[0]
                    held[flow] += round(float(line.rsplit(" ", 1)[1]))
        into.append(dict(held))
        time.sleep(0.5)


def _held(stack: FleetStack, index: int, priority: int) -> tuple[float, float]:
    """Requests of ``priority`` epp ``index`` dispatched from its queue, and their total wait."""
    mine = [
        line
        for line in _metrics(stack, index)
        if f'priority="{priority}"' in line and 'outcome="dispatched"' in line
    ]
    count = sum(float(x.rsplit(" ", 1)[1]) for x in mine if x.startswith(QUEUE_WAIT + "_count"))
    total = sum(float(x.rsplit(" ", 1)[1]) for x in mine if x.startswith(QUEUE_WAIT + "_sum"))
    return count, total


def _stack(workdir: Path, args: argparse.Namespace, epps: int, scope: str) -> FleetStack:
    workdir.mkdir(parents=True)
    return FleetStack(
        workdir,
        replicas=args.replicas,
        epp_count=epps,
        redis_url=REDIS_URL,
        sim_args=["--profile", "h100", "--time-scale", str(args.time_scale)],
        config_extra={
            "store": {"key_prefix": f"epp-fairness-{uuid.uuid4().hex[:8]}"},
            "admission": {
                "mode": "queue",
                "scope": scope,
                "max_requests": args.slots,
                # Room is the concurrency limit alone: the utilisation signals out of the way.
                "kv_threshold": 0.99,
                "queue_threshold": 1000,
                "stale_seconds": 1.0,
                "ttl": args.ttl,
            },
            # The fairness and objective headers stand for a gateway in front that sets them.
            "request": {"objectives": {"critical": 10, "batch": -1}, "trusted_headers": True},
            # Passive health's latency outlier detection ejects a replica that a saturated
            # pool keeps busier than the other for a moment, halving the pool for 5 s: noise
            # in a measurement of shares.
            "health": {"enabled": False},
        },
    )


def _fairness(
    label: str, epps: int, scope: str, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    stack = _stack(tmp / f"fair-{epps}-{scope}", args, epps, scope)
    with stack:
        stack.start(timeout=60)
        urls = [stack.pinned_envoy(i) for i in range(epps)]
        clients = []
        for i in range(10 * args.light):  # heavy: spread over every epp
            clients.append(
                (urls[i % epps], "heavy", i % epps, {"x-gateway-inference-fairness-id": "heavy"})
            )
        for _ in range(args.light):  # light: epp 0 only
            clients.append((urls[0], "light", 0, {"x-gateway-inference-fairness-id": "light"}))
        samples: list[dict[str, float]] = []
        seconds = args.warmup + args.duration
        sampler = threading.Thread(
            target=_sample_waiting,
            args=(stack, time.monotonic() + seconds, samples),
            daemon=True,
        )
        sampler.start()
        done, start = asyncio.run(_load(clients, seconds, args))
        sampler.join(10)
    window = [d for d in done if start + args.warmup <= d.finished <= start + seconds]
    served = Counter(d.tenant for d in window if d.status == 200)
    by_epp = Counter((d.tenant, d.epp) for d in window if d.status == 200)
    measured = samples[int(args.warmup / 0.5) :]
    both = sum(1 for s in measured if s.get("heavy", 0) > 0 and s.get("light", 0) > 0)
    return {
        "setup": label,
        "served": dict(served),
        "by_epp": {f"{t}@{e}": n for (t, e), n in sorted(by_epp.items())},
        "errors": sum(1 for d in window if d.status != 200),
        "both_waiting": both / len(measured) if measured else float("nan"),
        "light_over_heavy": served["light"] / served["heavy"] if served["heavy"] else float("nan"),
    }


def _priority(scope: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    stack = _stack(tmp / f"prio-{scope}", args, 2, scope)
    with stack:
        stack.start(timeout=60)
        critical_url, batch_url = stack.pinned_envoy(0), stack.pinned_envoy(1)
        critical = {"x-gateway-inference-objective": "critical"}
        batch = {"x-gateway-inference-objective": "batch"}
        clients = [(critical_url, "critical", 0, critical)] * args.critical
        clients += [(batch_url, "batch", 1, batch)] * (10 * args.critical)
        done, start = asyncio.run(_load(clients, args.warmup + args.duration, args))
        held = _held(stack, 0, 10)
    window = [d for d in done if d.finished >= start + args.warmup and d.status == 200]
    latency = [d.finished - d.started for d in window if d.tenant == "critical"]
    return {
        "setup": scope,
        "critical_served": len(latency),
        "batch_served": sum(1 for d in window if d.tenant == "batch"),
        "critical_held": held,
        "critical_p50": _pct(latency, 0.5),
        "critical_p99": _pct(latency, 0.99),
        "errors": sum(1 for d in done if d.status != 200),
    }


def _report(
    fair: list[dict[str, Any]], prio: list[dict[str, Any]], args: argparse.Namespace
) -> str:
    lines = [
        "# Fairness and priority across epp processes",
        "",
        f"Generated by `.venv/bin/python -m benchmarks.fairness --duration {args.duration:g}` "
        f"({args.replicas} simulated h100 replicas, time scale {args.time_scale:g}, "
        f"{args.max_tokens} output tokens per request; flow control `queue` with "
        f"`max_requests: {args.slots}` per replica, so {args.replicas * args.slots} requests "
        "in flight at most; every client closed-loop; the first "
        f"{args.warmup:g} s of each {args.warmup + args.duration:g} s run are not counted).",
        "",
        "## Two tenants in one band, 10:1 load",
        "",
        f"Heavy: {10 * args.light} clients (split over the epps); light: {args.light} clients "
        "(epp 0 only). Served: requests answered 200 inside the window, per tenant; `both "
        "waiting`: share of 0.5 s samples of the epps' queue gauges in which both tenants had "
        "requests held.",
        "",
        "| set-up | run | heavy served | light served | light / heavy | per epp | both waiting "
        "| errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in fair:
        lines.append(
            f"| {r['setup']} | {r['run']} | {r['served'].get('heavy', 0)} "
            f"| {r['served'].get('light', 0)} | {r['light_over_heavy']:.2f} "
            f"| {r['by_epp']} | {100 * r['both_waiting']:.0f}% | {r['errors']} |"
        )
    lines += [
        "",
        "## Critical on epp 0, batch on epp 1",
        "",
        f"{args.critical} critical clients (priority 10) through epp 0, {10 * args.critical} batch "
        "clients (priority -1) through epp 1, two epps sharing Redis. `critical held`: critical "
        "requests epp 0 dispatched from its queue and their mean wait there.",
        "",
        "| scope | run | critical served | critical held (n, mean wait) | critical latency p50 "
        "| critical latency p99 | batch served | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in prio:
        count, total = r["critical_held"]
        held = f"{count:.0f}, {1000 * total / count:.0f} ms" if count else "0"
        lines.append(
            f"| {r['setup']} | {r['run']} | {r['critical_served']} | {held} "
            f"| {r['critical_p50']:.3f} s | {r['critical_p99']:.3f} s | {r['batch_served']} "
            f"| {r['errors']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2, help="max_requests per replica")
    parser.add_argument("--time-scale", type=float, default=3.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--light", type=int, default=8, help="light clients (heavy: 10x)")
    parser.add_argument("--critical", type=int, default=2, help="critical clients (batch: 10x)")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--ttl", type=float, default=120.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "fairness.md")
    args = parser.parse_args()
    fair: list[dict[str, Any]] = []
    prio: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="epp-fairness-") as tmp:
        for run in range(1, args.repeat + 1):
            for label, epps, scope in [
                ("one epp", 1, "group"),
                ("two epps, scope local (before)", 2, "local"),
                ("two epps, scope group", 2, "group"),
            ]:
                result = _fairness(label, epps, scope, args, Path(tmp) / str(run))
                fair.append({**result, "run": run})
                print(json.dumps(fair[-1]), flush=True)
            for scope in ("local", "group"):
                prio.append({**_priority(scope, args, Path(tmp) / str(run)), "run": run})
                print(json.dumps(prio[-1]), flush=True)
    report = _report(fair, prio, args)
    args.output.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
