"""An epp dying under load: how many requests fail when one of two epps is SIGKILLed.

Envoy (as ``epp envoy-config`` renders it), two ``epp serve`` sharing a ``redis-server`` of this
script's own, three simulated replicas (one process each), ``--rate`` open-loop streaming
completions per second (``--max-tokens`` 128 at real speed: about a second each). Every
``--every`` seconds epp1 is SIGKILLed; the supervisor (as in ``epp dev``) restarts it. A failed
request is counted by when it started: before the kill (in flight when epp1 died) or after it
(the survivor could have routed it). Each body mode runs ``--kills`` kills; the table is printed
and, with ``--write``, written to ``docs/failover.md``.

Usage: ``python -m benchmarks.failover [--kills 5] [--rate 20] [--modes buffered full-duplex]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from benchmarks.soak import Load, Result
from epp.devstack import Mode, Stack
from tests.e2e.client import metric_values
from tests.helpers.redis_servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    setup: str
    requests: int
    in_flight: int  # failed, started before a kill
    after: int  # failed, started after a kill
    kinds: Counter[str]
    open_at_kill: list[int]  # streams open on epp1 just before each kill
    median_s: float  # request duration


def measure(args: argparse.Namespace, mode: Mode) -> Run:
    workdir = Path(tempfile.mkdtemp(prefix="epp-failover-"))
    redis = RedisServer(workdir / "redis").start()
    stack = Stack(
        workdir,
        replicas=3,
        mode=mode,
        epp_count=2,
        redis_url=redis.url,
        sim_args=["--time-scale", str(args.time_scale), "--num-gpu-blocks", "20000"],
        sim_per_replica=True,
        config_extra={"store": {"key_prefix": f"fo-{uuid.uuid4().hex[:8]}"}},
    )
    kills: list[float] = []
    open_at_kill: list[int] = []
    load = Load(stack.url, args.rate, args.max_tokens)
    try:
        stack.start(timeout=60)
        load.start()
        next_kill = time.monotonic() + args.every
        while len(kills) < args.kills or time.monotonic() < kills[-1] + args.every:
            now = time.monotonic()
            if len(kills) < args.kills and now >= next_kill:
                open_at_kill.append(_open_streams(stack))
                kills.append(time.monotonic())
                stack.procs["epp1"].kill()
                next_kill = now + args.every
            stack.supervise(lambda _: None)
            time.sleep(0.02)
        load.stop()
    finally:
        load.stop()
        stack.stop()
        redis.stop()
    failed = [r for r in load.results if r.status != 200]
    in_flight = [r for r in failed if _in_flight(r, kills)]
    kinds = Counter(f"{r.status} {r.error.split(':')[0]}" for r in failed)
    after = len(failed) - len(in_flight)
    median = statistics.median(r.ended - r.started for r in load.results)
    return Run(mode, len(load.results), len(in_flight), after, kinds, open_at_kill, median)


def _open_streams(stack: Stack) -> int:
    """ext_proc streams open on epp1 (requests it routed that are still running)."""
    url = f"http://127.0.0.1:{stack.epp_ports[1][2]}/metrics"
    try:
        return int(sum(metric_values(url, "epp_in_flight_requests").values()))
    except OSError:
        return -1  # not up again yet


def _in_flight(result: Result, kills: list[float]) -> bool:
    return any(result.started <= k <= result.ended for k in kills)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=5)
    # Over 10 s, so the supervisor restarts epp1 after 0.1 s each time (RESTART_RESET_AFTER).
    parser.add_argument("--every", type=float, default=12.0, help="seconds between kills")
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="simulated replicas' speed (1: real)"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["buffered", "full-duplex"],
        default=["buffered", "full-duplex"],
    )
    parser.add_argument("--write", action="store_true", help="write docs/failover.md")
    args = parser.parse_args()
    runs = []
    for mode in args.modes:
        run = measure(args, mode)
        runs.append(run)
        print(
            f"{mode}: {run.requests} requests, {run.in_flight} failed in flight on the killed "
            f"epp, {run.after} failed after the kill; streams open on it at each kill "
            f"{run.open_at_kill}; median request {run.median_s:.2f} s; {dict(run.kinds)}",
            flush=True,
        )
    load = os.getloadavg()
    lines = [
        "# An epp SIGKILLed under load",
        "",
        f"`python -m benchmarks.failover --kills {args.kills} --rate {args.rate:g}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, 2 shared cores, load average "
        f"{load[0]:.1f}): two epps behind Envoy, {args.rate:g} streaming requests/s of "
        f"{args.max_tokens} tokens, epp1 SIGKILLed every {args.every:g} s and restarted by the "
        "supervisor. What it means: docs/active-active.md#what-a-user-loses-when-an-epp-dies.",
        "",
        "| body mode | requests | kills | streams open on the killed epp at each kill "
        "| median request s | failed, in flight on the killed epp | failed, started after "
        "the kill |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {r.setup} | {r.requests} | {args.kills} | {' / '.join(map(str, r.open_at_kill))} "
            f"| {r.median_s:.2f} | {r.in_flight} | {r.after} |"
            for r in runs
        ],
        "",
    ]
    if args.write:
        (ROOT / "docs" / "failover.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
