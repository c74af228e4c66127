"""Tenant budgets held by two epp processes: admitted requests and tokens against the limits.

Envoy (as ``epp envoy-config`` renders it), two ``epp serve`` sharing a ``redis-server`` of this
script's own, two simulated replicas. Two tenants offer twice their budget for ``--seconds``
(default 60, one window: the product's default one-minute window, so nothing leaves it during the
run and the admitted totals must stay within the limits), as an open-loop stream of non-streaming
completions that Envoy spreads over both epps:

- ``rpm-bound``: ``--rpm`` requests per minute (tokens unlimited), offered ``2 x rpm``;
- ``tpm-bound``: ``--tpm`` tokens per minute (requests unlimited), offered requests of about
  ``--tokens-per-request`` prompt + completion tokens, twice ``tpm`` in all;
- ``rpm-burst``: like ``rpm-bound``, but the ``2 x rpm`` requests arrive within the first
  ``--burst`` seconds (the worst case for leased slices: see docs/admission.md).

Admitted tokens are the responses' own usage (prompt + completion tokens as the replica counted
them), not epp's estimate. Every 429 is checked for Retry-After, the drop reason and the six
x-ratelimit-* headers (the header of a budget the tenant does not have is not sent). The table
is printed and, with ``--write``, written to ``docs/budgets-bench.md``.

Usage: ``python -m benchmarks.budgets [--seconds 60] [--rpm 300] [--tpm 30000] [--write]``.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from epp.devstack import Mode, Stack
from epp.request import CHARS_PER_TOKEN
from tests.e2e.client import Reply, metric_values, request
from tests.helpers.redis_servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
FAIRNESS = "x-gateway-inference-fairness-id"
# What a 429 must carry besides the x-ratelimit-* headers of the budget that refused it.
REFUSAL_HEADERS = ("retry-after", "x-epp-request-dropped-reason")


@dataclass
class Tenant:
    name: str
    kind: str  # the budget that binds: requests or tokens
    limit: int
    seconds: float  # offered for this long from the start of the run
    rate: float  # requests offered per second
    max_tokens: int
    prompt: str
    ok: int = 0
    tokens: int = 0  # prompt + completion of admitted responses (their usage)
    refused: int = 0
    refused_complete: int = 0  # 429s with Retry-After, the reason and the headers
    retry_after: list[int] = field(default_factory=list)
    other: dict[int, int] = field(default_factory=dict)
    # One request's usage (prompt, completion), measured before the run (tokens-bound tenant).
    usage: tuple[int, int] = (0, 0)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, reply: Reply) -> None:
        with self.lock:
            if reply.status == 200:
                usage = reply.json().get("usage") or {}
                self.ok += 1
                self.tokens += int(usage.get("prompt_tokens", 0)) + int(
                    usage.get("completion_tokens", 0)
                )
            elif reply.status == 429:
                self.refused += 1
                headers = reply.headers
                kind = self.kind
                needed = (*REFUSAL_HEADERS, *(f"x-ratelimit-{h}-{kind}" for h in _PARTS))
                body = reply.json().get("error", {})
                if (
                    all(h in headers for h in needed)
                    and headers["x-epp-request-dropped-reason"] == "rejected-budget"
                    and body.get("code") == "rate_limit_exceeded"
                ):
                    self.refused_complete += 1
                    self.retry_after.append(int(headers["retry-after"]))
            else:
                self.other[reply.status] = self.other.get(reply.status, 0) + 1


_PARTS = ("limit", "remaining", "reset")


def tenants(args: argparse.Namespace) -> list[Tenant]:
    # Half prompt, half completion; the rate is set once a request's real usage is known.
    half = args.tokens_per_request // 2
    return [
        Tenant(
            "rpm-bound", "requests", args.rpm, args.seconds, 2 * args.rpm / args.seconds, 8, "hi"
        ),
        Tenant("tpm-bound", "tokens", args.tpm, args.seconds, 0.0, half, "budget " * half),
        Tenant("rpm-burst", "requests", args.rpm, args.burst, 2 * args.rpm / args.burst, 8, "hi"),
    ]


def calibrate(stack: Stack, tenant: Tenant, args: argparse.Namespace) -> None:
    """Offer twice the tenant's tokens per window: its rate from one request's usage (sent
    as an unbudgeted tenant)."""
    body = {"model": stack.model, "prompt": tenant.prompt, "max_tokens": tenant.max_tokens}
    usage = request(stack.url, "/v1/completions", body).json()["usage"]
    tenant.usage = (usage["prompt_tokens"], usage["completion_tokens"])
    tenant.rate = 2 * tenant.limit / args.seconds / sum(tenant.usage)


def config(args: argparse.Namespace, offered: list[Tenant]) -> dict[str, object]:
    budgets = {
        t.name: {"rpm": t.limit} if t.kind == "requests" else {"tpm": t.limit} for t in offered
    }
    return {
        "store": {"key_prefix": f"bb-{uuid.uuid4().hex[:8]}"},
        "budgets": {"tenants": budgets, "window_seconds": args.window},
        # The fairness header stands for a gateway in front that sets it.
        "request": {"trusted_headers": True},
    }


def offer(stack: Stack, tenant: Tenant, pool: ThreadPoolExecutor) -> None:
    """Open loop: request i is sent at start + i / rate, whatever the answers take."""
    started = time.monotonic()
    count = round(tenant.seconds * tenant.rate)
    body = {"model": stack.model, "prompt": tenant.prompt, "max_tokens": tenant.max_tokens}
    for i in range(count):
        time.sleep(max(0.0, started + i / tenant.rate - time.monotonic()))
        pool.submit(
            lambda: tenant.record(
                request(stack.url, "/v1/completions", body, {FAIRNESS: tenant.name})
            )
        )


def admitted_per_epp(stack: Stack) -> list[float]:
    return [
        sum(metric_values(f"http://127.0.0.1:{p[2]}/metrics", "epp_budget_admitted_total").values())
        for p in stack.epp_ports
    ]


def measure(args: argparse.Namespace, mode: Mode) -> tuple[list[Tenant], list[float], float]:
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"epp-budgets-{uuid.uuid4().hex[:6]}"
    redis = RedisServer(workdir / "redis").start()
    offered = tenants(args)
    stack = Stack(
        workdir,
        replicas=2,
        mode=mode,
        epp_count=2,
        redis_url=redis.url,
        sim_args=["--time-scale", "0.02"],
        config_extra=config(args, offered),
    )
    try:
        stack.start(timeout=60)
        # Envoy uses every epp once its health checks settle: unbudgeted warm-up requests.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            request(stack.url, "/v1/completions", {"model": stack.model, "prompt": "w"})
            picks = [
                sum(
                    metric_values(
                        f"http://127.0.0.1:{p[2]}/metrics", "epp_endpoint_picks_total"
                    ).values()
                )
                for p in stack.epp_ports
            ]
            if min(picks) > 0:
                break
        for tenant in offered:
            if tenant.kind == "tokens":
                calibrate(stack, tenant, args)
        started = time.monotonic()
        with ThreadPoolExecutor(64) as pool:
            threads = [threading.Thread(target=offer, args=(stack, t, pool)) for t in offered]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        took = time.monotonic() - started
        per_epp = admitted_per_epp(stack)
    finally:
        stack.stop()
        redis.stop()
    return offered, per_epp, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--window", type=float, default=60.0, help="budgets.window_seconds")
    parser.add_argument("--burst", type=float, default=2.0, help="seconds of rpm-burst's offer")
    parser.add_argument("--rpm", type=int, default=300)
    parser.add_argument("--tpm", type=int, default=30_000)
    parser.add_argument("--tokens-per-request", type=int, default=200)
    parser.add_argument(
        "--modes", nargs="+", choices=["buffered", "full-duplex"], default=["buffered"]
    )
    parser.add_argument("--write", action="store_true", help="write docs/budgets-bench.md")
    args = parser.parse_args()
    rows = []
    notes: list[str] = []
    for mode in args.modes:
        offered, per_epp, took = measure(args, mode)
        for t in offered:
            if t.kind == "tokens" and not notes:
                estimate = len(t.prompt) // CHARS_PER_TOKEN + 1 + t.max_tokens
                notes.append(
                    f"Each `tpm-bound` request used {sum(t.usage)} tokens by its usage "
                    f"({t.usage[0]} prompt + {t.usage[1]} completion); epp charged "
                    f"{estimate} at admission (the prompt estimated from its characters, plus "
                    "`max_tokens`) and corrected the charge by the usage when the response "
                    f"ended, so at most {t.limit // sum(t.usage)} of them fit the budget."
                )
        for t in offered:
            admitted = t.ok if t.kind == "requests" else t.tokens
            retry = f"{min(t.retry_after)}-{max(t.retry_after)}" if t.retry_after else "-"
            rows.append(
                f"| {mode} | {t.name} | {t.kind} | {t.limit} | "
                f"{t.ok + t.refused + sum(t.other.values())} | {t.ok} | {t.tokens} | "
                f"{admitted / t.limit:.1%} | {t.refused} | {t.refused_complete} | {retry} | "
                f"{sum(t.other.values())} |"
            )
        rows.append(
            f"| {mode} | (both epps) | admitted by epp0 / epp1 | | | "
            f"{per_epp[0]:.0f} / {per_epp[1]:.0f} | | | | | | |"
        )
        print(f"{mode}: offered over {took:.1f} s", flush=True)
    load = os.getloadavg()
    lines = [
        "# Tenant budgets held by two epps",
        "",
        f"`python -m benchmarks.budgets --seconds {args.seconds:g} --rpm {args.rpm} "
        f"--tpm {args.tpm} --burst {args.burst:g} --modes {' '.join(args.modes)}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, 2 shared cores, load average "
        f"{load[0]:.1f}): Envoy, two epps sharing one Redis, two simulated replicas; each "
        f"tenant offers twice its budget over {args.seconds:g} s (one {args.window:g} s "
        f"window; `rpm-burst` within its first {args.burst:g} s), spread by Envoy over both "
        "epps. Admitted tokens are the responses' usage (prompt + completion). How it works: "
        "docs/admission.md#tenant-budgets.",
        "",
        *notes,
        "",
        "Reading: the steady offers (`rpm-bound`, `tpm-bound`) spend each budget about halfway "
        "through the run; from then on every request is refused, and `Retry-After` counts "
        "down from about half a window (when the first admitted requests leave the window) to "
        "a second or two at the end. Nothing leaves the window during the run, so the admitted "
        "totals are what the two epps together let through in one window. `rpm-burst` is the "
        "worst case for leased slices: the whole offer arrives within a couple of seconds, "
        "while slices one epp holds unspent return to the group only after a second.",
        "",
        "| body mode | tenant | budget | limit | offered requests | admitted requests "
        "| admitted tokens | admitted / limit | 429 | 429 with Retry-After, reason and "
        "x-ratelimit-* | Retry-After s | other statuses |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    text = "\n".join(lines)
    if args.write:
        (ROOT / "docs" / "budgets-bench.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
