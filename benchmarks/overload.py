"""Overload: does critical traffic keep its latency while batch traffic floods the fleet?

First the fleet's capacity is measured (``--capacity`` skips this): with admission off, a
single stream of KV-heavy requests (long unique prompts, so KV use matters) at rising rates;
the capacity is the highest rate whose TTFT p90 stays within ``--climb`` x the lowest rate's.
Then, for each admission mode, a critical stream (priority 10) at half the capacity plus a batch
stream (priority -1) ramping from 0.5x to 3x the capacity, the two entering through different
epp processes (two epps sharing Redis, each behind its own Envoy), on one fresh fleet per run.
``queue`` derives its concurrency limit from the calibration (Little's law, see
:func:`_queue_limits`). ``--engine-priority F ...`` adds ``queue + engine priority`` rows: the
replicas run vLLM's ``--scheduling-policy priority``, epp writes each request's priority into
its body (``request.engine_priority``) and lets F x more batch in. ``--pool-reserve R ...``
adds rows with engine priority and a reserve for the pool instead of per endpoint
(``admission.pool_reserve``, :func:`_pool_limits`). ``--learned`` adds rows without any
hand-computed limit: ``queue`` as docs/admission.md's example configures it (fixed limits), and
``queue`` with the objectives alone, without and with a critical ``ttft_ms`` target
(``--critical-ttft-ms``): admission keeps room by the latency model's predictions
(epp.admission.objectives). Writes benchmarks/results/overload.md
(``--output``); docs/overload.md reads it.

    .venv/bin/python -m benchmarks.overload --repeat 2 --duration 60 --drain 20 --spill
    # about 17 minutes on 2 shared cores
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.loadgen import Outcome, Request, StageRun, poisson_arrivals, run_stage
from benchmarks.routers import FleetStack

ROOT = Path(__file__).resolve().parents[1]
MODES = ("off", "shed", "queue")
SPILL = "queue + spill"
DOCUMENTED = "queue as documented"
LEARNED = "queue, objectives only"
ENGINE = "queue + engine priority"
REDIS_URL = "redis://127.0.0.1:6379/0"
CRITICAL, BATCH = 10, -1
# Batch may spill (used only where an overflow pool is configured: the `spill` mode).
OBJECTIVES = {"critical": CRITICAL, "batch": {"priority": BATCH, "spill": True}}
BLOCK_TOKENS = 16  # the h100 profile's KV block size


def _request(objective: str, prompt: str, max_tokens: int) -> Request:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"x-gateway-inference-objective": objective}
    return Request("/v1/completions", json.dumps(body).encode(), headers)


def _ramp(start: float, end: float, duration: float, rng: random.Random) -> list[float]:
    """Poisson arrivals whose rate rises linearly from ``start`` to ``end`` per second."""
    out: list[float] = []
    steps = 10
    for i in range(steps):
        rate = start + (end - start) * (i + 0.5) / steps
        out += [i * duration / steps + t for t in poisson_arrivals(rate, duration / steps, rng)]
    return out


def _replica_metric(stack: FleetStack, name: str) -> list[float]:
    """One sample of a replica gauge or counter, per replica (label sets summed)."""
    out = []
    for address in stack.replica_addresses:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=2) as resp:
            text = resp.read().decode()
        out.append(
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(name + "{") or line.startswith(name + " ")
            )
        )
    return out


ENGINE_GAUGES = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)


def _engine_sampler(stack: FleetStack, until: float, into: list[tuple[float, ...]]) -> None:
    """Per gauge of ENGINE_GAUGES, its mean over the replicas, every 0.5 s until ``until``
    (monotonic): KV use is the report's, running and waiting say how full the engines were."""
    while time.monotonic() < until:
        into.append(tuple(statistics.fmean(_replica_metric(stack, g)) for g in ENGINE_GAUGES))
        time.sleep(0.5)


def _held(stack: FleetStack, index: int, priority: int) -> tuple[float, float]:
    """Requests of ``priority`` epp ``index`` held in its queue, and their total wait (s)."""
    name = "inference_extension_flow_control_request_queue_duration_seconds"
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.epp_ports[index][2]}/metrics") as resp:
        lines = resp.read().decode().splitlines()
    mine = [line for line in lines if f'priority="{priority}"' in line]
    count = sum(float(x.rsplit(" ", 1)[1]) for x in mine if x.startswith(name + "_count"))
    total = sum(float(x.rsplit(" ", 1)[1]) for x in mine if x.startswith(name + "_sum"))
    return count, total


