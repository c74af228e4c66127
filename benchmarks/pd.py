"""Prefill/decode disaggregation on the simulated fleet: aggregated serving against P/D at
two prefill:decode ratios on a long-prompt workload, and the decider's threshold against
always- and never-P/D on a mixed one.

Every arm runs the same number of simulated replicas (h100 profile, NIXL connector) behind
Envoy and epp, on a fresh fleet, with the same requests at the same send times. Aggregated
(never-P/D) arms run epp's default profile over replicas of role ``both``; P/D arms label P
replicas ``prefill`` and D ``decode`` with ``epp pd-sidecar`` in front of each decode engine,
and run docs/pd.md's two profiles. The client streams every request and notes when each token
event arrives: TTFT, the gaps between tokens (ITL, pooled over all requests) and end-to-end.

Usage: ``python -m benchmarks.pd [--quick] [--rate R] [--duration S] [--replicas N]``.
Writes ``docs/pd-bench.md`` and ``benchmarks/results/pd.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.loadgen import Request, poisson_arrivals
from benchmarks.routers import EppProfile, Fleet, FleetStack
from benchmarks.routing import RESULTS, ROOT, machine, percentile
from benchmarks.workloads import MODEL, text
from epp.devstack import free_port_run
from tests.e2e.client import metric_values

BLOCK_SIZE = 16
# vLLM's chunk size for chunked prefill on many set-ups; with the h100 profile's 8,192 one
# long prompt would be a single step, so fewer decode steps would share a batch with prefill.
BATCHED_TOKENS = 2048
DECISIONS = "llm_d_inference_scheduler_disagg_decision_total"


@dataclass(frozen=True)
class Shape:
    """A request stream: ``long_share`` of requests have a unique long prompt, the rest a
    short question after one of ``groups`` shared system prompts."""

    name: str
    long_share: float
    long_tokens: tuple[int, int] = (4096, 8192)
    long_output: tuple[int, int] = (200, 500)
    groups: int = 8
    system_tokens: int = 1024
    question_tokens: int = 64
    short_output: tuple[int, int] = (100, 200)

    def describe(self) -> str:
        long = (
            f"prompts {self.long_tokens[0]}-{self.long_tokens[1]} tokens (unique), outputs "
            f"{self.long_output[0]}-{self.long_output[1]}"
        )
        if self.long_share >= 1:
            return long
        return (
            f"{100 * self.long_share:.0f}% long ({long}), "
            f"{100 * (1 - self.long_share):.0f}% short ({self.groups} shared system prompts of "
            f"{self.system_tokens} tokens + a {self.question_tokens}-token question, outputs "
            f"{self.short_output[0]}-{self.short_output[1]})"
        )

    def stream(self, seed: int) -> Iterator[Request]:
        rng = random.Random(f"pd/{self.name}/{seed}")
        systems = [text(rng, self.system_tokens) for _ in range(self.groups)]
        while True:
            if rng.random() < self.long_share:
                prompt, out = text(rng, rng.randint(*self.long_tokens)), self.long_output
            else:
                system = systems[rng.randrange(self.groups)]
                prompt, out = f"{system}\n\n{text(rng, self.question_tokens)}", self.short_output
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": rng.randint(*out),
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            yield Request("/v1/completions", json.dumps(body).encode())


@dataclass(frozen=True)
class Arm:
    """One fleet set-up: ``prefill`` replicas of role prefill (0: aggregated) and the
    decider's threshold (None: aggregated, no decider)."""

    name: str
    workload: str
    prefill: int
    threshold: int | None


