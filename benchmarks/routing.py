"""Routing quality: epp's profiles against round robin, least request and the open routers.

One run measures every router on the same simulated fleet shape and the same deterministic
workloads, side by side. Per router and workload it starts a fresh fleet (empty caches), then
drives open-loop Poisson stages of increasing rate through that router's front door with
streaming requests, and reads TTFT, throughput, errors, the replicas' own prefix-cache counters
and the spread of requests over replicas. Stages of one router run back to back on warm caches
(as a load test ramping up a live system would); the first stage includes the cold start, for
every router alike.

The KV cache is sized so the shared-prefix workload's system prompts need ``--kv-ratio`` of
the whole fleet's KV: a router that spreads each group over all replicas makes every replica
hold every prefix and thrash; one that keeps groups together can hold them all.

Usage: ``python -m benchmarks.routing [--quick] [--routers a,b] [--workloads a,b]``.
Writes ``docs/benchmarks.md`` and ``docs/img/routing-*.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.loadgen import StageRun, poisson_arrivals, run_stage
from benchmarks.oracle import Oracle
from benchmarks.report import (
    Row,
    Run,
    load_run,
    markdown,
    plots,
    progress_line,
    save_run,
    text_table,
)
from benchmarks.routers import Fleet, FleetStack, Router, all_routers, available, named_routers
from benchmarks.trace import sum_samples, traced
from benchmarks.workloads import WORKLOADS, Item, SharedPrefix, Workload, warmup

ROOT = Path(__file__).resolve().parent.parent
# Raw results (JSON) live beside the benchmarks, not among the user documents in docs/.
RESULTS = ROOT / "benchmarks" / "results"
BLOCK_SIZE = 16
# Offered rates (requests per wall-clock second) per workload at the default time scale (3):
# from below round robin's saturation to past the best router's. Calibrated on this 2-core
# machine; docs/benchmarks.md says how.
RATES = {
    "shared-prefix": [4.0, 10.0, 16.0, 24.0, 32.0],
    # Past 24/s every router is bound by the fleet's KV: 32/s shows who holds that plateau.
    "multi-turn": [8.0, 16.0, 24.0, 32.0],
    # The LoRA mix needs little KV: cache-aware routers only part ways past ~32/s, and epp's
    # profiles still serve 48/s in full (so its throughput there is the offered load).
    "lora": [16.0, 32.0, 48.0, 64.0],
    # Not in the default run: the learned-latency benchmark's workload (benchmarks.learned).
    "mixed": [8.0, 16.0],
}
# --quick: one stage past round robin's saturation, so routing still shows; shared-prefix only
# unless --workloads says otherwise (every router x workload pair restarts a fleet).
QUICK_RATES = {"shared-prefix": [12.0], "multi-turn": [12.0], "lora": [12.0], "mixed": [12.0]}
QUICK_WORKLOADS = ["shared-prefix"]
# Warm-up requests per second (--warmup): on 8 replicas, 3/s for 10 s gives each a few
# responses to learn from while keeping the fleet far from busy (a cold 2,300-token prefill
# takes ~0.45 s on a fast replica at time scale 3).
WARMUP_RATE = 3.0
DEFAULT_WORKLOADS = ["shared-prefix", "multi-turn", "lora"]
COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
)
# The same counters in SGLang's names (--engine sglang; docs/sglang.md).
SGLANG_COUNTERS = dict(
    zip(
        COUNTERS,
        (
            "sglang:cached_tokens_total",
            "sglang:prompt_tokens_total",
            "sglang:num_requests_total",
            "sglang:num_retracted_requests_total",
        ),
        strict=True,
    )
)

T = TypeVar("T")


@dataclass
class Stage:
    """One rate of one workload: the same requests and send times for every router."""

    rate: float
    items: list[Item]
    arrivals: list[float]
    oracle_hit_rate: float

    def after(self) -> list[int | None] | None:
        """For each request, the earlier one of its conversation it waits for (None when
        the workload has no waiting turns)."""
        last: dict[str, int] = {}
        out: list[int | None] = []
        for i, item in enumerate(self.items):
            out.append(None if item.follows is None else last.get(item.follows))
            if item.follows is not None:
                last[item.follows] = i
        return out if any(a is not None for a in out) else None

    def think(self) -> list[float] | None:
        """Each request's think time after the turn it waits for (None when all are 0)."""
        out = [item.think for item in self.items]
        return out if any(out) else None


