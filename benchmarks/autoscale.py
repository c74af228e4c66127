"""Does ``epp_pool_desired_replicas`` lead the queue, and is it the right size?

Runs the simulated fleet behind Envoy and epp (``epp.devstack.Stack``), each replica able to
run ``--max-num-seqs`` requests at once, and epp's ``autoscaling.replica_concurrency`` set to
the same number. Two experiments, open-loop Poisson streaming load (``benchmarks/loadgen.py``):

1. ramp: a fixed fleet, offered load rising linearly past what it can serve. Per 4 s bin: the
   desired-replica signal (sampled from epp's /metrics twice a second) and the client's TTFT
   p90. The signal should pass the fleet's size before TTFT p90 passes the objective.
2. steady: one rate, tried on 2-3 fleet sizes; the smallest size that keeps TTFT p90 under
   the objective, next to what the signal asked for.

Usage: ``python -m benchmarks.autoscale``; prints markdown tables (docs/autoscaling.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import re
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks.loadgen import Outcome, Request, poisson_arrivals, run_stage
from epp.devstack import Stack

MAX_NUM_SEQS = 4
MAX_TOKENS = 32
DESIRED = re.compile(r'^epp_pool_desired_replicas\{pool="main"\} (\S+)$', re.MULTILINE)


@dataclass
class Bin:
    """A stretch of a run: its end (s), offered rate, the signal's value, TTFT p90, errors."""

    end: float
    rate: float
    desired: float
    ttft_p90: float
    errors: int


def fleet(workdir: Path, replicas: int, time_scale: float, window: float, target: float) -> Stack:
    return Stack(
        workdir,
        replicas=replicas,
        sim_args=["--max-num-seqs", str(MAX_NUM_SEQS), "--time-scale", str(time_scale)],
        config_extra={
            "autoscaling": {
                "replica_concurrency": MAX_NUM_SEQS,
                "target_utilisation": target,
                "window_seconds": window,
            }
        },
    )


def desired(stack: Stack) -> float:
    url = f"http://127.0.0.1:{stack.epp_ports[0][2]}/metrics"
    with urllib.request.urlopen(url, timeout=2) as resp:
        match = DESIRED.search(resp.read().decode())
    return float(match.group(1)) if match else 0.0


def request(seed: int) -> Request:
    body = {
        "model": "tiny",
        "prompt": f"{seed} " + "tell me a story " * 20,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return Request("/v1/completions", json.dumps(body).encode())


def p90(outcomes: list[Outcome]) -> float:
    ttfts = sorted(o.ttft for o in outcomes if o.ok and o.ttft is not None)
    if len(ttfts) < 5:
        return float("nan")
    return statistics.quantiles(ttfts, n=10)[-1]


async def sampled_stage(
    stack: Stack, arrivals: list[float], rng: random.Random
) -> tuple[list[Outcome], list[tuple[float, float]]]:
    """Send at ``arrivals``; the desired signal sampled twice a second meanwhile (seconds from
    the stage's start, like each outcome's ``started - t0``)."""
    requests = [request(rng.randrange(1 << 30)) for _ in arrivals]
    samples: list[tuple[float, float]] = []
    done = asyncio.Event()
    start = time.monotonic()

    async def sample() -> None:
        while not done.is_set():
            value = await asyncio.to_thread(desired, stack)
            samples.append((time.monotonic() - start, value))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.5)

    sampler = asyncio.create_task(sample())
    run = await run_stage(stack.url, requests, arrivals, request_timeout=60.0, drain_timeout=60.0)
    done.set()
    await sampler
    return run.outcomes, samples


def ramp_arrivals(low: float, high: float, seconds: float, rng: random.Random) -> list[float]:
    """A Poisson process whose rate rises linearly from ``low`` to ``high`` (thinning)."""
    return [
        t
        for t in poisson_arrivals(high, seconds, rng)
        if rng.random() < (low + (high - low) * t / seconds) / high
    ]