def pd_profiles(threshold: int) -> dict[str, Any]:
    """docs/pd.md's decode and prefill profiles with this ``non_cached_tokens``."""
    decider = {"non_cached_tokens": threshold, "prefill_profile": "prefill"}
    return {
        "profile": "pd",
        "profiles": {
            "pd": [
                {"plugin": "decode-filter"},
                {"plugin": "prefix-cache-scorer", "weight": 3},
                {"plugin": "inflight-load-scorer", "weight": 2},
                {"plugin": "kv-cache-utilization-scorer", "weight": 1},
                {"plugin": "max-score-picker"},
                {"plugin": "prefix-based-pd-decider", "parameters": decider},
            ],
            "prefill": [
                {"plugin": "prefill-filter"},
                {"plugin": "prefix-cache-scorer", "weight": 3},
                {"plugin": "queue-scorer", "weight": 2},
                {"plugin": "max-score-picker"},
            ],
        },
    }


@dataclass
class PdStack(FleetStack):
    """The fleet's engines, plus a sidecar in front of every decode engine; epp's pool (and
    what the stack waits to see ready) is the prefill engines and the sidecars."""

    prefill: int = 0
    engines: list[str] = field(default_factory=list)

    def start_sims(self) -> None:
        super().start_sims()
        allowed = [a for e in self.engines[: self.prefill] for a in ("--prefill", e)]
        sidecars = self.replica_addresses[self.prefill :]
        for i, (listen, engine) in enumerate(
            zip(sidecars, self.engines[self.prefill :], strict=True)
        ):
            argv = [sys.executable, "-m", "epp", "pd-sidecar", "--listen", listen]
            argv += ["--engine", f"http://{engine}", "--connector", "nixl", *allowed]
            self.spawn(f"sidecar{i}", [*argv, "--log-level", "warning"])


class PdRouter(EppProfile):
    """epp behind Envoy: its default profile over an aggregated fleet, or the P/D profiles
    over ``arm.prefill`` prefill replicas and the rest decode."""

    def __init__(self, arm: Arm) -> None:
        super().__init__("epp-default")
        self.arm = arm
        self.name = arm.name

    def stack(self, workdir: Path, fleet: Fleet) -> FleetStack:
        base = super().stack(workdir, fleet)
        base.sim_args += ["--kv-connector", "nixl", "--max-num-batched-tokens", str(BATCHED_TOKENS)]
        if self.arm.threshold is None:
            return base
        engines = list(base.replica_addresses)
        decode = fleet.replicas - self.arm.prefill
        taken = {int(a.rpartition(":")[2]) for a in engines}
        first = free_port_run(decode, taken)
        stack = PdStack(
            workdir,
            replicas=fleet.replicas,
            sim_base_port=base.sim_base_port,
            sim_args=base.sim_args,
            model=base.model,
            sim_processes=base.sim_processes,
            epp_args=base.epp_args,
            prefill=self.arm.prefill,
            engines=engines,
        )
        stack.replica_addresses = engines[: self.arm.prefill] + [
            f"127.0.0.1:{first + i}" for i in range(decode)
        ]
        roles = ["prefill"] * self.arm.prefill + ["decode"] * decode
        endpoints = [
            {"address": a, "role": r} for a, r in zip(stack.replica_addresses, roles, strict=True)
        ]
        stack.config_extra = {
            "models": {MODEL: {"pools": ["main"]}},
            "pools": {"main": {"endpoints": endpoints}},
            "scheduling": pd_profiles(self.arm.threshold),
        }
        return stack


@dataclass
class Outcome:
    ok: bool
    ttft: float = math.nan
    e2e: float = math.nan
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)


