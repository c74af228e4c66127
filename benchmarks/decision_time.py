"""Decision time of epp's default profile: 64 endpoints, 32k-token (~128 KB) prompts.

Measures what epp spends per request between a parsed request and a chosen endpoint: the
cycle, every filter and scorer (prompt hashing, prefix matching) and the picker ("decide", the
answer path); then, apart, the post-pick bookkeeping (index insert, session binding), which
epp runs once the answer is sent. Parsing the body is excluded (see
``benchmarks/overhead.py`` for end-to-end numbers). The prefix index is warmed with earlier
picks of the same workload: 200 groups sharing a ~96 KB system prompt, each request adding a
unique ~32 KB question, as in GIE's shared-prefix benchmarks but with longer prompts.

Usage: ``python -m benchmarks.decision_time [--requests 2000] [--endpoints 64] [--clock cpu]``
(``--clock cpu``: thread CPU time, for a machine shared with other work).
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import time
from array import array
from collections.abc import Callable
from typing import Any

from epp.config import DEFAULT_PROFILE, parse_config
from epp.prefix.hashing import BlockHasher
from epp.request import InferenceRequest
from epp.scheduling import Cycle, Profile, build_profile
from epp.state import EndpointMetrics, EndpointState, Snapshot
from epp.state.fleet import FleetState

PROMPT_TOKENS = 32 * 1024
# Scrapes change load between requests; cycling through views spreads picks over the fleet.
LOAD_VIEWS = 16
SHARED_FRACTION = 0.75
GROUPS = 200


def profile(max_blocks: int) -> Profile:
    """epp's default profile, its prefix hashing capped at ``max_blocks``, plus the capacity
    scorer (one more per-candidate loop, for fleets of unequal replicas)."""
    hashing = {"max_blocks": max_blocks}
    entries: list[dict[str, Any]] = []
    for entry in DEFAULT_PROFILE:
        if entry["plugin"] == "prefix-cache-scorer":
            entry = {**entry, "parameters": hashing}
        if entry["plugin"] == "max-score-picker":
            entries.append({"plugin": "capacity-scorer", "weight": 1})
        entries.append(entry)
    config = {
        "models": {"m": {"pools": ["p"]}},
        "pools": {"p": {"endpoints": ["10.0.0.1:8000"]}},
        "scheduling": {"profile": "bench", "profiles": {"bench": entries}},
    }
    return build_profile(parse_config(config).scheduling.selected)


def endpoints(count: int, rng: random.Random) -> list[EndpointState]:
    out = []
    for i in range(count):
        metrics = EndpointMetrics(
            waiting=rng.randrange(8),
            running=rng.randrange(32),
            # Mostly roomy; a few nearly full so the headroom filter has work to do.
            kv_usage=rng.choice([0.2, 0.5, 0.7, 0.99]),
            block_size=16,
            num_gpu_blocks=40_000,
            running_loras=frozenset({"a"}) if i % 4 == 0 else frozenset(),
            waiting_loras=frozenset(),
            max_loras=4,
        )
        out.append(EndpointState(f"10.0.{i // 250}.{i % 250}:8000", "p", True, metrics, 1.0))
    return out


def text_requests(n: int, rng: random.Random) -> list[InferenceRequest]:
    chars = PROMPT_TOKENS * 4
    shared = int(chars * SHARED_FRACTION)
    groups = [os.urandom(shared // 2).hex() for _ in range(GROUPS)]
    return [
        InferenceRequest(
            str(i),
            "/v1/chat/completions",
            "chat",
            "m",
            rng.choice(groups) + os.urandom((chars - shared) // 2).hex(),
            lora="a" if i % 8 == 0 else None,
            session=f"s{rng.randrange(5000)}",
        )
        for i in range(n)
    ]


def token_requests(n: int, rng: random.Random) -> list[InferenceRequest]:
    shared = int(PROMPT_TOKENS * SHARED_FRACTION)

    def ids(count: int) -> tuple[int, ...]:
        return tuple(v % 100_000 for v in array("I", os.urandom(4 * count)))

    groups = [ids(shared) for _ in range(GROUPS)]
    return [
        InferenceRequest(
            str(i),
            "/v1/completions",
            "completions",
            "m",
            "",
            prompt_token_ids=rng.choice(groups) + ids(PROMPT_TOKENS - shared),
            session=f"s{rng.randrange(5000)}",
        )
        for i in range(n)
    ]


def percentiles(samples_ns: list[int]) -> tuple[float, float]:
    ordered = sorted(samples_ns)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return statistics.median(ordered) / 1000, p99 / 1000


def decisions(
    warmup: list[InferenceRequest],
    requests: list[InferenceRequest],
    views: list[list[EndpointState]],
    max_blocks: int,
) -> tuple[tuple[float, float], tuple[float, float]]:
    """Decision time of ``requests`` after ``warmup`` filled the prefix index and sessions:
    the answer path (post-pick bookkeeping deferred, as epp's stream handler runs it) and the
    deferred bookkeeping, each as (p50, p99)."""
    prof, fleet, snapshot = profile(max_blocks), FleetState(), Snapshot()
    weights = {e.address: 2.0 for e in views[0][::8]}
    run = prof.run
    rotation = itertools.cycle(views)
    deferred: list[Callable[[], None]] = []

    def decide(request: InferenceRequest) -> None:
        run(request, next(rotation), Cycle(snapshot, fleet, weights), 2, defer=deferred)

    def settle(_: InferenceRequest) -> None:
        deferred.pop()()

    clock = CLOCKS[CLOCK]
    answer, after = [], []
    for i, request in enumerate(warmup + requests):
        start = clock()
        decide(request)
        middle = clock()
        settle(request)
        if i >= len(warmup):
            answer.append(middle - start)
            after.append(clock() - middle)
    return percentiles(answer), percentiles(after)


# wall: elapsed time (what a request waits on an idle machine); cpu: this thread's CPU time,
# which preemption by other processes on a shared machine does not inflate.
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
CLOCK = "wall"


def timed(fn: Callable[[InferenceRequest], object], requests: list[InferenceRequest]) -> list[int]:
    clock = CLOCKS[CLOCK]
    samples = []
    for request in requests:
        start = clock()
        fn(request)
        samples.append(clock() - start)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--endpoints", type=int, default=64)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = parser.parse_args()
    global CLOCK
    CLOCK = args.clock
    rng = random.Random(1)
    views = [endpoints(args.endpoints, rng) for _ in range(LOAD_VIEWS)]
    # Each workload's first half warms the index; the second (new questions) is measured.
    n = args.requests
    workloads = {
        "text, 128 KB": text_requests(2 * n, rng),
        "token ids, 32k": token_requests(2 * n, rng),
    }
    print(f"{args.endpoints} endpoints, {args.requests} requests per row, {CLOCK} µs\n")
    print(f"{'prompt':<16}{'max_blocks':>11}{'hash p50':>10}{'hash p99':>10}", end="")
    print(f"{'decide p50':>12}{'decide p99':>12}{'post-pick p50':>15}{'post-pick p99':>15}")
    for name, both in workloads.items():
        warmup, requests = both[:n], both[n:]
        # 256 is GIE's cap (4k tokens); 2048 covers the whole 32k-token prompt.
        for max_blocks in (256, 2048):
            hasher = BlockHasher(max_blocks=max_blocks)
            hash_p50, hash_p99 = percentiles(timed(hasher.hashes, requests))
            (p50, p99), (post50, post99) = decisions(warmup, requests, views, max_blocks)
            print(f"{name:<16}{max_blocks:>11}{hash_p50:>10.0f}{hash_p99:>10.0f}", end="")
            print(f"{p50:>12.0f}{p99:>12.0f}{post50:>15.0f}{post99:>15.0f}")


if __name__ == "__main__":
    main()