def _spilled(stack: FleetStack, index: int) -> dict[str, int]:
    """``{"spilled": n}`` for the requests epp ``index`` sent to an overflow pool, if any."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.epp_ports[index][2]}/metrics") as resp:
        lines = resp.read().decode().splitlines()
    n = sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("epp_spilled_requests_total{")
    )
    return {"spilled (of served)": int(n)} if n else {}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _prompt(kind: str, i: int, words: int, documents: int = 0) -> str:
    """The request's own number starts the prompt, so no two requests share a KV block; with
    ``documents``, it ends the prompt instead, after one of that many shared documents."""
    text = "the quick brown fox jumps over a lazy dog " * (words // 9)
    if documents:
        return f"{kind} document {i % documents} {text} question {i}"
    return f"{kind} {i} " + text


def _requests(kind: str, count: int, args: argparse.Namespace) -> list[Request]:
    """``kind`` is the objective too (critical or batch)."""
    documents = args.batch_documents if kind == "batch" else 0
    return [
        _request(kind, _prompt(kind, i, args.prompt_words, documents), args.max_tokens)
        for i in range(count)
    ]


def _ttfts(outcomes: list[Outcome]) -> list[float]:
    return [o.ttft for o in outcomes if o.ok and o.ttft is not None]


def _sim_args(args: argparse.Namespace, policy: str = "fcfs") -> list[str]:
    return [
        "--profile",
        "h100",
        "--time-scale",
        str(args.time_scale),
        "--num-gpu-blocks",
        str(args.num_gpu_blocks),
        "--scheduling-policy",
        policy,
    ]


@dataclass(frozen=True, slots=True)
class Calibration:
    """The admission-off ramp: per rate, TTFT p50/p90 and mean latency; the capacity found."""

    stages: list[tuple[float, float, float, float]]  # rate, TTFT p50, TTFT p90, mean e2e
    capacity: float
    latency: float  # mean end-to-end latency at the capacity, seconds
    prompt_tokens: float  # mean prompt tokens per request, as the replicas counted them


def _stack(
    workdir: Path,
    args: argparse.Namespace,
    admission: dict[str, Any],
    epps: int = 2,
    engine_priority: bool = False,
    objectives: dict[str, Any] | None = None,
) -> FleetStack:
    """A fleet; with ``engine_priority`` its engines order and preempt by the body's
    priority, which epp writes there."""
    workdir.mkdir(parents=True)
    return FleetStack(
        workdir,
        replicas=args.replicas,
        epp_count=epps,
        redis_url=REDIS_URL,
        sim_args=_sim_args(args, "priority" if engine_priority else "fcfs"),
        config_extra={
            "store": {"key_prefix": f"epp-overload-{uuid.uuid4().hex[:8]}"},
            "admission": admission,
            # The objective header stands for a gateway in front that sets it.
            "request": {
                "objectives": objectives or OBJECTIVES,
                "engine_priority": engine_priority,
                "trusted_headers": True,
            },
        },
    )


def _calibrate(args: argparse.Namespace, workdir: Path) -> Calibration:
    stages: list[tuple[float, float, float, float]] = []
    stack = _stack(workdir / "calibrate", args, {"mode": "off"})
    with stack:
        stack.start(timeout=60)
        url = stack.pinned_envoy(0)
        rate = args.calibrate_step
        while rate <= args.calibrate_max:
            rng = random.Random(args.seed)
            at = poisson_arrivals(rate, args.calibrate_stage, rng)
            reqs = _requests("critical", len(at), args)
            run = asyncio.run(
                run_stage(url, reqs, at, request_timeout=120, drain_timeout=args.drain)
            )
            ttft = _ttfts(run.outcomes)
            e2e = [o.finished - o.started for o in run.outcomes if o.ok]
            stages.append((rate, _pct(ttft, 0.5), _pct(ttft, 0.9), statistics.fmean(e2e)))
            print(f"calibrate {rate:g}/s: TTFT p50 {stages[-1][1]:.3f} p90 {stages[-1][2]:.3f}")
            if stages[-1][2] > args.climb * stages[0][2]:
                break
            rate += args.calibrate_step
        counts = _replica_metric(stack, "vllm:request_prompt_tokens_count")
        sums = _replica_metric(stack, "vllm:request_prompt_tokens_sum")
    ok = [s for s in stages if s[2] <= args.climb * stages[0][2]]
    best = ok[-1] if ok else stages[0]
    return Calibration(stages, best[0], best[3], sum(sums) / max(1.0, sum(counts)))


def _queue_limits(
    cal: Calibration, args: argparse.Namespace, headroom: float, engine_priority: bool = False
) -> dict[str, Any]:
    """Flow control sized from the calibration and the engines' KV size, not guessed.

    Two limits on the requests epp has in flight per endpoint (requests rather than tokens:
    epp estimates a prompt's tokens from its characters, a quarter of what this tokenizer
    makes of these prompts, so a token limit would be in the wrong unit):

    - critical (``max_requests``): as many as the engine's KV cache holds. Critical work is
      held only when the engine could not start it anyway; below that it goes straight in.
    - batch: what a replica holds at the measured capacity. Little's law: at the capacity
      ``capacity x latency`` requests are in flight, ``/ replicas`` per replica
      (x ``headroom``). Past it, batch waits in epp rather than in the engines, where it
      would take the KV cache and the prefill time critical requests need.

    ``sheddable_reserve`` is the gap between the two. A ``headroom`` that takes batch past
    what the KV cache holds raises ``max_requests`` to it. With ``engine_priority`` (the
    engines order their own queues, critical first) critical gets a whole KV cache's worth of
    room above batch: it reaches an engine, which serves it ahead of the batch waiting there,
    rather than waiting in epp behind batch holding every slot. The utilisation
    thresholds are left to these limits (KV at 0.95, the waiting queue at 50: "past anything
    the limits allow"), and metrics may be 1 s old before they count as full (a noisy 2-core
    machine delays scrapes).
    """
    kv_requests = _kv_requests(cal, args)
    batch = cal.capacity * cal.latency / args.replicas * headroom
    critical = round(batch) + kv_requests if engine_priority else max(kv_requests, round(batch))
    return _queue(
        args,
        max_requests=critical,
        sheddable_reserve=round(max(0.0, 1 - batch / critical), 3),
        kv_threshold=0.95,
    )


def _pool_limits(reserve: int, max_requests: int, args: argparse.Namespace) -> dict[str, Any]:
    """Flow control with a reserve for the pool rather than per endpoint: every request may
    take an endpoint up to ``max_requests``, batch only while ``reserve`` of those slots stay
    free somewhere in the pool for critical work.
    The engines order their queues by priority (the rows run with engine priority), and the
    KV threshold is left to the counts (1.0): a KV cache full of running work must not hold
    critical work in epp when an engine queue would serve it first."""
    return _queue(args, max_requests=max_requests, pool_reserve=reserve, kv_threshold=1.0)


def _queue(args: argparse.Namespace, **limits: Any) -> dict[str, Any]:
    """Flow control with the given limits, the waiting-queue threshold past anything they
    allow, metrics trusted for 1 s, and the batch band's capacity and TTL."""
    return {
        "mode": "queue",
        **limits,
        "queue_threshold": 50,
        "stale_seconds": 1.0,
        "ttl": args.ttl,
        "bands": {BATCH: {"capacity": args.batch_capacity, "ttl": args.ttl}},
    }