async def timed(session: aiohttp.ClientSession, url: str, request: Request) -> Outcome:
    """One streamed request, each token event timed as its end arrives."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    times: list[float] = []
    done, pending = False, b""
    try:
        async with session.post(url + request.path, data=request.body) as resp:
            if resp.status != 200:
                return Outcome(False)
            async for chunk in resp.content.iter_any():
                now = loop.time()
                *events, pending = (pending + chunk).split(b"\n\n")
                for event in events:
                    done = done or event == b"data: [DONE]"
                    if b'"text":"' in event and b'"choices":[]' not in event:
                        times.append(now)
    except (aiohttp.ClientError, TimeoutError):
        return Outcome(False)
    if not done or not times:
        return Outcome(False)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return Outcome(True, times[0] - start, loop.time() - start, len(times), gaps)


async def drive(
    url: str, requests: Sequence[Request], arrivals: Sequence[float], limit_s: float
) -> tuple[list[Outcome], float]:
    """Open loop: ``requests[i]`` at ``arrivals[i]``; returns the outcomes and the time from
    the first send to the last answer."""
    loop = asyncio.get_running_loop()
    limits = aiohttp.ClientTimeout(total=limit_s)
    connector = aiohttp.TCPConnector(limit=0)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(
        connector=connector, timeout=limits, headers=headers
    ) as session:
        start = loop.time()
        tasks = []
        for request, at in zip(requests, arrivals, strict=True):
            await asyncio.sleep(max(0.0, start + at - loop.time()))
            tasks.append(asyncio.create_task(timed(session, url, request)))
        outcomes = list(await asyncio.gather(*tasks))
    return outcomes, loop.time() - start


@dataclass
class Row:
    arm: str
    workload: str
    fleet: str
    rate: float
    sent: int
    errors: int
    split: float  # share of requests epp disaggregated
    ttft_p50: float
    ttft_p90: float
    itl_p50: float
    itl_p95: float
    itl_p99: float
    e2e_p50: float
    req_s: float
    out_tok_s: float


def split_share(stack: FleetStack) -> float:
    values = metric_values(f"http://127.0.0.1:{stack.epp_ports[0][2]}/metrics", DECISIONS)
    total = sum(values.values())
    split = sum(v for k, v in values.items() if '"prefill-decode"' in k)
    return split / total if total else 0.0


def measure(
    arm: Arm,
    requests: list[Request],
    arrivals: list[float],
    fleet: Fleet,
    args: argparse.Namespace,
    workdir: Path,
) -> Row:
    router = PdRouter(arm)
    stack = router.stack(workdir / arm.name, fleet)
    try:
        url = router.start(stack, fleet, timeout=args.start_timeout)
        outcomes, busy = asyncio.run(drive(url, requests, arrivals, args.request_timeout))
        split = split_share(stack)
    finally:
        stack.stop()
    ok = [o for o in outcomes if o.ok]
    gaps = sorted(g for o in ok for g in o.gaps)
    ttfts = sorted(o.ttft for o in ok)
    decode = fleet.replicas - arm.prefill
    row = Row(
        arm=arm.name,
        workload=arm.workload,
        fleet=f"{arm.prefill}:{decode}" if arm.prefill else f"{fleet.replicas} both",
        rate=args.rate,
        sent=len(outcomes),
        errors=len(outcomes) - len(ok),
        split=split,
        ttft_p50=percentile(ttfts, 0.5),
        ttft_p90=percentile(ttfts, 0.9),
        itl_p50=percentile(gaps, 0.5),
        itl_p95=percentile(gaps, 0.95),
        itl_p99=percentile(gaps, 0.99),
        e2e_p50=percentile(sorted(o.e2e for o in ok), 0.5),
        req_s=len(ok) / busy if busy else math.nan,
        out_tok_s=sum(o.tokens for o in ok) / busy if busy else math.nan,
    )
    print("  " + " | ".join(cells(row)), flush=True)
    return row


def arms(args: argparse.Namespace) -> list[Arm]:
    out = [Arm("aggregated", "long", 0, None)]
    for p in args.ratios:
        out.append(Arm(f"pd-{p}:{args.replicas - p}", "long", p, args.threshold))
    p = args.ratios[0]
    out += [
        Arm("threshold", "mixed", p, args.threshold),
        Arm("always-pd", "mixed", p, 0),
        Arm("never-pd", "mixed", 0, None),
    ]
    return out


SHAPES = {"long": Shape("long", 1.0), "mixed": Shape("mixed", 0.3)}


def run(args: argparse.Namespace) -> list[Row]:
    fleet = Fleet(
        replicas=args.replicas,
        profile="h100",
        time_scale=args.time_scale,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=args.gpu_blocks,
    )
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="epp-pd-"))
    print(f"P/D benchmark; logs under {workdir}", flush=True)
    arrivals = poisson_arrivals(args.rate, args.duration, random.Random(args.seed))
    plans = {}
    for name, shape in SHAPES.items():
        stream = shape.stream(args.seed)
        plans[name] = [next(stream) for _ in arrivals]
    return [measure(a, plans[a.workload], arrivals, fleet, args, workdir) for a in arms(args)]


HEADER = (
    "arm", "workload", "P:D", "rate/s", "errors", "split %", "TTFT p50 s", "TTFT p90 s",
    "ITL p50 ms", "ITL p95 ms", "ITL p99 ms", "E2E p50 s", "req/s", "out tok/s",
)  # fmt: skip


def cells(r: Row) -> list[str]:
    return [
        r.arm, r.workload, r.fleet, f"{r.rate:g}", f"{r.errors}/{r.sent}",
        f"{100 * r.split:.0f}", f"{r.ttft_p50:.3f}", f"{r.ttft_p90:.3f}",
        f"{1000 * r.itl_p50:.1f}", f"{1000 * r.itl_p95:.1f}", f"{1000 * r.itl_p99:.1f}",
        f"{r.e2e_p50:.2f}", f"{r.req_s:.2f}", f"{r.out_tok_s:.0f}",
    ]  # fmt: skip


def table(rows: Sequence[Row]) -> list[str]:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return lines + ["| " + " | ".join(cells(r)) + " |" for r in rows]


def verdicts(rows: Sequence[Row]) -> list[str]:
    """The targets, checked against this run's rows."""
    by = {r.arm: r for r in rows}
    agg = by["aggregated"]
    out = []
    for r in rows:
        if r.workload != "long" or r is agg:
            continue
        itl = r.itl_p95 <= agg.itl_p95 / 2
        ttft = r.ttft_p90 <= 1.5 * agg.ttft_p90
        out.append(
            f"- `{r.arm}`: ITL p95 {1000 * r.itl_p95:.1f} ms against aggregated "
            f"{1000 * agg.itl_p95:.1f} ms ({r.itl_p95 / agg.itl_p95:.2f}x; target at most 0.5x: "
            f"{'met' if itl else 'missed'}); TTFT p90 {r.ttft_p90:.3f} s against "
            f"{agg.ttft_p90:.3f} s ({r.ttft_p90 / agg.ttft_p90:.2f}x; target at most 1.5x: "
            f"{'met' if ttft else 'missed'})."
        )
    th, always, never = by["threshold"], by["always-pd"], by["never-pd"]
    for label, key, unit in (("TTFT p90", "ttft_p90", 1.0), ("ITL p95", "itl_p95", 1000.0)):
        mine, a, n = (getattr(x, key) * unit for x in (th, always, never))
        worse_than_both = mine > a and mine > n
        out.append(
            f"- Mixed workload, {label}: threshold {mine:.3f} against always-P/D {a:.3f} and "
            f"never-P/D {n:.3f} (target: not worse than both: "
            f"{'missed' if worse_than_both else 'met'})."
        )
    return out