async def ramp(stack: Stack, low: float, high: float, seconds: float, bin_s: float) -> list[Bin]:
    rng = random.Random(1)
    outcomes, samples = await sampled_stage(stack, ramp_arrivals(low, high, seconds, rng), rng)
    t0 = min(o.started for o in outcomes)
    bins = []
    for i in range(int(seconds // bin_s)):
        lo, hi = i * bin_s, (i + 1) * bin_s
        inside = [o for o in outcomes if lo <= o.started - t0 < hi]
        signal = [v for t, v in samples if lo <= t < hi] or [0.0]
        rate = low + (high - low) * (lo + hi) / 2 / seconds
        bins.append(Bin(hi, rate, max(signal), p90(inside), sum(not o.ok for o in inside)))
    return bins


async def steady(stack: Stack, rate: float, seconds: float) -> Bin:
    rng = random.Random(2)
    outcomes, samples = await sampled_stage(stack, poisson_arrivals(rate, seconds, rng), rng)
    # Skip the first third: the rates are still filling their window.
    t0 = min(o.started for o in outcomes)
    measured = [o for o in outcomes if o.started - t0 >= seconds / 3]
    late = [v for t, v in samples if t >= seconds / 3] or [0.0]
    return Bin(
        seconds, rate, statistics.median(late), p90(measured), sum(not o.ok for o in outcomes)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--objective", type=float, default=0.5, help="TTFT p90 objective, s")
    parser.add_argument("--ramp-replicas", type=int, default=2)
    parser.add_argument("--ramp", default="2,14", help="offered req/s at start and end")
    parser.add_argument("--ramp-seconds", type=float, default=72.0)
    parser.add_argument("--steady-rate", type=float, default=8.0)
    parser.add_argument("--steady-seconds", type=float, default=30.0)
    parser.add_argument("--sizes", default="2,3,4")
    parser.add_argument("--window", type=float, default=3.0, help="autoscaling.window_seconds")
    parser.add_argument("--target", type=float, default=0.7, help="autoscaling.target_utilisation")
    args = parser.parse_args()
    low, high = (float(r) for r in args.ramp.split(","))
    size = args.ramp_replicas

    with tempfile.TemporaryDirectory() as tmp:
        stack = fleet(Path(tmp) / "ramp", size, args.time_scale, args.window, args.target)
        with stack:
            stack.start()
            bins = asyncio.run(ramp(stack, low, high, args.ramp_seconds, 4.0))
        print(
            f"\nramp {low:g} -> {high:g} req/s over {args.ramp_seconds:g} s on {size} "
            f"replicas (max-num-seqs {MAX_NUM_SEQS}, target_utilisation {args.target:g}, "
            f"window {args.window:g} s); objective TTFT p90 < {args.objective:g} s\n"
        )
        print("| until (s) | offered req/s | desired replicas | TTFT p90 (s) | errors |")
        print("|---|---|---|---|---|")
        for b in bins:
            print(f"| {b.end:g} | {b.rate:.1f} | {b.desired:g} | {b.ttft_p90:.3f} | {b.errors} |")
        signal = next((b.end for b in bins if b.desired > size), None)
        # Degraded: two bins in a row over the objective (one bin of ~40 requests is noisy).
        degraded = next(
            (
                b.end
                for b, after in itertools.pairwise(bins)
                if min(b.ttft_p90, after.ttft_p90) > args.objective
            ),
            None,
        )
        print(
            f"\ndesired > {size} first in the bin ending {signal} s; "
            f"TTFT p90 > objective in two bins in a row from the bin ending {degraded} s"
        )

        print(f"\nsteady {args.steady_rate:g} req/s, {args.steady_seconds:g} s per fleet size\n")
        print("| replicas | desired replicas | TTFT p90 (s) | under objective | errors |")
        print("|---|---|---|---|---|")
        for n in (int(n) for n in args.sizes.split(",")):
            stack = fleet(Path(tmp) / f"steady-{n}", n, args.time_scale, args.window, args.target)
            with stack:
                stack.start()
                b = asyncio.run(steady(stack, args.steady_rate, args.steady_seconds))
            ok = "yes" if b.ttft_p90 < args.objective else "no"
            print(f"| {n} | {b.desired:g} | {b.ttft_p90:.3f} | {ok} | {b.errors} |", flush=True)


if __name__ == "__main__":
    main()