def _kv_requests(cal: Calibration, args: argparse.Namespace) -> int:
    """Requests of this benchmark's size one engine's KV cache holds to the last output token."""
    return max(1, int(args.num_gpu_blocks * BLOCK_TOKENS // (cal.prompt_tokens + args.max_tokens)))


def _learned(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(label, admission section, objectives) of the rows without hand-computed limits: the
    documented example's fixed limits, the objectives alone, and with a critical target."""
    band = {BATCH: {"capacity": args.batch_capacity, "ttl": args.ttl}}
    documented = {"mode": "queue", "max_requests": 6, "sheddable_reserve": 0.34}
    learned = {"mode": "queue", "ttl": args.ttl, "bands": band}
    out = [(DOCUMENTED, documented | {"bands": {BATCH: {"ttl": 30}}}, OBJECTIVES)]
    out.append((LEARNED, learned, OBJECTIVES))
    for target in args.critical_ttft_ms:
        critical = {"priority": CRITICAL, "ttft_ms": target}
        label = f"queue, objectives + critical ttft_ms {target:g}"
        out.append((label, learned, {**OBJECTIVES, "critical": critical}))
    return out


def _variants(cal: Calibration, args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(label, admission section) per row: ``off`` and ``shed`` as before flow control
    (utilisation thresholds only), ``queue`` once per ``--headroom``."""
    out: list[tuple[str, dict[str, Any]]] = []
    for mode in args.modes:
        if mode != "queue":
            out.append((mode, {"mode": mode}))
            continue
        for h in args.headroom:
            out.append(("queue" if h == 1 else f"queue, batch x{h:g}", _queue_limits(cal, args, h)))
    if args.spill:
        out.append((SPILL, _queue_limits(cal, args, args.headroom[0])))
    for h in args.engine_priority:
        out.append((f"{ENGINE}, batch x{h:g}", _queue_limits(cal, args, h, engine_priority=True)))
    for r in args.pool_reserve:
        for m in args.pool_max_requests or [_kv_requests(cal, args)]:
            out.append((f"{ENGINE}, pool reserve {r} of {m}", _pool_limits(r, m, args)))
    return out


async def _measure(
    critical_url: str, batch_url: str, capacity: float, args: argparse.Namespace, batch: bool
) -> tuple[StageRun, StageRun | None]:
    rng = random.Random(args.seed)
    critical_at = poisson_arrivals(capacity / 2, args.duration, rng)
    critical = _requests("critical", len(critical_at), args)
    runs = [
        run_stage(
            critical_url, critical, critical_at, request_timeout=120, drain_timeout=args.drain
        )
    ]
    if batch:
        batch_at = _ramp(capacity / 2, 3 * capacity, args.duration, rng)
        requests = _requests("batch", len(batch_at), args)
        runs.append(
            run_stage(batch_url, requests, batch_at, request_timeout=120, drain_timeout=args.drain)
        )
    results = await asyncio.gather(*runs)
    return results[0], (results[1] if batch else None)


def _fate(o: Outcome) -> str:
    if o.ok:
        return "served"
    if o.error.startswith("HTTP 429") and "Retry after" in o.error:
        return "429 + Retry-After"
    return o.error.split(":")[0] if o.error.startswith("HTTP") else "error"


def _run_mode(
    mode: str,
    admission: dict[str, Any],
    cal: Calibration,
    args: argparse.Namespace,
    workdir: Path,
    objectives: dict[str, Any] | None = None,
) -> dict[str, Any]:
    engine = mode.startswith(ENGINE)
    stack = _stack(workdir / "home", args, admission, engine_priority=engine, objectives=objectives)
    with contextlib.ExitStack() as running:
        if mode == SPILL:
            # The other region: its own fleet behind its own Envoy and epp (admission off).
            region = running.enter_context(_stack(workdir / "region", args, {"mode": "off"}, 1))
            region.start(timeout=60)
            home = {"endpoints": stack.replica_addresses, "overflow": ["region"]}
            gateway = region.url.removeprefix("http://")
            overflow = {
                "gateway": [gateway],
                "endpoints": region.replica_addresses,
                # What the region holds at its capacity (Little's law, as for home batch).
                "max_requests": max(1, round(cal.capacity * cal.latency)),
            }
            stack.config_extra |= {"pools": {"main": home}, "overflow": {"region": overflow}}
        running.enter_context(stack)
        stack.start(timeout=60)
        critical_url, batch_url = stack.pinned_envoy(0), stack.pinned_envoy(1)
        unloaded: list[float] = []
        if mode == "off":
            alone, _ = asyncio.run(_measure(critical_url, batch_url, cal.capacity, args, False))
            unloaded = _ttfts(alone.outcomes)
        samples: list[tuple[float, ...]] = []
        sampler = threading.Thread(
            target=_engine_sampler,
            args=(stack, time.monotonic() + args.duration, samples),
            daemon=True,
        )
        sampler.start()
        critical, batch = asyncio.run(_measure(critical_url, batch_url, cal.capacity, args, True))
        sampler.join(10)
        held = _held(stack, 0, CRITICAL)
        spilled = _spilled(stack, 1)
        hits = sum(_replica_metric(stack, "vllm:prefix_cache_hits_total"))
        queries = sum(_replica_metric(stack, "vllm:prefix_cache_queries_total"))
    assert batch is not None
    ttft = _ttfts(critical.outcomes)
    # Goodput: batch requests completed within the arrival window (work still queued or
    # running when the load stops is not counted).
    first = min(o.started for o in batch.outcomes if o.started)
    in_window = sum(o.ok and o.finished - first <= args.duration for o in batch.outcomes)
    return {
        "mode": mode,
        "unloaded_ttft": unloaded,
        "critical_p50": _pct(ttft, 0.5),
        "critical_p99": _pct(ttft, 0.99),
        "critical_ok": sum(o.ok for o in critical.outcomes),
        "critical_sent": len(critical.outcomes),
        "critical_held": held,
        "batch_goodput": in_window / args.duration,
        "batch": dict(Counter(_fate(o) for o in batch.outcomes)) | spilled,
        "kv_mean": statistics.fmean(s[0] for s in samples) if samples else float("nan"),
        "hit_rate": hits / queries if queries else float("nan"),
        "engine_running": statistics.fmean(s[1] for s in samples) if samples else float("nan"),
        "engine_waiting": statistics.fmean(s[2] for s in samples) if samples else float("nan"),
    }


def _report(cal: Calibration, results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    unloaded = [t for r in results for t in r["unloaded_ttft"]]
    base50, base99 = _pct(unloaded, 0.5), _pct(unloaded, 0.99)
    left = cal.capacity / 2
    limits = [_queue_limits(cal, args, h) for h in args.headroom]
    lines = [
        "# Overload: critical latency under a batch flood",
        "",
        f"Generated by `.venv/bin/python -m benchmarks.overload` ({args.replicas} simulated h100 "
        f"replicas with {args.num_gpu_blocks} KV blocks of 16 tokens each, time scale "
        f"{args.time_scale:g}; prompts of about {cal.prompt_tokens:.0f} tokens, "
        f"{args.max_tokens} output tokens; {args.duration:g} s per run).",
        "",
        "## Capacity (admission off, one stream)",
        "",
        "| rate (/s) | TTFT p50 | TTFT p90 | mean latency |",
        "|---|---|---|---|",
        *(
            f"| {r:g} | {p50:.3f} s | {p90:.3f} s | {e2e:.2f} s |"
            for r, p50, p90, e2e in cal.stages
        ),
        "",
        f"Capacity: **{cal.capacity:g}/s**, the highest rate whose TTFT p90 stayed within "
        f"{args.climb:g}x the lowest rate's (mean latency there {cal.latency:.2f} s).",
        "",
        "## Critical at half the capacity, batch ramping to 3x",
        "",
        f"Critical (priority {CRITICAL}) at {left:g}/s through epp 0; batch (priority {BATCH}) "
        f"ramping {left:g} -> {3 * cal.capacity:g}/s through epp 1 (two epps sharing Redis, "
        "each behind its own Envoy). `off` and `shed` use the utilisation thresholds only (the "
        "behaviour before flow control); `queue` (see `_queue_limits`) uses "
        f"`max_requests: {limits[0]['max_requests']}` per endpoint (what the engine's KV "
        "cache holds) and a `sheddable_reserve` that holds batch back past what a replica "
        "holds at the measured capacity (x the batch factor in the row's name): "
        + ", ".join(f"{r['sheddable_reserve']:g}" for r in limits)
        + f"; batch TTL {args.ttl:g} s, batch band capacity {args.batch_capacity}."
        + (
            f" `{SPILL}`: `queue`, plus a second fleet like the first (its own Envoy and "
            "epp, admission off) as the home pool's overflow pool; batch is spill-eligible, "
            "`max_requests` of the overflow is what that fleet holds at the capacity."
            if args.spill
            else ""
        )
        + (
            f" `{ENGINE}, batch xF`: `queue` with batch factor F, the replicas run vLLM's "
            "`--scheduling-policy priority` and epp writes each request's priority into its "
            f"body as vLLM's `priority` (`request.engine_priority: true`; critical "
            f"{-CRITICAL}, batch {-BATCH}: lower is served first); critical's `max_requests` "
            "is the batch limit plus what the KV cache holds: "
            + ", ".join(
                f"x{h:g}: {lim['max_requests']} (reserve {lim['sheddable_reserve']:g})"
                for h in args.engine_priority
                for lim in [_queue_limits(cal, args, h, engine_priority=True)]
            )
            + "."
            if args.engine_priority
            else ""
        )
        + (
            f" `{ENGINE}, pool reserve R of M`: the engines order their queues by priority "
            "as above, every request may take an endpoint up to `max_requests: M` "
            f"({_kv_requests(cal, args)} is what one engine's KV cache holds), batch only "
            "while the pool keeps R of those slots free for critical "
            "(`admission.pool_reserve: R`, no per-endpoint reserve, `kv_threshold: 1.0`)."
            if args.pool_reserve
            else ""
        ),
        "",
        f"Unloaded critical TTFT (critical alone, admission off): p50 {base50:.3f} s, "
        f"p99 {base99:.3f} s.",
        "",
        "| admission | run | critical TTFT p50 | critical TTFT p99 (x unloaded) | critical ok "
        f"| critical held by epp (n, mean) | batch goodput (/s, % of the {left:g}/s left) "
        "| mean KV use | prefix-cache hit rate | engine running / waiting | batch outcomes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p99, goodput = r["critical_p99"], r["batch_goodput"]
        lines.append(
            f"| {r['mode']} | {r['run']} | {r['critical_p50']:.3f} s "
            f"| {p99:.3f} s ({p99 / base99:.1f}x) | {r['critical_ok']}/{r['critical_sent']} "
            f"| {_held_text(r['critical_held'])} "
            f"| {goodput:.2f} ({100 * goodput / left:.0f}%) "
            f"| {100 * r['kv_mean']:.1f}% | {100 * r['hit_rate']:.0f}% "
            f"| {r['engine_running']:.1f} / {r['engine_waiting']:.1f} | {r['batch']} |"
        )
    return "\n".join(lines) + "\n"


def _held_text(held: tuple[float, float]) -> str:
    count, total = held
    return f"{count:.0f}, {1000 * total / count:.0f} ms" if count else "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=float, help="skip calibration: fleet capacity, req/s")
    parser.add_argument("--latency", type=float, default=2.0, help="with --capacity: latency, s")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--time-scale", type=float, default=3.0)
    parser.add_argument("--num-gpu-blocks", type=int, default=300)
    parser.add_argument("--prompt-words", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--calibrate-step", type=float, default=1.0)
    parser.add_argument("--calibrate-max", type=float, default=20.0)
    parser.add_argument("--calibrate-stage", type=float, default=15.0)
    parser.add_argument("--climb", type=float, default=1.5, help="TTFT p90 growth = saturated")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--drain", type=float, default=30.0)
    parser.add_argument(
        "--headroom", type=float, nargs="+", default=[1.0, 1.5], help="queue: batch limit factors"
    )
    parser.add_argument("--batch-capacity", type=int, default=64)
    parser.add_argument(
        "--batch-documents",
        type=int,
        default=0,
        metavar="K",
        help="batch prompts share one of K documents (0: every prompt unique)",
    )
    parser.add_argument("--ttl", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--spill",
        action="store_true",
        help="add a queue + spill run: a second fleet (its own Envoy and epp) as overflow pool",
    )
    parser.add_argument(
        "--engine-priority",
        type=float,
        nargs="*",
        default=[],
        metavar="F",
        help="add a queue + engine priority run per batch factor F (engines ordering and "
        "preempting by priority, which epp writes into the body)",
    )
    parser.add_argument(
        "--pool-reserve",
        type=int,
        nargs="*",
        default=[],
        metavar="R",
        help="add a queue + engine priority run per R with admission.pool_reserve R (batch "
        "fills endpoints while R request slots stay free in the pool)",
    )
    parser.add_argument(
        "--pool-max-requests",
        type=int,
        nargs="*",
        default=[],
        metavar="M",
        help="with --pool-reserve: a row per max_requests M per endpoint (default: what one "
        "engine's KV cache holds)",
    )
    parser.add_argument(
        "--learned",
        action="store_true",
        help="add rows without hand-computed limits: queue as the docs' example configures it, "
        "and queue with the objectives alone (and with each --critical-ttft-ms target)",
    )
    parser.add_argument(
        "--critical-ttft-ms",
        type=float,
        nargs="*",
        default=[],
        metavar="MS",
        help="with --learned: a row per critical ttft_ms target",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "overload.md",
        help="the generated report (docs/overload.md, written by hand, quotes its rows)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="epp-overload-") as tmp:
        if args.capacity is None:
            cal = _calibrate(args, Path(tmp))
        else:
            prompt = args.prompt_words * 2.2  # this tokenizer's ratio on these prompts
            cal = Calibration([], args.capacity, args.latency, prompt)
        results = []
        rows = [(m, a, OBJECTIVES) for m, a in _variants(cal, args)]
        rows += _learned(args) if args.learned else []
        for run in range(1, args.repeat + 1):
            for i, (mode, admission, objectives) in enumerate(rows):
                workdir = Path(tmp) / f"{i}-{run}"
                result = _run_mode(mode, admission, cal, args, workdir, objectives)
                results.append({**result, "run": run})
                print(json.dumps({k: v for k, v in result.items() if k != "unloaded_ttft"}))
    report = _report(cal, results, args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