def report(rows: Sequence[Row], args: argparse.Namespace, command: str, where: str) -> str:
    return "\n".join(
        [
            "# Prefill/decode disaggregation on the simulated fleet",
            "",
            "<!-- Generated by benchmarks/pd.py: run it again to change this file. -->",
            "",
            f"`{command}` on {where}.",
            "",
            f"- Fleet: {args.replicas} simulated replicas in every arm (`epp sim --profile h100 "
            f"--time-scale {args.time_scale:g} --max-num-batched-tokens {BATCHED_TOKENS} "
            f"--num-gpu-blocks {args.gpu_blocks} --kv-connector nixl`), behind Envoy and epp, "
            "a fresh fleet per arm. Aggregated and never-P/D: epp's default profile, every "
            "replica of role `both`. P/D arms: `P:D` replicas of role prefill and decode, "
            "`epp pd-sidecar` (NIXL) in front of each decode engine, the profiles of "
            f"[pd.md](pd.md) with `non_cached_tokens: {args.threshold}` (always-P/D: 0).",
            f"- Workloads: `long`: {SHAPES['long'].describe()}; `mixed`: "
            f"{SHAPES['mixed'].describe()}. Open-loop Poisson arrivals at {args.rate:g} "
            f"requests/s for {args.duration:g} s, the same requests and send times in every "
            "arm of a workload.",
            "- ITL is every gap between two token events of one stream, pooled over the "
            "stream's requests (as vLLM's `inter_token_latency` histogram); TTFT and end-to-end "
            "are per request; throughput counts requests and output tokens from the first send "
            "to the last answer. `split %`: requests epp disaggregated (its "
            f"`{DECISIONS}`).",
            "",
            *table(rows),
            "",
            "## Targets",
            "",
            *verdicts(rows),
            "",
            "## Caveats",
            "",
            "- Simulated replicas, not GPUs: the h100 step-time model of "
            "[simulator.md](simulator.md), slowed down "
            f"{args.time_scale:g}x, so wall-clock latencies are {args.time_scale:g}x the "
            "modelled ones. The simulator does model the contention P/D removes: a step's time "
            "is the sum of its prefill tokens and its decodes, so a running decode waits for "
            f"every prefill chunk (up to {BATCHED_TOKENS} tokens) batched with it. It does not "
            "model the KV transfer competing with either replica's compute, or the prefill "
            "replica's blocks being pinned until the decode replica pulled them.",
            "- With the h100 profile's cheap prefill (60 us a token) a chunk stalls a decode for "
            "about 0.13 s modelled, but such steps are a small share of all decode steps unless "
            "the fleet's prefill work is heavy: pooled ITL p95 moves only at high load, while "
            "the worst gaps show the stalls first: the ITL p99 column.",
            "- One short stage per arm on a shared 2-core machine that also runs the simulator, "
            "the sidecars, epp, Envoy and this client: one run, no repetitions; the ratios "
            "between arms are the result, not the absolute figures.",
            "",
        ]
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pd", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="smallest run: 2 replicas, 1:1")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--ratios", help="comma list of prefill replicas per P/D arm (2,3)")
    parser.add_argument("--rate", type=float, help="requests per second (default 2)")
    parser.add_argument("--duration", type=float, help="seconds of arrivals (default 45)")
    parser.add_argument("--threshold", type=int, default=512, help="non_cached_tokens")
    parser.add_argument("--time-scale", type=float, help="simulator time scale (default 2)")
    parser.add_argument("--gpu-blocks", type=int, default=8192, help="per replica")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--start-timeout", type=float, default=60.0)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "pd-bench.md")
    parser.add_argument("--results", type=Path, default=RESULTS / "pd.json")
    args = parser.parse_args(argv)
    quick = args.quick
    if quick and args.replicas == 4:
        args.replicas = 2
    ratios = args.ratios or ("1" if quick else "2,3")
    args.ratios = [int(x) for x in ratios.split(",")]
    if any(not 0 < p < args.replicas for p in args.ratios):
        parser.error(f"--ratios: each between 1 and {args.replicas - 1}")
    args.rate = args.rate or 2.0
    args.duration = args.duration or (2.0 if quick else 45.0)
    args.time_scale = args.time_scale or (0.2 if quick else 2.0)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "benchmarks.pd", *(argv or sys.argv[1:])])
    where = machine()
    started = time.monotonic()
    rows = run(args)
    print("\n".join(table(rows)))
    print("\n".join(verdicts(rows)))
    print(f"took {time.monotonic() - started:.0f} s", flush=True)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    payload = {"command": command, "machine": where, "rows": [asdict(r) for r in rows]}
    args.results.write_text(json.dumps(payload, indent=1) + "\n")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report(rows, args, command, where))
    return 0


if __name__ == "__main__":
    sys.exit(main())