def plan(workload: Workload, rates: Sequence[float], duration: float, fleet: Fleet) -> list[Stage]:
    """Draw every stage's requests up front (tokenizing is not part of the measurement) and
    replay them through the oracle."""
    stream = workload.stream()
    oracle = Oracle(fleet.replicas, fleet.num_gpu_blocks, fleet.block_size)
    stages = []
    for i, rate in enumerate(rates):
        arrivals = poisson_arrivals(rate, duration, random.Random(f"{workload.seed}/{i}"))
        items = [next(stream) for _ in arrivals]
        stages.append(Stage(rate, items, arrivals, oracle.replay(items)))
    return stages


def replica_counters(addresses: Sequence[str], engine: str) -> dict[str, dict[str, float]]:
    """The counters this benchmark reads from each replica's /metrics, summed over labels,
    under their vLLM names whatever the engine."""
    names = SGLANG_COUNTERS if engine == "sglang" else {n: n for n in COUNTERS}
    out: dict[str, dict[str, float]] = {}
    for address in addresses:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
            page = resp.read().decode()
        values = sum_samples(page, names.values())
        out[address] = {ours: values[theirs] for ours, theirs in names.items()}
    return out


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time of these processes (all their threads), from /proc."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of sorted values; NaN when there are none."""
    if not values:
        return math.nan
    pos = (len(values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def summarize(
    workload: str,
    router: str,
    stage: Stage,
    run: StageRun,
    delta: dict[str, dict[str, float]],
    cpu: tuple[float, float],
    slo: float = math.inf,
) -> Row:
    ok = [o for o in run.outcomes if o.ok]
    ttfts = sorted(o.ttft for o in ok if o.ttft is not None)
    busy = run.busy_s or math.nan
    hits = sum(d["vllm:prefix_cache_hits_total"] for d in delta.values())
    queries = sum(d["vllm:prefix_cache_queries_total"] for d in delta.values())
    served = [d["vllm:request_success_total"] for d in delta.values()]
    mean = statistics.fmean(served) if served else 0.0
    errors = [o.error for o in run.outcomes if not o.ok]
    return Row(
        workload=workload,
        router=router,
        rate=stage.rate,
        sent=len(run.outcomes),
        errors=len(errors),
        req_s=len(ok) / busy,
        out_tok_s=sum(o.output_tokens for o in ok) / busy,
        ttft_p50=percentile(ttfts, 0.50),
        ttft_p90=percentile(ttfts, 0.90),
        ttft_p99=percentile(ttfts, 0.99),
        hit_rate=hits / queries if queries else 0.0,
        oracle_hit_rate=stage.oracle_hit_rate,
        load_cv=statistics.pstdev(served) / mean if mean else math.nan,
        preemptions=int(sum(d["vllm:num_preemptions_total"] for d in delta.values())),
        sim_cpu=cpu[0],
        router_cpu=cpu[1],
        send_lag=run.max_send_lag_s,
        first_error=errors[0] if errors else "",
        slo_met=sum(1 for t in ttfts if t <= slo) / len(run.outcomes) if run.outcomes else math.nan,
    )


def _run_async(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def measure(
    router: Router,
    workload: Workload,
    stages: Sequence[Stage],
    fleet: Fleet,
    args: argparse.Namespace,
    workdir: Path,
    after_stage: Callable[[FleetStack, Row], None] | None = None,
) -> list[Row]:
    """Fresh fleet + router, then every stage in order; everything is stopped on the way out.
    ``after_stage`` sees the running stack after each stage (to read the router's state)."""
    stack: FleetStack = router.stack(workdir, fleet)
    started = time.monotonic()
    try:
        url = router.start(stack, fleet, timeout=args.start_timeout)
        print(f"  {router.name}: ready in {time.monotonic() - started:.1f}s", flush=True)
        sim_pids = [p.popen.pid for n, p in stack.procs.items() if n.startswith("sim")]
        router_pids = [p.popen.pid for n, p in stack.procs.items() if not n.startswith("sim")]
        if args.warmup > 0:
            requests, arrivals = warmup(args.warmup, WARMUP_RATE, args.seed)
            warm = _run_async(
                run_stage(
                    url,
                    requests,
                    arrivals,
                    request_timeout=args.request_timeout,
                    drain_timeout=args.drain_timeout,
                )
            )
            failed = sum(1 for o in warm.outcomes if not o.ok)
            print(
                f"  {router.name}: warm-up {len(requests)} requests in {args.warmup:g} s, "
                f"{failed} failed (not in the stats)",
                flush=True,
            )
        rows = []
        for stage in stages:
            before = replica_counters(stack.replica_addresses, fleet.engine)
            cpu_before = cpu_seconds(sim_pids), cpu_seconds(router_pids)
            wall = time.monotonic()
            load = run_stage(
                url,
                [item.request for item in stage.items],
                stage.arrivals,
                request_timeout=args.request_timeout,
                drain_timeout=args.drain_timeout,
                after=stage.after(),
                think=stage.think(),
            )
            trace = ""
            if args.trace:
                keys = [item.key for item in stage.items]
                path = workdir / f"trace-{stage.rate:g}.jsonl"
                run, trace = _run_async(traced(load, stack.replica_addresses, keys, path))
            else:
                run = _run_async(load)
            wall = time.monotonic() - wall
            after = replica_counters(stack.replica_addresses, fleet.engine)
            cpu = (
                (cpu_seconds(sim_pids) - cpu_before[0]) / wall,
                (cpu_seconds(router_pids) - cpu_before[1]) / wall,
            )
            delta = {a: {k: after[a][k] - before[a][k] for k in COUNTERS} for a in after}
            row = summarize(workload.name, router.name, stage, run, delta, cpu, args.slo)
            print(progress_line(row), flush=True)
            if after_stage is not None:
                after_stage(stack, row)
            if trace:
                print(trace, flush=True)
            rows.append(row)
        return rows
    finally:
        stack.stop()


def make_fleet(args: argparse.Namespace, workload: Workload) -> Fleet:
    """KV sized from the shared-prefix workload (the same for every workload, so results
    compare): its system prompts take ``kv_ratio`` of the fleet's cacheable tokens."""
    prefixes = SharedPrefix(seed=args.seed).shared_tokens()
    per_replica = prefixes / (args.kv_ratio * args.replicas * BLOCK_SIZE)
    adapters, max_loras = workload.loras()
    return Fleet(
        replicas=args.replicas,
        profile=args.profile,
        time_scale=args.time_scale,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=math.ceil(per_replica) + 1,
        lora_modules=tuple(adapters),
        max_loras=max_loras,
        sim_processes=args.sim_processes,
        speeds=tuple(float(v) for v in args.speeds.split(",")) if args.speeds else (),
        engine=args.engine,
    )


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{platform.node()} ({cpu}, {os.cpu_count()} cores shared by the simulator, the router "
        f"and the load generator; load average {load} at start; Python "
        f"{platform.python_version()}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )


def describe(fleet: Fleet, workloads: Sequence[Workload], args: argparse.Namespace) -> list[str]:
    per_replica = (fleet.num_gpu_blocks - 1) * fleet.block_size
    lines = [
        f"- Fleet: {fleet.replicas} simulated {'SGLang' if fleet.engine == 'sglang' else 'vLLM'} "
        f"replicas (`epp sim {' '.join(fleet.sim_args())}`"
        f"): {per_replica:,} cacheable tokens each, {fleet.kv_tokens:,} in all"
        + (
            f"; compute speeds {', '.join(f'{v:g}' for v in fleet.speeds)} (`--speed`)."
            if fleet.speeds
            else "."
        ),
        f"- Stages of {args.duration:g} s of open-loop Poisson arrivals per rate; each request "
        f"times out after {args.request_timeout:g} s; requests still running "
        f"{args.drain_timeout:g} s after a stage's last send count as errors."
        + (
            f" Before its first stage every router got the same {args.warmup:g} s warm-up "
            f"(`--warmup`: {WARMUP_RATE:g} req/s of 2,300-token prompts sharing no prefix with "
            "the workload, 32 output tokens, drained before the stage; not in the stats)."
            if args.warmup > 0
            else ""
        ),
        "- Rates were calibrated by sweeping 4-32 req/s at time scale 3 on this machine: round "
        "robin saturates the shared-prefix fleet at about 8 req/s (TTFT p90 0.5 s at 4/s, "
        "1.7 s at 8/s, 10 s at 16/s, throughput flat at ~5 req/s completed), sglang-router at "
        "about 16-24 req/s (~9.5 req/s completed), epp's profiles keep TTFT p90 under 1 s to "
        "about 24 req/s and complete ~15 req/s at 32. The default rates span all three. On "
        "the LoRA mix sglang-router collapses between 32 and 48 req/s (TTFT p90 0.1 -> 6.8 s), "
        "epp and GIE's profile do not, even at 64 (TTFT p90 under 0.3 s; 64 is the top rate "
        "because at 48 their throughput was simply the offered load). On the multi-turn mix "
        "every router reaches the fleet's KV bound near 24 req/s (~16-18 req/s completed, "
        "~2,000-2,250 tok/s); 32 shows who holds that plateau.",
    ]
    for w in workloads:
        shared = w.shared_tokens()
        lines.append(
            f"- `{w.name}`: {w.describe()}. Tokens to keep cached: {shared:,} = "
            f"{100 * shared / fleet.kv_tokens:.0f}% of the fleet's KV, "
            f"{shared / per_replica:.1f}x one replica's."
        )
    return lines


def caveats(args: argparse.Namespace) -> list[str]:
    return [
        f"- Simulated replicas, not GPUs: the `{args.profile}` step-time model of "
        "docs/simulator.md, slowed down "
        f"{args.time_scale:g}x (`--time-scale {args.time_scale:g}`) so the whole benchmark fits "
        f"on this machine. Rates and latencies are wall-clock: the modelled GPU would serve "
        f"{args.time_scale:g}x the rate at 1/{args.time_scale:g} of the latency. The relative "
        "order of routers is the result, not the absolute numbers.",
        "- One 2-core machine runs the simulator (split over "
        f"{args.sim_processes} processes), the router, Envoy and the load generator; the CPU "
        "columns show what the simulator and the router took. Two routers make the simulator "
        "do work a real replica does on its own CPU: epp (like GIE) scrapes every replica's "
        "`/metrics` every 50 ms (the simulator renders the page incrementally, 0.04-0.12 ms per "
        "scrape; vLLM's own takes ~7 ms), and vllm-router calls `/v1/completions/render` (404 "
        "here) and `/tokenize` on every worker for every request, so each request is tokenized "
        "8 times on the simulator. Where the simulator's CPU nears its cores, its timing "
        "stretches and that router is penalised by the harness, not by its decisions.",
        "- sglang-router and vllm-router are their own HTTP front door; round robin, least "
        "request and epp go through Envoy (epp via ext_proc). Envoy and ext_proc add about "
        "1-2 ms per request (docs/overhead.md), negligible against these TTFTs.",
        "- `least-request` is Envoy's `LEAST_REQUEST` policy (power of two choices on active "
        "requests). The peers run with their defaults (cache threshold 0.3, balance thresholds "
        "64 requests absolute / 1.5x relative).",
        "- Stages of one router run back to back on warm caches (the first starts cold, for "
        "every router), each request stream is deterministic (`--seed`), and only arrival times "
        "depend on the rate. "
        + (
            f"Each router was measured {args.repeat} times; the tables show medians. "
            if args.repeat > 1
            else "One run, no repetitions (`--repeat N` adds them). "
        )
        + "A single run's throughput at saturation varies by ~10-20%, and where about a tenth "
        "of the requests are cold prefills (shared-prefix at 10-16 req/s) its TTFT p90 jumps "
        "between the warm and the cold latency (0.1-0.45 s) from run to run; a busy machine "
        "(see the load average above) adds more.",
        "- The oracle pins each group / conversation / adapter to one replica (spread evenly), "
        "replays the same requests one at a time through an LRU of each replica's full KV "
        "capacity and counts hits with vLLM's rules. It ignores queueing and the KV of requests "
        "in flight, so it is an upper bound a router can approach but should not be expected "
        "to reach at high load.",
        "- TTFT is measured at the first SSE chunk carrying generated text (not the chat role "
        "chunk); output tokens come from the final usage chunk. Output text is filler.",
        "- Multi-turn arrivals are open loop like the others: each arrival is the next turn of "
        "a random active conversation, whether or not that conversation's previous reply has "
        "finished (its canned reply is in the prompt already). At 16-24 req/s over 24 "
        "conversations a conversation gets a turn every 1-1.5 s while a reply takes 2.4 s or "
        "more, so two or three turns of one conversation are often in flight at once, each "
        "holding the whole history in KV; a chat user waits for the reply. Past saturation "
        "this overstates the KV pressure of a real chat fleet at the same rate.",
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.routing", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: one short stage of shared-prefix"
    )
    parser.add_argument(
        "--routers",
        help=(
            "comma list of router names, run in this order; profiles under "
            "benchmarks/profiles/learned/ too (default: benchmarks/profiles/ and the peers)"
        ),
    )
    parser.add_argument("--workloads", help=f"comma list of {', '.join(WORKLOADS)}")
    parser.add_argument("--rates", help="comma list of req/s for every workload (overrides)")
    parser.add_argument("--duration", type=float, help="seconds per stage (default 12, quick 6)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure every router N times, each on a fresh fleet (tables show medians)",
    )
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument(
        "--speeds",
        help="each replica's compute speed, comma list (a heterogeneous fleet: 1,0.5,1,0.5,...)",
    )
    parser.add_argument(
        "--sim-processes", type=int, default=2, help="simulator processes the fleet is split over"
    )
    parser.add_argument("--profile", default="h100", help="simulator hardware profile")
    parser.add_argument(
        "--engine",
        choices=["vllm", "sglang"],
        default="vllm",
        help="the simulated replicas speak this engine's /metrics and KV events; epp's pool "
        "says so (docs/sglang.md)",
    )
    parser.add_argument(
        "--time-scale", type=float, default=3.0, help="simulator time scale (3 = 3x slower)"
    )
    parser.add_argument(
        "--kv-ratio",
        type=float,
        default=0.6,
        help="share of the fleet's KV the shared-prefix system prompts need",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        help=f"seconds of warm-up before each router's first stage, excluded from the stats: "
        f"{WARMUP_RATE:g} req/s of prompts cached nowhere that share no prefix with the "
        "workload (so a learning router has seen every replica, and the measured prompts' "
        "caches stay cold); the same requests for every router (default 0: none)",
    )
    parser.add_argument(
        "--slo", type=float, default=1.0, help="TTFT p90 target (s) for the report's summary"
    )
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--start-timeout", type=float, default=60.0)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--img-dir", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="FILE",
        help="measure nothing: rewrite the report and plots from a run's saved results "
        "(written to --results by every run)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        metavar="FILE",
        help="where every run saves its raw results as JSON "
        "(default: benchmarks/results/<--output's name>.json)",
    )
    parser.add_argument("--workdir", type=Path, help="logs and configs (default: a temp dir)")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="also write each stage's replica queues over time and every request's timing to "
        "WORKDIR/<router>/<workload>/<rep>/trace-<rate>.jsonl (docs/benchmarks.md)",
    )
    args = parser.parse_args(argv)
    if args.results is None:
        args.results = RESULTS / args.output.with_suffix(".json").name
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.speeds and len(args.speeds.split(",")) != args.replicas:
        parser.error(f"--speeds needs one factor per replica ({args.replicas})")
    if args.duration is None:
        args.duration = 6.0 if args.quick else 12.0
    return args


def run(args: argparse.Namespace, command: str) -> Run:
    names = args.workloads.split(",") if args.workloads else None
    names = names or (QUICK_WORKLOADS if args.quick else DEFAULT_WORKLOADS)
    workloads = [WORKLOADS[n](seed=args.seed) for n in names]
    routers = named_routers(args.routers.split(",")) if args.routers else all_routers()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="epp-routing-"))
    fleet = make_fleet(args, workloads[0])
    result = Run(
        [],
        command,
        describe(fleet, workloads, args),
        caveats(args),
        machine(),
        args.slo,
        repeat=args.repeat,
    )
    print(f"routing benchmark; logs under {workdir}", flush=True)
    print("\n".join(result.setup), flush=True)
    routers = available(routers, result.unavailable)
    result.routers = {r.name: r.label() for r in routers}
    for workload in workloads:
        fleet = make_fleet(args, workload)
        rates = (
            [float(x) for x in args.rates.split(",")]
            if args.rates
            else (QUICK_RATES if args.quick else RATES)[workload.name]
        )
        print(f"== {workload.name}: planning {len(rates)} stages ...", flush=True)
        stages = plan(workload, rates, args.duration, fleet)
        # Repetitions go round the routers rather than one router N times in a row, so a slow
        # spell of the shared machine lands on several routers instead of all of one.
        for rep in range(args.repeat):
            if args.repeat > 1:
                print(f"  repetition {rep + 1}/{args.repeat}", flush=True)
            for router in routers:
                if f"{router.name} on {workload.name}" in result.unavailable:
                    continue
                logs = workdir / router.name / workload.name / str(rep)
                try:
                    rows = measure(router, workload, stages, fleet, args, logs)
                except (RuntimeError, OSError) as exc:
                    why = str(exc).splitlines()[0]
                    print(f"  {router.name}: failed on {workload.name}: {why}", flush=True)
                    result.unavailable[f"{router.name} on {workload.name}"] = why
                    continue
                for row in rows:
                    row.rep = rep
                result.rows += rows
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m benchmarks.routing " + " ".join(
        sys.argv[1:] if argv is None else list(argv)
    )

    def _terminate(*_: object) -> None:
        raise KeyboardInterrupt

    # Children run in their own sessions (a terminal's Ctrl-C does not reach them), so both
    # signals become KeyboardInterrupt here and the stacks' finally blocks stop every process.
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    if args.from_json:
        result = load_run(args.from_json)
    else:
        try:
            result = run(args, command.strip())
        except KeyboardInterrupt:
            print("interrupted: every process started was stopped; no report written", flush=True)
            return 130
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        save_run(result, args.results)
    print()
    print(text_table(result.medians()))
    try:
        images = plots(result.medians(), args.img_dir)
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", flush=True)
        images = []
    args.output.write_text(markdown(result, images, args.output.parent))
    print(f"wrote {args.output}" + "".join(f", {p}" for p in images), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
